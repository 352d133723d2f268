"""The plain engine against a straightforward reference loop, sampling, stops and limits."""

import mlx.core as mx
import msgspec
from mlx_lm.models.cache import make_prompt_cache

from warmspec.engine import Engine, Finished
from warmspec_protocol import SamplingParams

from conftest import chat_prompt


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
    from warmspec.engine import default_cost_cache
    from warmspec.gate import CostTable

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
