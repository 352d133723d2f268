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
from typing import Sequence

from .drafter import Proposal

DEFAULT_MIN_N = 3
MAX_AGREEMENT = 256  # longer agreement says nothing more about which candidate is right
OCCURRENCES_PER_KEY = 8


def _record(where: list[int], end: int) -> None:
    """Add an occurrence to a key's list, forgetting the oldest beyond ``OCCURRENCES_PER_KEY``."""
    where.append(end)
    if len(where) > OCCURRENCES_PER_KEY:
        del where[0]


class NgramIndex:
    """An append-only token sequence with an index of where each n-gram ended. ``extend`` changes
    it in place: only for an index one thread owns (a request's own). A published index -- a
    workspace file's, read by drafters on the engine thread -- is never changed: ``derive`` makes
    its successor."""

    def __init__(self, tokens: Sequence[int] = (), *, name: str = "", min_n: int = DEFAULT_MIN_N,
                 kind: str = "workspace"):
        self.name = name
        self.kind = kind  # the kind of guess source, for statistics
        self.min_n = min_n
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], list[int]] = {}
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
                    self.ends[key] = [len(toks) - 1]
                else:
                    _record(where, len(toks) - 1)

    def derive(self, tokens: Sequence[int]) -> "NgramIndex":
        """A new index of ``tokens`` that shares with this one everything before the first token
        that differs; this one is left exactly as it was (copy-on-write), so a drafter reading it
        on another thread never sees it change. ``self`` when nothing changed.

        The key table is copied shallowly (at C speed) and a key's list is replaced, not changed,
        when an occurrence is dropped or added; the Python work is proportional to the tokens from
        the first change on. A key that had more than ``OCCURRENCES_PER_KEY`` occurrences may keep
        fewer than a fresh index would (the list forgot the oldest): only drafting quality depends
        on it, never output.
        """
        old, new_tokens = self.tokens, list(tokens)
        common = common_prefix(old, new_tokens)
        if common == len(old) == len(new_tokens):
            return self
        n = self.min_n
        first = max(common, n - 1)  # the first end that changes
        out = NgramIndex(name=self.name, min_n=n, kind=self.kind)
        out.tokens = new_tokens
        out.ends = ends = dict(self.ends)
        owned: set[tuple[int, ...]] = set()  # keys whose list is out's own (safe to append to)
        for key in {tuple(old[end - n + 1 : end + 1]) for end in range(first, len(old))}:
            kept = [e for e in ends.get(key, ()) if e < first]
            if kept:
                ends[key] = kept
                owned.add(key)
            else:
                ends.pop(key, None)
        for end in range(first, len(new_tokens)):
            key = tuple(new_tokens[end - n + 1 : end + 1])
            where = ends.get(key)
            if key not in owned:
                where = ends[key] = list(where or ())
                owned.add(key)
            _record(where, end)
        return out

    @property
    def nbytes(self) -> int:
        """An estimate for memory budgets, fitted with tracemalloc on indexes of 2k-20k tokens
        (within 0.85-1.5x of what they hold): per token a list slot, and the position recorded
        for it (a slot and an int); per key its tuple, its list and the dict entry. The previous
        estimate (8 bytes a token, 120 a key) held a seventh of the truth with a deque per key
        (17.9 MB measured for 20k keys against 2.6 MB), so a 256 MiB workspace budget let the
        indexes grow past 1 GiB; a list per key holds a quarter of what the deque did."""
        return 44 * len(self.tokens) + 150 * len(self.ends)

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
PREDICTION_PRIORITY = OWN_PRIORITY + 1  # what the client predicted wins every tie
# The evidence a client's prediction starts with, before any token agreed: as good as a match of
# this many tokens (the gate's acceptance estimates are kept per match length).
PREDICTION_AGREEMENT = 17

# After a divergence, how far around the source position where it happened a re-alignment is
# looked for, and for how many emitted tokens the position is kept before the drafter relies on
# the index alone. An edit changes a few tokens and then copies on: a window of 96 source tokens
# ahead covers a changed line or two; a longer insertion or deletion is found by the index.
RESYNC_BEHIND = 16
RESYNC_AHEAD = 96
RESYNC_SPAN = 24
# Right after a divergence of d <= SUBSTITUTION_MAX tokens, the drafter assumes the model replaced
# as many source tokens and continues after them (a renamed identifier, a changed literal).
SUBSTITUTION_MAX = 4


def agreement_confidence(agree: int) -> float:
    """The gate's confidence key for a match of ``agree`` tokens: 1 -> 0.5, 3 -> 0.75, 33 -> 0.97.
    Acceptance grows with agreement (a 3-token match in prose, "of the", is right far less often
    than a 40-token one inside a copied file), and the gate keeps an estimate per bin of it."""
    return max(agree, 1) / (max(agree, 1) + 1)


class Follow:
    """The source being copied and the position in it that the next token should come from.

    ``agree`` counts the tokens that agreed up to ``pos`` (the gate's evidence). After a mismatch
    ``anchor`` keeps the source position where the copy broke off and ``since`` the tokens emitted
    since, until a re-alignment is confirmed by the next token matching (``tentative``).
    """

    __slots__ = ("src", "pos", "agree", "anchor", "since", "tentative")

    def __init__(self, src: NgramIndex, pos: int, agree: int):
        self.src = src
        self.pos = pos
        self.agree = agree
        self.anchor: int | None = None
        self.since = 0
        self.tentative = False

    def advance(self, token: int) -> bool:
        """Account one emitted token; False when the copy position should be forgotten."""
        toks = self.src.tokens
        if self.pos < len(toks) and toks[self.pos] == token:
            self.pos += 1
            self.agree = min(self.agree + 1, MAX_AGREEMENT)
            if self.tentative:
                self.anchor, self.since, self.tentative = None, 0, False
            return True
        if self.anchor is None:  # a fresh divergence: remember where the copy broke off
            self.anchor, self.since, self.agree = self.pos, 1, 0
        else:
            self.since += 1
        self.tentative = False
        return self.since <= RESYNC_SPAN

    def realign(self, pos: int, agree: int) -> None:
        """Continue at ``pos`` on trial: confirmed when the next token matches there."""
        self.pos, self.agree, self.tentative = pos, agree, True


class NgramDrafter:
    """Proposes continuations from the request's own tokens and any extra sources.

    ``own`` indexes the request's prompt and everything emitted; ``sources`` are shared indexes
    (workspace files, recent answers) with their priority for this request, which this drafter only
    reads.

    Once a match is found the drafter follows that source position by position (``Follow``)
    instead of looking the last n-gram up again every step. When the model's token differs from
    the source -- an edit -- it re-aligns at once rather than waiting for a fresh 3-token match:
    first by the index, then by the last one or two emitted tokens near where the copy broke off,
    else assuming a substitution of as many tokens as were emitted since. Before this, every changed
    token cost three plain passes of re-matching on file edits.
    """

    def __init__(self, context: Sequence[int], sources: Sequence[Source] = (),
                 *, min_n: int = DEFAULT_MIN_N, prediction: Sequence[int] = ()):
        self.own = NgramIndex(context, name="request", min_n=min_n, kind="request")
        self.sources = [(s, prio) for s, prio in sources if s.min_n == min_n]
        self.follow: Follow | None = None
        self.proposals = 0
        if prediction:  # the client's guess of the answer: followed from its first token
            guess = NgramIndex(prediction, name="prediction", min_n=min_n, kind="prediction")
            self.sources.insert(0, (guess, PREDICTION_PRIORITY))
            self.follow = Follow(guess, 0, PREDICTION_AGREEMENT)

    wants_hidden = False

    def commit(self, tokens: Sequence[int], hidden: object = None) -> None:
        f = self.follow
        for t in tokens:
            if f is not None and not f.advance(t):
                f = self.follow = None
            self.own.extend((t,))

    def propose(self, k: int) -> Proposal | None:
        if k <= 0:
            return None
        f = self.follow
        if f is not None and f.anchor is None and f.pos < len(f.src.tokens):
            return self._draft(f, k)
        found = self._lookup(f)
        if found is not None:
            agree, src, end = found
            if f is not None and src is f.src:
                f.realign(end + 1, agree)
            else:
                f = self.follow = Follow(src, end + 1, agree)
            return self._draft(f, k)
        if f is not None and f.anchor is not None:
            return self._resync(f, k)
        return None

    def _draft(self, f: Follow, k: int) -> Proposal | None:
        toks = f.src.tokens
        tokens = toks[f.pos : f.pos + k]
        if f.src is self.own and len(tokens) < k:
            # The copy runs into the present: the text is repeating with period len - pos.
            # Continue the cycle instead of stopping short (small models loop, and a loop is
            # the cheapest thing there is to draft).
            period = len(toks) - f.pos
            tokens = [toks[f.pos + i % period] for i in range(k)]
        if not tokens:
            return None
        self.proposals += 1
        return Proposal(tokens=tokens, confidence=agreement_confidence(f.agree), source=f.src.kind)

    def _lookup(self, f: Follow | None) -> tuple[int, NgramIndex, int] | None:
        """The best earlier occurrence of the context's last n-gram: longest agreement, then
        closeness to where a broken-off copy was (the file being edited), then source priority,
        then the newest."""
        context = self.own.tokens
        best: tuple[tuple[int, int, int, int], NgramIndex] | None = None
        near = f.src if f is not None and f.anchor is not None else None
        for src, priority in ((self.own, OWN_PRIORITY), *self.sources):
            exclude = len(context) - 1 if src is self.own else None
            for agree, end in src.candidates(context, exclude_end=exclude):
                local = src is near and -RESYNC_BEHIND <= end - f.anchor <= RESYNC_AHEAD
                key = (agree, local, priority, end)
                if best is None or key > best[0]:
                    best = (key, src)
        if best is None:
            return None
        (agree, _, _, end), src = best
        return agree, src, end

    def _resync(self, f: Follow, k: int) -> Proposal | None:
        """Re-align a broken-off copy by the last emitted tokens near its anchor (two agreeing
        tokens, else a substitution of the tokens emitted since, else one agreeing token)."""
        context = self.own.tokens
        toks = f.src.tokens
        lo = max(f.anchor - RESYNC_BEHIND, 0)
        hi = min(f.anchor + RESYNC_AHEAD, len(toks) - 1)
        last = context[-1]
        best: tuple[int, int] | None = None  # (agree, -distance) of the alignment ending at j
        best_j = -1
        for j in range(lo, hi):
            if toks[j] != last:
                continue
            agree = 1
            while agree < 2 and j - agree >= 0 and toks[j - agree] == context[-1 - agree]:
                agree += 1
            key = (agree, -abs(j - f.anchor))
            if best is None or key > best:
                best, best_j = key, j
        if best is not None and best[0] >= 2:
            f.realign(best_j + 1, best[0])
        elif f.since <= SUBSTITUTION_MAX and f.anchor + f.since < len(toks):
            f.realign(f.anchor + f.since, 1)
        elif best is not None:
            f.realign(best_j + 1, 1)
        else:
            return None
        return self._draft(f, k)


RECENT_ANSWERS = 32
RECENT_TOKENS = 1 << 16
RECENT_PRIORITY = 0  # below every workspace source
MIN_RECENT = 16  # shorter answers ("OK.") are not worth an index


class RecentAnswers:
    """The engine's recent answers, as n-gram sources for later requests: agents repeat tool
    calls, file paths and code across conversations (the observation behind SuffixDecoding), and
    an answer regenerated after a retry is the answer before it. Bounded in answers and tokens;
    owned by the decode thread, which both writes and reads it."""

    def __init__(self, max_answers: int = RECENT_ANSWERS, max_tokens: int = RECENT_TOKENS,
                 *, min_n: int = DEFAULT_MIN_N):
        self.max_answers = max_answers
        self.max_tokens = max_tokens
        self.min_n = min_n
        self._answers: deque[NgramIndex] = deque()
        self._tokens = 0

    def add(self, tokens: Sequence[int]) -> None:
        if len(tokens) < MIN_RECENT:
            return
        self._answers.append(NgramIndex(tokens[-self.max_tokens:], name="recent answer", min_n=self.min_n,
                                          kind="recent"))
        self._tokens += len(self._answers[-1])
        while len(self._answers) > self.max_answers or self._tokens > self.max_tokens:
            self._tokens -= len(self._answers.popleft())

    def sources(self) -> list[Source]:
        return [(a, RECENT_PRIORITY) for a in reversed(self._answers)]

    def clear(self) -> None:
        self._answers.clear()
        self._tokens = 0
