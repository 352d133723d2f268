"""Where a verify pass's time goes on the device: graph building (host) against evaluation, per
width, for the default model in float32; then the pieces (attention, matmuls) alone.

Run on the device: python3 docs/bench/h200-s31/passprobe.py (PYTHONPATH as bench/h200.sh sets).
"""
import statistics, sys, time
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from warmspec.model import load

lm = load(None, dequantize="--q4" not in sys.argv)
model = lm.model
print("device", mx.default_device(), "dtype", model.model.embed_tokens.weight.dtype
      if hasattr(model.model.embed_tokens, "weight") else "?")

def timed(fn, n=15, warm=3):
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(n):
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3

for ctx in (64, 512):
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[5] * ctx]), cache=cache))
    for p in (1, 2, 3, 4, 5, 8, 16, 32):
        x = mx.array([[7] * p])
        builds, evals = [], []
        def one():
            t0 = time.perf_counter()
            y = mx.argmax(model(x, cache=cache)[0], axis=-1)
            t1 = time.perf_counter()
            y.tolist()
            t2 = time.perf_counter()
            builds.append(t1 - t0); evals.append(t2 - t1)
            for c in cache:
                c.trim(p)
        for _ in range(3): one()
        builds.clear(); evals.clear()
        for _ in range(15): one()
        print(f"ctx {ctx:4d} width {p:2d}: build {statistics.median(builds)*1e3:6.2f} ms, "
              f"eval {statistics.median(evals)*1e3:6.2f} ms, total {statistics.median([a+b for a,b in zip(builds,evals)])*1e3:6.2f}")
    # the cache advancing each pass (new shapes each time): the first pass at a new length
    grow = []
    for i in range(10):
        t = time.perf_counter(); mx.eval(mx.argmax(model(mx.array([[7] * 4]), cache=cache)[0], axis=-1)); grow.append(time.perf_counter() - t)
    print(f"ctx {ctx} width 4, cache growing each pass: " + " ".join(f"{g*1e3:.1f}" for g in grow))

# pieces
args = model.args
H, KV, D = args.num_attention_heads, args.num_key_value_heads, args.hidden_size // args.num_attention_heads
for L in (64, 512):
    k = mx.random.normal((1, KV, L, D)); v = mx.random.normal((1, KV, L, D))
    for q in (1, 2, 4, 8, 16):
        qq = mx.random.normal((1, H, q, D)); mx.eval(qq, k, v)
        for mask in (None, "causal"):
            if q == 1 and mask: continue
            f = lambda: mx.eval(mx.fast.scaled_dot_product_attention(qq, k, v, scale=D ** -0.5, mask=mask))
            print(f"sdpa L {L} q {q:2d} mask {mask}: {timed(f):.3f} ms")
W = mx.random.normal((1536, 576)); W2 = mx.random.normal((49152, 576)); mx.eval(W, W2)
for m in (1, 2, 4, 8, 16):
    a = mx.random.normal((1, m, 576)); mx.eval(a)
    print(f"matmul m {m:2d}: mlp {timed(lambda: mx.eval(a @ W.T)):.3f} ms, lm_head {timed(lambda: mx.eval(a @ W2.T)):.3f} ms")
# one layer
layer = model.model.layers[0]
for p in (1, 4, 16):
    c = make_prompt_cache(model)[0]
    h = mx.random.normal((1, 64, 576)); mx.eval(layer(h, mask="causal", cache=c))
    x = mx.random.normal((1, p, 576)); mx.eval(x)
    def f():
        mx.eval(layer(x, mask="causal" if p > 1 else None, cache=c)); c.trim(p)
    print(f"one layer width {p}: {timed(f):.3f} ms")
