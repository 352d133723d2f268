"""warmspec's CLI with fastattn.sdpa in place of Llama's attention for every pass, one-position steps
included (edits3-everywhere/). Usage: PYTHONPATH=daemon:protocol python docs/bench/cpu-s26/everywhere.py bench ..."""
import sys
sys.path.insert(0, __import__("os").path.dirname(__file__))
from warmspec import blas
blas.reexec_with_openblas(sys.argv)
from mlx_lm.models import llama
import fastattn
llama.scaled_dot_product_attention = fastattn.sdpa
from warmspec.cli import main
sys.exit(main(sys.argv[1:]))
