"""Model drafters behind the drafter interface: a model's MTP head and a separate draft model.

Both propose through the same ``propose(k) -> Proposal`` / ``commit(tokens, hidden)`` the n-gram
drafter implements, so the verify step, the gate and the exact sampler treat every guess source
alike. Their confidence is the probability they gave their first token (what the gate bins its
acceptance estimates by, per source); sampled drafts carry their distributions ``q``, drawn with
the target's own processing (temperature, top-k, top-p, min-p), which is what keeps rejection
sampling exact and its acceptance high (OptiQ: truncating one side only, 32% instead of 63%).
"""

from __future__ import annotations

from typing import Any, Sequence

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

    def __init__(self, head: MTPHead, params: SamplingParams):
        self.head = head
        self.params = params
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
        if k <= 0 or not self._tokens:
            return None
        hidden = mx.concatenate(self._hidden)[None]
        tokens = mx.array([self._tokens])
        self._hidden, self._tokens = [], []
        drafted, q, first = self.head.draft(hidden, tokens, self.cache, k, self.params, self.rng)
        return Proposal(tokens=drafted, confidence=first, source=self.source, q=q)


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
