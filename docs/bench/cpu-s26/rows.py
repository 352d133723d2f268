"""One 16-position pass against sixteen one-position passes after 700 tokens: are the logit rows bit-equal?

Usage: PYTHONPATH=daemon:protocol python docs/bench/cpu-s26/rows.py"""
import sys
sys.path.insert(0, __import__("os").path.dirname(__file__))
from warmspec import blas
blas.reexec_with_openblas(sys.argv)
import mlx.core as mx
from mlx_lm.models import llama
from mlx_lm.models.cache import make_prompt_cache
from warmspec.model import load
import fastattn
lm = load(None); model = lm.model
ORIG = llama.scaled_dot_product_attention
for name, f in (("stock", ORIG), ("fast", fastattn.sdpa)):
    llama.scaled_dot_product_attention = f
    cache = make_prompt_cache(model)
    model(mx.array([[ (i * 7919) % 40000 + 100 for i in range(700)]]), cache=cache); mx.eval([c.state for c in cache])
    x = [ (i * 104729) % 40000 + 100 for i in range(16)]
    wide = model(mx.array([x]), cache=cache)[0]; mx.eval(wide)
    for c in cache: c.trim(16)
    one = mx.stack([model(mx.array([[t]]), cache=cache)[0, -1] for t in x])
    print(name, "bitwise equal rows:", sum(bool(mx.array_equal(wide[i], one[i]).item()) for i in range(16)), "of 16;",
          "max diff", mx.max(mx.abs(wide - one)).item(), flush=True)
