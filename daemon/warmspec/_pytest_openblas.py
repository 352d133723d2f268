"""pytest plugin, enabled by the project's ``addopts``: re-execute the test run on OpenBLAS.

It has to run before pytest starts capturing output (a conftest is too late: the re-executed
process would inherit the capture files), which is when ``-p`` plugins are imported.
"""

import sys

from .blas import reexec_with_openblas

reexec_with_openblas(["-m", "pytest", *sys.argv[1:]])
