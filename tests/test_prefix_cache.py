"""Prefix caching is exact: a request served from a cached prefix decodes exactly what a cold
engine decodes, for every cache kind (attention KV, sliding window, recurrent state, chunked
attention) -- speculatively, with drafts accepted and rejected on the reused state."""

from __future__ import annotations

import numpy as np
import pytest

from warmspec.core.engine import Engine, Run
from warmspec.core.gate import CostTable
from warmspec.probes import ScriptedDrafter
from warmspec.core import GenerationStats, SamplingParams

import tiny
from conftest import chat_prompt

COSTS = {0: {1: 1.0, 2: 1.05, 33: 1.5}}


def gen(engine, prompt, n=24, drafter=None):
    stats = GenerationStats()
    out = [t for new in engine.generate_tokens(prompt, Run(SamplingParams(), n, stats), drafter=drafter)
           for t in new]
    return out, stats


def cold(lm, prompt, n=24):
    """Plain greedy decoding on a fresh engine: the reference."""
    return gen(Engine(lm, speculate=False, costs=CostTable(COSTS)), prompt, n)[0]


def spec(engine, prompt, n=24):
    """Speculative decoding on ``engine``'s caches with a drafter that guesses the reference but
    corrupts every third guess, so drafts are accepted and rejected on whatever state the request
    resumed from; checks that both happened and that the output equals the reference."""
    ref = cold(engine.lm, prompt, n)
    out, stats = gen(engine, prompt, n, ScriptedDrafter(prompt, ref, wrong_every=3, k=5, vocab=tiny.VOCAB))
    assert stats.drafted > 0 and 0 < stats.accepted < stats.drafted
    assert out == ref
    return out, stats


ARCHS = ["llama", "qwen3_5", "gemma3_text", "llama4"]


@pytest.mark.parametrize("arch", ARCHS)
def test_next_turn_reuses_prompt_and_answer(arch):
    lm = tiny.build(arch)
    rng = np.random.default_rng(1)
    a = rng.integers(0, tiny.VOCAB, 60).tolist()
    engine = Engine(lm, costs=CostTable(COSTS), checkpoint_every=16)
    out_a, _ = spec(engine, a)
    b = a + out_a + rng.integers(0, tiny.VOCAB, 10).tolist()
    _, st = spec(engine, b)
    assert st.cached_tokens >= len(a) + len(out_a) - 1  # prompt and answer reused


@pytest.mark.parametrize("arch", ARCHS)
def test_divergence_mid_prompt_and_return(arch):
    lm = tiny.build(arch)
    rng = np.random.default_rng(2)
    a = rng.integers(0, tiny.VOCAB, 70).tolist()
    c = a[:40] + rng.integers(0, tiny.VOCAB, 20).tolist()
    engine = Engine(lm, costs=CostTable(COSTS), checkpoint_every=16)
    spec(engine, a)
    _, st_c = spec(engine, c)
    # attention layers rewind to the divergence; recurrent/wrapped/chunked layers to the
    # checkpoint at 32
    assert st_c.cached_tokens == (40 if arch == "llama" else 32)
    # a's state was parked in the store: coming back reuses all of it
    _, st_a2 = spec(engine, a)
    assert st_a2.cached_tokens == len(a) - 1
    assert engine.store.hits >= 2


@pytest.mark.parametrize("arch", ARCHS)
def test_eviction_keeps_results_exact(arch):
    lm = tiny.build(arch)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, tiny.VOCAB, 50).tolist() for _ in range(3)]
    engine = Engine(lm, costs=CostTable(COSTS), prefix_budget_bytes=1, checkpoint_every=16)
    for p in prompts:
        spec(engine, p)
    assert engine.store.evictions >= 1 and not engine.store.entries
    _, st = spec(engine, prompts[0])
    assert st.cached_tokens == 0  # evicted: a cold start, not a wrong one


def test_default_model_next_turn(default_lm, default_costs):
    engine = Engine(default_lm, costs=CostTable(default_costs.points), observe_costs=False)
    tok = default_lm.tokenizer
    msgs = [{"role": "user", "content": "Name three fruits."}]
    first = list(engine.generate(chat_prompt(default_lm, msgs[0]["content"]), SamplingParams(), max_tokens=30))[-1]
    msgs += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And three vegetables?"}]
    prompt = tok.encode(tok.apply_chat_template(msgs))
    warm = list(engine.generate(prompt, SamplingParams(), max_tokens=30))[-1]
    assert warm.stats.cached_tokens > 40
    # the list's shape ("\n2. ", "\n3. ") is drafted from the first answer, on the reused cache
    assert warm.stats.drafted > 0 and warm.stats.accepted > 0
    fresh = list(Engine(default_lm, costs=CostTable(default_costs.points), observe_costs=False).generate(
        prompt, SamplingParams(), max_tokens=30))[-1]
    assert warm.tokens == fresh.tokens


@pytest.mark.parametrize("arch", ARCHS)
def test_returning_conversation_survives_eviction_of_its_own_entry(arch):
    """A, B, then A again under a budget of one and a half states: parking B's live state evicts
    the least recently used entry, which is A's -- the very one the third request resumes from."""
    lm = tiny.build(arch)
    rng = np.random.default_rng(4)
    a, b = (rng.integers(0, tiny.VOCAB, 60).tolist() for _ in range(2))
    probe = Engine(lm, costs=CostTable(COSTS), checkpoint_every=16)
    spec(probe, a)
    budget = int(1.5 * probe.live.nbytes)
    engine = Engine(lm, costs=CostTable(COSTS), prefix_budget_bytes=budget, checkpoint_every=16)
    spec(engine, a)
    spec(engine, b)
    _, st = spec(engine, a)
    assert engine.store.evictions >= 1
    assert st.cached_tokens == len(a) - 1  # resumed from A's state, though it left the store
