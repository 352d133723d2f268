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
    """An append-only token sequence with an index of where each n-gram ended. ``extend`` changes
    it in place: only for an index one thread owns (a request's own). A published index -- a
    workspace file's, read by drafters on the engine thread -- is never changed: ``derive`` makes
    its successor."""

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

    def derive(self, tokens: Sequence[int]) -> "NgramIndex":
        """A new index of ``tokens`` that shares with this one everything before the first token
        that differs; this one is left exactly as it was (copy-on-write), so a drafter reading it
        on another thread never sees it change. ``self`` when nothing changed.

        The key table is copied shallowly (at C speed) and a key's deque is replaced, not changed,
        when an occurrence is dropped or added; the Python work is proportional to the tokens from
        the first change on. A key that had more than ``OCCURRENCES_PER_KEY`` occurrences may keep
        fewer than a fresh index would (the deque forgot the oldest): only drafting quality depends
        on it, never output.
        """
        old, new_tokens = self.tokens, list(tokens)
        common = common_prefix(old, new_tokens)
        if common == len(old) == len(new_tokens):
            return self
        n = self.min_n
        first = max(common, n - 1)  # the first end that changes
        out = NgramIndex(name=self.name, min_n=n)
        out.tokens = new_tokens
        out.ends = ends = dict(self.ends)
        owned: set[tuple[int, ...]] = set()  # keys whose deque is out's own (safe to append to)
        for key in {tuple(old[end - n + 1 : end + 1]) for end in range(first, len(old))}:
            kept = [e for e in ends.get(key, ()) if e < first]
            if kept:
                ends[key] = deque(kept, maxlen=OCCURRENCES_PER_KEY)
                owned.add(key)
            else:
                ends.pop(key, None)
        for end in range(first, len(new_tokens)):
            key = tuple(new_tokens[end - n + 1 : end + 1])
            where = ends.get(key)
            if key not in owned:
                where = ends[key] = deque(where or (), maxlen=OCCURRENCES_PER_KEY)
                owned.add(key)
            where.append(end)
        return out

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


def common_prefix(a: Sequence[int], b: Sequence[int], block: int = 4096) -> int:
    """How many leading tokens ``a`` and ``b`` share: compared a block at a time at C speed,
    then token by token inside the first block that differs."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i : i + block] == b[i : i + block]:
        i += block
    if i >= n:
        return n
    return next((j for j in range(i, min(i + block, n)) if a[j] != b[j]), n)


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
