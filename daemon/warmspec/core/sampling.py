"""Token choice: greedy, and sampling with temperature, top-k, top-p and min-p.

Plain decoding, speculative verification and the model drafters all process logits with the same
function, ``probabilities`` (on the device), so a draft is judged against exactly the distribution
plain sampling would draw from, truncated identically on both sides. OptiQ measured what a mismatch
costs: truncating only one side kept acceptance at 32% instead of 63% on Qwen3.5-9B.

What reaches the host is what the sampler needs: for a verify pass of k drafts, the k probabilities
of the drafted tokens, then the one row it draws the next token from (the rejected position's
residual, or the bonus row) -- not 1 + k rows of the vocabulary (49k floats each). The draws run
on the host in float64 (one uniform per accept test, inverse CDF), from a seeded generator.
``distribution`` is the same processing in float64 NumPy: the reference the tests compute exact
distributions with.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from .types import SamplingParams


def make_rng(params: SamplingParams) -> np.random.Generator:
    return np.random.default_rng(params.seed)


def distribution(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The processed next-token distribution (float64, sums to 1) for one row of logits.

    Order: temperature, then top-k, top-p (smallest set with mass >= top_p), then min-p (tokens
    with at least min_p times the top probability), renormalized after each cut.
    """
    x = np.asarray(logits, dtype=np.float64) / params.temperature
    x -= x.max()
    p = np.exp(x)
    p /= p.sum()
    if params.top_k and params.top_k < p.size:
        cut = np.partition(p, -params.top_k)[-params.top_k]
        p = np.where(p >= cut, p, 0.0)
        p /= p.sum()
    if params.top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        keep = int(np.searchsorted(cum, params.top_p)) + 1  # first index reaching top_p, inclusive
        mask = np.zeros(p.size, dtype=bool)
        mask[order[:keep]] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    if params.min_p > 0.0:
        p = np.where(p >= params.min_p * p.max(), p, 0.0)
        p /= p.sum()
    return p


def sample(p: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one token from a normalized distribution by inverse CDF (one uniform per draw)."""
    cum = np.cumsum(p)
    i = int(np.searchsorted(cum, rng.random() * cum[-1], side="right"))
    return min(i, p.size - 1)


def probabilities(logits: mx.array, params: SamplingParams) -> mx.array:
    """The processed next-token distributions (float32, rows summing to 1) of ``logits``
    (positions x vocabulary), on the device: temperature, then top-k, top-p (the smallest set
    with mass >= top_p), then min-p (at least min_p times the top probability), renormalized
    after each cut -- ``distribution``'s processing."""
    p = mx.softmax(logits.astype(mx.float32) / params.temperature, axis=-1)
    vocab = p.shape[-1]
    if params.top_k and params.top_k < vocab:
        cut = mx.sort(p, axis=-1)[..., vocab - params.top_k : vocab - params.top_k + 1]
        p = mx.where(p >= cut, p, 0.0)
        p = p / p.sum(axis=-1, keepdims=True)
    if params.top_p < 1.0:
        order = mx.argsort(-p, axis=-1)
        ranked = mx.take_along_axis(p, order, axis=-1)
        keep = (mx.cumsum(ranked, axis=-1) - ranked) < params.top_p  # up to the first reaching it
        mask = mx.put_along_axis(mx.zeros(p.shape, dtype=mx.bool_), order, keep, axis=-1)
        p = mx.where(mask, p, 0.0)
        p = p / p.sum(axis=-1, keepdims=True)
    if params.min_p > 0.0:
        p = mx.where(p >= params.min_p * p.max(axis=-1, keepdims=True), p, 0.0)
        p = p / p.sum(axis=-1, keepdims=True)
    return p


def host_row(p: mx.array) -> np.ndarray:
    """One row of ``probabilities`` on the host, renormalized in float64."""
    row = np.array(p, dtype=np.float64)
    return row / row.sum()


def verify_sampled(
    probs: mx.array,
    drafts: list[int],
    rng: np.random.Generator,
    draft_probs: list[np.ndarray] | None = None,
) -> tuple[int, int]:
    """Speculative sampling over one verify pass: ``(accepted, next_token)``.

    ``probs[i]`` is the target's processed distribution after the i-th input (``probabilities``;
    row 0 follows the last emitted token), so ``probs[i]`` judges ``drafts[i]`` and
    ``probs[len(drafts)]`` gives the bonus token. Drafts without ``draft_probs`` come from a
    deterministic source (n-gram lookup: q is a point mass), for which the Leviathan-Chen rule
    reduces to: accept d with probability p(d), else draw from p with d removed. With
    ``draft_probs`` (a model drafter's q), accept with probability min(1, p(d)/q(d)), else draw from
    max(p - q, 0) renormalized. Either way the emitted token is distributed exactly as plain
    sampling from p. One read of the k drafted probabilities, then one row.
    """
    k = len(drafts)
    if k:
        picked = mx.take_along_axis(probs[:k], mx.array(drafts)[:, None], axis=-1)[:, 0]
        totals = probs[:k].sum(axis=-1)
        pd = (np.array(picked, dtype=np.float64) / np.array(totals, dtype=np.float64)).tolist()
    for i, d in enumerate(drafts):
        q = None if draft_probs is None else draft_probs[i]
        ratio = pd[i] if q is None else min(1.0, pd[i] / q[d]) if q[d] > 0 else 0.0
        if rng.random() < ratio:
            continue
        p = host_row(probs[i])
        if q is None:
            residual = p.copy()
            residual[d] = 0.0
        else:
            residual = np.maximum(p - q, 0.0)
        total = residual.sum()
        # total == 0 only when p is a point mass on d, which the test above always accepts.
        return i, sample(residual / total, rng)
    return k, sample(host_row(probs[k]), rng)
