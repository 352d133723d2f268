"""A forward pass of the default model per width, at 64 and 512 tokens of context, on this
process's BLAS (``warmspec.blas.describe()``); milliseconds, medians of 15 (gpu-s42's timing).

    WARMSPEC_BLAS_CHECKED=1 BLIS_NUM_THREADS=2 LD_PRELOAD=/usr/lib/x86_64-linux-gnu/blis-openmp/libblis.so.4 \
        PYTHONPATH=daemon python3 docs/bench/cpu-s45/passes.py

(``WARMSPEC_BLAS_CHECKED=1`` with a hand-set ``LD_PRELOAD`` keeps warmspec from choosing the
library itself, so each build and thread count can be tried.)
"""

import sys
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from warmspec import blas
from warmspec.model import load

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "gpu-s42"))
from widths import one_pass, timed  # noqa: E402

lm = load(None)
model = lm.model
print(blas.describe())
for ctx in (64, 512):
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[1] * ctx]), cache=cache))
    line = f"ctx {ctx}:"
    for w in (1, 2, 4, 8, 16):
        line += f" {w}:{timed(one_pass(model, cache, w), n=15, warm=3):.1f}"
    print(line, flush=True)
