"""The drafter interface: every guess source the verify step hosts implements it.

``propose(k)`` offers up to ``k`` tokens, a ``confidence`` the gate keys its acceptance estimates on
(the drafter's own evidence, in (0, 1): the n-gram drafter's agreement length, a model drafter's
probability of its first token) and, when the tokens were sampled from distributions, those
distributions ``q`` for exact rejection sampling. A model drafter may leave its greedy tokens on
the device (``device``, not computed yet): the verify pass is queued on them and both are read
back at once, so the device never waits for the host between drafting and verifying. ``commit(tokens, hidden)`` tells the drafter what
the step emitted, with the target's hidden states at the positions that produced those tokens
(for drafters that condition on them: the first row produced the first token), so it can roll its
own state back past what was rejected.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

import msgspec


class Proposal(msgspec.Struct, frozen=True):
    """Up to k guessed tokens, the drafter's confidence in them and where they came from."""

    tokens: list[int]  # empty when the tokens are on the device
    confidence: float  # in (0, 1); what the gate bins its acceptance estimates by
    source: str  # the kind of source: request, workspace, recent, prediction, mtp, draft
    q: list[Any] | None = None  # per token, the distribution it was sampled from (None: chosen)
    device: Any = None  # the greedy tokens as a lazy (k,) array, not read back yet

    @property
    def width(self) -> int:
        return len(self.tokens) if self.device is None else int(self.device.shape[0])


class Drafter(Protocol):
    """Anything that guesses: asked for up to k guesses, told every emitted token."""

    wants_hidden: bool  # whether commit needs the target's hidden states

    def propose(self, k: int) -> Proposal | None: ...

    def commit(self, tokens: Sequence[int], hidden: Any = None) -> None: ...
