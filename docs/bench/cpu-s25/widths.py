"""Verify-pass cost at every width 1..MAX on this machine, two contexts."""
import sys
from warmspec import blas
blas.reexec_with_openblas(sys.argv)
import statistics, time  # noqa
from warmspec.model import load  # noqa
lm = load(None)
top = int(sys.argv[1]) if len(sys.argv) > 1 else 65
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 3
import mlx.core as mx, numpy as np  # noqa
from mlx_lm.models.cache import make_prompt_cache  # noqa
from warmspec.core.cache import Checkpoint  # noqa
rng = np.random.default_rng(0)
for ctx in (64, 1024):
    cache = make_prompt_cache(lm.model)
    lm.model(mx.array([rng.integers(0, 30000, ctx).tolist()]), cache=cache)
    mx.eval([c.state for c in cache])
    def fwd(p):
        ck = Checkpoint(cache, p)
        mx.eval(mx.argmax(lm.model(mx.array([rng.integers(0, 30000, p).tolist()]), cache=cache)[0], axis=-1))
        ck.rollback(0)
    row = {}
    for p in range(1, top + 1):
        fwd(p)
    for p in range(1, top + 1):
        ts = []
        for _ in range(reps):
            t = time.perf_counter(); fwd(p); ts.append(time.perf_counter() - t)
        row[p] = statistics.median(ts)
    print(ctx, " ".join(f"{p}:{row[p]*1000:.0f}" for p in row), flush=True)
