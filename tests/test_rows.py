"""The few-rows linear layers for CUDA (``warmspec.rows``). The kernel itself runs only on a CUDA
device (checked there by ``docs/bench/h100-s33/rowsprobe.py`` and the bench's divergence count);
here its plumbing is tested on the CPU with MLX's product standing in for it: which layers
``install`` replaces, which passes go through it, and that speculative output still equals plain
decoding's through the replaced layers, every cache kind."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from warmspec import rows

import tiny
from test_speculative import OracleDrafter, decode


def replaced(model):
    return [name for name, m in model.named_modules() if isinstance(m, rows.RowsLinear)]


def test_install_changes_nothing_on_a_cpu():
    lm = tiny.build("llama")
    assert rows.install(lm.model) == []
    assert replaced(lm.model) == []


def test_the_default_model_is_loaded_without_it_on_a_cpu(default_lm):
    assert default_lm.kernels == ("polyexp-1",) and default_lm.kernel_notes == ()
    assert replaced(default_lm.model) == []


@pytest.fixture
def on_cuda(monkeypatch):
    """``install`` as on a CUDA device, with MLX's product in the kernel's place; returns the
    number of rows of every product that went through it."""
    calls = []
    monkeypatch.setenv("WARMSPEC_ROWS", "1")
    monkeypatch.setattr(rows, "on_cuda", lambda: True)
    monkeypatch.setattr(rows, "matmul", lambda x, w: calls.append(x.size // x.shape[-1]) or x @ w.T)
    return calls


def test_it_is_off_on_cuda_unless_asked_for(monkeypatch):
    """Measured not to pay on the H100 (the module's docstring): a CUDA device alone installs nothing."""
    monkeypatch.delenv("WARMSPEC_ROWS", raising=False)
    monkeypatch.setattr(rows, "on_cuda", lambda: True)
    lm = tiny.build("llama")
    assert rows.install(lm.model, choose=lambda w: (1.0, 0.1)) == [] and replaced(lm.model) == []


def test_only_shapes_measured_faster_are_replaced(on_cuda):
    lm = tiny.build("llama")  # hidden 64, MLP 128: q/o 64x64, k/v 32x64, gate/up 128x64, down 64x128
    lines = rows.install(lm.model, choose=lambda w: (1.0, 0.5 if w.shape[0] == 128 else 0.9))
    assert sorted(replaced(lm.model)) == sorted(f"model.layers.{i}.mlp.{p}" for i in range(2)
                                                for p in ("gate_proj", "up_proj"))
    assert len(lines) == 5 and sum(line.endswith(": kernel") for line in lines) == 1, lines
    assert on_cuda == list(rows.BUCKETS)  # the one chosen shape compiled at every size, at load
    nothing = tiny.build("llama")
    assert rows.install(nothing.model, choose=lambda w: (1.0, 0.9)) == []
    assert replaced(nothing.model) == []


def test_a_replaced_layer_keeps_its_arrays_and_its_bias(on_cuda):
    layer = nn.Linear(8, 5, bias=True)
    new = rows.RowsLinear.of(layer)
    assert new.weight is layer.weight and new.bias is layer.bias
    for n in (1, 3, 17):
        x = mx.random.normal((1, n, 8))
        assert mx.array_equal(new(x), layer(x)).item()
    assert on_cuda == [3]  # one row and 17 rows keep MLX's product


@pytest.mark.parametrize("arch", list(tiny.CONFIGS))
def test_speculation_through_it_is_exact_every_cache_kind(arch, on_cuda):
    """Output equals plain decoding's with every float linear layer replaced, and the passes of
    2 to 16 positions, and only they, went through the kernel's place."""
    lm = tiny.build(arch)
    assert rows.install(lm.model, choose=lambda w: (1.0, 0.5))
    assert replaced(lm.model)
    on_cuda.clear()  # the sizes compiled at load
    prompt = np.random.default_rng(7).integers(0, tiny.VOCAB, 24).tolist()
    plain, _ = decode(lm, prompt, 60)
    assert on_cuda == []  # prefill (24 rows) and one-position steps
    drafter = OracleDrafter(prompt, plain, wrong_every=4)
    spec, stats = decode(lm, prompt, 60, drafter=drafter, speculate=True, gated=False)
    assert spec == plain
    assert stats.accepted > 0 and on_cuda and all(2 <= n <= rows.MAX_ROWS for n in on_cuda)
