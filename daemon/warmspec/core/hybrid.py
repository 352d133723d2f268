"""Verify passes for hybrid models that capture the recurrent state after every position.

A GatedDeltaNet layer (Qwen3.5/3.6, Qwen3-Next) keeps a fixed-size state that a rejected draft
cannot be trimmed out of. The generic fallback (``cache.Checkpoint`` without a tape) restores the
state from before the pass and replays the accepted tokens in one more forward pass -- on a model
whose layers are mostly recurrent that is nearly a whole extra pass per rejection. Here instead the
verify pass itself runs the recurrence one position at a time and keeps each intermediate
(conv window, state) pair, so rolling back to any accepted prefix is a pointer swap.

The per-position loop is the same arithmetic mlx-lm runs on CPU and CUDA (``gated_delta_ops``
steps ``_gated_delta_step_ops``), so the states are bit-identical there. Where mlx-lm runs its
own passes through its fused Metal kernel instead (``uses_fused_kernel``), which rounds
differently, the engine does not capture: it snapshots and replays, so every state comes from
the model's own forward. The cost of capturing is memory: one state per position per recurrent
layer, held only until the pass is committed.

This mirrors mlx-lm's ``qwen3_5`` decoder loop and ``GatedDeltaNet.__call__`` (without pipeline
or tensor parallelism); ``supports`` checks the structure before it is used, and the exactness
tests compare its logits and states with the model's own forward.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask, create_ssm_mask
from mlx_lm.models.gated_delta import _gated_delta_step_ops, compute_g, normalize_qk

Tape = dict[int, list[list[mx.array]]]


def _text_model(model: nn.Module) -> nn.Module | None:
    tm = getattr(model, "language_model", model)
    inner = getattr(tm, "model", None)
    return tm if inner is not None and hasattr(inner, "layers") and hasattr(inner, "fa_idx") else None


def supports(model: nn.Module) -> bool:
    """True for single-device qwen3_5-style hybrids whose layers this module knows how to run."""
    tm = _text_model(model)
    if tm is None:
        return False
    layers = tm.model.layers
    linear = [l for l in layers if getattr(l, "is_linear", False)]
    if not linear or getattr(tm.model, "pipeline_size", 1) != 1:
        return False
    gdn = linear[0].linear_attn
    return all(hasattr(gdn, a) for a in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a",
                                         "conv1d", "A_log", "dt_bias", "norm", "out_proj")) and \
        getattr(gdn, "sharding_group", None) is None


def _metal_gpu() -> bool:
    return mx.default_device() == mx.gpu and mx.metal.is_available()


def uses_fused_kernel(head_k_dim: int, *, training: bool = False, metal_gpu: bool | None = None) -> bool:
    """Would mlx-lm's ``gated_delta_update`` take its fused Metal kernel for layers of this key
    head size? Its condition, mirrored: not training, the default device the GPU with Metal, and
    a key head dimension that is a positive multiple of 32 (else it steps ``gated_delta_ops``,
    the arithmetic ``_gdn`` repeats)."""
    metal_gpu = _metal_gpu() if metal_gpu is None else metal_gpu
    return not training and metal_gpu and head_k_dim >= 32 and head_k_dim % 32 == 0


def capture_exact(model: nn.Module) -> bool:
    """True where ``verify_forward`` (a ``supports`` model) computes bit-identically what the
    model's own forward computes: wherever mlx-lm does not use its fused kernel."""
    layers = _text_model(model).model.layers
    return not any(uses_fused_kernel(l.linear_attn.head_k_dim, training=l.linear_attn.training)
                   for l in layers if getattr(l, "is_linear", False))


def _gdn(m: nn.Module, x: mx.array, cache: Any) -> tuple[mx.array, list[list[mx.array]]]:
    """``GatedDeltaNet.__call__`` for an unpadded batch, returning the per-position states."""
    B, S, _ = x.shape
    qkv = m.in_proj_qkv(x)
    z = m.in_proj_z(x).reshape(B, S, m.num_v_heads, m.head_v_dim)
    b = m.in_proj_b(x)
    a = m.in_proj_a(x)
    n_keep = m.conv_kernel_size - 1
    conv_state = cache[0] if cache[0] is not None else mx.zeros((B, n_keep, m.conv_dim), dtype=x.dtype)
    conv_input = mx.concatenate([conv_state, qkv], axis=1)
    conv_out = nn.silu(m.conv1d(conv_input))
    q, k, v = [
        t.reshape(B, S, h, d)
        for t, h, d in zip(
            mx.split(conv_out, [m.key_dim, 2 * m.key_dim], -1),
            [m.num_k_heads, m.num_k_heads, m.num_v_heads],
            [m.head_k_dim, m.head_k_dim, m.head_v_dim],
        )
    ]
    q, k = normalize_qk(q, k, inv_scale=m.head_k_dim**-0.5, eps=1e-6)
    beta = mx.sigmoid(b)
    g = compute_g(m.A_log, a, m.dt_bias)
    state = cache[1]
    if state is None:
        state = mx.zeros((B, m.num_v_heads, m.head_v_dim, m.head_k_dim), dtype=mx.float32)
    if (repeat := m.num_v_heads // m.num_k_heads) > 1:
        q = mx.repeat(q, repeat, -2)
        k = mx.repeat(k, repeat, -2)
    ys, tape = [], []
    for t in range(S):
        y, state = _gated_delta_step_ops(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        ys.append(y)
        tape.append([conv_input[:, t + 1 : t + 1 + n_keep], state])
    cache[0], cache[1] = tape[-1]
    out = m.norm(mx.stack(ys, axis=1), z)
    return m.out_proj(out.reshape(B, S, -1)), tape


def verify_forward(model: nn.Module, inputs: mx.array, cache: list[Any]) -> tuple[mx.array, Tape]:
    """Logits for every input position, and for each recurrent layer (by cache index) the
    ``[conv_state, ssm_state]`` after each position."""
    tm = _text_model(model)
    inner = tm.model
    h = inner.embed_tokens(inputs)
    fa_mask = create_attention_mask(h, cache[inner.fa_idx])
    ssm_mask = create_ssm_mask(h, cache[inner.ssm_idx])
    if ssm_mask is not None:
        raise ValueError("padded batches are not supported by the capturing verify pass")
    tape: Tape = {}
    for i, (layer, c) in enumerate(zip(inner.layers, cache)):
        if layer.is_linear:
            r, tape[i] = _gdn(layer.linear_attn, layer.input_layernorm(h), c)
        else:
            r = layer.self_attn(layer.input_layernorm(h), fa_mask, c)
        h = h + r
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    h = inner.norm(h)
    if tm.args.tie_word_embeddings:
        return inner.embed_tokens.as_linear(h), tape
    return tm.lm_head(h), tape
