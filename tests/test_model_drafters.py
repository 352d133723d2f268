"""Model drafters in the one verify step: an MTP head (Qwen3.5 checkpoint layout, loaded through the
real loader) and a draft model. Greedy output is token-identical to plain decoding; a head built to
copy the target's own choice is accepted at every depth (the plumbing is right end to end, in the
engine, not only in the head's own test); sampled drafts with their q keep sampling exact."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import tiny
from test_mtp import copy_head_tensors, make_position_wise, random_tokens, write_checkpoint
from warmspec.core import CostTable, Engine, GenerationStats, Run, SamplingParams
from warmspec.core.draft_model import DraftModel
from warmspec.core.mtp import load_mtp

FREE = CostTable({0: {1: 1.0, 2: 1.0, 8: 1.0, 65: 1.0}})  # verifying is free: the gate always drafts


def decode(engine, prompt, n, params=SamplingParams(), speculate=True):
    run = Run(params, n, GenerationStats())
    out = [t for new in engine.generate_tokens(prompt, run, speculate=speculate) for t in new]
    return out, run.stats


def engine(lm, **kw):
    return Engine(lm, costs=CostTable(FREE.points), gated=False, observe_costs=False, max_draft=6, **kw)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_5"])
def test_mtp_head_greedy_exact(tmp_path, arch, overlap):
    """A head of random weights (written as a Qwen3.5 checkpoint): mostly wrong guesses, plain's
    tokens all the same, on attention and hybrid targets; with verify passes queued on the head's
    drafts before the consumer's turn (as on a GPU) and after it."""
    lm = tiny.build(arch)
    rng = np.random.default_rng(0)
    head_tensors = {k: mx.array(rng.standard_normal(v.shape).astype(np.float32) * 0.2) if v.ndim == 2 else v
                    for k, v in copy_head_tensors(lm).items()}
    head = load_mtp(write_checkpoint(tmp_path / "ckpt", lm, arch, head_tensors), lm)
    prompt = random_tokens(20, seed=5)
    plain, _ = decode(Engine(lm, speculate=False), prompt, 50, speculate=False)
    e = engine(lm, mtp=head, drafting="mtp")
    e._pipelining_pays = lambda: overlap
    assert e.drafting == "mtp"
    spec, stats = decode(e, prompt, 50)
    assert spec == plain
    assert stats.sources["mtp"].drafted > 0 and set(stats.sources) == {"mtp"}


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_5"])
def test_a_head_copying_the_target_is_accepted_at_every_depth(tmp_path, arch):
    lm = tiny.build(arch)
    make_position_wise(lm)
    head = load_mtp(write_checkpoint(tmp_path / "ckpt", lm, arch, copy_head_tensors(lm)), lm)
    prompt = random_tokens(16, seed=9)
    plain, _ = decode(Engine(lm, speculate=False), prompt, 60, speculate=False)
    spec, stats = decode(engine(lm, mtp=head, drafting="mtp"), prompt, 60)
    assert spec == plain
    assert stats.acceptance > 0.98 and stats.tokens_per_pass > 5
    assert len(stats.drafted_at) == 6 and stats.accepted_at[0] == stats.drafted_at[0] > 5
    assert stats.draft_s > 0


@pytest.mark.parametrize("arch", ["llama", "qwen3_5", "gemma3_text"])
def test_draft_model_greedy_exact(arch):
    """Another random model of the same vocabulary drafts (mostly wrong); the target itself as its
    own draft model is accepted every time. Both give plain's tokens."""
    lm = tiny.build(arch)
    prompt = random_tokens(20, seed=2)
    plain, _ = decode(Engine(lm, speculate=False), prompt, 50, speculate=False)
    other = DraftModel(tiny.build(arch, seed=7), lm)
    spec, stats = decode(engine(lm, draft_model=other), prompt, 50)
    assert spec == plain and stats.sources["draft"].drafted > 0
    same = DraftModel(tiny.build(arch), lm)
    spec, stats = decode(engine(lm, draft_model=same), prompt, 50)
    assert spec == plain and stats.acceptance == 1.0 and stats.tokens_per_pass > 5


class WrongQ:
    """Negative control: a draft model's samples, reported with a wrong distribution q."""

    wants_hidden = False

    def __init__(self, inner):
        self.inner = inner

    def commit(self, tokens, hidden=None):
        self.inner.commit(tokens, hidden)

    def propose(self, k):
        from warmspec.core.drafter import Proposal

        p = self.inner.propose(k)
        flat = [np.full_like(q, 1.0 / q.size) for q in p.q]
        return Proposal(tokens=p.tokens, confidence=p.confidence, source=p.source, q=flat)


def sampled_with(lm, draft_lm, wrong_q=False):
    """Counts of the first 3 tokens over RUNS seeds, drafted by ``draft_lm`` with their q."""
    from test_sampling import PARAMS, PROMPT, RUNS, V
    from warmspec.core.drafters import DraftModelDrafter

    e = Engine(lm, costs=CostTable({0: {1: 1.0, 4: 1.0}}), gated=False, observe_costs=False)
    dm = DraftModel(draft_lm, lm)
    counts = np.zeros((V,) * 3)
    both = 0
    for seed in range(RUNS):
        params = SamplingParams(**{**{f: getattr(PARAMS, f) for f in PARAMS.__struct_fields__}, "seed": seed})
        run = Run(params, 3, GenerationStats())
        drafter = DraftModelDrafter(dm, PROMPT, params)
        out = [t for new in e.generate_tokens(PROMPT, run, drafter=WrongQ(drafter) if wrong_q else drafter)
               for t in new]
        counts[tuple(out)] += 1
        both += run.stats.accepted == 2
    return counts, both


def test_sampled_drafts_with_their_q_keep_sampling_exact():
    """A draft model of other weights samples two drafts a pass with the target's processing; the
    first three tokens are distributed exactly as plain sampling's (chi-square against the exact
    joint), with both drafts accepted in many runs; the same drafts reported with a wrong q fail."""
    from test_sampling import RUNS, V, exact_joint, gof

    lm = tiny.build("llama", seed=3, scale=1.5, vocab=V)
    draft = tiny.build("llama", seed=4, scale=1.5, vocab=V)
    joint = exact_joint(lm)
    counts, both = sampled_with(lm, draft)
    assert both > RUNS // 20
    assert gof(counts, joint) > 0.001
    wrong, _ = sampled_with(lm, draft, wrong_q=True)
    assert gof(wrong, joint) < 0.001


def test_ngram_and_mtp_together_pick_per_step(tmp_path):
    """ngram+mtp (the default with a head): a prompt that repeats itself is drafted from the
    n-gram match, the rest from the head; plain's tokens either way, and both sources used."""
    lm = tiny.build("llama")
    make_position_wise(lm)
    head = load_mtp(write_checkpoint(tmp_path / "ckpt", lm, "llama", copy_head_tensors(lm)), lm)
    block = random_tokens(12, seed=4)
    prompt = block * 3 + random_tokens(5, seed=6)
    plain, _ = decode(Engine(lm, speculate=False), prompt, 150, speculate=False)
    e = Engine(lm, costs=CostTable(FREE.points), observe_costs=False, max_draft=6, mtp=head)
    assert e.drafting == "ngram+mtp"
    spec, stats = decode(e, prompt, 150)
    assert spec == plain
    # the position-wise target's answer soon cycles: then the n-gram match, long and trusted, is
    # taken without asking the head
    assert stats.sources["mtp"].accepted > 0 and stats.sources["request"].accepted > 50


def test_a_head_s_device_time_is_priced_per_drafted_token(tmp_path):
    """A head's greedy drafts are computed inside the verify pass (a decoder layer and an output
    projection per depth): the engine measures that time per drafted token when the head drafts,
    and the gate prices it, so a deep draft is asked for only where its acceptance pays for it."""
    from warmspec.core.gate import Gate, Rates

    lm = tiny.build("llama")
    head = load_mtp(write_checkpoint(tmp_path / "ckpt", lm, "llama", copy_head_tensors(lm)), lm)
    e = Engine(lm, costs=CostTable({0: {1: 0.05, 2: 0.055, 8: 0.06}}), mtp=head)
    assert e.gate.device_source["mtp"] > 0
    assert "mtp" not in Engine(lm, costs=CostTable(FREE.points), mtp=head, drafting="ngram").gate.device_source

    gate = Gate(CostTable({0: {1: 0.05, 2: 0.055, 8: 0.06}}), max_draft=8)
    gate.source_rate["mtp"] = Rates(0.6, 0.6)
    assert gate.depth("mtp", 8) >= 6  # unpriced: deep drafts, since wider passes cost little
    gate.device_source["mtp"] = 0.005  # a tenth of a pass per drafted token
    assert gate.depth("mtp", 8) == 3
    assert gate.value(8, 0.5, source="mtp")[0] == 2  # a proposal judged at the prior, 0.5
    gate.device_source["mtp"] = 0.05  # as much as a pass
    assert gate.depth("mtp", 8) == 0


def test_an_ngram_proposal_the_head_wins_over_is_scored_all_the_same():
    """With the head's proposal taken, n-gram's is scored against what the step emits: its bin
    keeps learning, so a loop the answer falls into is seen even while the head drafts."""
    from warmspec.core.drafter import Proposal
    from warmspec.core.drafters import CombinedDrafter
    from warmspec.core.gate import Gate, Rates

    class Fixed:
        def __init__(self, proposal, params=SamplingParams()):
            self.proposal, self.params = proposal, params

        def propose(self, k):
            return self.proposal

        def commit(self, tokens, hidden=None):
            pass

    gate = Gate(CostTable({0: {1: 0.05, 2: 0.055, 8: 0.06}}), max_draft=8)
    short = Proposal(tokens=[1, 2, 3], confidence=0.5, source="request")
    b = gate.bin(0.5, "request")
    gate.rate[b] = Rates(0.1, 0.1)  # a short match, estimated hopeless: gated off
    head = Proposal(tokens=[], confidence=0.5, source="mtp", device=mx.array([4, 5]))
    combined = CombinedDrafter(Fixed(short), Fixed(head), gate, lambda: 0)
    assert combined.propose(8) is head
    gate.settle([1, 2, 9])  # two of n-gram's tokens came, then another
    scored = Rates(0.9 * 0.1 + 0.1, 0.9 * (0.9 * 0.1 + 0.1))  # first right; then one right, one wrong
    assert gate.rate[b] == pytest.approx(scored)
    gate.settle([7])  # nothing is left to score twice
    assert gate.rate[b] == pytest.approx(scored)


def test_tapping_the_hidden_state_adds_no_parameter():
    """The tap keeps the last hidden state outside the module tree: as an array attribute it was
    a parameter, and the model's size (the memory check's figure) grew by one position's state."""
    from mlx.utils import tree_flatten
    from warmspec.core.target import Target

    lm = tiny.build("llama")
    size = lambda: sum(v.nbytes for _, v in tree_flatten(lm.model.parameters()))  # noqa: E731
    before = size()
    target = Target(lm.model)
    target.tap_hidden()
    mx.eval(lm.model(mx.array([random_tokens(8, seed=1)])))
    assert target._tap.last is not None
    assert size() == before


@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
def test_the_cost_probes_feed_only_ids_of_the_vocabulary(tmp_path, monkeypatch, arch):
    """The verify-cost and head-cost probes run the model on made-up ids. MLX's CPU embedding
    lookup does not check its index: ids up to 1000 on a 256-token model read outside the table
    and crashed one test run in seven (a segmentation fault in ``measure_head``). The hybrid's
    vocabulary size is nested in its config, where ``args.vocab_size`` missed it."""
    lm = tiny.build(arch)
    head = load_mtp(write_checkpoint(tmp_path / "ckpt", lm, arch, copy_head_tensors(lm)), lm)
    embed = head.parts.embed
    seen = []
    original = type(embed).__call__
    monkeypatch.setattr(type(embed), "__call__", lambda self, x: seen.append(int(x.max())) or original(self, x))
    e = Engine(lm, mtp=head, drafting="mtp")
    assert e.target.vocab_size == tiny.VOCAB
    e.measure_costs(contexts=(16,), repeats=1)
    e.measure_head(context=16, repeats=1)
    assert seen and max(seen) < tiny.VOCAB
