"""Model drafters behind the drafter interface: a model's MTP head and a separate draft model.

Both propose through the same ``propose(k) -> Proposal`` / ``commit(tokens, hidden)`` the n-gram
drafter implements, so the verify step, the gate and the exact sampler treat every guess source
alike. Their confidence is the probability they gave their first token (what the gate bins its
acceptance estimates by, per source); sampled drafts carry their distributions ``q``, drawn with
the target's own processing (temperature, top-k, top-p, min-p), which is what keeps rejection
sampling exact and its acceptance high (OptiQ: truncating one side only, 32% instead of 63%).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import mlx.core as mx
import numpy as np

from .draft_model import DraftModel
from .drafter import Proposal
from .mtp import MTPHead
from .sampling import make_rng
from .types import SamplingParams


def _seeded(params: SamplingParams) -> np.random.Generator | None:
    """The drafter's own random stream (apart from the verifier's), reproducible with a seed."""
    if params.greedy:
        return None
    return make_rng(params if params.seed is None else SamplingParams(seed=params.seed + 1))


class MtpDrafter:
    """Drafts with an MTP head from the target's hidden state at the last committed position.

    The head keeps a KV cache of its own over the (hidden state, next token) pairs of the positions
    committed during this request; its speculative positions are trimmed after each proposal, so
    a rejected draft needs no rollback here. (The prompt's positions are not in it: their hidden
    states are not kept by prefill or the prefix cache. The head conditions on the target's hidden
    state, which carries the context.)"""

    wants_hidden = True
    source = "mtp"
    # Deepest draft ever asked of the head (each depth is a head step run in sequence); within
    # it the gate picks the depth from the head's measured acceptance and proposing time. The
    # shipped head on held-back answers: accepted by depth 58% / 28% / 15% / 9%, so depths past 4
    # add little; a head that copies the target is accepted up to the ceiling.
    max_depth = 8

    def __init__(self, head: MTPHead, params: SamplingParams, gate=None,
                 context: "Callable[[], int] | None" = None):
        self.head = head
        self.params = params
        self.gate = gate  # decides how deep to draft, and whether to ask at all (None: always k)
        self.context = context  # tokens in the target's cache now (the pass costs depend on it)
        self.rng = _seeded(params)
        self.cache = head.make_cache()
        self._hidden: list[mx.array] = []
        self._tokens: list[int] = []

    def commit(self, tokens: Sequence[int], hidden: Any = None) -> None:
        if hidden is None:
            raise ValueError("the MTP drafter needs the target's hidden states (tap the target)")
        self._hidden.append(hidden)
        self._tokens.extend(tokens)

    def propose(self, k: int) -> Proposal | None:
        k = min(k, self.max_depth)
        if self.gate is not None:
            k = self.gate.depth(self.source, k, self.context() if self.context else 0)
        if k <= 0 or not self._tokens:
            return None
        t = time.perf_counter()
        hidden = mx.concatenate(self._hidden)[None]
        tokens = mx.array([self._tokens])
        self._hidden, self._tokens = [], []
        if self.params.greedy:  # left on the device: the verify pass reads them back with its own
            drafted = self.head.draft_lazy(hidden, tokens, self.cache, k)
            proposal = Proposal(tokens=[], confidence=LAZY_CONFIDENCE, source=self.source, device=drafted)
        else:
            drafted, q, first = self.head.draft(hidden, tokens, self.cache, k, self.params, self.rng)
            proposal = Proposal(tokens=drafted, confidence=first, source=self.source, q=q)
        if self.gate is not None:
            self.gate.observe_source(self.source, time.perf_counter() - t)
        return proposal


# Greedy head drafts stay on the device, so their first token's probability is not known when
# the gate decides; the head is judged by its acceptance over all its proposals (``Gate.depth``),
# and its proposals are binned together, at the prior's confidence.
LAZY_CONFIDENCE = 0.5


class DraftModelDrafter:
    """Drafts with a separate small model sharing the target's vocabulary (its own cache, rolled
    back by ``DraftModel`` to the committed tokens)."""

    wants_hidden = False
    source = "draft"

    def __init__(self, model: DraftModel, prompt: Sequence[int], params: SamplingParams):
        self.model = model
        self.params = params
        self.rng = _seeded(params)
        self.context = list(prompt)

    def commit(self, tokens: Sequence[int], hidden: Any = None) -> None:
        self.context.extend(tokens)

    def propose(self, k: int) -> Proposal | None:
        if k <= 0:
            return None
        drafted, q, first = self.model.propose(self.context, k, self.params, self.rng)
        return Proposal(tokens=drafted, confidence=first, source=self.source, q=q)


class CombinedDrafter:
    """N-gram lookup and an MTP head together: each step, the proposal the gate values more.

    The n-gram drafter is asked first (a lookup costs microseconds); where it follows a long match
    -- a copied file, a loop -- its value is taken without running the head (a head proposal costs
    a decoder layer and an output projection per depth). Otherwise the head is asked for as many
    tokens as the gate says can pay (``Gate.depth``: its acceptance and its own proposing time,
    measured per source), and of the two proposals the gate's value (acceptance estimate
    for that source and confidence, over the measured pass costs) picks one. Both are told every
    emitted token: the head's cache needs every committed pair, and the n-gram drafter its copy
    position.
    """

    wants_hidden = True

    def __init__(self, ngram, mtp: MtpDrafter, gate, context: "callable"):
        self.ngram = ngram
        self.mtp = mtp
        self.gate = gate
        self.context = context  # tokens in the target's cache now (the pass costs depend on it)

    def commit(self, tokens: Sequence[int], hidden: Any = None) -> None:
        self.ngram.commit(tokens)
        self.mtp.commit(tokens, hidden)

    def propose(self, k: int) -> Proposal | None:
        ctx = self.context()
        gate = self.gate
        best, best_value = None, 0.0
        t = time.perf_counter()
        n = self.ngram.propose(k)
        gate.observe_source(n.source if n is not None else "ngram", time.perf_counter() - t)
        if n is not None:
            kn, best_value = gate.value(len(n.tokens), n.confidence, ctx, source=n.source)
            r = gate.acceptance(n.confidence, n.source)
            if kn and min(r.first, r.later) >= LONG_MATCH_ACCEPTANCE:
                return n
            best = n if kn else None
        m = self.mtp.propose(k)  # asks the gate how deep, or whether at all
        if m is not None:
            km, v = gate.value(m.width, m.confidence, ctx, source=m.source)
            if best is None or v > best_value:
                best = m
        if n is not None and m is not None and best is m and self.mtp.params.greedy:
            gate.shadow(n.tokens, n.confidence, n.source)  # scored all the same (``Gate.settle``)
        return best if best is not None else (n or m)


# Where the n-gram drafter's acceptance estimate for its proposal is this high, the head is not
# asked: the copy will be accepted for long stretches, the head adds little and costs a pass of its
# own per depth.
LONG_MATCH_ACCEPTANCE = 0.9
