"""Speculative decoding is exact: token ids equal plain greedy decoding; sampling is distributed
as plain sampling. Every cache kind is rolled back through the same verify loop."""

from __future__ import annotations

import numpy as np
import pytest

from warmspec.core.cache import offset
from warmspec.core.engine import Engine, Finished, Run
from warmspec.core.drafter import Proposal
from warmspec.probes import ScriptedDrafter
from warmspec.core.gate import CostTable, Gate, Rates
from warmspec.core import GenerationStats, SamplingParams

import tiny
from conftest import SAMPLE_FILE, chat_prompt

# verify passes priced as nearly free, so the gate always drafts what it is offered
CHEAP = CostTable({0: {1: 1.0, 2: 1.01, 32: 1.1}})


def OracleDrafter(prompt, reference, wrong_every=4, k=5):
    """Guesses the reference continuation, corrupting every ``wrong_every``-th guess, so that
    passes end in every possible way: all accepted, none, and partial prefixes."""
    return ScriptedDrafter(prompt, reference, wrong_every=wrong_every, k=k, vocab=tiny.VOCAB)


def decode(lm, prompt, n, *, drafter=None, speculate=False, params=SamplingParams(), costs=None,
           gated=True, engine=None):
    costs = costs or CHEAP
    engine = engine or Engine(lm, speculate=speculate, costs=CostTable(costs.points, costs.plain_points),
                              gated=gated, observe_costs=False)
    stats = GenerationStats()
    run = Run(params, n, stats)
    out = [t for new in engine.generate_tokens(prompt, run, drafter=drafter, speculate=speculate)
           for t in new]
    return out, stats


@pytest.mark.parametrize("arch", list(tiny.CONFIGS))
@pytest.mark.parametrize("wrong_every", [2, 5])
def test_oracle_drafts_exact_every_cache_kind(arch, wrong_every):
    lm = tiny.build(arch)
    prompt = np.random.default_rng(7).integers(0, tiny.VOCAB, 24).tolist()
    plain, _ = decode(lm, prompt, 60)
    drafter = OracleDrafter(prompt, plain, wrong_every=wrong_every)
    spec, stats = decode(lm, prompt, 60, drafter=drafter, speculate=True, gated=False)
    assert spec == plain
    assert stats.accepted > 0 and stats.accepted < stats.drafted  # both outcomes happened
    assert stats.passes < len(plain)


@pytest.mark.parametrize("rollback", ["capture", "replay"])
def test_hybrid_rollback_both_ways(rollback):
    """Qwen3.5-style GatedDeltaNet layers: per-position capture (no extra pass) and
    snapshot + replay (one extra pass per rejection) both reproduce plain decoding."""
    lm = tiny.build("qwen3_5")
    prompt = np.random.default_rng(11).integers(0, tiny.VOCAB, 20).tolist()
    plain, _ = decode(lm, prompt, 50)
    engine = Engine(lm, costs=CostTable(CHEAP.points), gated=False, recurrent_rollback=rollback)
    assert engine.capture == (rollback == "capture")
    spec, stats = decode(lm, prompt, 50, drafter=OracleDrafter(prompt, plain, wrong_every=3),
                         speculate=True, engine=engine)
    assert spec == plain
    rejected_passes = stats.drafted - stats.accepted > 0
    assert rejected_passes
    if rollback == "capture":
        assert engine.replays == 0
    else:
        assert engine.replays > 0


@pytest.mark.parametrize("arch", list(tiny.CONFIGS))
def test_a_whole_pass_is_undone_on_every_cache_kind(arch):
    """A pass queued past the answer's end is undone whole (``keep(pass, 0)``): every cache is as
    it was before it, including recurrent states captured per position (whose last captured
    state is the one after the pass) and sliding windows that wrapped."""
    from warmspec.core.target import Target
    from mlx_lm.models.cache import make_prompt_cache
    import mlx.core as mx

    lm = tiny.build(arch)
    engine = Engine(lm, costs=CostTable(CHEAP.points))
    target = Target(lm.model, capture=engine.capture)
    cache = make_prompt_cache(lm.model)
    lm.model(mx.array([list(range(3, 40))]), cache=cache)
    p = target.verify(mx.array([5, 6, 7, 8, 9]), cache)
    mx.eval(p.logits)
    assert target.keep(p, 0, cache) == 0 and offset(cache) == 37
    # the cache goes on as if the pass never was
    fresh = make_prompt_cache(lm.model)
    lm.model(mx.array([list(range(3, 40))]), cache=fresh)
    want = lm.model(mx.array([[11, 12]]), cache=fresh)
    got = lm.model(mx.array([[11, 12]]), cache=cache)
    assert mx.allclose(got, want, atol=1e-5).item()


def test_capture_only_where_mlx_lm_skips_its_fused_kernel(monkeypatch):
    """On Metal mlx-lm runs GatedDeltaNet through a fused kernel (key heads a multiple of 32),
    which the per-position capture cannot reproduce bit for bit: replay there."""
    from warmspec.core import hybrid

    assert hybrid.uses_fused_kernel(128, metal_gpu=True)
    assert hybrid.uses_fused_kernel(32, metal_gpu=True)
    for dim, metal, training in ((128, False, False), (16, True, False), (48, True, False),
                                 (128, True, True)):
        assert not hybrid.uses_fused_kernel(dim, training=training, metal_gpu=metal)
    lm = tiny.build("qwen3_5")  # key heads of 16: the ops path even on Metal
    lm.model.eval()  # as loaded models are: mlx-lm uses no kernel while training
    monkeypatch.setattr(hybrid, "_metal_gpu", lambda: True)
    assert Engine(lm, costs=CostTable(CHEAP.points)).capture
    for layer in lm.model.layers:
        if layer.is_linear:
            layer.linear_attn.head_k_dim = 64
    assert not Engine(lm, costs=CostTable(CHEAP.points)).capture
    monkeypatch.setattr(hybrid, "_metal_gpu", lambda: False)
    assert Engine(lm, costs=CostTable(CHEAP.points)).capture


def test_rotating_cache_wraps_during_speculation():
    """gemma3's sliding window is 8 here: 60 tokens wrap it many times mid-speculation."""
    lm = tiny.build("gemma3_text")
    prompt = list(range(5, 20))
    plain, _ = decode(lm, prompt, 60)
    spec, stats = decode(lm, prompt, 60, drafter=OracleDrafter(prompt, plain, wrong_every=3),
                         speculate=True, gated=False)
    assert spec == plain and stats.accepted > 20


@pytest.mark.parametrize("arch", list(tiny.CONFIGS))
def test_ngram_self_drafting_exact(arch):
    """A prompt that repeats itself makes the n-gram drafter propose; output equals plain."""
    lm = tiny.build(arch)
    rng = np.random.default_rng(3)
    block = rng.integers(0, tiny.VOCAB, 12).tolist()
    prompt = block * 4
    plain, _ = decode(lm, prompt, 50)
    spec, stats = decode(lm, prompt, 50, speculate=True, gated=False)
    assert spec == plain
    assert stats.drafted > 0
    assert set(stats.sources) == {"request"} and stats.sources["request"].drafted == stats.drafted


@pytest.mark.parametrize("arch", list(tiny.CONFIGS))
def test_end_of_sequence_inside_accepted_drafts(arch):
    """A pass whose accepted drafts contain end-of-sequence, with more accepted after it: the
    output stops at it exactly as plain decoding does, every cache kind."""
    lm = tiny.build(arch)
    prompt = np.random.default_rng(12).integers(0, tiny.VOCAB, 24).tolist()
    reference, _ = decode(lm, prompt, 40)  # the byte tokenizer has no end-of-sequence
    k = next(i for i in range(12, 40) if reference[i] not in reference[:i])
    lm.tokenizer.eos_ids = frozenset({reference[k]})  # this model's own tokenizer only
    plain = generate(Engine(lm, speculate=False, costs=CostTable(CHEAP.points)), prompt, max_tokens=40)
    engine = Engine(lm, costs=CostTable(CHEAP.points), gated=False)
    spec = generate(engine, prompt, max_tokens=40,
                    drafter=ScriptedDrafter(prompt, reference, wrong_every=1000, k=8, vocab=tiny.VOCAB))
    assert plain.tokens == reference[:k] and plain.finish_reason == "stop"
    assert (spec.tokens, spec.text, spec.finish_reason) == (plain.tokens, plain.text, "stop")
    assert spec.stats.completion_tokens == plain.stats.completion_tokens == k
    # the end-of-sequence was an accepted draft with more accepted after it, not the bonus token
    assert len(engine.cache_tokens) > len(prompt) + k


def copy_prompt(lm):
    return chat_prompt(lm, f"You are editing the file `paths.py`.\n\nHere is the current content of "
                       f"the file:\n\n```python\n{SAMPLE_FILE}```\n\nChange request:\nRename cache_dir to "
                       "user_cache_dir.\n\nOutput the complete updated file in one fenced code block "
                       "(```python ... ```) and nothing else: no explanation before or after it, and do "
                       "not omit or abbreviate any unchanged parts.")


def test_default_model_copy_prompt_exact(default_lm, default_costs):
    """The real model copying a file: long drafts accepted and some rejected, output identical."""
    prompt = copy_prompt(default_lm)
    plain, pst = decode(default_lm, prompt, 200, costs=default_costs)
    spec, sst = decode(default_lm, prompt, 200, speculate=True, costs=default_costs)
    assert spec == plain
    assert sst.accepted >= 60 and sst.accepted < sst.drafted
    assert sst.passes < pst.passes / 2


def generate(engine, prompt, **kw):
    """``Engine.generate``'s Finished, after checking that the deltas carry its tokens in order."""
    events = list(engine.generate(prompt, SamplingParams(), **kw))
    fin = events[-1]
    assert isinstance(fin, Finished)
    assert [t for ev in events[:-1] for t in ev.tokens] == fin.tokens
    assert "".join(ev.text for ev in events[:-1]) == fin.text
    return fin


def test_text_level_identical_with_stop(default_lm, default_costs):
    """Text, tokens and token counts (every API's usage) equal plain decoding's, though the stop
    string ends inside a pass of accepted drafts (the file's copy is drafted from the prompt)."""
    prompt = copy_prompt(default_lm)
    outs = []
    for spec in (False, True):
        engine = Engine(default_lm, speculate=spec, costs=CostTable(default_costs.points),
                        observe_costs=False)
        fin = generate(engine, prompt, max_tokens=100, stop=["environ"])
        outs.append((fin.text, fin.finish_reason, fin.tokens, fin.stats.completion_tokens))
    assert outs[0] == outs[1]
    assert outs[0][1] == "stop" and outs[0][3] == len(outs[0][2])
    assert fin.stats.accepted > 0
    assert len(engine.cache_tokens) > len(prompt) + len(fin.tokens)  # the pass went past the stop


@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
def test_stop_string_inside_accepted_drafts_counts_as_plain(arch):
    lm = tiny.build(arch)
    prompt = np.random.default_rng(8).integers(0, tiny.VOCAB, 24).tolist()
    engine = Engine(lm, speculate=False, costs=CostTable(CHEAP.points))
    reference = generate(engine, prompt, max_tokens=40)
    stop = reference.text[len(reference.text) // 2:][:2]
    plain = generate(Engine(lm, speculate=False, costs=CostTable(CHEAP.points)), prompt, max_tokens=40,
                     stop=[stop])
    engine = Engine(lm, costs=CostTable(CHEAP.points), gated=False)
    spec = generate(engine, prompt, max_tokens=40, stop=[stop],
                    drafter=OracleDrafter(prompt, reference.tokens, wrong_every=1000, k=8))
    assert plain.finish_reason == "stop" and len(plain.tokens) < len(reference.tokens)
    assert (spec.text, spec.stop, spec.tokens) == (plain.text, plain.stop, plain.tokens)
    assert spec.stats.completion_tokens == plain.stats.completion_tokens == len(plain.tokens)
    # the pass that completed the stop string accepted drafts beyond it
    assert len(engine.cache_tokens) >= len(prompt) + len(spec.tokens)


def test_drafts_accepted_up_to_end_of_sequence_are_kept(default_lm, default_costs):
    """A pass that accepts drafts and then reaches end-of-sequence keeps those drafts: the echo
    below ends '...a test.' then <|im_end|>, all drafted from the prompt in one pass."""
    prompt = chat_prompt(default_lm, "Say exactly this and nothing else: Hello world, this is a test.")
    plain, pst = decode(default_lm, prompt, 40, costs=default_costs)
    spec, sst = decode(default_lm, prompt, 40, speculate=True, costs=default_costs)
    assert pst.completion_tokens < 40  # it ended on end-of-sequence, not on the budget
    assert spec == plain
    assert sst.accepted > 0


# A machine where a pipelined plain step costs half a synchronous one (as on a GPU): speculative
# decoding then runs its plain steps ahead and switches between the two kinds of pass.
PIPELINED = CostTable({0: {1: 1.0, 2: 1.01, 32: 1.1}}, plain={0: 0.5})


class Intermittent:
    """Proposes on some steps only -- right, wrong in the first token (the one a pass queued
    ahead computes), or wrong later -- and nothing on the others, so that the engine runs
    pipelined plain steps, switches to verify passes queued on an unread token, and back."""

    def __init__(self, prompt, reference, period=7, silent=(1, 2, 4)):
        self.text = list(prompt) + list(reference)
        self.pos = len(prompt)
        self.calls = 0
        self.period, self.silent = period, silent

    wants_hidden = False

    def commit(self, tokens, hidden=None):
        self.pos += len(tokens)

    def propose(self, k):
        from warmspec.core.drafter import Proposal

        self.calls += 1
        phase = self.calls % self.period
        if phase in self.silent:  # nothing to propose
            return None
        guess = self.text[self.pos : self.pos + min(k, 6)]
        if not guess:
            return None
        if phase == 3:
            guess[0] = (guess[0] + 1) % tiny.VOCAB
        elif phase == 5 and len(guess) > 2:
            guess[2] = (guess[2] + 1) % tiny.VOCAB
        return Proposal(tokens=guess, confidence=0.98, source="intermittent")


@pytest.mark.parametrize("arch", list(tiny.CONFIGS))
def test_pipelined_plain_steps_between_drafts_exact_every_cache_kind(arch):
    """Gated-off steps run pipelined and drafts resume from a pass queued ahead: the tokens are
    plain's, on every cache kind (the pass left ahead at the end is rolled back, so the engine's
    next request is right too)."""
    lm = tiny.build(arch)
    prompt = np.random.default_rng(5).integers(0, tiny.VOCAB, 20).tolist()
    plain, _ = decode(lm, prompt, 70)
    engine = Engine(lm, speculate=True, costs=CostTable(PIPELINED.points, PIPELINED.plain_points),
                    gated=False)
    assert engine._pipelining_pays()
    drafter = Intermittent(prompt, plain)
    spec, stats = decode(lm, prompt, 70, drafter=drafter, speculate=True, engine=engine)
    assert spec == plain
    assert 0 < stats.accepted < stats.drafted and stats.draft_passes < stats.passes
    again, _ = decode(lm, prompt, 40, engine=engine)  # plain decoding on the same engine
    assert again == plain[:40]


class Flipping:
    """Plain steps of both kinds in a random order, and verify passes queued before or after the
    consumer's turn (``best``) in another, to check every switch between them."""

    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)
        self.seen = {True: 0, False: 0}
        self.overlapped = {True: 0, False: 0}

    @property
    def best(self):
        b = bool(self.rng.integers(2))
        self.overlapped[b] += 1
        return b

    def ahead(self):
        return bool(self.rng.integers(2))

    def observe(self, ahead, seconds, context=0):
        assert seconds > 0
        self.seen[ahead] += 1


@pytest.mark.parametrize("arch", list(tiny.CONFIGS))
def test_switching_between_pipelined_and_synchronous_plain_steps_is_exact(arch):
    """The plain-step kind can change at any step (a pass in flight is then read without one
    queued behind it), and so can whether the next pass is queued before the consumer gets a
    step's tokens: the tokens are plain's on every cache kind, both kinds of plain step get
    timed, and the engine's next request is right too."""
    lm = tiny.build(arch)
    prompt = np.random.default_rng(6).integers(0, tiny.VOCAB, 20).tolist()
    plain, _ = decode(lm, prompt, 150)
    for seed in range(3):
        engine = Engine(lm, speculate=True, costs=CostTable(PIPELINED.points, PIPELINED.plain_points),
                        gated=False)
        engine._plain_steps = steps = Flipping(seed)
        drafter = Intermittent(prompt, plain, period=14, silent=(1, 2, 4, 6, 7, 8, 9, 10, 11, 12))
        spec, stats = decode(lm, prompt, 150, drafter=drafter, speculate=True, engine=engine)
        assert spec == plain
        assert steps.seen[True] > 0 and steps.seen[False] > 0
        assert steps.overlapped[True] > 0 and steps.overlapped[False] > 0
        again, _ = decode(lm, prompt, 40, engine=engine)
        assert again == plain[:40]


def test_plain_steps_follow_the_kind_measured_faster():
    """``PlainSteps`` keeps its prior until both kinds are timed, then the faster one, and tries
    the other now and then, less often the further apart they are; fixed, it never tries."""
    from warmspec.core.gate import EXPLORE_EVERY, EXPLORE_FIRST, EXPLORE_STEPS, PlainSteps

    costs = CostTable({0: {1: 0.1}, 1000: {1: 0.2}})

    def run(steps, times, n):
        kinds = []
        for i in range(n):
            ahead = steps.ahead()
            kinds.append(ahead)
            steps.observe(ahead, times[ahead] * (1 + i / 1000), context=i)  # context grows
        return kinds

    steps = PlainSteps(costs, prior=False)
    kinds = run(steps, {True: 0.09, False: 0.1}, 2000)  # running ahead is 10% faster
    assert kinds[: EXPLORE_FIRST - 1] == [False] * (EXPLORE_FIRST - 1)  # the prior first
    tried = EXPLORE_FIRST - 1 + EXPLORE_STEPS
    assert kinds[EXPLORE_FIRST - 1 : tried] == [True] * EXPLORE_STEPS
    assert steps.best is True
    near = kinds[tried:].count(False)  # the synchronous kind, tried now and then
    assert 0 < near <= EXPLORE_STEPS * (2000 // EXPLORE_EVERY)
    far = PlainSteps(costs, prior=True)  # synchronous 50% slower: tried less often
    kinds = run(far, {True: 0.1, False: 0.15}, 2000)
    assert far.best is True and 0 < kinds[tried:].count(False) < near / 3
    slower = PlainSteps(costs, prior=True)  # the prior was wrong: running ahead is slower
    kinds = run(slower, {True: 0.12, False: 0.1}, 300)
    assert slower.best is False and kinds[-50:].count(False) >= 50 - EXPLORE_STEPS
    fixed = PlainSteps(costs, prior=True, learn=False)
    assert all(run(fixed, {True: 0.2, False: 0.1}, 300)) and fixed.best is True


def test_plain_decoding_is_pipelined_on_every_cache_kind():
    """Plain greedy decoding (no drafter) runs ahead on every cache kind, not only attention."""
    for arch in tiny.CONFIGS:
        lm = tiny.build(arch)
        prompt = list(range(3, 30))
        from test_engine import reference_greedy

        ref = reference_greedy(lm.model, prompt, 40, lm.tokenizer.eos_ids)
        engine = Engine(lm, speculate=False)
        out, stats = decode(lm, prompt, 40, engine=engine)
        assert out == ref and stats.passes == len(out)
        # the pass run ahead was undone: the cache holds the prompt and all but the last token
        assert engine.cache_tokens == prompt + out[:-1]
        assert offset(engine.cache) == len(prompt) + len(out) - 1
        # and exactly: continuing the answer from that state equals decoding it from scratch
        longer = prompt + out
        assert decode(lm, longer, 12, engine=engine)[0] == reference_greedy(lm.model, longer, 12, set())


def test_the_first_token_is_read_before_a_pass_is_queued_behind_it():
    """An answer's first token comes from one pass: queued behind it, a second pass made a CPU
    compute both before the first token could be read (ghost text's first character waited
    two passes). Pipelining starts from the second token: plain decoding and speculative
    decoding with a pipelining gate both yield the first token with exactly one decode pass
    made, and the tokens are plain's."""
    from test_engine import CountingModel, reference_greedy

    lm = tiny.build("llama")
    prompt = list(range(3, 30))
    ref = reference_greedy(lm.model, prompt, 12, lm.tokenizer.eos_ids)
    for engine in (Engine(lm, speculate=False),
                   Engine(lm, speculate=True, costs=CostTable(PIPELINED.points, PIPELINED.plain_points))):
        counting = CountingModel(engine.model)
        engine.model = counting
        run = Run(SamplingParams(temperature=0.0), 12, GenerationStats())
        out = []
        for new in engine.generate_tokens(prompt, run):
            if not out:
                assert counting.calls == 1 + 1, counting.calls  # one prefill chunk, one decode pass
            out.extend(new)
        assert out == ref
        engine.model = counting._model


def test_a_consumer_that_stops_early_leaves_no_pass_in_flight(monkeypatch):
    """Ghost text stops at the end of a line with the next pass queued ahead: the generation
    waits for it on its stream before it ends (a process exiting with a pass inside OpenBLAS hung
    in OpenBLAS's shutdown), and the next request decodes as plain decoding does."""
    import mlx.core as mx
    from mlx_lm.generate import generation_stream
    from test_engine import reference_greedy

    synced = []
    real = mx.synchronize
    monkeypatch.setattr(mx, "synchronize", lambda *a, **k: (synced.append(a or k), real(*a, **k))[1])
    lm = tiny.build("llama")
    prompt = list(range(3, 30))
    ref = reference_greedy(lm.model, prompt, 12, lm.tokenizer.eos_ids)
    for engine in (Engine(lm, speculate=False),
                   Engine(lm, speculate=True, costs=CostTable(PIPELINED.points, PIPELINED.plain_points))):
        steps = engine.generate_tokens(prompt, Run(SamplingParams(temperature=0.0), 12, GenerationStats()))
        out = next(steps) + next(steps)  # the consumer takes two steps and stops
        assert out == ref[:len(out)]
        synced.clear()
        steps.close()
        assert synced == [(generation_stream,)]
        run = Run(SamplingParams(temperature=0.0), 12, GenerationStats())
        assert [t for new in engine.generate_tokens(prompt, run) for t in new] == ref


class SlowDrafter:
    """A drafter that takes ``delay`` seconds per proposal and is right half the time."""

    def __init__(self, prompt, reference, delay):
        self.inner = ScriptedDrafter(prompt, reference, wrong_every=2, k=1, vocab=tiny.VOCAB)
        self.delay = delay
        self.calls = 0

    wants_hidden = False

    def commit(self, tokens, hidden=None):
        self.inner.commit(tokens)

    def propose(self, k):
        import time

        self.calls += 1
        time.sleep(self.delay)
        p = self.inner.propose(1)
        return p


def test_host_time_turns_a_slow_drafter_off():
    """Proposing costs host time: a drafter whose proposals take longer than the pass they could
    save is gated off (by the measured host time) and then rarely asked."""
    lm = tiny.build("llama")
    prompt = list(range(3, 30))
    plain, _ = decode(lm, prompt, 60)
    # a step costs 10 ms here; a proposal 30 ms, right half the time
    costs = CostTable({0: {1: 0.010, 2: 0.011, 8: 0.012}})
    engine = Engine(lm, speculate=True, costs=costs, observe_costs=False)
    slow = SlowDrafter(prompt, plain, delay=0.03)
    spec, stats = decode(lm, prompt, 60, drafter=slow, speculate=True, engine=engine)
    assert spec == plain
    assert engine.gate.host_s >= 0.03
    assert slow.calls < 15  # 60 steps: the pauses left most of them without a proposal
    assert engine.gate.skipped > 40
    # the same drafter without the delay is verified every time it proposes
    fast_engine = Engine(lm, speculate=True, costs=CostTable(costs.points), observe_costs=False)
    fast = SlowDrafter(prompt, plain, delay=0.0)
    decode(lm, prompt, 60, drafter=fast, speculate=True, engine=fast_engine)
    assert fast_engine.gate.skipped == 0 and fast.calls > 25


class Unsure:
    """Always right, but claims only even odds (the prior's bin): the gate must learn it."""

    wants_hidden = False

    def __init__(self, prompt, reference):
        self.inner = ScriptedDrafter(prompt, reference, wrong_every=10**9, k=6, vocab=tiny.VOCAB)

    def commit(self, tokens, hidden=None):
        self.inner.commit(tokens)

    def propose(self, k):
        p = self.inner.propose(k)
        return p and Proposal(tokens=p.tokens, confidence=0.5, source="unsure")


def test_proposals_left_unverified_are_scored_against_what_was_emitted():
    """A proposal the gate refuses is scored against the token the plain step then emits: its
    bin's estimate keeps learning without a verify pass, and a drafter that is right is soon
    verified. Learning from verified drafts alone (a one-token probe every 16 refusals), the
    estimate would reach 0.64 in these 80 tokens, and nothing would be verified."""
    lm = tiny.build("llama")
    prompt = list(range(3, 30))
    plain, _ = decode(lm, prompt, 80)
    # a draft of one costs three plain steps: at the prior's even odds no width pays
    costs = CostTable({0: {1: 0.01, 2: 0.03, 8: 0.05}})
    engine = Engine(lm, speculate=True, costs=costs, observe_costs=False, observe_host=False)
    spec, stats = decode(lm, prompt, 80, drafter=Unsure(prompt, plain), speculate=True, engine=engine)
    assert spec == plain
    assert stats.gated_steps > 5 and stats.drafted > 0
    assert stats.accepted == stats.drafted and stats.accepted > 30


def test_time_outside_the_pass_is_priced_where_a_verify_step_pays_it():
    """The consumer's work on each step (streaming, detokenizing) runs while the device computes
    the pass queued before it, for verify passes as for plain steps, where plain steps run
    ahead (a GPU): a slow consumer then costs drafting nothing and a drafter right half the time
    is verified at each proposal. Where steps are synchronous (a CPU that measured them
    faster), every step pays that time after its pass, plain and verify alike, and the gate
    prices it on both sides: drafting goes on as well. Only a verify step read synchronously
    between pipelined plain steps would pay it alone, and the gate then turns marginal drafting
    off (as it did on an H200, where it had drafted at 11% acceptance: prose at 0.86x plain)."""
    import time

    from warmspec.core.gate import Gate

    lm = tiny.build("llama")
    prompt = list(range(3, 30))
    plain, _ = decode(lm, prompt, 30)
    # a pass 50 ms, one draft 10% more; a pipelined plain step as measured: 60 ms a token
    points, plain_points = {0: {1: 0.05, 2: 0.055, 8: 0.06}}, {0: 0.06}

    def consume(delay, pipelined):
        engine = Engine(lm, speculate=True, costs=CostTable(points, plain_points), observe_costs=False)
        engine._pipelining_pays = lambda: pipelined
        stats = GenerationStats()
        out = []
        for new in engine.generate_tokens(prompt, Run(SamplingParams(), 30, stats),
                                          drafter=SlowDrafter(prompt, plain, delay=0.0), speculate=True):
            out.extend(new)
            time.sleep(delay)
        assert out == plain
        return stats, engine.gate

    quick, gate = consume(0.0, True)
    assert gate.overlapped and quick.drafted >= 12  # a proposal every step: verified each time
    slow, gate = consume(0.15, True)
    assert gate.overlapped and gate._outside() == 0.0  # nothing paid outside a pass
    assert slow.drafted >= 12
    synchronous, gate = consume(0.15, False)
    assert not gate.overlapped and gate.outside_s >= 0.15 and synchronous.drafted >= 12
    # a verify step read synchronously while plain steps run ahead pays that time alone
    gate = Gate(CostTable(points, plain_points), max_draft=8)
    gate.pipelined, gate.overlapped, gate.outside_s = True, False, 0.15
    assert gate.choose(8, 0.5, source="x") == 0
    gate.overlapped = True
    assert gate.choose(8, 0.5, source="x") > 0


def test_drafts_that_guess_a_token_in_flight_are_priced_without_the_guess():
    """Queued on a plain pass in flight, k drafts cost a pass of k positions, and the first one
    (the guess of the token in flight) yields no token of its own: a proposal whose first token
    is mostly right and the rest mostly wrong pays as an ordinary verify pass but not there,
    and one whose later tokens are right pays in both."""
    points = {64: {1: 0.010, 2: 0.011, 4: 0.012, 8: 0.014, 9: 0.0145}}
    gate = Gate(CostTable(points, {64: 0.010}), max_draft=8)
    gate.pipelined = gate.overlapped = True
    b = Gate.bin(0.5, "x")
    gate.rate[b] = Rates(0.9, 0.1)
    k, v = gate.value(8, 0.5, 64, source="x")
    assert k > 0 and v > 1.9 / 0.0115  # about 1.9 tokens for 0.011-0.0115 s
    gate.guessing = True
    k, v = gate.value(8, 0.5, 64, source="x")
    assert k == 0 and v == pytest.approx(1 / 0.010)  # 1.09 tokens for 0.011 s at best
    gate.rate[b] = Rates(0.9, 0.9)
    k, v = gate.value(8, 0.5, 64, source="x")
    assert k == 8 and v == pytest.approx((Rates(0.9, 0.9).expected(8) - 0.9) / 0.014)
    gate.rate[b] = Rates(1.0, 1.0)  # even a certain one-token draft is a plain pass, synchronous
    assert gate.value(1, 0.5, 64, source="x")[0] == 0


@pytest.mark.parametrize("arch", ["llama", "qwen3_5", "gemma3_text"])
def test_the_next_pass_is_queued_before_the_consumer_gets_a_step(arch):
    """Where plain steps run ahead, every step after the first reaches the consumer with the
    next pass already on the device -- verify passes and plain ones -- and the tokens are
    plain's; where they run synchronously, no step does (the consumer's work would slow the
    pass on a CPU's shared cores)."""
    lm = tiny.build(arch)
    prompt = np.random.default_rng(8).integers(0, tiny.VOCAB, 20).tolist()
    plain, _ = decode(lm, prompt, 60)
    for ahead in (True, False):
        engine = Engine(lm, speculate=True, costs=CostTable(PIPELINED.points, PIPELINED.plain_points),
                        gated=False, observe_costs=False)
        engine._pipelining_pays = lambda: ahead
        queued = []
        verify = engine.target.verify
        engine.target.verify = lambda *a: queued.append(1) or verify(*a)
        guessing = []  # per proposal: whether its pass goes on a plain pass in flight
        choose = engine.gate.choose
        engine.gate.choose = lambda *a, **k: guessing.append(engine.gate.guessing) or choose(*a, **k)
        stats = GenerationStats()
        run = Run(SamplingParams(), 60, stats)
        out, in_flight = [], []
        for new in engine.generate_tokens(prompt, run, drafter=Intermittent(prompt, plain),
                                          speculate=True):
            in_flight.append(len(queued) - stats.passes)  # passes queued and not read back
            out.extend(new)
        assert engine.replays == 0 and out == plain
        assert stats.draft_passes > 5 and stats.passes - stats.draft_passes > 5
        if ahead:
            assert in_flight[0] == 0 and all(n >= 1 for n in in_flight[1:-1]), in_flight
            assert any(guessing) and not all(guessing)  # after a verify step nothing is in flight
        else:
            assert all(n == 0 for n in in_flight), in_flight
            assert guessing and not any(guessing)
        again, _ = decode(lm, prompt, 40, engine=engine)  # what was queued past the end is undone
        assert again == plain[:40]


def test_a_repeated_answer_is_drafted_from_the_engine_s_recent_answers():
    """A request answered before (a retry, an agent repeating itself in another conversation)
    drafts from the earlier answer: nearly the whole answer in few passes, still plain's tokens."""
    lm = tiny.build("llama")
    prompt = np.random.default_rng(21).integers(0, tiny.VOCAB, 30).tolist()
    plain, _ = decode(lm, prompt, 60)
    engine = Engine(lm, speculate=True, costs=CostTable(CHEAP.points), gated=False, observe_costs=False)
    first, st1 = decode(lm, prompt, 60, speculate=True, engine=engine)
    engine.reset()
    engine.store.clear()  # no cached state: the second run must draft, not reuse
    again, st2 = decode(lm, prompt, 60, speculate=True, engine=engine)
    assert first == again == plain
    assert st2.accepted >= 50 and st2.passes <= 12
    assert st2.accepted > st1.accepted + 30
    assert st2.sources["recent"].accepted >= 50 and "recent" not in st1.sources
    engine.recent.clear()
    engine.reset()
    engine.store.clear()
    _, st3 = decode(lm, prompt, 60, speculate=True, engine=engine)
    assert st3.accepted == st1.accepted  # without the recent answers: as the first time


def test_a_prediction_is_drafted_from_the_first_token():
    """OpenAI-style predicted output: drafted from the answer's first token, ahead of every other
    source; a right prediction is accepted nearly whole, a wrong one changes nothing."""
    lm = tiny.build("qwen3")
    prompt = np.random.default_rng(4).integers(0, tiny.VOCAB, 25).tolist()
    plain, _ = decode(lm, prompt, 50)
    engine = Engine(lm, speculate=True, costs=CostTable(CHEAP.points), gated=False, observe_costs=False)
    run = Run(SamplingParams(), 50, GenerationStats())
    right = [t for new in engine.generate_tokens(prompt, run, prediction=plain) for t in new]
    assert right == plain
    assert run.stats.sources["prediction"].accepted >= 45 and run.stats.passes <= 5
    engine.reset()
    engine.store.clear()
    engine.recent.clear()
    wrong = [(t + 1) % tiny.VOCAB for t in plain]
    run = Run(SamplingParams(), 50, GenerationStats())
    out = [t for new in engine.generate_tokens(prompt, run, prediction=wrong) for t in new]
    assert out == plain
    assert run.stats.sources["prediction"].accepted == 0 < run.stats.sources["prediction"].drafted


def test_a_drafts_first_token_and_the_rest_are_estimated_apart():
    """The gate keeps two rates per bin: of a proposal's first token, and of each later one after
    an accepted one. A source right at the first token one time in four, but then right on
    (prose copying a phrase), is worth a long draft where a wide pass costs little more than a
    narrow one; one per-token rate, pulled down by every first-token miss, kept such drafts at two
    tokens. And a source whose first tokens are rarely right is not drafted from however long its
    lucky runs are."""
    from warmspec.core.gate import Gate, Rates

    costs = {0: {1: 0.05, 2: 0.058, 8: 0.078}}  # a two-wide pass 1.16x one, eight-wide 1.56x
    bursty = Gate(CostTable(costs), max_draft=8)
    for _ in range(10):  # one proposal in four right (both drafts), three wrong from the first
        bursty.observe(0.5, 2, 2, source="s")
        for _ in range(3):
            bursty.observe(0.5, 2, 0, source="s")
    bursty.begin()  # that history was earlier requests': this one is not calibrated yet
    rates = bursty.acceptance(0.5, "s")
    assert 0.2 < rates.first < 0.3 and rates.cont > 0.8  # from the prior, 0.5, after 10 hits
    assert bursty.choose(8, 0.5, source="s") >= 6
    assert bursty.value(8, 0.5, source="s")[1] > 1.5 / 0.078  # 1.9 tokens for a 1.56x pass

    rare = Gate(CostTable(costs), max_draft=8)
    for _ in range(5):  # one proposal in ten right at its first token, then six of seven more
        rare.observe(0.5, 8, 7, source="s")
        for _ in range(9):
            rare.observe(0.5, 8, 0, source="s")
    assert rare.acceptance(0.5, "s").first < 0.15
    assert rare.choose(8, 0.5, source="s") == 0
    assert Rates(0.25, 1.0).expected(8) == 3.0 and Rates(0.5, 0.5).expected(2) == 1.75


def test_a_request_whose_drafts_miss_stops_drafting_in_bins_it_has_not_tried():
    """Acceptance is learned per bin across requests; a request whose drafts fall short of the
    estimates scales every bin of that source down (``Gate.calibration``), so that misses spread
    over several bins stop drafting in the others too, while a long copy is still drafted, and the
    next request starts from the estimates again. The same for later tokens: first tokens right
    and the rest wrong stop long drafts on a later rate learned in loops. Costs as on an H100 (``docs/bench/gpu-s35``):
    a failed draft costs one or two plain steps there."""
    from warmspec.core.gate import Gate

    costs = CostTable({0: {1: 0.003, 2: 0.005, 4: 0.006, 16: 0.0062}}, {0: 0.0025})
    gate = Gate(costs, max_draft=16)
    gate.pipelined = True
    for confidence in (0.5, 2 / 3, 0.75):  # earlier requests: lists that copied well
        for _ in range(3):
            gate.observe(confidence, 4, 4, source="request")
            gate.observe(confidence, 4, 1, source="request")
    gate.begin()
    assert gate.choose(8, 0.75, source="request") > 0
    for confidence in (0.5, 2 / 3):  # this one: prose, two misses in each of two other bins
        for _ in range(2):
            gate.observe(confidence, 8, 0, source="request")
    assert gate.calibration("request")[0] < 0.5
    assert gate.choose(8, 0.75, source="request") == 0  # a bin this request has not tried
    assert gate.choose(16, 33 / 34, source="request") > 8  # a long copy still pays
    assert gate.calibration("mtp") == (1.0, 1.0)  # another source's estimates are its own
    gate.begin()
    assert gate.choose(8, 0.75, source="request") > 0
    # this one: first tokens right, the copy they start stops at once (a loop's estimates)
    for _ in range(6):
        gate.observe(33 / 34, 16, 16, source="request")  # an earlier request, looping
    gate.begin()
    assert gate.choose(16, 33 / 34, source="request") == 16
    for confidence in (0.5, 2 / 3, 0.75) * 2:
        gate.observe(confidence, 8, 1, source="request")
    assert gate.calibration("request")[1] < 0.4
    assert gate.choose(16, 33 / 34, source="request") <= 4



def test_a_request_whose_first_drafts_miss_drafts_again_when_its_text_turns_to_copying():
    """The request's calibration forgets (``CALIBRATION_DECAY``): summed over the request, a
    start of misses kept the ratio low for the rest of it, and a prompt whose answer copied
    later ran at 0.94x plain against 1.53x without it on an H100 (own-essay-05,
    ``docs/bench/gpu-s37``). Its proposals are still scored while gated off (``settle``), and
    once they come right about as often as the estimates say, the request drafts again."""
    from warmspec.core.gate import Gate

    costs = CostTable({0: {1: 0.003, 2: 0.005, 4: 0.006, 16: 0.0062}}, {0: 0.0025})
    gate = Gate(costs, max_draft=16)
    gate.pipelined = True
    for _ in range(10):  # earlier requests: short and longer matches right most of the time
        for confidence in (0.5, 2 / 3, 0.75, 5 / 6):
            gate.observe(confidence, 4, 4, source="request")
            gate.observe(confidence, 4, 0, source="request")
    gate.begin()
    for _ in range(7):  # this one starts with misses in three bins
        for confidence in (0.5, 2 / 3, 0.75):
            gate.observe(confidence, 4, 0, source="request")
    assert gate.calibration("request")[0] < 0.3
    assert gate.choose(8, 5 / 6, source="request") == 0  # a bin it has not tried
    for i in range(15):  # then it copies: as often right as the estimate says (3 in 5)
        hit = i % 5 < 3
        gate.shadow([1, 2, 3, 4], 5 / 6, "request")
        gate.settle([1, 2, 3, 4, 5] if hit else [9])
    assert gate.calibration("request")[0] > 0.8
    assert gate.choose(8, 5 / 6, source="request") >= 2


def test_a_head_right_half_the_time_keeps_drafting_after_a_run_of_misses():
    """A source asked before it proposes (``Gate.depth``: an MTP head) is not calibrated: it is
    not scored while not asked, and its rate over its proposals already follows the request.
    With the calibration, four misses in a row of a head right half the time turned it off
    (costs as on this 2-core CPU: a wider pass costs little more than one position); a head
    that keeps missing still stops, by its own rate."""
    from warmspec.core.gate import Gate
    from warmspec.core.drafters import LAZY_CONFIDENCE

    costs = CostTable({0: {1: 0.060, 2: 0.063, 4: 0.068, 16: 0.095}}, {0: 0.060})
    gate = Gate(costs, max_draft=16)
    gate.device_source["mtp"] = 0.0025
    for i in range(40):  # earlier requests: right half the time
        gate.observe(LAZY_CONFIDENCE, 2, i % 2, source="mtp")
    gate.begin()
    assert gate.depth("mtp", 4) >= 1
    for _ in range(4):  # this request: a run of misses, as a coin right half the time throws
        gate.observe(LAZY_CONFIDENCE, 1, 0, source="mtp")
    assert gate.depth("mtp", 4) >= 1 and gate.choose(4, LAZY_CONFIDENCE, source="mtp") >= 1
    assert gate.calibration("mtp") == (1.0, 1.0)
    for _ in range(20):  # a head that keeps missing stops by its own rate
        gate.observe(LAZY_CONFIDENCE, 1, 0, source="mtp")
    assert gate.depth("mtp", 4) == 0
    assert gate.calibration("request") == (1.0, 1.0)  # n-gram, proposed on the host, is calibrated
    gate.observe(0.5, 4, 0, source="request")
    assert gate.calibration("request")[0] < 1.0

class SlowWide:
    """The model, holding the host ``delay`` seconds before every pass wider than one position
    (prefill chunks and verify passes): drafting that costs more than it saves."""

    def __init__(self, model, delay):
        self._model = model
        self.delay = delay

    def __call__(self, inputs, *args, **kwargs):
        import time

        if inputs.shape[-1] > 1:
            time.sleep(self.delay)
        return self._model(inputs, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._model, name)


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, seed=3)])
def test_the_ledger_pauses_drafting_that_loses_time_whatever_the_gate_estimates(params):
    """The gate's choice is forced to draft 4 at every proposal (estimates that are wrong), and
    every verify pass costs 50 ms more than a plain step: the request's ledger sees the time
    lost and pauses drafting, for longer each time, so only a few drafting steps are run.
    Greedy, its tokens are plain's; sampled too, it pauses. Without the ledger every step
    drafts."""
    lm = tiny.build("llama")
    prompt = list(range(3, 30))
    plain, _ = decode(lm, prompt, 160)
    greedy = params.greedy

    def run(ledger):
        costs = CostTable({0: {1: 0.002, 2: 0.002, 8: 0.002}}, {0: 0.002})
        engine = Engine(lm, speculate=True, costs=costs)  # observing costs and host time: real clocks
        engine.gate.choose = lambda available, *a, **k: min(available, 4)
        if not ledger:
            engine.gate.observe_step = lambda *a, **k: None
        engine.model = SlowWide(engine.model, 0.05)
        drafter = ScriptedDrafter(prompt, plain, wrong_every=2, k=4, vocab=tiny.VOCAB)
        out, stats = decode(lm, prompt, 160, drafter=drafter, speculate=True, engine=engine,
                            params=params)
        assert out == plain or not greedy
        return stats, engine.gate.ledger

    stats, ledger = run(True)
    assert ledger.pauses >= 2 and stats.paused_steps == ledger.paused >= 60
    assert stats.draft_passes <= 4 * ledger.pauses  # each trial: the drafting steps it needed
    unguarded, _ = run(False)
    assert unguarded.paused_steps == 0 and unguarded.draft_passes >= 40


def test_the_ledger_books_time_saved_and_lost():
    """A step of 4 tokens in the time of 2 plain steps saves 2 steps; a proposal gated off costs
    its host time; one slow drafting step alone is noise and starts no pause; losses past both
    bounds (2% of the decode time, 3 plain steps from where drafting resumed) over 3 drafting
    steps do, for 16 steps, then 32; a trial after a pause is judged from where it started. A
    plain step is priced at the request's own plain steps once there are 8, else the estimate."""
    from warmspec.core.gate import Ledger

    led, plain = Ledger(), 0.01
    assert not led.book(4, 0.02, plain, True) and led.balance == pytest.approx(0.02)
    led.charge(0.001)
    assert led.balance == pytest.approx(0.019)
    assert not led.book(1, 0.01, plain, False) and led.balance == pytest.approx(0.019)  # plain: no saving
    assert not led.book(1, 0.05, plain, True)  # one slow step: -0.021, 2 drafts
    assert not led.book(1, 0.015, plain, True) and led.drafts == 3
    assert led.balance == pytest.approx(-0.026)  # within 3 plain steps
    assert led.book(1, 0.02, plain, True)  # -0.036: past 3 steps and 2% of 0.115 s
    assert led.left == 16 and led.pauses == 1
    for _ in range(16):
        assert led.hold()
        assert not led.book(1, 0.01, plain, False)
    assert not led.hold() and led.paused == 16 and led.drafts == 0
    assert led.start == pytest.approx(-0.036)
    for _ in range(2):  # the trial loses 2.5 steps over two drafting steps: not yet
        assert not led.book(1, 0.0225, plain, True)
    assert led.book(1, 0.016, plain, True)  # 3 drafts, 3.1 steps lost
    assert led.left == 32 and led.pauses == 2

    slow = Ledger()  # this request's plain steps take twice the estimate
    for _ in range(8):
        slow.book(1, 0.02, plain, False)
    assert slow.price(plain) == pytest.approx(0.02)
    slow.book(2, 0.03, plain, True)
    assert slow.balance == pytest.approx(0.01)  # a gain, not the loss the estimate implies

    # plain steps lengthened by proposing (a host-bound device): priced without it, so drafting
    # steps that take longer than the plain steps they replace are booked as the loss they are
    busy = Ledger()
    for _ in range(8):
        busy.book(1, 0.02, plain, False, proposing=0.008)
    assert busy.price(plain) == pytest.approx(0.012)
    # drafting steps of 2 tokens in 35 ms: -11 ms each, past 3 plain steps (36 ms) at the 4th
    assert [busy.book(2, 0.035, plain, True) for _ in range(4)] == [False, False, False, True]
    counted = Ledger()  # the same steps with their proposing counted as plain decoding's time
    for _ in range(8):
        counted.book(1, 0.02, plain, False)
    assert not any(counted.book(2, 0.035, plain, True) for _ in range(8)) and counted.balance > 0


def test_the_ledger_books_the_plain_step_after_drafting_to_drafting():
    """The first plain step after a drafting step refills the pipeline (its pass was queued after
    the verify pass's read-back): its time beyond a plain step is drafting's cost and it stays out
    of the price. Averaged into the price, such refills made failed one-token drafts (6 ms, 1
    token) beside 9.5 ms refills look like gains against 5 ms steady plain steps; booked as
    drafting's cost, the loss pauses drafting by the third refill. The request's own steady
    steps price a plain step even below the gate's estimate."""
    from warmspec.core.gate import Ledger

    led, estimate = Ledger(), 0.01
    for _ in range(8):
        assert not led.book(1, 0.005, estimate, False)
    assert led.price(estimate) == pytest.approx(0.005)
    booked = [led.book(1, s, estimate, d) for s, d in [(0.006, True), (0.0095, False)] * 3]
    assert booked == [False] * 5 + [True]
    assert led.refills == 3 and led.plains == 8 and led.price(estimate) == pytest.approx(0.005)
    assert led.balance == pytest.approx(3 * (0.005 - 0.006) + 3 * (0.005 - 0.0095))


def test_the_gate_books_a_plain_step_less_the_proposing_done_in_it():
    """``observe_host`` times a proposal; the next ``observe_step`` hands that time to the ledger,
    which takes it off the plain step's own time, and starts the next step from zero."""
    from warmspec.core.gate import Gate
    gate = Gate(CostTable({64: {1: 0.005, 2: 0.006}}, {64: 0.005}))
    gate.begin()
    gate.observe_host(0.003, drafting=False, context=64)
    gate.observe_host(0.001, drafting=False, context=64)
    gate.observe_step(1, 0.010, drafting=False, context=64)
    assert gate.ledger.plain_mean == pytest.approx(0.006) and gate.step_host_s == 0.0
    gate.observe_step(1, 0.010, drafting=False, context=64)  # nothing proposed in it
    assert gate.ledger.plain_mean == pytest.approx(0.9 * 0.006 + 0.1 * 0.010)


@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
def test_ids_past_the_embedding_are_refused_in_prompts_and_cut_from_drafts(arch):
    """A tokenizer that does not match the weights could make a pass look up an id past the
    embedding's rows, which MLX's CPU lookup does not check (it reads outside the table; a test
    model fed such ids crashed a run with a segmentation fault). A prompt holding one is refused
    with an ``EngineError`` and the engine serves the next request; a proposal holding one is
    verified up to it, and the output stays plain's."""
    from warmspec.core.engine import EngineError

    lm = tiny.build(arch)
    prompt = np.random.default_rng(5).integers(0, tiny.VOCAB, 20).tolist()
    plain, _ = decode(lm, prompt, 40)
    engine = Engine(lm, speculate=True, costs=CostTable(CHEAP.points), gated=False, observe_costs=False)
    assert engine.input_rows == tiny.VOCAB
    with pytest.raises(EngineError, match="no row in the model's embedding"):
        decode(lm, prompt[:-1] + [tiny.VOCAB + 3], 8, engine=engine, speculate=True)

    fed = []
    model = engine._model
    call = type(model).__call__

    class Recording(type(model)):
        def __call__(self, inputs, *a, **k):
            fed.append(int(inputs.max()))
            return call(self, inputs, *a, **k)

    model.__class__ = Recording
    try:
        class Bad:
            """Plain's continuation with an id past the embedding third."""
            wants_hidden = False

            def __init__(self):
                self.pos = 0

            def commit(self, tokens, hidden=None):
                self.pos += len(tokens)

            def propose(self, k):
                guess = plain[self.pos: self.pos + 5]
                if len(guess) > 2:
                    guess[2] = tiny.VOCAB + 7
                return Proposal(tokens=guess, confidence=0.98, source="script") if guess else None

        spec, stats = decode(lm, prompt, 40, drafter=Bad(), speculate=True, engine=engine)
    finally:
        model.__class__ = type(model).__mro__[1]
    assert spec == plain
    assert stats.accepted > 0 and max(fed) < tiny.VOCAB
