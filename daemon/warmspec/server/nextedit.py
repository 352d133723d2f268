"""Next-edit suggestions: from a buffer's recent edits and the cursor, the edit that comes next.

Each open document keeps its recent edits (``EditHistory``: the editor syncs full texts, so an
edit is the span between the common prefix and suffix of two successive texts). Keystrokes in one
place coalesce into one edit -- selecting ``fetch`` and typing ``l``, ``o``, ``a``, ``d`` is one
edit ``fetch`` -> ``load`` -- so the history holds what a person would call their last edits.

The last edit, widened to whole words, is the pattern:

- ``rename``: it turned one identifier into another (``fetch_rows`` -> ``load_rows``). Every
  remaining whole-word occurrence of the old name is a candidate; the nearest to the cursor is
  suggested (range: the old name; text: the new one), and accepting it makes that the last edit,
  so the next request suggests the one after.
- ``repeat``: any other substitution whose old text (at least 3 characters, with a word character)
  is still elsewhere in the buffer, bounded by word edges the same way: the same replacement there
  (``print "x"`` -> ``print("x")``).

No model is asked, by choice. The rename and repeat rules are exact where they apply -- the
replacement is the user's own text, and where to put it is a whole-word match -- so a model could
only add cost (a prefill of the buffer and a decoded line, ~100-300 ms of the 135M model on this
CPU per suggestion, taken from the ghost text's share of one decode thread) and risk (a 135M model
rewriting a line can change what the user did not touch). The cases a pattern cannot decide -- an
edit that is not a substitution (an argument added to one call, to be added to the other calls in
their own words), or whether an occurrence inside a string or comment should follow a rename --
are where a model belongs; that is left for later and is not guessed at here: such edits get no
suggestion.
"""

from __future__ import annotations

import re
from collections import deque
from typing import NamedTuple

MAX_EDITS = 16  # recent edits kept per document
MAX_EDIT_CHARS = 256  # an edit longer than this is kept but not merged into (and is no pattern)
CHUNK = 4096  # compared at once while looking for the changed span (C speed, not per character)

_IDENT = re.compile(r"[^\W\d]\w*")


class Edit(NamedTuple):
    """``old`` was replaced by ``new``, which starts at ``start`` of the text after the edit."""

    start: int
    old: str
    new: str

    @property
    def end(self) -> int:
        return self.start + len(self.new)


class Suggestion(NamedTuple):
    """Replace ``text[start:end]`` with ``text``."""

    start: int
    end: int
    text: str
    kind: str
    old: str
    new: str
    remaining: int


def _common_prefix(a: str, b: str) -> int:
    """Length of the common prefix: chunk by chunk (a C comparison each), then character by
    character within the chunk that differs -- a keystroke in a 1 MiB buffer costs ~1 ms."""
    n = min(len(a), len(b))
    i = 0
    while i + CHUNK <= n and a[i:i + CHUNK] == b[i:i + CHUNK]:
        i += CHUNK
    end = min(i + CHUNK, n)
    while i < end and a[i] == b[i]:
        i += 1
    return i


def diff(a: str, b: str) -> Edit | None:
    """The one span in which ``b`` differs from ``a`` (None: they are equal)."""
    if a == b:
        return None
    p = _common_prefix(a, b)
    s = _common_prefix(a[p:][::-1], b[p:][::-1])
    return Edit(p, a[p:len(a) - s], b[p:len(b) - s])


class EditHistory:
    """One document's recent edits, coalesced, and the text they lead to."""

    def __init__(self, text: str):
        self.text = text
        self.edits: deque[Edit] = deque(maxlen=MAX_EDITS)

    def update(self, text: str) -> None:
        e = diff(self.text, text)
        prev, self.text = self.text, text
        if e is None:
            return
        last = self.edits[-1] if self.edits else None
        if (last is not None and len(last.old) + len(last.new) <= MAX_EDIT_CHARS
                and e.start <= last.end and e.start + len(e.old) >= last.start):
            # ``e`` touches the span the last edit left: one edit. ``lo``..``hi`` covers both in
            # the text before ``e``; the original text there is the last edit's old text between
            # whatever of the text around it ``e`` also took.
            lo, hi = min(last.start, e.start), max(last.end, e.start + len(e.old))
            old = prev[lo:last.start] + last.old + prev[last.end:hi]
            new = text[lo:hi + len(e.new) - len(e.old)]
            self.edits[-1] = Edit(lo, old, new)
        else:
            self.edits.append(e)

    @property
    def last(self) -> Edit | None:
        return self.edits[-1] if self.edits else None


def _word(c: str) -> bool:
    return c.isalnum() or c == "_"


def pattern(text: str, e: Edit) -> tuple[str, str, str, int, int] | None:
    """The last edit widened to whole words: (kind, old, new, start, end of new in ``text``)."""
    if len(e.old) + len(e.new) > MAX_EDIT_CHARS:
        return None
    lo, hi = e.start, e.end
    while lo > 0 and _word(text[lo - 1]):
        lo -= 1
    while hi < len(text) and _word(text[hi]):
        hi += 1
    new = text[lo:hi]
    old = text[lo:e.start] + e.old + text[e.end:hi]
    if old == new or not old.strip():
        return None
    if _IDENT.fullmatch(old) and _IDENT.fullmatch(new):
        return "rename", old, new, lo, hi
    if len(old) >= 3 and any(_word(c) for c in old):
        return "repeat", old, new, lo, hi
    return None


def occurrences(text: str, old: str) -> list[int]:
    """Where ``old`` occurs in ``text`` not inside a longer word (its edges that are word
    characters must not continue into one)."""
    left = r"(?<!\w)" if _word(old[0]) else ""
    right = r"(?!\w)" if _word(old[-1]) else ""
    return [m.start() for m in re.finditer(left + re.escape(old) + right, text)]


def suggest(last: Edit | None, text: str, cursor: int) -> Suggestion | None:
    """The next edit of ``text`` after ``last``, nearest the cursor; None when the last edit is no
    pattern or nothing is left to apply it to."""
    if last is None:
        return None
    found = pattern(text, last)
    if found is None:
        return None
    kind, old, new, lo, hi = found
    k = new.find(old)  # an occurrence inside a site already edited is no candidate (x -> x.y)
    sites = [m for m in occurrences(text, old)
             if not (m < hi and m + len(old) > lo)
             and not (k >= 0 and text[m - k:m - k + len(new)] == new and m >= k)]
    if not sites:
        return None
    best = min(sites, key=lambda m: (abs(m - cursor), m < cursor))
    return Suggestion(best, best + len(old), new, kind, old, new, len(sites))
