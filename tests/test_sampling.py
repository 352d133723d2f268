"""Speculative sampling is distributed exactly as plain sampling.

Both are compared, by chi-square goodness of fit, with the exact joint distribution of the first
two tokens computed from the model by teacher forcing, under a sampler that truncates (top-k,
top-p, min-p) -- the case where a draft/verify mismatch would show. Seeds are fixed, so each test
gives the same verdict every run; the negative control shows the test has the power to fail.
"""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
from scipy.stats import chisquare

from warmspec.drafting import Proposal
from warmspec.engine import Engine, Run
from warmspec.gate import CostTable
from warmspec.sampling import distribution, sample, verify_sampled
from warmspec_protocol import GenerationStats, SamplingParams

import tiny

V = 8
PARAMS = SamplingParams(temperature=1.0, top_k=6, top_p=0.95, min_p=0.05)
PROMPT = [1, 5, 2, 7, 3]
RUNS = 2500


def exact_joint(lm) -> np.ndarray:
    """p(t1, t2) under PARAMS, by teacher forcing."""
    logits = lm.model(mx.array([PROMPT]))[0, -1]
    p1 = distribution(np.array(logits), PARAMS)
    joint = np.zeros((V, V))
    for t1 in range(V):
        if p1[t1] == 0:
            continue
        l2 = lm.model(mx.array([PROMPT + [t1]]))[0, -1]
        joint[t1] = p1[t1] * distribution(np.array(l2), PARAMS)
    return joint


class FixedDrafter:
    """Always guesses the same two tokens: one often right, one often wrong."""

    def __init__(self, guess):
        self.guess = guess

    def extend(self, tokens):
        pass

    def propose(self, k):
        return Proposal(tokens=self.guess[:k], match_len=64, source="fixed")


def sampled_pairs(lm, speculate: bool, guess=None) -> np.ndarray:
    engine = Engine(lm, speculate=speculate, costs=CostTable({0: {1: 1.0, 4: 1.0}}), gated=False)
    counts = np.zeros((V, V))
    for seed in range(RUNS):
        params = SamplingParams(**{**{f: getattr(PARAMS, f) for f in PARAMS.__struct_fields__}, "seed": seed})
        run = Run(params, 2, GenerationStats())
        drafter = FixedDrafter(guess) if speculate else None
        out = [t for new in engine.generate_tokens(PROMPT, run, drafter=drafter, speculate=speculate)
               for t in new]
        counts[out[0], out[1]] += 1
    return counts


def gof(counts: np.ndarray, joint: np.ndarray) -> float:
    mask = joint.ravel() > 0
    assert counts.ravel()[~mask].sum() == 0, "sampled a token outside the truncated support"
    expected = joint.ravel()[mask] * counts.sum()
    return chisquare(counts.ravel()[mask], expected).pvalue


def test_speculative_sampling_matches_plain_distribution():
    lm = tiny.build("llama", seed=3, scale=1.5, vocab=V)
    joint = exact_joint(lm)
    assert (joint > 0).sum() >= 10  # a distribution with real spread, truncated somewhere
    top1 = int(np.argmax(joint.sum(1)))
    top2 = int(np.argmax(joint[top1]))
    guess = [top1, (top2 + 1) % V]  # the first guess usually right, the second usually wrong
    plain = sampled_pairs(lm, speculate=False)
    spec = sampled_pairs(lm, speculate=True, guess=guess)
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
    for _ in range(n):
        accepted, nxt = verify_sampled([logits, logits], [draft], PARAMS, rng)
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
    for _ in range(n):
        d = sample(q, rng)
        accepted, nxt = verify_sampled([logits, logits], [d], PARAMS, rng, draft_probs=[q])
        counts[d if accepted else nxt] += 1
    mask = p > 0
    assert counts[~mask].sum() == 0
    assert chisquare(counts[mask], p[mask] * n).pvalue > 0.001


def test_distribution_truncation():
    logits = np.log(np.array([0.4, 0.3, 0.15, 0.1, 0.05]))
    p = distribution(logits, SamplingParams(temperature=1.0, top_k=3))
    assert np.allclose(p, [0.4 / 0.85, 0.3 / 0.85, 0.15 / 0.85, 0, 0])
    p = distribution(logits, SamplingParams(temperature=1.0, top_p=0.7))
    assert np.allclose(p, [0.4 / 0.7, 0.3 / 0.7, 0, 0, 0])
    p = distribution(logits, SamplingParams(temperature=1.0, min_p=0.3))
    assert np.allclose(p, [0.4 / 0.85, 0.3 / 0.85, 0.15 / 0.85, 0, 0])
    assert list(itertools.accumulate(p))[-1] == 1.0 or abs(p.sum() - 1) < 1e-12
