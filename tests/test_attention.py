"""The CPU attention for wide passes (``warmspec.attention``): the same values as MLX's own kernel,
and speculative output still equal to plain decoding's when every multi-position pass uses it."""

from __future__ import annotations

import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import base

from warmspec import attention

import tiny
from test_speculative import OracleDrafter, decode


def qkv(h, kv, length, keys, seed=0):
    mx.random.seed(seed)
    return (mx.random.normal((1, h, length, 16)) * 3, mx.random.normal((1, kv, keys, 16)) * 3,
            mx.random.normal((1, kv, keys, 16)))


@pytest.mark.parametrize("heads", [(6, 2), (4, 4)])
@pytest.mark.parametrize("length,keys", [(2, 2), (5, 40), (16, 100)])
@pytest.mark.parametrize("mask", ["none", "causal", "bool", "additive", "per-head"])
def test_attend_matches_mlx(heads, length, keys, mask):
    h, kv = heads
    q, k, v = qkv(h, kv, length, keys)
    rng = np.random.default_rng(1)
    m = {"none": None, "causal": "causal",
         "bool": mx.array(rng.random((length, keys)) < 0.7) | (mx.arange(keys)[None] == 0),
         "additive": mx.array(rng.normal(size=(1, 1, length, keys)).astype(np.float32)),
         "per-head": mx.array(rng.random((1, h, length, keys)) < 0.6) | (mx.arange(keys) == 0)}[mask]
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=m)
    got = attention.attend(q, k, v, 0.25, m)
    assert got.shape == want.shape
    assert mx.allclose(got, want, atol=2e-5, rtol=1e-5).item(), mx.max(mx.abs(got - want)).item()


def test_gradients_match_mlx():
    """``warmspec forge`` trains a head through this attention: its gradients are MLX's."""
    q, k, v = qkv(6, 2, 8, 8)
    w = mx.random.normal((1, 6, 8, 16))

    def loss(f):
        return lambda q, k, v: (f(q, k, v) * w).sum()

    ours = mx.grad(loss(lambda q, k, v: attention.attend(q, k, v, 0.25, "causal")), argnums=(0, 1, 2))(q, k, v)
    mlx = mx.grad(loss(lambda q, k, v: mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask="causal")),
                  argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(ours, mlx):
        assert mx.allclose(a, b, atol=1e-4, rtol=1e-4).item(), mx.max(mx.abs(a - b)).item()


def test_softmax_at_the_extremes():
    """Masked and underflowing scores weigh exactly 0; large ones do not overflow; each row sums to 1."""
    s = mx.array([[0.0, -mx.inf, -1000.0, -86.0, 3.0], [80.0, 79.0, -mx.inf, 0.0, -50.0]])
    got = attention.softmax(s)
    assert got[0, 1].item() == 0.0 and got[0, 2].item() == 0.0 and got[1, 2].item() == 0.0
    assert mx.allclose(got, mx.softmax(s, axis=-1, precise=True), atol=1e-7).item()
    assert mx.allclose(got.sum(-1), mx.ones(2)).item()
    x = mx.linspace(-87.0, 0.0, 10001)  # the polynomial itself, over the whole range it serves
    y, bits = attention._poly(x, mx.zeros(1))
    exp = attention._scale(y, bits.view(mx.float32), x, mx.zeros(1))
    want = np.exp(np.array(x, dtype=np.float64))  # mx.exp itself is off by up to 3.8e-6 here
    assert np.max(np.abs(np.array(exp) - want) / want) < 2e-7


def test_small_one_position_and_prefill_passes_keep_mlx_s_kernel(monkeypatch):
    calls = []
    monkeypatch.setattr(attention, "attend", lambda *a: calls.append(a) or base.scaled_dot_product_attention(
        a[0], a[1], a[2], cache=None, scale=a[3], mask=a[4]))
    q1, k, v = qkv(9, 3, 1, 2048)
    attention.scaled_dot_product_attention(q1, k, v, None, 0.25, None)
    q2, k, v = qkv(9, 3, 2, 64)
    attention.scaled_dot_product_attention(q2, k, v, None, 0.25, "causal")
    assert not calls
    q512, k, v = qkv(9, 3, 512, 1024)  # a prefill chunk
    attention.scaled_dot_product_attention(q512, k, v, None, 0.25, "causal")
    assert not calls
    q16, k, v = qkv(9, 3, 16, 1024)
    attention.scaled_dot_product_attention(q16, k, v, None, 0.25, "causal")
    assert len(calls) == 1


@pytest.mark.parametrize("arch", list(tiny.CONFIGS))
def test_speculation_through_it_is_exact_every_cache_kind(arch, monkeypatch):
    """Every multi-position pass through ``attend`` (no size threshold), every cache kind: output
    equals plain decoding's, and the wide passes did go through it."""
    lm = tiny.build(arch)
    names = {type(m).__module__ for m in lm.model.modules()}
    for name in names:  # installed for this test only
        module = sys.modules[name]
        if getattr(module, "scaled_dot_product_attention", None) is base.scaled_dot_product_attention:
            monkeypatch.setattr(module, "scaled_dot_product_attention", base.scaled_dot_product_attention)
    assert attention.install(lm.model)
    monkeypatch.setattr(attention, "MIN_SCORES", 0)
    calls = []
    attend = attention.attend
    monkeypatch.setattr(attention, "attend", lambda *a: calls.append(a[0].shape[2]) or attend(*a))
    prompt = np.random.default_rng(7).integers(0, tiny.VOCAB, 24).tolist()
    plain, _ = decode(lm, prompt, 60)
    drafter = OracleDrafter(prompt, plain, wrong_every=4)
    spec, stats = decode(lm, prompt, 60, drafter=drafter, speculate=True, gated=False)
    assert spec == plain
    assert stats.accepted > 0 and stats.accepted < stats.drafted
    assert any(n > 1 for n in calls)


def test_the_default_model_loads_with_it_on_a_cpu(default_lm):
    assert sys.modules["mlx_lm.models.llama"].scaled_dot_product_attention is attention.scaled_dot_product_attention


def test_the_cuda_kernel_serves_only_what_it_was_written_for():
    """``attention_cuda.usable``: passes of 4-64 queries with at most 8192 scores a head (where it
    measured faster than MLX's), head size 64, causal or no mask, a float cache; plain steps,
    prefill chunks, long contexts, masks given as arrays, quantized caches and passes without a
    cache (training) keep MLX's.
    (The kernel itself runs only on CUDA: ``docs/bench/gpu-s44/fewq.py`` checks it there.)"""
    from warmspec import attention_cuda as ac

    from mlx_lm.models.cache import KVCache

    def ok(L=8, S=300, D=64, mask="causal", cache=KVCache(), sinks=None, dtype=mx.float32, kv=3):
        q = mx.zeros((1, 9, L, D), dtype)
        k = mx.zeros((1, kv, S, D), dtype)
        return ac.usable(q, k, k, cache, mask, sinks)

    assert ok() and ok(L=4) and ok(L=64, S=128) and ok(mask=None) and ok(dtype=mx.float16)
    assert ok(L=4, S=2048) and not ok(L=4, S=2049) and ok(L=32, S=256) and not ok(L=32, S=257)
    assert not ok(L=1) and not ok(L=3) and not ok(L=65, S=65) and not ok(L=512)
    assert not ok(D=128) and not ok(kv=2)
    assert not ok(mask=mx.ones((8, 300), mx.bool_)) and not ok(sinks=mx.zeros((9,)))
    assert not ok(cache=type("Q", (), {"bits": 4})())
    assert not ok(cache=None)  # training (``warmspec forge``): MLX's attention has a gradient
    assert not ac.wanted()  # this CPU: MLX's kernels, and the CPU path of ``attention``
