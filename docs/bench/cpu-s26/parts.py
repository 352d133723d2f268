"""Time attention's pieces (q.k^T, softmax, exp, p.v, MLX's fused call) at the default model's shapes, 1024 keys, 30 layers.

Usage: PYTHONPATH=daemon:protocol python docs/bench/cpu-s26/parts.py"""
import time, sys
from warmspec import blas
blas.reexec_with_openblas(sys.argv)
import mlx.core as mx
H, KV, D = 9, 3, 64
def bench(f, n=20):
    for _ in range(3): mx.eval(f())
    t=time.perf_counter()
    for _ in range(n): mx.eval(f())
    return (time.perf_counter()-t)/n*1000
L=1024
buf_k = mx.random.normal((1, KV, 4096, D)); buf_v = mx.random.normal((1, KV, 4096, D)); mx.eval(buf_k, buf_v)
k = buf_k[..., :L, :]; v = buf_v[..., :L, :]
kc = mx.contiguous(k); vc = mx.contiguous(v); mx.eval(kc, vc)
for P in (1, 4, 16):
    q = mx.random.normal((1, H, P, D)); mx.eval(q)
    qq = q.reshape(1, KV, H // KV * P, D)  # (only valid layout for P==1, for timing)
    s = mx.random.normal((1, H, P, L)); mx.eval(s)
    print(f"P={P}", flush=True)
    print("  scores view   %.2f" % bench(lambda: [qq @ k.swapaxes(-1, -2) for _ in range(30)]))
    print("  scores contig %.2f" % bench(lambda: [qq @ kc.swapaxes(-1, -2) for _ in range(30)]))
    print("  softmax prec  %.2f" % bench(lambda: [mx.softmax(s, axis=-1, precise=True) for _ in range(30)]))
    print("  softmax       %.2f" % bench(lambda: [mx.softmax(s, axis=-1) for _ in range(30)]))
    print("  exp           %.2f" % bench(lambda: [mx.exp(s) for _ in range(30)]))
    sv = s.reshape(1, KV, H // KV * P, L)
    print("  @v view       %.2f" % bench(lambda: [sv @ v for _ in range(30)]))
    print("  @v contig     %.2f" % bench(lambda: [sv @ vc for _ in range(30)]))
    mask = None if P == 1 else "causal"
    print("  fast sdpa     %.2f" % bench(lambda: [mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask) for _ in range(30)]))
    print("  fast contig   %.2f" % bench(lambda: [mx.fast.scaled_dot_product_attention(q, kc, vc, scale=0.125, mask=mask) for _ in range(30)]))
