"""warmspec.rows on the device: its product against MLX's by shape and rows, what the model's
load chose, the model's pass time by width with and without it (float32), and a 4-wide pass's
rows against one-position passes. Run with PYTHONPATH holding daemon/, protocol/ and
docs/bench/h200-s31 (for passtime.py)."""
import os
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from passtime import pass_times, timed
from warmspec import rows
from warmspec.model import load

for dtype in (mx.float32, mx.bfloat16):
    for shape in ((1536, 576), (576, 1536), (192, 576), (576, 576)):
        W = mx.random.normal(shape).astype(dtype); mx.eval(W)
        parts = []
        for P in (1, 2, 4, 8, 16):
            x = mx.random.normal((1, P, shape[1])).astype(dtype); mx.eval(x)
            ref = x @ W.T; got = rows.matmul(x, W); mx.eval(ref, got)
            err = float(mx.abs(ref.astype(mx.float32) - got.astype(mx.float32)).max())
            parts.append(f"P{P}: {timed(lambda: mx.eval(x @ W.T)):.3f}/{timed(lambda: mx.eval(rows.matmul(x, W))):.3f} ({err:.1e})")
        print(f"{dtype} W {shape} MLX/rows ms (max diff): " + ", ".join(parts), flush=True)

os.environ["WARMSPEC_ROWS"] = "0"
lm = load(None, dequantize=True)
base = pass_times(lm.model, "pass, MLX's products")
print("load chose:", rows.install(lm.model) or "nothing")
new = pass_times(lm.model, "pass, rows kernel where chosen")
print("  max |logit diff|:", {p: f"{float(mx.abs(new[p] - base[p]).max()):.2e}" for p in new}, flush=True)
model = lm.model
for width in (2, 4, 8, 16):
    cache = make_prompt_cache(model); mx.eval(model(mx.array([[5] * 64]), cache=cache))
    toks = [7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67][:width]
    wide = model(mx.array([toks]), cache=cache); mx.eval(wide)
    for c in cache: c.trim(width)
    ones = []
    for t in toks:
        ones.append(model(mx.array([[t]]), cache=cache)); mx.eval(ones[-1])
    one = mx.concatenate(ones, axis=1)
    print(f"  {width}-wide rows against 1-position passes, max |logit diff|: {float(mx.abs(one - wide).max()):.2e},",
          "argmax equal:", bool(mx.all(mx.argmax(one, -1) == mx.argmax(wide, -1))), flush=True)
