"""``x @ W.T`` for the default model's shapes (out x in) and 1-16 rows, on this process's BLAS;
milliseconds, medians of 20. Run as ``passes.py`` says."""

import statistics
import time

import mlx.core as mx


def timed(f, n=20):
    for _ in range(3):
        mx.eval(f())
    ts = []
    for _ in range(n):
        s = time.perf_counter()
        mx.eval(f())
        ts.append(time.perf_counter() - s)
    return statistics.median(ts) * 1e3


for (o, i) in ((1536, 576), (576, 1536), (576, 576), (49152, 576)):
    W = mx.random.normal((o, i))
    mx.eval(W)
    line = f"{o}x{i}:"
    for m in (1, 2, 4, 8, 16):
        x = mx.random.normal((m, i))
        mx.eval(x)
        line += f" M{m} {timed(lambda: x @ W.T):.3f}"
    print(line, flush=True)
