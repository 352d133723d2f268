"""Prefix caching is exact: a request served from a cached prefix decodes exactly what a cold
engine decodes, for every cache kind (attention KV, sliding window, recurrent state)."""

from __future__ import annotations

import numpy as np
import pytest

from warmspec.engine import Engine, Run
from warmspec.gate import CostTable
from warmspec_protocol import GenerationStats, SamplingParams

import tiny
from conftest import chat_prompt

COSTS = {0: {1: 1.0, 2: 1.05, 33: 1.5}}


def gen(engine, prompt, n=24):
    stats = GenerationStats()
    out = [t for new in engine.generate_tokens(prompt, Run(SamplingParams(), n, stats)) for t in new]
    return out, stats


def cold(lm, prompt, n=24):
    return gen(Engine(lm, costs=CostTable(COSTS)), prompt, n)[0]


ARCHS = ["llama", "qwen3_5", "gemma3_text", "llama4"]


@pytest.mark.parametrize("arch", ARCHS)
def test_next_turn_reuses_prompt_and_answer(arch):
    lm = tiny.build(arch)
    rng = np.random.default_rng(1)
    a = rng.integers(0, tiny.VOCAB, 60).tolist()
    engine = Engine(lm, costs=CostTable(COSTS), checkpoint_every=16)
    out_a, _ = gen(engine, a)
    b = a + out_a + rng.integers(0, tiny.VOCAB, 10).tolist()
    out_b, st = gen(engine, b)
    assert st.cached_tokens >= len(a) + len(out_a) - 1  # prompt and answer reused
    assert out_b == cold(lm, b)


@pytest.mark.parametrize("arch", ARCHS)
def test_divergence_mid_prompt_and_return(arch):
    lm = tiny.build(arch)
    rng = np.random.default_rng(2)
    a = rng.integers(0, tiny.VOCAB, 70).tolist()
    c = a[:40] + rng.integers(0, tiny.VOCAB, 20).tolist()
    engine = Engine(lm, costs=CostTable(COSTS), checkpoint_every=16)
    gen(engine, a)
    out_c, st_c = gen(engine, c)
    # attention layers rewind to the divergence; recurrent/wrapped layers to the checkpoint at 32
    assert st_c.cached_tokens == (40 if arch == "llama" else 32)
    assert out_c == cold(lm, c)
    # a's state was parked in the store: coming back reuses all of it
    out_a2, st_a2 = gen(engine, a)
    assert st_a2.cached_tokens == len(a) - 1
    assert out_a2 == cold(lm, a)
    assert engine.store.hits >= 2


@pytest.mark.parametrize("arch", ARCHS)
def test_eviction_keeps_results_exact(arch):
    lm = tiny.build(arch)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, tiny.VOCAB, 50).tolist() for _ in range(3)]
    engine = Engine(lm, costs=CostTable(COSTS), prefix_budget_bytes=1, checkpoint_every=16)
    for p in prompts:
        gen(engine, p)
    assert engine.store.evictions >= 1 and not engine.store.entries
    out, st = gen(engine, prompts[0])
    assert st.cached_tokens == 0  # evicted: a cold start, not a wrong one
    assert out == cold(lm, prompts[0])


def test_default_model_next_turn(default_lm, default_costs):
    engine = Engine(default_lm, costs=default_costs)
    tok = default_lm.tokenizer
    msgs = [{"role": "user", "content": "Name three fruits."}]
    first = list(engine.generate(chat_prompt(default_lm, msgs[0]["content"]), SamplingParams(), max_tokens=30))[-1]
    msgs += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And three vegetables?"}]
    prompt = tok.encode(tok.apply_chat_template(msgs))
    warm = list(engine.generate(prompt, SamplingParams(), max_tokens=30))[-1]
    assert warm.stats.cached_tokens > 40
    fresh = list(Engine(default_lm, costs=default_costs).generate(prompt, SamplingParams(), max_tokens=30))[-1]
    assert warm.tokens == fresh.tokens


@pytest.mark.parametrize("arch", ARCHS)
def test_returning_conversation_survives_eviction_of_its_own_entry(arch):
    """A, B, then A again under a budget of one and a half states: parking B's live state evicts
    the least recently used entry, which is A's -- the very one the third request resumes from."""
    lm = tiny.build(arch)
    rng = np.random.default_rng(4)
    a, b = (rng.integers(0, tiny.VOCAB, 60).tolist() for _ in range(2))
    probe = Engine(lm, costs=CostTable(COSTS), checkpoint_every=16)
    gen(probe, a)
    budget = int(1.5 * probe.live.nbytes)
    engine = Engine(lm, costs=CostTable(COSTS), prefix_budget_bytes=budget, checkpoint_every=16)
    gen(engine, a)
    gen(engine, b)
    out, st = gen(engine, a)
    assert engine.store.evictions >= 1
    assert st.cached_tokens == len(a) - 1  # resumed from A's state, though it left the store
    assert out == cold(lm, a)
