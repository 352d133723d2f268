"""The plain engine against a straightforward reference loop, sampling, stops and limits."""

import asyncio
import threading

import mlx.core as mx
import msgspec
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from warmspec.core.engine import Engine, Finished
from warmspec.core.gate import CostTable
from warmspec.core import SamplingParams

import tiny
from conftest import chat_prompt, wait_idle


def reference_greedy(model, prompt, n, eos):
    """The simplest correct greedy loop: whole prompt in one pass, then one token per pass."""
    cache = make_prompt_cache(model)
    logits = model(mx.array([prompt]), cache=cache)
    out = []
    for _ in range(n):
        y = mx.argmax(logits[0, -1]).item()
        if y in eos:
            break
        out.append(y)
        logits = model(mx.array([[y]]), cache=cache)
    return out


def run(engine, prompt, params=SamplingParams(), **kw):
    events = list(engine.generate(prompt, params, **kw))
    assert isinstance(events[-1], Finished)
    return events


def test_greedy_equals_reference_loop(default_lm):
    prompt = chat_prompt(default_lm, "Write a Python function that returns the n-th Fibonacci number.")
    ref = reference_greedy(default_lm.model, prompt, 120, default_lm.tokenizer.eos_ids)
    engine = Engine(default_lm, speculate=False)
    fin = run(engine, prompt, max_tokens=120)[-1]
    assert fin.tokens == ref
    assert "def " in fin.text  # a coherent answer: it writes a function
    assert fin.stats.passes == len(fin.tokens)


def test_chunked_prefill_equals_one_pass(default_lm):
    prompt = chat_prompt(default_lm, "List three colours and say why the sky is blue. " * 6)
    ref = reference_greedy(default_lm.model, prompt, 30, default_lm.tokenizer.eos_ids)
    engine = Engine(default_lm, speculate=False, prefill_chunk=16)
    assert run(engine, prompt, max_tokens=30)[-1].tokens == ref


def test_seeded_sampling_reproducible(default_lm):
    prompt = chat_prompt(default_lm, "Tell me a short story about a robot.")
    engine = Engine(default_lm, speculate=False)
    p = SamplingParams(temperature=1.0, top_p=0.95, top_k=50, min_p=0.02, seed=1234)
    a = run(engine, prompt, p, max_tokens=40)[-1].tokens
    b = run(engine, prompt, p, max_tokens=40)[-1].tokens
    c = run(engine, prompt, msgspec.structs.replace(p, seed=99), max_tokens=40)[-1].tokens
    assert a == b
    assert a != c


def test_max_tokens_and_stop_string(default_lm):
    prompt = chat_prompt(default_lm, "Write a Python function that returns the n-th Fibonacci number.")
    engine = Engine(default_lm, speculate=False)
    fin = run(engine, prompt, max_tokens=7)[-1]
    assert fin.finish_reason == "length" and len(fin.tokens) == 7
    full = run(engine, prompt, max_tokens=60)[-1].text
    assert "(n" in full
    events = run(engine, prompt, max_tokens=60, stop=["(n"])
    fin = events[-1]
    assert fin.finish_reason == "stop"
    assert fin.text == full[: full.index("(n")]
    assert "".join(e.text for e in events[:-1]) == fin.text


def test_eos_ends_with_stop(default_lm):
    prompt = chat_prompt(default_lm, "Say hello.")
    fin = run(Engine(default_lm, speculate=False), prompt, max_tokens=200)[-1]
    assert fin.finish_reason == "stop" and 0 < len(fin.tokens) < 200
    assert not set(fin.tokens) & default_lm.tokenizer.eos_ids


def test_cancel_stops_within_a_step(default_lm):
    prompt = chat_prompt(default_lm, "Tell me a long story.")
    engine = Engine(default_lm, speculate=False)
    seen = []
    events = engine.generate(prompt, SamplingParams(), max_tokens=100,
                             cancelled=lambda: len(seen) >= 3)
    for ev in events:
        if not isinstance(ev, Finished):
            seen.append(ev)
    assert ev.finish_reason == "cancelled" and len(ev.tokens) == 3
    # the engine is consistent afterwards: the same prompt again equals a fresh engine's answer
    again = run(engine, prompt, max_tokens=10)[-1].tokens
    assert again == run(Engine(default_lm, speculate=False), prompt, max_tokens=10)[-1].tokens


def test_cost_table_persists_per_machine(default_lm, tmp_path, monkeypatch):
    """The verify-cost measurement runs once per machine and model; later engines load it."""
    from warmspec.core.engine import default_cost_cache
    from warmspec.core.gate import CostTable

    monkeypatch.setenv("WARMSPEC_CACHE", str(tmp_path))
    path = default_cost_cache(default_lm)
    assert path.is_relative_to(tmp_path) and not path.exists()
    first = Engine(default_lm, cost_cache=path)
    measured = first.costs
    assert path.exists()
    calls = []
    second = Engine(default_lm, cost_cache=path)
    monkeypatch.setattr(second, "measure_costs", lambda *a, **k: calls.append(1))
    assert second.costs.points == measured.points and not calls
    path.write_text("{not json")
    assert CostTable.load(path) is None


# -- cancellation during prefill (tiny models: a 300-token prompt in 64-token chunks) ----------------

class CountingModel:
    """The model, counting forward passes (prefill chunks) and optionally holding the first one
    until released, so a test can act while a job is known to be inside its prefill."""

    def __init__(self, model, hold: bool = False):
        self._model = model
        self.calls = 0
        self.entered = threading.Event()
        self.release = threading.Event()
        if not hold:
            self.release.set()

    def __call__(self, *args, **kwargs):
        self.calls += 1
        self.entered.set()
        self.release.wait(timeout=120)
        return self._model(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._model, name)


def tiny_engine(lm, **kw):
    return Engine(lm, speculate=False, prefill_chunk=64, costs=CostTable({0: {1: 1.0, 2: 1.1}}), **kw)


@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
def test_cancel_cuts_prefill_and_keeps_what_it_computed(arch):
    lm = tiny.build(arch)
    prompt = np.random.default_rng(5).integers(0, tiny.VOCAB, 300).tolist()
    engine = tiny_engine(lm)
    counting = CountingModel(engine.model)
    engine.model = counting
    fin = run(engine, prompt, max_tokens=8, cancelled=lambda: counting.calls >= 1)[-1]
    assert fin.finish_reason == "cancelled" and fin.tokens == []
    assert counting.calls == 1  # one chunk of the five the prompt needs
    assert engine.cache_tokens == prompt[:64]
    assert all(offset == 64 for offset in (c.offset for c in engine.cache if hasattr(c, "offset")))
    # another prompt sharing the chunk continues from it; for the recurrent layers the retry
    # of the first then resumes from the checkpoint taken at the cut
    other = prompt[:64] + np.random.default_rng(6).integers(0, tiny.VOCAB, 100).tolist()
    assert run(engine, other, max_tokens=8)[-1].stats.cached_tokens == 64
    again = run(engine, prompt, max_tokens=8)[-1]
    assert again.stats.cached_tokens == 64 and again.finish_reason == "length"
    assert again.tokens == run(tiny_engine(lm), prompt, max_tokens=8)[-1].tokens


def test_cancel_during_prefill_frees_the_scheduler():
    """A ticket cancelled while its job is inside prefill: the job ends after the chunk in
    flight, with Finished("cancelled"), and the worker is idle again."""
    from warmspec.server.scheduler import Job, Scheduler

    lm = tiny.build("llama")
    engine = tiny_engine(lm)
    counting = CountingModel(engine.model, hold=True)
    engine.model = counting
    scheduler = Scheduler(engine)
    scheduler.start()
    prompt = np.random.default_rng(6).integers(0, tiny.VOCAB, 300).tolist()

    async def scenario():
        ticket = scheduler.submit(Job(prompt=prompt, params=SamplingParams(), max_tokens=8))
        assert await asyncio.to_thread(counting.entered.wait, 60), "the job never started its prefill"
        ticket.cancel()
        counting.release.set()
        return [ev async for ev in ticket]

    try:
        events = asyncio.run(scenario())
        wait_idle(scheduler)
    finally:
        counting.release.set()
        scheduler.stop()
    assert isinstance(events[-1], Finished) and events[-1].finish_reason == "cancelled"
    assert counting.calls == 1 < -(-299 // 64)


@pytest.mark.parametrize("saved", ['{"64": {"1": 0}}', '{"64": {"1": -0.01, "2": 0.02}}',
                                   '{"64": {"1": NaN}}', '{"64": {"1": Infinity}}', '{"64": {"1": null}}',
                                   '{"64": [1, 2]}', '{"64": {"2": 0.1}}', '{"64": {"0": 0.1, "1": 0.1}}',
                                   '[]', '{}', '"costs"', '{"-5": {"1": 0.1}}'])
def test_bad_saved_cost_table_is_measured_again(saved, tmp_path, monkeypatch):
    """A cost table file that is malformed, or whose costs are zero, negative or not finite
    (the gate divides by them), is ignored: the engine measures again and saves a good one."""
    path = tmp_path / "costs.json"
    path.write_text(saved)
    assert CostTable.load(path) is None
    engine = Engine(tiny.build("llama"), cost_cache=path)
    good = CostTable({0: {1: 1.0, 2: 1.1}})
    monkeypatch.setattr(engine, "measure_costs", lambda *a, **k: good)
    assert engine.costs is good and engine.gate.choose(4, 8) >= 0
    assert CostTable.load(path).points == good.points


def test_cost_table_refuses_non_positive_costs():
    for row in ({1: 0.0}, {1: 1.0, 4: -1.0}, {1: float("inf")}, {1: float("nan")}, {0: 1.0, 1: 1.0}):
        with pytest.raises(ValueError):
            CostTable({0: row})


def test_cost_table_times_short_passes_more_and_never_falls_with_width(monkeypatch):
    """Passes of a few ms (a GPU) are timed until ``MIN_SAMPLE_S`` of them, and a wider pass
    measured cheaper than a narrower one is booked at the narrower one's cost: the 4-wide pass
    here has one slow outlier of three samples at first, and the 8-wide one dips below it."""
    from warmspec.core import gate
    clock = [0.0]
    monkeypatch.setattr(gate.time, "perf_counter", lambda: clock[0])
    durations = {1: [0.005], 2: [0.010], 4: [0.017, 0.017, 0.040], 8: [0.015]}
    calls = {p: 0 for p in durations}

    def forward(p, context):
        seq = durations[p]
        clock[0] += seq[calls[p] % len(seq)]
        calls[p] += 1

    table = CostTable.measure(forward, [1, 2, 4, 8], [64], repeats=2)
    row = {p: round(t, 6) for p, t in table.points[64].items()}
    assert row == {1: 0.005, 2: 0.010, 4: 0.017, 8: 0.017}  # 8 measured 0.015: not below 4's
    # one warm-up each, then until 0.1 s or 12 passes: 12 of 5 ms, 10 of 10 ms
    assert calls[1] == 1 + 12 and calls[2] == 1 + 10
    durations[1], calls[1] = [0.3], 0  # a CPU's pass: two are enough
    slow = CostTable.measure(forward, [1], [64], repeats=2)
    assert calls[1] == 1 + 2 and round(slow.points[64][1], 6) == 0.3


def test_cost_table_interpolates_width_then_context_with_a_floor():
    """A cost between measured widths is on the line between them, beyond the widest it grows with
    the last two points' slope, between the first and last contexts it is on the line between
    their rows (beyond them too), and never below half the smaller row's."""
    table = CostTable({64: {1: 0.005, 4: 0.008}, 1024: {1: 0.006, 4: 0.012}})
    approx = lambda v: pytest.approx(v, rel=1e-12)  # noqa: E731
    assert table.cost(2, 64) == approx(0.006)
    assert table.cost(8, 64) == approx(0.012)  # 0.001 a position beyond 4
    assert table.cost(1, 544) == approx(0.0055)
    assert table.cost(4, 2944) == approx(0.02)  # the rise of 0.004 per 960 tokens, twice more
    assert table.cost(1, -5000) == approx(0.0025)  # the floor
    table.scale, table.correction = 2.0, {4: 1.5}
    assert table.cost(4, 64) == approx(0.024) and table.base(4, 64) == approx(0.008)
    one = CostTable({0: {1: 1.0, 3: 2.0}})
    assert [one.cost(p, c) for p, c in ((1, 0), (2, 5000), (5, 10))] == [1.0, 1.5, 3.0]


def test_cost_table_plain_step_on_the_line_between_its_contexts_with_a_floor():
    """A pipelined plain step is interpolated as a pass is, between its own measured contexts:
    on the line between them and beyond, never below half the smaller; with one context, that
    cost everywhere; without any, a one-position pass."""
    approx = lambda v: pytest.approx(v, rel=1e-12)  # noqa: E731
    table = CostTable({64: {1: 0.005}, 1024: {1: 0.006}}, {100: 0.004, 500: 0.006})
    assert table.plain(300) == approx(0.005)
    assert table.plain(900) == approx(0.008)  # 0.002 per 400 tokens, beyond the last
    assert table.plain(-10000) == approx(0.002)  # the floor: half the smaller end
    table.plain_scale = 0.5
    assert table.plain(100) == approx(0.002)
    assert CostTable({0: {1: 1.0}}, {7: 0.25}).plain(5000) == 0.25
    assert CostTable({0: {1: 1.0}, 100: {1: 2.0}}).plain(50) == approx(1.5)


@pytest.mark.parametrize("points", [
    {64: {1: 0.005, 2: 0.005, 4: 0.0076, 16: 0.008, 65: 0.0135},
     1024: {1: 0.0058, 2: 0.0062, 4: 0.0091, 16: 0.0091, 65: 0.0126}},
    {0: {1: 1.0, 2: 1.01, 32: 1.1}},
])
def test_cost_table_prices_every_width_at_once_as_one_at_a_time(points):
    """``costs`` (every draft length in one pass, what the gate reads) gives exactly the floats
    of ``cost`` per width: inside and beyond the measured widths and contexts, with the online
    scale and per-width corrections."""
    table = CostTable(points)
    table.scale, table.correction = 1.3, {3: 1.1, 9: 0.8, 70: 1.5}
    for context in (0, 64, 300, 1024, 5000):
        assert table.costs(80, context) == [0.0, *(table.cost(p, context) for p in range(1, 81))]
    assert table.costs(3, 10) == [0.0, *(table.cost(p, 10) for p in range(1, 4))]  # a shorter read after
