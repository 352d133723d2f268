"""Prototype attention for the CPU: grouped-query attention whose softmax uses a polynomial exp in
two compiled shapeless kernels (MLX's CPU exp is ~10 ns an element). Measured in README.md, not in the package."""
import mlx.core as mx

LOG2E = 1.4426950408889634

def _poly(s, m):
    x = mx.maximum(s - m, -87.0)
    fx = mx.floor(x * LOG2E + 0.5)
    r = x - fx * 0.693359375 - fx * -2.12194440e-4
    z = r * r
    y = 1.9875691500e-4
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        y = y * r + c
    y = y * z + r + 1.0
    return y, mx.left_shift(fx.astype(mx.int32) + 127, 23)

def _scale(y, scale, s, m):
    return mx.where(s - m < -87.0, 0.0, y * scale)

_p = mx.compile(_poly, shapeless=True)
_s = mx.compile(_scale, shapeless=True)

def exp_shifted(s, m):
    y, bits = _p(s, m)
    return _s(y, bits.view(mx.float32), s, m)

def softmax(s):
    m = mx.max(s, axis=-1, keepdims=True)
    e = exp_shifted(s, m)
    return e / mx.sum(e, axis=-1, keepdims=True)

def sdpa(queries, keys, values, cache=None, scale=1.0, mask=None, sinks=None):
    B, H, L, D = queries.shape
    KV, S = keys.shape[1], keys.shape[2]
    R = H // KV
    q = (queries * scale).reshape(B, KV, R, L, D)
    s = q @ mx.expand_dims(keys, 2).swapaxes(-1, -2)
    if isinstance(mask, str):
        mask = mx.arange(S - L, S)[:, None] >= mx.arange(S)[None]
    if mask is not None:
        if mask.ndim == 4:
            # (B, 1 or H, L, S) to broadcast against the scores' (B, KV, R, L, S)
            mask = mx.expand_dims(mask, 2) if mask.shape[1] == 1 else mask.reshape(B, KV, R, L, S)
        s = mx.where(mask, s, -mx.inf) if mask.dtype == mx.bool_ else s + mask
    p = softmax(s)
    return (p @ mx.expand_dims(values, 2)).reshape(B, H, L, D)
