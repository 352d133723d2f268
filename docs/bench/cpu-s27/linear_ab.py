"""Interleaved A/B: nn.Linear as x @ W.T (MLX) against (W @ x.T).T for passes of <= 16 rows.

Usage: PYTHONPATH=daemon:protocol python docs/bench/cpu-s27/linear_ab.py (the default model, 40 passes per
width and context, the two forms alternating, the first two of each dropped)."""
import sys, time, statistics
from warmspec import blas
blas.reexec_with_openblas(sys.argv)
import mlx.core as mx, mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache
from warmspec.model import load
lm = load(None); model = lm.model
ORIG = nn.Linear.__call__
def fast(self, x):
    if x.size // x.shape[-1] <= 16:
        y = mx.swapaxes(self.weight @ mx.swapaxes(x, -1, -2), -1, -2)
        return y + self["bias"] if "bias" in self else y
    return ORIG(self, x)
for ctx in (64, 512):
    cache = make_prompt_cache(model)
    toks = mx.array([[(i * 7919) % 40000 + 100 for i in range(ctx)]])
    model(toks, cache=cache); mx.eval([c.state for c in cache])
    for P in (1, 2, 4):
        x = mx.array([[(i * 104729) % 40000 + 100 for i in range(P)]])
        ts = {False: [], True: []}
        for r in range(40):
            patch = r % 2 == 1
            nn.Linear.__call__ = fast if patch else ORIG
            t = time.perf_counter(); y = model(x, cache=cache); mx.eval(y); ts[patch].append(time.perf_counter() - t)
            for c in cache: c.trim(P)
        a = statistics.median(ts[False][2:]) * 1000; b = statistics.median(ts[True][2:]) * 1000
        pr = statistics.median([u / v for u, v in zip(ts[False][2:], ts[True][2:])])
        print(f"ctx {ctx} width {P}: MLX {a:.1f} ms, W@x.T {b:.1f} ms, paired ratio {pr:.3f}", flush=True)
nn.Linear.__call__ = ORIG
