"""The prefix cache's disk tier is exact: a conversation continued after a restart (a new engine
reading the states the old one saved) decodes token for token what an uninterrupted one decodes,
for every cache kind; a truncated, corrupt or foreign file is dropped and changes nothing."""

from __future__ import annotations

import numpy as np
import pytest

from warmspec.core.engine import Engine, Run
from warmspec.core.gate import CostTable
from warmspec.core.prefix_disk import SUFFIX, DiskTier, model_identity, read_state
from warmspec.core import GenerationStats, SamplingParams

import tiny
from conftest import chat_prompt

COSTS = {0: {1: 1.0, 2: 1.05, 33: 1.5}}
ARCHS = ["llama", "gemma3_text", "qwen3_5"]


def gen(engine, prompt, n=24):
    stats = GenerationStats()
    out = [t for new in engine.generate_tokens(prompt, Run(SamplingParams(), n, stats)) for t in new]
    return out, stats


def with_disk(lm, root, costs=None, **kw):
    engine = Engine(lm, costs=costs or CostTable(COSTS), checkpoint_every=16, **kw)
    tier = DiskTier(root, model_identity(lm), budget_bytes=1 << 30)
    tier.attach(engine)
    return engine, tier


def restart(engine, tier):
    """What the daemon does at shutdown: spill every state, wait for the writer."""
    tier.spill_all(engine)
    tier.close()


def conversation(arch, seed=1):
    lm = tiny.build(arch)
    rng = np.random.default_rng(seed)
    a = rng.integers(0, tiny.VOCAB, 60).tolist()
    engine = Engine(lm, costs=CostTable(COSTS), checkpoint_every=16)
    out_a, _ = gen(engine, a)
    b = a + out_a + rng.integers(0, tiny.VOCAB, 10).tolist()
    out_b, _ = gen(engine, b)
    return lm, a, out_a, b, out_b


@pytest.mark.parametrize("arch", ARCHS)
def test_conversation_continues_exactly_after_a_restart(arch, tmp_path):
    lm, a, out_a, b, out_b = conversation(arch)
    first, tier = with_disk(lm, tmp_path)
    assert gen(first, a)[0] == out_a
    restart(first, tier)
    assert len(list((tmp_path).rglob("*" + SUFFIX))) == 1

    second, tier2 = with_disk(lm, tmp_path)
    out, st = gen(second, b)
    assert tier2.stats.hits == 1  # the disk tier served it...
    assert st.cached_tokens == len(a) + len(out_a) - 1  # ...all of the prompt and answer
    assert out == out_b
    tier2.close()


@pytest.mark.parametrize("arch", ARCHS)
def test_evicted_states_are_spilled_and_loaded_back(arch, tmp_path):
    """A memory budget of one byte evicts every parked state: each goes to disk, and a request
    coming back to one is served from there, mid-prompt divergences included."""
    lm = tiny.build(arch)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, tiny.VOCAB, 50).tolist() for _ in range(3)]
    engine, tier = with_disk(lm, tmp_path, prefix_budget_bytes=1)
    for p in prompts:
        gen(engine, p)
    assert tier.flush(60)
    assert engine.store.evictions >= 2 and tier.stats.writes >= 2
    back = prompts[0][:40] + rng.integers(0, tiny.VOCAB, 10).tolist()
    out, st = gen(engine, back)
    assert tier.stats.hits == 1
    assert st.cached_tokens == (40 if arch == "llama" else 32)  # rewound to the divergence / checkpoint
    assert out == gen(Engine(lm, costs=CostTable(COSTS)), back)[0]
    tier.close()


def _damage(path, how):
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[: len(data) - 100])
    elif how == "corrupt":  # one bit of the payload
        path.write_bytes(data[:-5] + bytes([data[-5] ^ 1]) + data[-4:])


def test_loading_a_state_makes_no_copy_of_the_file(tmp_path):
    """``read_state`` reads the arrays straight into MLX: Python never holds the payload (it once
    held all of it in a ``bytes`` and copied that into MLX, which grew the daemon's C heap under
    the soak). tracemalloc sees every Python allocation, numpy's and ``bytes`` included. Plain
    attention KV, as the default model's: with checkpoints every 16 tokens the header's own
    objects (thousands of small arrays) would weigh as much as this small payload."""
    import tracemalloc

    lm = tiny.build("llama")
    engine, tier = with_disk(lm, tmp_path)
    gen(engine, np.random.default_rng(3).integers(0, tiny.VOCAB, 1500).tolist(), n=4)
    restart(engine, tier)
    (path,) = tmp_path.rglob("*" + SUFFIX)
    payload = path.stat().st_size
    assert payload > 256 << 10
    identity = model_identity(lm)
    read_state(path, identity)  # imports and first-use caches, outside the measurement
    tracemalloc.start()
    try:
        for _ in range(3):
            state = read_state(path, identity)
            assert len(state.tokens) >= 1500
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < payload / 3, f"{peak} bytes of Python memory to read a {payload}-byte file"


@pytest.mark.parametrize("how", ["truncated", "corrupt", "foreign"])
def test_a_bad_file_is_dropped_and_changes_nothing(how, tmp_path):
    lm, a, out_a, b, out_b = conversation("qwen3_5")
    if how == "foreign":  # a state of other weights (same architecture), put where ours would be
        other = tiny.build("qwen3_5", seed=7)
        first, tier = with_disk(other, tmp_path)
    else:
        first, tier = with_disk(lm, tmp_path)
    gen(first, a)
    restart(first, tier)
    (path,) = tmp_path.rglob("*" + SUFFIX)
    ours = tmp_path / model_identity(lm)[:24]
    ours.mkdir(exist_ok=True)
    if how == "foreign":
        path = path.rename(ours / path.name)
    _damage(path, how)

    second, tier2 = with_disk(lm, tmp_path)
    out, st = gen(second, b)
    assert tier2.stats.dropped == 1 and tier2.stats.hits == 0
    assert st.cached_tokens == 0 and not path.exists()
    assert out == out_b
    tier2.close()


def test_disk_budget_keeps_the_most_recent(tmp_path):
    lm = tiny.build("llama")
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, tiny.VOCAB, 50).tolist() for _ in range(4)]
    engine, tier = with_disk(lm, tmp_path, prefix_budget_bytes=1)
    gen(engine, prompts[0])
    tier.spill(engine.live, force=True)
    assert tier.flush(60)
    one = tier.describe().bytes
    tier.budget_bytes = int(2.5 * one)
    for p in prompts[1:]:
        gen(engine, p)
    tier.spill(engine.live, force=True)
    assert tier.flush(60)
    d = tier.describe()
    assert d.entries == 2 and d.bytes <= tier.budget_bytes
    kept = {e.tokens[:10] for e in tier.entries}
    assert kept == {tuple(p[:10]) for p in prompts[2:]}
    tier.close()


def test_default_model_conversation_after_a_restart(default_lm, default_costs, tmp_path):
    tok = default_lm.tokenizer
    msgs = [{"role": "user", "content": "Name three fruits."}]
    engine = Engine(default_lm, costs=default_costs)
    first = list(engine.generate(chat_prompt(default_lm, msgs[0]["content"]), SamplingParams(), max_tokens=30))[-1]
    msgs += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And three vegetables?"}]
    prompt = tok.encode(tok.apply_chat_template(msgs))
    uninterrupted = list(engine.generate(prompt, SamplingParams(), max_tokens=30))[-1]

    before, tier = with_disk(default_lm, tmp_path, costs=default_costs)
    list(before.generate(chat_prompt(default_lm, msgs[0]["content"]), SamplingParams(), max_tokens=30))
    restart(before, tier)
    after, tier2 = with_disk(default_lm, tmp_path, costs=default_costs)
    resumed = list(after.generate(prompt, SamplingParams(), max_tokens=30))[-1]
    assert tier2.stats.hits == 1 and resumed.stats.cached_tokens > 40
    assert resumed.tokens == uninterrupted.tokens
    tier2.close()


def test_conversation_after_warmspec_stop_and_a_new_daemon(default_lm, tmp_path):
    """End to end: turn 1 on a daemon, ``warmspec stop``, turn 2 on a new daemon: served from the
    disk tier, and the same tokens as the same conversation in one uninterrupted engine."""
    from warmspec.core.engine import Engine
    from warmspec_protocol import rpc as wire

    from daemon_proc import Daemon

    turn1 = [{"role": "user", "content": "Write a haiku about the sea."}]
    first = Daemon(tmp_path)
    try:
        with first.client() as c:
            a1 = c.call("warmspec/chat", wire.ChatParams(messages=turn1, max_tokens=40), wire.GenerateResult)
        first.stop()
    finally:
        first.kill()
    turn2 = turn1 + [{"role": "assistant", "content": a1.text}, {"role": "user", "content": "Now one about rain."}]
    second = Daemon(tmp_path)
    try:
        with second.client() as c:
            a2 = c.call("warmspec/chat", wire.ChatParams(messages=turn2, max_tokens=40), wire.GenerateResult)
            st = c.call("warmspec/status", None, wire.Status)
    finally:
        second.kill()
    assert st.prefix_cache.disk_hits == 1 and a2.stats.cached_tokens > 40

    engine = Engine(default_lm, speculate=False)
    tok = default_lm.tokenizer
    ids = lambda msgs: tok.encode(tok.apply_chat_template(msgs))  # noqa: E731
    ref1 = list(engine.generate(ids(turn1), SamplingParams(), max_tokens=40))[-1]
    assert ref1.text == a1.text
    ref2 = list(engine.generate(ids(turn2), SamplingParams(), max_tokens=40))[-1]
    assert a2.text == ref2.text and a2.stats.completion_tokens == len(ref2.tokens)
