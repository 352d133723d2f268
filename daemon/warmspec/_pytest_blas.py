"""pytest plugin, enabled by the project's ``addopts``: re-execute the test run on an optimized BLAS (``blas.py``).

It has to run before pytest starts capturing output (a conftest is too late: the re-executed
process would inherit the capture files), which is when ``-p`` plugins are imported.
"""

import sys

from .blas import reexec_with_blas

reexec_with_blas(["-m", "pytest", *sys.argv[1:]])
