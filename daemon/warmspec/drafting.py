"""Guess sources: n-gram lookup over the conversation and over files the agent has read.

An ``NgramIndex`` holds one token sequence (a request's prompt and output, or a workspace file)
and maps every ``min_n``-gram to the positions where it ended, newest last, a few per key.
Appending a token is O(1). To propose, the drafter takes the context's last ``min_n`` tokens,
collects every earlier occurrence in every source, scores each by how far the tokens *before* it
agree with the context (the match length), and drafts what followed the best one. Ranking by
match length first is what finds the right file among thirty: a 3-gram such as ``self.`` occurs
everywhere, but only the file being copied agrees with the last hundred tokens. Source priority
(the request's own tokens first, then files read in this conversation, then other read files)
breaks ties.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol, Sequence

import msgspec

DEFAULT_MIN_N = 3
MAX_AGREEMENT = 256  # longer agreement says nothing more about which candidate is right
OCCURRENCES_PER_KEY = 8


class Proposal(msgspec.Struct, frozen=True):
    """Up to k guessed tokens and why: how many context tokens agreed with the source."""

    tokens: list[int]
    match_len: int
    source: str


class Drafter(Protocol):
    """Anything that guesses: told every accepted token, asked for up to k guesses."""

    def extend(self, tokens: Sequence[int]) -> None: ...

    def propose(self, k: int) -> Proposal | None: ...


class NgramIndex:
    """An append-only token sequence with an index of where each n-gram ended."""

    def __init__(self, tokens: Sequence[int] = (), *, name: str = "", min_n: int = DEFAULT_MIN_N):
        self.name = name
        self.min_n = min_n
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], deque[int]] = {}
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        toks = self.tokens
        n = self.min_n
        for t in tokens:
            toks.append(t)
            if len(toks) >= n:
                key = tuple(toks[-n:])
                where = self.ends.get(key)
                if where is None:
                    where = self.ends[key] = deque(maxlen=OCCURRENCES_PER_KEY)
                where.append(len(toks) - 1)

    def truncate(self, length: int) -> None:
        """Forget everything from ``length`` on (used when a request's tokens are rolled back)."""
        if length >= len(self.tokens):
            return
        n = self.min_n
        for end in range(len(self.tokens) - 1, max(length, n - 1) - 1, -1):
            key = tuple(self.tokens[end - n + 1 : end + 1])
            where = self.ends.get(key)
            if where and where[-1] == end:
                where.pop()
                if not where:
                    del self.ends[key]
        del self.tokens[length:]

    @property
    def nbytes(self) -> int:
        # ~ list slot + dict entry + deque per key; an estimate for memory budgets.
        return 8 * len(self.tokens) + 120 * len(self.ends)

    def candidates(self, context: Sequence[int], exclude_end: int | None = None):
        """Yield ``(match_len, end)`` for each earlier occurrence of the context's last n-gram."""
        n = self.min_n
        where = self.ends.get(tuple(context[-n:]))
        if not where:
            return
        toks = self.tokens
        for end in reversed(where):
            if end == exclude_end or end + 1 >= len(toks):
                continue
            agree = n
            limit = min(end + 1, len(context), MAX_AGREEMENT)
            while agree < limit and toks[end - agree] == context[-1 - agree]:
                agree += 1
            yield agree, end


Source = tuple[NgramIndex, int]  # an index and its priority (higher wins ties)
OWN_PRIORITY = 1 << 30


class NgramDrafter:
    """Proposes continuations from the request's own tokens and any extra sources.

    ``own`` indexes the request's prompt and everything emitted; ``sources`` are shared indexes
    (workspace files) with their priority for this request, which this drafter only reads.
    """

    def __init__(self, context: Sequence[int], sources: Sequence[Source] = (),
                 *, min_n: int = DEFAULT_MIN_N):
        self.own = NgramIndex(context, name="request", min_n=min_n)
        self.sources = [(s, prio) for s, prio in sources if s.min_n == min_n]
        self.proposals = 0

    def extend(self, tokens: Sequence[int]) -> None:
        self.own.extend(tokens)

    def propose(self, k: int) -> Proposal | None:
        if k <= 0:
            return None
        context = self.own.tokens
        best: tuple[int, int, int, NgramIndex] | None = None
        for src, priority in ((self.own, OWN_PRIORITY), *self.sources):
            exclude = len(context) - 1 if src is self.own else None
            for agree, end in src.candidates(context, exclude_end=exclude):
                key = (agree, priority, end)
                if best is None or key > best[:3]:
                    best = (agree, priority, end, src)
        if best is None:
            return None
        agree, _, end, src = best
        self.proposals += 1
        tokens = src.tokens[end + 1 : end + 1 + k]
        if src is self.own and len(tokens) < k:
            # The match runs into the present: the text is repeating with period
            # len - 1 - end. Continue the cycle instead of stopping short (small models loop,
            # and a loop is the cheapest thing there is to draft).
            period = len(context) - 1 - end
            cycle = context[-period:]
            tokens = [cycle[i % period] for i in range(k)]
        return Proposal(tokens=tokens, match_len=agree, source=src.name)
