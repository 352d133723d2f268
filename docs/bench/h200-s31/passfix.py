"""Can a verify pass of a few positions cost what one position costs on MLX CUDA? Variants of the
linear layers and attention timed alone and in the whole pass (default model, float32)."""
import mlx.core as mx
import mlx.nn as nn
from warmspec.model import load
from passtime import pass_times as _pass_times, timed

W = mx.random.normal((1536, 576)); mx.eval(W)
Wt = W.T
for P in (2, 4, 8, 16):
    x = mx.random.normal((1, P, 576)); mx.eval(x)
    r = {}
    r["gemm"] = timed(lambda: mx.eval(x @ Wt))
    r["b-gemv"] = timed(lambda: mx.eval(x.reshape(P, 1, 576) @ Wt))
    Wb = mx.broadcast_to(Wt, (P, 576, 1536))
    r["b-gemv-bcast"] = timed(lambda: mx.eval(mx.matmul(x.reshape(P, 1, 576), Wb)))
    r["loop-gemv"] = timed(lambda: mx.eval(mx.concatenate([x[:, i:i + 1] @ Wt for i in range(P)], axis=1)))
    r["W@xT"] = timed(lambda: mx.eval((W @ x[0].T).T))
    x16 = x.astype(mx.bfloat16); W16 = Wt.astype(mx.bfloat16); mx.eval(x16, W16)
    r["bf16 gemm"] = timed(lambda: mx.eval(x16 @ W16))
    print(f"P {P:2d}: " + ", ".join(f"{k} {v:.3f}" for k, v in r.items()), flush=True)
x1 = mx.random.normal((1, 1, 576)); mx.eval(x1)
print(f"P  1: gemv {timed(lambda: mx.eval(x1 @ Wt)):.3f}", flush=True)

lm = load(None, dequantize=True)
model = lm.model

base = _pass_times(model, "pass as is")

orig_linear = nn.Linear.__call__
def linear_bgemv(self, x):
    if x.ndim == 3 and x.shape[0] == 1 and 1 < x.shape[1] <= 16 and "weight" in self:
        P = x.shape[1]
        y = (x.reshape(P, 1, x.shape[-1]) @ self["weight"].T).reshape(1, P, -1)
        return y + self["bias"] if "bias" in self else y
    return orig_linear(self, x)
nn.Linear.__call__ = linear_bgemv
b = _pass_times(model, "linear as batched gemv")
print("  max |logit diff| vs as is:", {p: float(mx.abs(b[p] - base[p]).max()) for p in b}, flush=True)
nn.Linear.__call__ = orig_linear

import mlx_lm.models.llama as llama
orig_sdpa = llama.scaled_dot_product_attention
def sdpa_rows(queries, keys, values, cache, scale, mask, sinks=None):
    P = queries.shape[2]
    if P == 1 or P > 16:
        return orig_sdpa(queries, keys, values, cache=cache, scale=scale, mask=mask)
    L = keys.shape[2]
    outs = [mx.fast.scaled_dot_product_attention(queries[:, :, i:i + 1], keys[:, :, :L - P + i + 1],
                                                 values[:, :, :L - P + i + 1], scale=scale)
            for i in range(P)]
    return mx.concatenate(outs, axis=2)
llama.scaled_dot_product_attention = sdpa_rows
c = _pass_times(model, "attention one query at a time")
print("  max |logit diff| vs as is:", {p: float(mx.abs(c[p] - base[p]).max()) for p in c}, flush=True)
nn.Linear.__call__ = linear_bgemv
d = _pass_times(model, "both")
print("  max |logit diff| vs as is:", {p: float(mx.abs(d[p] - base[p]).max()) for p in d}, flush=True)
