"""warmspec.rows on the device, second look (after rowsprobe.py found every product's time alone
near a launch floor): products timed 32 to an evaluation by shape and rows, what load chooses with
that measure, and the model's pass time by width with MLX's products, with the kernel where load
chose it, and with the kernel on every float linear layer; the widened passes' logits against
one-position passes. Run with PYTHONPATH holding daemon/, protocol/ and docs/bench/h200-s31."""
import os
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from passtime import pass_times
from warmspec import rows
from warmspec.model import load

for dtype in (mx.float32, mx.bfloat16):
    for shape in ((1536, 576), (576, 1536), (192, 576), (576, 576)):
        W = mx.random.normal(shape).astype(dtype); mx.eval(W)
        parts = [f"P{P}: " + "/".join(f"{t:.4f}" for t in rows.measure(W, rows=P)) for P in (1, 2, 4, 8, 16)]
        print(f"{dtype} W {shape} MLX/rows ms per product, 32 per eval: " + ", ".join(parts), flush=True)

os.environ["WARMSPEC_ROWS"] = "0"
lm = load(None, dequantize=True)
os.environ["WARMSPEC_ROWS"] = "1"
model = lm.model
base = pass_times(model, "pass, MLX's products")
print("load chose:", "\n  ".join(rows.install(model)) or "nothing", flush=True)
pass_times(model, "pass, kernel where load chose")
print("forced:", len(rows.install(model, choose=lambda w: (1.0, 0.0))), "shapes")
new = pass_times(model, "pass, kernel on every float linear")
print("  max |logit diff| vs MLX:", {p: f"{float(mx.abs(new[p] - base[p]).max()):.2e}" for p in new}, flush=True)
for width in (2, 4, 8, 16):
    cache = make_prompt_cache(model); mx.eval(model(mx.array([[5] * 64]), cache=cache))
    toks = [7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67][:width]
    wide = model(mx.array([toks]), cache=cache); mx.eval(wide)
    for c in cache: c.trim(width)
    one = mx.concatenate([model(mx.array([[t]]), cache=cache) for t in toks], axis=1); mx.eval(one)
    print(f"  {width}-wide against 1-position passes, max |logit diff|: {float(mx.abs(one - wide).max()):.2e},",
          "argmax equal:", bool(mx.all(mx.argmax(one, -1) == mx.argmax(wide, -1))), flush=True)
