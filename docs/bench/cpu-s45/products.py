"""``x @ W.T`` for the default model's shapes (out x in) and 1-16 rows, on this process's BLAS;
milliseconds, medians of 20 (gpu-s42's timing). Run as ``passes.py`` says."""

import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "gpu-s42"))
from widths import timed  # noqa: E402

for (o, i) in ((1536, 576), (576, 1536), (576, 576), (49152, 576)):
    W = mx.random.normal((o, i))
    mx.eval(W)
    line = f"{o}x{i}:"
    for m in (1, 2, 4, 8, 16):
        x = mx.random.normal((m, i))
        mx.eval(x)
        line += f" M{m} {timed(lambda: x @ W.T, n=20, warm=3):.3f}"
    print(line, flush=True)
