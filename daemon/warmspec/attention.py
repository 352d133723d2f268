"""Attention for multi-position passes on a CPU, whose softmax does not use MLX's ``exp``.

Why: MLX's CPU ``exp`` costs about 10.5 ns an element (numpy's 0.56 ns), and a verify pass takes
the softmax over positions x context scores per head. On the 2-core VM, with 16 positions at 1024
tokens of context, the exponentials took ~50 ms of a 137 ms pass and the matrix products under 8
ms (``docs/bench/cpu-s26``). Edits decode at 1-3k tokens of context with passes up to 65 wide, so
that is where their time went.

What: the same grouped-query attention as MLX's own fallback on a CPU (scale, scores, mask,
softmax, values), with ``exp`` computed by Cephes' single-precision polynomial in two compiled
shapeless kernels. A shapeless compile cannot hold the bit cast that makes 2^n, so it sits
between them. On one layer's scores this is 3.1x faster than ``mx.exp``, and each row's values
are the same whatever the number of rows. With it, n-gram decoding of the first 16 public edits
ran 87.3 tok/s against 69.0 before (7.41x plain against 5.37x), and the gate, pricing the cheaper
wide passes, drafted 20.39 tokens a pass against 18.39.

Where: only passes of 2 to ``MAX_POSITIONS`` positions with at least ``MIN_SCORES`` scores. The
extra operations per layer cost more than they save on small score matrices: used for every pass,
plain decoding's one-position steps at short contexts ran 53 -> 70 ms. Plain decoding and
one-position passes keep MLX's own kernel, as do prefill chunks, quantized KV caches and attention
sinks. The two paths agree to ~1e-5 in the logits. That is the same order as between a wide pass
and one-position passes with MLX's kernel alone (5.1e-5), so greedy output still equals plain's
except at such a near tie.

``install(model)`` rebinds ``scaled_dot_product_attention`` in the mlx-lm modules the model is
built from (the mlx-lm model files call it by that name) when MLX runs on the CPU. On a CUDA GPU
it rebinds them to ``attention_cuda``'s, whose kernel serves passes of a few positions there.
"""

from __future__ import annotations

import sys
from typing import Any

import mlx.core as mx
from mlx_lm.models import base

from warmspec import attention_cuda

# Below this many scores (batch x heads x positions x keys) a pass keeps MLX's kernel. A
# one-layer softmax over 9 x 2 x 1024 scores ran 1.6x faster than MLX's, over 9 x 64 scores 0.7x.
MIN_SCORES = 8192
# Above this many positions (prefill chunks, 512) a pass keeps MLX's kernel too: a 512-token chunk
# at 1024 tokens of context took 4.2 s either way (median of 3), and this path holds a few more
# score-sized arrays at once. Verify passes are at most 65 positions.
MAX_POSITIONS = 128
LOG2E = 1.4426950408889634
FLOOR = -87.0  # exp below this underflows float32's normal range: 0
# Part of the key of the cost tables kept on disk (``core.engine.default_cost_cache``): a table
# measured with another attention prices wide passes wrongly.
VERSION = "polyexp-1"


def _poly(s: mx.array, m: mx.array) -> tuple[mx.array, mx.array]:
    """exp(s - m) as y * 2^n: the polynomial y and the bits of 2^n."""
    x = mx.maximum(s - m, FLOOR)
    n = mx.floor(x * LOG2E + 0.5)
    r = x - n * 0.693359375 - n * -2.12194440e-4  # ln 2 in two parts, as Cephes' expf
    y = 1.9875691500e-4
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        y = y * r + c
    y = y * (r * r) + r + 1.0
    return y, mx.left_shift(n.astype(mx.int32) + 127, 23)


def _scale(y: mx.array, two_n: mx.array, s: mx.array, m: mx.array) -> mx.array:
    return mx.where(s - m < FLOOR, 0.0, y * two_n)


_poly_c = mx.compile(_poly, shapeless=True)
_scale_c = mx.compile(_scale, shapeless=True)


@mx.custom_function
def softmax(scores: mx.array) -> mx.array:
    """Softmax over the last axis, float32. Differentiable (``warmspec forge`` trains through
    it): the bit cast has no gradient of its own, so the softmax's is given."""
    m = mx.max(scores, axis=-1, keepdims=True)
    y, bits = _poly_c(scores, m)
    e = _scale_c(y, bits.view(mx.float32), scores, m)
    return e / mx.sum(e, axis=-1, keepdims=True)


@softmax.vjp
def _softmax_vjp(primals, cotangent, output):
    return (output * (cotangent - mx.sum(cotangent * output, axis=-1, keepdims=True)),)


def attend(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: Any) -> mx.array:
    """softmax(q k^T * scale + mask) v for queries (B, H, L, D), keys and values (B, KV, S, D);
    ``mask``: None, "causal" (the last L of S positions) or an array, boolean or additive,
    broadcastable to (B, H, L, S)."""
    B, H, L, D = queries.shape
    KV, S = keys.shape[1], keys.shape[2]
    R = H // KV
    q = (queries * scale).reshape(B, KV, R, L, D)
    s = q @ mx.expand_dims(keys, 2).swapaxes(-1, -2)  # (B, KV, R, L, S)
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"unknown attention mask {mask!r}")
        mask = base.create_causal_mask(L, offset=S - L)
    if mask is not None:
        if mask.ndim == 4:  # (B or 1, 1 or H, L, S) against the scores' (B, KV, R, L, S)
            mask = (mx.expand_dims(mask, 2) if mask.shape[1] == 1
                    else mask.reshape(mask.shape[0], KV, R, L, S))
        s = mx.where(mask, s, -mx.inf) if mask.dtype == mx.bool_ else s + mask.astype(s.dtype)
    out = softmax(s) @ mx.expand_dims(values, 2)
    return out.reshape(B, H, L, D).astype(queries.dtype)


def scaled_dot_product_attention(queries, keys, values, cache, scale: float, mask, sinks=None):
    """mlx-lm's ``base.scaled_dot_product_attention``, with ``attend`` for large multi-position
    passes (see the module's docstring)."""
    B, H, L, _ = queries.shape
    if (L < 2 or L > MAX_POSITIONS or sinks is not None or hasattr(cache, "bits") or queries.dtype != mx.float32
            or B * H * L * keys.shape[2] < MIN_SCORES):
        return base.scaled_dot_product_attention(queries, keys, values, cache=cache, scale=scale,
                                                 mask=mask, sinks=sinks)
    return attend(queries, keys, values, scale, mask)


def install(model) -> str | None:
    """Route the attention of every mlx-lm module ``model`` is built from through this module's
    ``scaled_dot_product_attention`` on a CPU, or ``attention_cuda``'s on a CUDA GPU. Returns
    the version of the attention installed (part of the cost tables' key), None if none was."""
    if mx.default_device() == mx.cpu:
        fn, version = scaled_dot_product_attention, VERSION
    elif attention_cuda.wanted():
        fn, version = attention_cuda.scaled_dot_product_attention, attention_cuda.VERSION
        attention_cuda.warm(model)
    else:
        return None
    done = False
    for name in {type(m).__module__ for m in model.modules()}:
        module = sys.modules.get(name)
        if getattr(module, "scaled_dot_product_attention", None) is base.scaled_dot_product_attention:
            module.scaled_dot_product_attention = fn
        done = done or getattr(module, "scaled_dot_product_attention", None) is fn
    return version if done else None
