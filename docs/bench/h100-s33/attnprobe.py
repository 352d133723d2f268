"""Where a wider pass's time goes on the device, after rowsprobe2.py found the products are not it:
MLX's fused attention by query count (32 per evaluation, as in a pass), and the model's pass by
width with attention done one query at a time (each through the one-query kernel)."""
import time, statistics
import mlx.core as mx
from passtime import pass_times
from warmspec.model import load

def ms(fn, n=20):
    for _ in range(3): mx.eval(fn())
    ts = []
    for _ in range(n):
        t = time.perf_counter(); mx.eval(fn()); ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3

for ctx in (64, 1024):
    k = mx.random.normal((1, 3, ctx, 64)); v = mx.random.normal((1, 3, ctx, 64)); mx.eval(k, v)
    parts = []
    for q in (1, 2, 4, 8, 16):
        qs = [mx.random.normal((1, 9, q, 64)) for _ in range(32)]; mx.eval(qs)
        mask = "causal" if q > 1 else None
        parts.append(f"q{q}: {ms(lambda: [mx.fast.scaled_dot_product_attention(x, k, v, scale=0.125, mask=mask) for x in qs]) / 32:.4f}")
    print(f"sdpa ms per call, ctx {ctx}: " + ", ".join(parts), flush=True)

lm = load(None, dequantize=True)
pass_times(lm.model, "pass, MLX's attention")
orig = mx.fast.scaled_dot_product_attention
def per_query(q, k, v, *, scale, mask=None, **kw):
    n = q.shape[2]
    if n == 1 or n > 16:
        return orig(q, k, v, scale=scale, mask=mask, **kw)
    L = k.shape[2]
    return mx.concatenate([orig(q[:, :, i:i + 1], k[:, :, :L - n + i + 1], v[:, :, :L - n + i + 1], scale=scale)
                           for i in range(n)], axis=2)
mx.fast.scaled_dot_product_attention = per_query
pass_times(lm.model, "pass, attention a query at a time")
