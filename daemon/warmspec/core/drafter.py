"""The drafter interface: every guess source the verify step hosts implements it.

``propose(k)`` offers up to ``k`` tokens (with their distributions ``q`` when they were sampled,
for exact rejection sampling) and a confidence the gate keys its acceptance estimates on;
``commit(tokens, pass)`` tells the drafter which tokens the step emitted, with the target's pass
(its hidden states, for drafters that condition on them), so it can roll its own state back.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import msgspec

class Proposal(msgspec.Struct, frozen=True):
    """Up to k guessed tokens and why: how many context tokens agreed with the source."""

    tokens: list[int]
    match_len: int
    source: str  # the kind of source: request, workspace, recent, prediction, ...


class Drafter(Protocol):
    """Anything that guesses: told every accepted token, asked for up to k guesses."""

    def extend(self, tokens: Sequence[int]) -> None: ...

    def propose(self, k: int) -> Proposal | None: ...



