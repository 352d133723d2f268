"""MTP heads: loaded from a Qwen3.5-layout checkpoint through the real loader, attached to the target
without a second copy of its weights, and wired (concatenation order, hidden state, norms) so that a
head built to copy the target's own choice agrees with it on every position.

The copy construction, exact by design. Make the tiny target position-wise: zero every layer's
attention output (``o_proj`` / GatedDeltaNet ``out_proj``) and every MLP ``down_proj`` except in the
template layer T (the full-attention layer the head's decoder layer copies). The target's logits at
a position then depend on that position's token only: ``F(t) = lm_head(norm(e + mlp_T(ln_T(e))))``
with ``e = embed(t)``. A head whose ``fc`` passes the EMBEDDING half through, whose decoder layer is
layer T and whose ``mtp.norm`` is the target's final norm computes ``F(t_{i+1})`` from the pair
(h_i, t_{i+1}): exactly the target's prediction of t_{i+2}. For the pre-fc RMSNorm to be the
identity, the embedding rows are rescaled to mean square 1 - eps. With the halves swapped (the
mistake that gave ports 0%) the same head sees a normalised hidden state instead and agreement
collapses; for qwen3_5 the norms are written zero-centred, as Qwen3.5 checkpoints store them, so a
loader that forgot the +1 would fail too.

The hidden construction tests the other half: ``fc`` passing the HIDDEN half, an identity decoder
layer (zero ``o_proj`` and ``down_proj``) and unit norms give ``lm_head(h_i / rms(h_i))``, whose argmax
is the target's own choice at i exactly when h_i is the final-norm output (a positive multiple of
what the target's lm_head scores); with the pre-norm residual instead (emulated as h_i / w_final:
RMSNorm is scale-invariant) the target's final-norm weights are missing and agreement drops.
"""

from __future__ import annotations

import dataclasses
import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

import tiny
from warmspec.core import mtp
from warmspec_protocol import SamplingParams

ARCHS = ["llama", "qwen3", "qwen3_5"]


# -- construction helpers ---------------------------------------------------------------------------

def zero_linear(module) -> None:
    module.weight = mx.zeros_like(module.weight)


def randomize_final_norm(lm, seed: int = 1) -> None:
    parts = mtp.target_parts(lm.model)
    w = parts.norm.weight
    parts.norm.weight = mx.array(np.random.default_rng(seed).uniform(0.3, 3.0, w.shape), dtype=w.dtype)


def make_position_wise(lm) -> None:
    """Zero attention outputs everywhere and MLP outputs outside the template layer; unit-ish rows."""
    parts = mtp.target_parts(lm.model)
    for i, layer in enumerate(parts.inner.layers):
        if "self_attn" in layer:
            zero_linear(layer.self_attn.o_proj)
        if "linear_attn" in layer:
            zero_linear(layer.linear_attn.out_proj)
        if i != parts.template:
            zero_linear(layer.mlp.down_proj)
    eps = float(parts.args.rms_norm_eps)
    e = parts.embed.weight
    parts.embed.weight = e / mx.sqrt(mx.mean(e * e, axis=-1, keepdims=True)) * np.sqrt(1 - eps)
    randomize_final_norm(lm)
    mx.eval(lm.model.parameters())


def layer_tensors(parts, *, identity: bool = False) -> dict[str, mx.array]:
    out = {f"layers.0.{k}": v for k, v in tree_flatten(parts.inner.layers[parts.template].parameters())}
    if identity:
        for k in out:
            if k.endswith(("o_proj.weight", "down_proj.weight")):
                out[k] = mx.zeros_like(out[k])
    return out


def fc_passing(d: int, half: str) -> mx.array:
    eye, zero = mx.eye(d), mx.zeros((d, d))
    return mx.concatenate([eye, zero] if half == "embedding" else [zero, eye], axis=1)


def copy_head_tensors(lm, half: str = "embedding") -> dict[str, mx.array]:
    parts = mtp.target_parts(lm.model)
    d = parts.hidden_size
    return {"fc.weight": fc_passing(d, half), "pre_fc_norm_embedding.weight": mx.ones(d),
            "pre_fc_norm_hidden.weight": mx.ones(d), "norm.weight": parts.norm.weight,
            **layer_tensors(parts)}


def hidden_head_tensors(lm) -> dict[str, mx.array]:
    parts = mtp.target_parts(lm.model)
    d = parts.hidden_size
    return {"fc.weight": fc_passing(d, "hidden"), "pre_fc_norm_embedding.weight": mx.ones(d),
            "pre_fc_norm_hidden.weight": mx.ones(d), "norm.weight": mx.ones(d),
            **layer_tensors(parts, identity=True)}


def write_checkpoint(path, lm, arch: str, head: dict[str, mx.array] | None, *, declare: int = 1,
                     shards: int = 1, quantization: dict | None = None):
    """A checkpoint directory in the Qwen3.5 layout: config.json declaring the MTP layers, the
    target's weights and the head's ``mtp.*`` tensors (norms zero-centred for qwen3_5)."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = json.loads(json.dumps(tiny.CONFIGS[arch]))
    (cfg.get("text_config") or cfg)["mtp_num_hidden_layers"] = declare
    if quantization:
        cfg["quantization"] = quantization
    (path / "config.json").write_text(json.dumps(cfg))
    centred = arch in mtp.ZERO_CENTRED_NORMS
    tensors = {f"model.{k}": v for k, v in tree_flatten(lm.model.parameters())}
    for k, v in (head or {}).items():
        tensors[f"mtp.{k}"] = v - 1.0 if centred and k.endswith("norm.weight") else v
    names = sorted(tensors)
    if shards == 1:
        mx.save_safetensors(str(path / "model.safetensors"), tensors)
        return path
    weight_map = {}
    for s in range(shards):
        part = names[s::shards]
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        mx.save_safetensors(str(path / fname), {k: tensors[k] for k in part})
        weight_map.update({k: fname for k in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return path


def agreement(head, lm, tokens: list[int], *, shift: int, hidden_fn=None) -> float:
    """Teacher-forced: the head's argmax at pair (h_i, t_{i+1}) against the target's argmax at
    position i + shift (1: the target's choice of t_{i+2}; 0: its choice of t_{i+1})."""
    logits, hidden = mtp.forward_hidden(lm.model, mx.array([tokens]))
    if hidden_fn is not None:
        hidden = hidden_fn(hidden)
    head_logits, _ = head(hidden[:, :-1], mx.array([tokens[1:]]), head.make_cache())
    got = np.array(mx.argmax(head_logits[0], axis=-1))
    want = np.array(mx.argmax(logits[0], axis=-1))[shift: shift + len(got)]
    return float(np.mean(got[: len(want)] == want))


def random_tokens(n: int, seed: int = 3) -> list[int]:
    return np.random.default_rng(seed).integers(0, tiny.VOCAB, n).tolist()


# -- loading ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
def test_copy_head_from_checkpoint_agrees_with_target_next_next(tmp_path, arch):
    lm = tiny.build(arch)
    make_position_wise(lm)
    path = write_checkpoint(tmp_path / "ckpt", lm, arch, copy_head_tensors(lm),
                            shards=2 if arch == "qwen3_5" else 1)
    head = mtp.load_mtp(path, lm)
    assert agreement(head, lm, random_tokens(200), shift=1) == 1.0


@pytest.mark.parametrize("arch", ARCHS)
def test_swapped_halves_break_the_copy_head(tmp_path, arch):
    """Negative control: the construction sees the concatenation order."""
    lm = tiny.build(arch)
    make_position_wise(lm)
    path = write_checkpoint(tmp_path / "ckpt", lm, arch, copy_head_tensors(lm, half="hidden"))
    assert agreement(mtp.load_mtp(path, lm), lm, random_tokens(200), shift=1) < 0.5


def test_zero_centred_norms_need_the_offset(tmp_path):
    """Negative control: read the qwen3_5 checkpoint without the +1 and the copy head breaks."""
    lm = tiny.build("qwen3_5")
    make_position_wise(lm)
    weights, recipe = mtp.read_checkpoint(
        write_checkpoint(tmp_path / "ckpt", lm, "qwen3_5", copy_head_tensors(lm)))
    assert recipe.norm_offset == 1.0
    head = mtp.build(lm, weights, dataclasses.replace(recipe, norm_offset=0.0))
    assert agreement(head, lm, random_tokens(200), shift=1) < 0.5


@pytest.mark.parametrize("arch", ARCHS)
def test_hidden_half_sees_the_final_norm_output(tmp_path, arch):
    lm = tiny.build(arch)
    randomize_final_norm(lm)
    head = mtp.load_mtp(write_checkpoint(tmp_path / "ckpt", lm, arch, hidden_head_tensors(lm)), lm)
    tokens = random_tokens(200)
    assert agreement(head, lm, tokens, shift=0) == 1.0
    w = mtp.target_parts(lm.model).norm.weight
    assert agreement(head, lm, tokens, shift=0, hidden_fn=lambda h: h / w) < 0.75  # pre-norm: wrong


@pytest.mark.parametrize("arch", ARCHS)
def test_drafts_at_depth_follow_the_target_greedy_continuation(tmp_path, arch):
    """A draft/verify loop: the head consumes the verified pairs, drafts k = 4 feeding back its own
    hidden and tokens; every draft is the target's greedy choice, and the head's cache keeps only
    the committed pairs."""
    lm = tiny.build(arch)
    make_position_wise(lm)
    head = mtp.load_mtp(write_checkpoint(tmp_path / "ckpt", lm, arch, copy_head_tensors(lm)), lm)
    cache = head.make_cache()
    context = random_tokens(9)
    logits, hidden = mtp.forward_hidden(lm.model, mx.array([context]))
    context.append(int(mx.argmax(logits[0, -1])))
    fed = 0  # pairs in the head cache
    proposed = accepted = 0
    while len(context) < 60:
        new = slice(fed, len(context) - 1)
        drafts, q, _ = head.draft(hidden[:, new], mx.array([context[new.start + 1:]]), cache, 4)
        fed = len(context) - 1
        assert q is None and head.offset(cache) == fed
        logits, hidden = mtp.forward_hidden(lm.model, mx.array([context + drafts]))
        choice = np.array(mx.argmax(logits[0, len(context) - 1:], axis=-1)).tolist()
        n = next((i for i, (d, c) in enumerate(zip(drafts, choice)) if d != c), len(drafts))
        proposed += len(drafts)
        accepted += n
        context += drafts[:n] + [choice[n]]
    assert accepted == proposed


def test_sampled_drafts_carry_the_processed_distribution():
    lm = tiny.build("qwen3")
    head = mtp.MTPHead(mtp.target_parts(lm.model))
    mx.eval(head.parameters())
    tokens = random_tokens(12)
    _, hidden = mtp.forward_hidden(lm.model, mx.array([tokens]))
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05)
    drafts, qs, _ = head.draft(hidden[:, :-1], mx.array([tokens[1:]]), head.make_cache(), 3, params,
                            np.random.default_rng(0))
    assert len(drafts) == len(qs) == 3
    # the first q is the target's processing of the head's logits at the last committed pair
    logits, _ = head(hidden[:, :-1], mx.array([tokens[1:]]), head.make_cache())
    from warmspec.core.sampling import distribution
    np.testing.assert_allclose(qs[0], distribution(np.array(logits[0, -1]), params), atol=1e-6)
    assert all(q[d] > 0 for q, d in zip(qs, drafts))


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_head_cache_rolls_back_to_the_committed_pairs(arch):
    """A random head (attention live): pairs fed in pieces with drafts between give the logits of
    one pass over all pairs, so trimming the speculative positions restores the cache exactly."""
    lm = tiny.build(arch)
    head = mtp.MTPHead(mtp.target_parts(lm.model))
    mx.eval(head.parameters())
    tokens = random_tokens(14)
    _, hidden = mtp.forward_hidden(lm.model, mx.array([tokens]))
    h, t = hidden[:, :-1], mx.array([tokens[1:]])
    whole, _ = head(h, t, head.make_cache())
    cache = head.make_cache()
    head.draft(h[:, :5], t[:, :5], cache, 3)
    head.draft(h[:, 5:6], t[:, 5:6], cache, 2)
    head.rewind(cache, 4)  # e.g. a prefix reused by the next request
    pieces, _ = head(h[:, 4:], t[:, 4:], cache)
    np.testing.assert_allclose(np.array(pieces[0]), np.array(whole[0, 4:]), atol=1e-4)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_quantized_target_and_head(tmp_path, arch):
    """The GPU path: a quantized target (QuantizedEmbedding.as_linear as the tied output head) and
    a head whose layer tensors are quantized too, built from the checkpoint's quantization."""
    lm = tiny.build(arch)
    make_position_wise(lm)
    nn.quantize(lm.model, group_size=32, bits=8)
    lm.quantized = True
    path = write_checkpoint(tmp_path / "ckpt", lm, arch, copy_head_tensors(lm),
                            quantization={"group_size": 32, "bits": 8})
    head = mtp.load_mtp(path, lm)
    assert isinstance(head.layers[0].mlp.up_proj, nn.QuantizedLinear)
    assert agreement(head, lm, random_tokens(200), shift=1) == 1.0
    mtp.save_mtp(head, tmp_path / "q.safetensors")
    again = mtp.load_mtp(tmp_path / "q.safetensors", lm)
    assert agreement(again, lm, random_tokens(200), shift=1) == 1.0


# -- attaching without a second copy ----------------------------------------------------------------

def test_head_holds_references_not_copies(tmp_path):
    lm = tiny.build("qwen3_5")
    head = mtp.load_mtp(write_checkpoint(tmp_path / "c", lm, "qwen3_5", copy_head_tensors(lm)), lm)
    parts = mtp.target_parts(lm.model)
    assert head.parts.embed is parts.embed and head.parts.norm is parts.norm
    names = [k for k, _ in tree_flatten(head.parameters())]
    assert not any("embed_tokens" in k or "lm_head" in k for k in names)
    assert names and all(k.startswith(("fc.", "pre_fc_norm", "norm.", "layers.0.")) for k in names)


def test_peak_memory_grows_by_the_head_only(tmp_path):
    """The checkpoint holds the whole target beside the head (as a real one does); loading the head
    must read only the head: the peak rises by about the head's bytes, far less than the target's
    (a second copy of the embedding alone would be 4x the head here)."""
    lm = tiny.build("qwen3_5", vocab=4096)
    path = write_checkpoint(tmp_path / "c", lm, "qwen3_5", copy_head_tensors(lm))
    target_bytes = lm.nbytes
    mx.clear_cache()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    head = mtp.load_mtp(path, lm)
    mx.eval(head.parameters())
    peak_delta = mx.get_peak_memory() - before
    active_delta = mx.get_active_memory() - before
    head_bytes = sum(v.nbytes for _, v in tree_flatten(head.parameters()))
    print(f"target {target_bytes} B, head {head_bytes} B, load peak +{peak_delta} B, "
          f"resident +{active_delta} B")
    assert head_bytes * 0.9 <= active_delta <= head_bytes * 1.1
    assert peak_delta <= 2 * head_bytes < target_bytes


# -- errors -----------------------------------------------------------------------------------------

def test_declared_but_stripped_head_is_a_clear_error(tmp_path):
    lm = tiny.build("qwen3_5")
    path = write_checkpoint(tmp_path / "c", lm, "qwen3_5", None)
    with pytest.raises(mtp.MTPError, match="no mtp.* tensors.*converters often strip them"):
        mtp.load_mtp(path, lm)


def test_missing_tensors_are_named(tmp_path):
    lm = tiny.build("qwen3_5")
    head = copy_head_tensors(lm)
    del head["fc.weight"], head["layers.0.self_attn.k_proj.weight"]
    with pytest.raises(mtp.MTPError, match=r"lacks 2 .*mtp.fc.weight.*converters often strip them"):
        mtp.load_mtp(write_checkpoint(tmp_path / "c", lm, "qwen3_5", head), lm)


def test_config_without_mtp_layers_is_refused(tmp_path):
    lm = tiny.build("llama")
    path = write_checkpoint(tmp_path / "c", lm, "llama", copy_head_tensors(lm), declare=0)
    with pytest.raises(mtp.MTPError, match="declares no MTP layers"):
        mtp.load_mtp(path, lm)


def test_head_for_another_target_is_refused(tmp_path):
    small = tiny.build("qwen3")
    path = write_checkpoint(tmp_path / "c", small, "qwen3", copy_head_tensors(small))
    other = tiny.build("llama")  # different layer layout (no q_norm / k_norm)
    with pytest.raises(mtp.MTPError):
        mtp.load_mtp(path, other)


def test_family_with_logits_beyond_the_head_is_refused(tmp_path):
    """A target that caps its logits after the output head (as Gemma 2 does): the head's
    ``lm_head(norm(x))`` would not be the target's scoring, so attaching is refused."""
    lm = tiny.build("llama")
    path = write_checkpoint(tmp_path / "c", lm, "llama", copy_head_tensors(lm))

    class Capped(type(lm.model)):
        def __call__(self, inputs, cache=None, **kw):
            return 3.0 * mx.tanh(super().__call__(inputs, cache, **kw) / 3.0)

    lm.model.__class__ = Capped
    with pytest.raises(mtp.MTPError, match="not lm_head"):
        mtp.load_mtp(path, lm)


# -- standalone heads -------------------------------------------------------------------------------

def test_standalone_head_round_trips(tmp_path):
    lm = tiny.build("qwen3_5")
    head = mtp.MTPHead(mtp.target_parts(lm.model))
    mx.eval(head.parameters())
    mtp.save_mtp(head, tmp_path / "head.safetensors", trained_on="test")
    meta = json.loads((tmp_path / "head.json").read_text())
    assert meta["format"] == mtp.FORMAT and meta["hidden"] == "final_norm"
    again = mtp.load_mtp(tmp_path / "head.safetensors", lm)
    tokens = random_tokens(10)
    _, hidden = mtp.forward_hidden(lm.model, mx.array([tokens]))
    a, _ = head(hidden, mx.array([tokens]))
    b, _ = again(hidden, mx.array([tokens]))
    np.testing.assert_array_equal(np.array(a), np.array(b))
    (tmp_path / "head.json").unlink()
    with pytest.raises(mtp.MTPError, match="recipe head.json"):
        mtp.load_mtp(tmp_path / "head.safetensors", lm)
