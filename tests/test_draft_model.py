"""Draft models: proposals are the draft model's own continuation, its cache rolls back to exactly
the committed tokens for every cache kind (KV, sliding window after it wraps, recurrent), and a
draft model with another vocabulary is refused at load."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache
from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers

import tiny
from warmspec.core.draft_model import DraftError, DraftModel
from warmspec.core.sampling import distribution, sample
from warmspec.tokenizer import Tokenizer, _byte_decoder, byte_tokenizer
from warmspec_protocol import SamplingParams

ARCHS = list(tiny.CONFIGS)  # llama, qwen3 (KV), gemma3_text (sliding window 8), qwen3_5 (recurrent)


def greedy_continuation(model, context: list[int], k: int) -> tuple[list[int], mx.array]:
    """The plain loop: a fresh cache, the whole context in one pass, then one token at a time."""
    cache = make_prompt_cache(model)
    row = model(mx.array([context]), cache=cache)[0, -1]
    first_row, out = row, []
    for _ in range(k):
        out.append(int(mx.argmax(row).item()))
        row = model(mx.array([[out[-1]]]), cache=cache)[0, -1]
    return out, first_row


def tokens(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, tiny.VOCAB, n).tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_proposals_are_the_draft_models_greedy_continuation(arch):
    target, draft_lm = tiny.build(arch, seed=0), tiny.build(arch, seed=1)
    draft = DraftModel(draft_lm, target)
    context = tokens(20, 5)
    got, q, _ = draft.propose(context, 6)
    want, _ = greedy_continuation(draft_lm.model, context, 6)
    assert got == want and q is None


@pytest.mark.parametrize("arch", ARCHS)
def test_rollback_keeps_the_cache_equal_to_a_fresh_one(arch):
    """A verify loop that accepts some drafts and rejects the rest (a bonus token that differs),
    then a new request sharing only a prefix: after each commit the cache holds exactly the
    committed tokens, and proposals and logits equal a fresh draft model's fed those tokens. The
    run is long enough (60+ tokens) for gemma3_text's 8-token windows to wrap many times."""
    target, draft_lm = tiny.build(arch, seed=0), tiny.build(arch, seed=1)
    draft = DraftModel(draft_lm, target)
    rng = np.random.default_rng(11)
    context = tokens(10, 6)
    for step in range(16):
        drafts, _, _ = draft.propose(context, 4)
        accepted = int(rng.integers(0, 5))
        bonus = drafts[accepted] if accepted < 4 and step % 3 == 0 else int(rng.integers(0, tiny.VOCAB))
        context = context + drafts[:accepted] + [bonus]
        draft.commit(context)
        assert draft.tokens == context
        check_fresh(draft, draft_lm, context)
    for shared in (len(context) - 3, 12, 1):  # a later request diverging after `shared` tokens
        context = context[:shared] + tokens(5, shared)
        check_fresh(draft, draft_lm, context)


def check_fresh(draft: DraftModel, draft_lm, context: list[int]) -> None:
    got, _, _ = draft.propose(context, 3)
    row = draft._spec[0][1]  # the logits after the context's last token
    want, want_row = greedy_continuation(draft_lm.model, context, 3)
    assert got == want
    np.testing.assert_allclose(np.array(row), np.array(want_row), atol=1e-4)


def test_sampled_proposals_use_the_targets_processing():
    target, draft_lm = tiny.build("qwen3", seed=0), tiny.build("qwen3", seed=1)
    draft = DraftModel(draft_lm, target)
    params = SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.02)
    context = tokens(16, 8)
    got, qs, _ = draft.propose(context, 4, params, np.random.default_rng(3))
    # the same draws by hand: process each row as the target would, sample, feed
    cache, rng, want = make_prompt_cache(draft_lm.model), np.random.default_rng(3), []
    row = draft_lm.model(mx.array([context]), cache=cache)[0, -1]
    for i in range(4):
        p = distribution(np.array(row), params)
        np.testing.assert_allclose(qs[i], p, atol=1e-6)
        want.append(sample(p, rng))
        row = draft_lm.model(mx.array([[want[-1]]]), cache=cache)[0, -1]
    assert got == want


def test_q_rows_have_the_targets_width():
    """A draft model padded to more rows than the target: rows are cut to the target's ids."""
    target, draft_lm = tiny.build("llama", seed=0), tiny.build("llama", seed=1, vocab=320)
    draft = DraftModel(draft_lm, target)
    got, qs, _ = draft.propose(tokens(8, 9), 3, SamplingParams(temperature=1.0), np.random.default_rng(0))
    assert all(q.shape == (tiny.VOCAB,) for q in qs) and all(t < tiny.VOCAB for t in got)


def permuted_byte_tokenizer(a: int, b: int) -> Tokenizer:
    """The 256-token byte tokenizer with ids ``a`` and ``b`` swapped: same size, other strings."""
    table = {v: c for c, v in _byte_decoder().items()}
    pieces = [table[i] for i in range(256)]
    pieces[a], pieces[b] = pieces[b], pieces[a]
    backend = HFTokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    raw = [bytes([i]) for i in range(256)]
    raw[a], raw[b] = raw[b], raw[a]
    return Tokenizer(backend, token_bytes=raw, special_ids=(), eos_ids=())


def test_vocabulary_mismatch_is_refused():
    target = tiny.build("llama", seed=0)
    other = tiny.build("llama", seed=1)
    other.tokenizer = byte_tokenizer(200)
    with pytest.raises(DraftError, match="200 tokens, the target's 256"):
        DraftModel(other, target)
    other.tokenizer = permuted_byte_tokenizer(65, 66)
    with pytest.raises(DraftError, match="token 65 is 'B', the target's is 'A'"):
        DraftModel(other, target)
