"""Speculative sampling is distributed exactly as plain sampling.

Both are compared, by chi-square goodness of fit, with the exact joint distribution of the first
three tokens computed from the model by teacher forcing, under a sampler that truncates (top-k,
top-p, min-p) -- the case where a draft/verify mismatch would show. The drafter guesses two
tokens, so a pass can accept both: the test covers acceptance past the first draft, where a wrong
residual or a wrong position offset would show. Seeds are fixed, so each test gives the same
verdict every run; the negative control shows the test has the power to fail.
"""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
from scipy.stats import chisquare

from warmspec.core.drafter import Proposal
from warmspec.core.engine import Engine, Run
from warmspec.core.gate import CostTable
from warmspec.core.sampling import distribution, probabilities, sample, verify_sampled
from warmspec.core import GenerationStats, SamplingParams

import tiny

V = 8
PARAMS = SamplingParams(temperature=1.0, top_k=6, top_p=0.95, min_p=0.05)
PROMPT = [1, 5, 2, 7, 3]
RUNS = 2500


N = 3  # tokens sampled per run


def exact_joint(lm, prefix=(), n=N) -> np.ndarray:
    """p(t1, ..., tn) under PARAMS after PROMPT + prefix, by teacher forcing."""
    logits = lm.model(mx.array([PROMPT + list(prefix)]))[0, -1]
    p = distribution(np.array(logits), PARAMS)
    if n == 1:
        return p
    joint = np.zeros((V,) * n)
    for t in range(V):
        if p[t] > 0:
            joint[t] = p[t] * exact_joint(lm, (*prefix, t), n - 1)
    return joint


class FixedDrafter:
    """Always guesses the same two tokens: one often right, one often wrong."""

    def __init__(self, guess):
        self.guess = guess

    wants_hidden = False

    def commit(self, tokens, hidden=None):
        pass

    def propose(self, k):
        return Proposal(tokens=self.guess[:k], confidence=0.98, source="fixed")


def sampled(lm, speculate: bool, guess=None) -> tuple[np.ndarray, list[int]]:
    """Counts of the first N tokens over RUNS seeds, and the drafts accepted in each run."""
    engine = Engine(lm, speculate=speculate, costs=CostTable({0: {1: 1.0, 4: 1.0}}), gated=False)
    counts = np.zeros((V,) * N)
    accepted = []
    for seed in range(RUNS):
        params = SamplingParams(**{**{f: getattr(PARAMS, f) for f in PARAMS.__struct_fields__}, "seed": seed})
        run = Run(params, N, GenerationStats())
        drafter = FixedDrafter(guess) if speculate else None
        out = [t for new in engine.generate_tokens(PROMPT, run, drafter=drafter, speculate=speculate)
               for t in new]
        counts[tuple(out)] += 1
        accepted.append(run.stats.accepted)
    return counts, accepted


def gof(counts: np.ndarray, joint: np.ndarray) -> float:
    """Chi-square p-value; cells expecting fewer than 5 samples are pooled into one."""
    counts, joint = counts.ravel(), joint.ravel()
    support = joint > 0
    assert counts[~support].sum() == 0, "sampled a token outside the truncated support"
    expected = joint * counts.sum()
    big = expected >= 5
    rest = support & ~big
    obs = np.append(counts[big], counts[rest].sum())
    exp = np.append(expected[big], expected[rest].sum())
    return chisquare(obs, exp).pvalue


def test_speculative_sampling_matches_plain_distribution():
    lm = tiny.build("llama", seed=3, scale=1.5, vocab=V)
    joint = exact_joint(lm)
    assert (joint > 0).sum() >= 30  # a distribution with real spread, truncated somewhere
    first = joint.sum(axis=(1, 2))
    g1 = int(np.argmax(first))
    g2 = int(np.argmax(joint[g1].sum(axis=1)))
    guess = [g1, g2]  # the model's likeliest continuation: both drafts often accepted
    plain, _ = sampled(lm, speculate=False)
    spec, accepted = sampled(lm, speculate=True, guess=guess)
    # one pass (budget 3 = 2 drafts + the bonus token) accepted both drafts in many runs, and
    # none in others: acceptance past the first draft and every rejection point are exercised
    assert accepted.count(2) > RUNS // 20 and accepted.count(0) > RUNS // 20
    assert gof(plain, joint) > 0.001
    assert gof(spec, joint) > 0.001


def test_verify_rule_and_negative_control():
    """verify_sampled against a known distribution; a subtly wrong rule is caught."""
    rng = np.random.default_rng(0)
    logits = rng.normal(size=V) * 1.5
    p = distribution(logits, PARAMS)
    draft = int(np.argsort(p)[-2])  # a plausible but not top guess
    n = 20000
    good = np.zeros(V)
    bad = np.zeros(V)
    probs = probabilities(mx.array(np.stack([logits, logits]).astype(np.float32)), PARAMS)
    for _ in range(n):
        accepted, nxt = verify_sampled(probs, [draft], rng)
        good[draft if accepted else nxt] += 1
        # wrong: on rejection, resample from p without removing the draft (over-weights it)
        bad[draft if rng.random() < p[draft] else sample(p, rng)] += 1
    mask = p > 0
    assert chisquare(good[mask], p[mask] * n).pvalue > 0.001
    assert chisquare(bad[mask], p[mask] * n).pvalue < 1e-6


def test_draft_probabilities_rule():
    """With a drafter distribution q (drafter models), accept min(1, p/q), else residual."""
    rng = np.random.default_rng(1)
    logits = rng.normal(size=V)
    p = distribution(logits, PARAMS)
    q = rng.dirichlet(np.ones(V))
    counts = np.zeros(V)
    n = 20000
    probs = probabilities(mx.array(np.stack([logits, logits]).astype(np.float32)), PARAMS)
    for _ in range(n):
        d = sample(q, rng)
        accepted, nxt = verify_sampled(probs, [d], rng, draft_probs=[q])
        counts[d if accepted else nxt] += 1
    mask = p > 0
    assert counts[~mask].sum() == 0
    assert chisquare(counts[mask], p[mask] * n).pvalue > 0.001


def test_device_probabilities_match_the_reference():
    """The device processing the engine samples from is ``distribution``'s, to float32 rounding."""
    rng = np.random.default_rng(5)
    logits = rng.normal(size=(4, 300)) * 3
    for params in (PARAMS, SamplingParams(temperature=0.7), SamplingParams(temperature=1.3, top_p=0.5),
                   SamplingParams(temperature=1.0, top_k=7, min_p=0.1)):
        got = np.array(probabilities(mx.array(logits.astype(np.float32)), params))
        want = np.stack([distribution(row, params) for row in logits])
        assert np.allclose(got, want, atol=1e-6)


def test_distribution_truncation():
    logits = np.log(np.array([0.4, 0.3, 0.15, 0.1, 0.05]))
    p = distribution(logits, SamplingParams(temperature=1.0, top_k=3))
    assert np.allclose(p, [0.4 / 0.85, 0.3 / 0.85, 0.15 / 0.85, 0, 0])
    p = distribution(logits, SamplingParams(temperature=1.0, top_p=0.7))
    assert np.allclose(p, [0.4 / 0.7, 0.3 / 0.7, 0, 0, 0])
    p = distribution(logits, SamplingParams(temperature=1.0, min_p=0.3))
    assert np.allclose(p, [0.4 / 0.85, 0.3 / 0.85, 0.15 / 0.85, 0, 0])
    assert list(itertools.accumulate(p))[-1] == 1.0 or abs(p.sum() - 1) < 1e-12


def test_a_verify_pass_reads_one_row(monkeypatch):
    """Only what the sampler needs reaches the host: the drafted tokens' probabilities, then the one
    row the next token is drawn from -- not a row per position."""
    from warmspec.core import sampling

    reads = []
    real = sampling.host_row
    monkeypatch.setattr(sampling, "host_row", lambda p: reads.append(1) or real(p))
    rng = np.random.default_rng(2)
    logits = mx.array((rng.normal(size=(6, 50)) * 2).astype(np.float32))
    probs = probabilities(logits, SamplingParams(temperature=1.0))
    for _ in range(50):
        reads.clear()
        verify_sampled(probs, rng.integers(0, 50, 5).tolist(), rng)
        assert reads == [1]
