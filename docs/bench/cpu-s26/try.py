"""Whole passes of the default model with MLX's attention and with fastattn.sdpa, widths 1-65 at 64-2048 tokens of context; then the logits of the two.

Usage: PYTHONPATH=daemon:protocol python docs/bench/cpu-s26/try.py"""
import sys, time
sys.path.insert(0, __import__("os").path.dirname(__file__))
from warmspec import blas
blas.reexec_with_openblas(sys.argv)
import mlx.core as mx
from mlx_lm.models import llama
from mlx_lm.models.cache import make_prompt_cache
from warmspec.model import load
import fastattn
lm = load(None)
model = lm.model
def run(patch):
    llama.scaled_dot_product_attention = fastattn.sdpa if patch else ORIG
    out = {}
    for ctx in (64, 1024, 2048):
        cache = make_prompt_cache(model)
        toks = mx.array([[ (i * 7919) % 40000 + 100 for i in range(ctx)]])
        model(toks, cache=cache); mx.eval([c.state for c in cache])
        for P in (1, 2, 16, 65):
            x = mx.array([[ (i * 104729) % 40000 + 100 for i in range(P)]])
            ts = []
            for _ in range(4):
                t = time.perf_counter(); y = model(x, cache=cache); mx.eval(y); ts.append(time.perf_counter() - t)
                for c in cache: c.trim(P)
            out[(ctx, P)] = sorted(ts)[1] * 1000
    return out
ORIG = llama.scaled_dot_product_attention
a = run(False); b = run(True)
for k in a: print(k, "stock %.0f ms  fast %.0f ms  (%.2fx)" % (a[k], b[k], a[k] / b[k]), flush=True)
# exactness: one 16-wide pass vs 16 one-position passes, with the fast attention
llama.scaled_dot_product_attention = fastattn.sdpa
cache = make_prompt_cache(model)
toks = mx.array([[ (i * 7919) % 40000 + 100 for i in range(700)]])
model(toks, cache=cache); mx.eval([c.state for c in cache])
x = [ (i * 104729) % 40000 + 100 for i in range(16)]
wide = model(mx.array([x]), cache=cache)[0]; mx.eval(wide)
for c in cache: c.trim(16)
rows = []
for t in x:
    rows.append(model(mx.array([[t]]), cache=cache)[0, -1]); mx.eval(rows[-1])
one = mx.stack(rows)
print("bitwise equal rows:", [bool(mx.array_equal(wide[i], one[i]).item()) for i in range(16)])
print("argmax equal:", bool(mx.array_equal(mx.argmax(wide, -1), mx.argmax(one, -1)).item()))
llama.scaled_dot_product_attention = ORIG
for c in cache: c.trim(16)
ref = model(mx.array([x]), cache=cache)[0]
print("max |fast - stock| logits:", mx.max(mx.abs(ref - wide)).item(), "argmax equal:", bool(mx.array_equal(mx.argmax(wide, -1), mx.argmax(ref, -1)).item()))
