"""What became of the ghost text: per-request timings, the editors' feedback, and the tuning that
follows from it.

Editors report each suggestion shown, accepted, partially accepted (next word, next line) or
dismissed (``warmspec/inlineCompletionFeedback``). The daemon keeps acceptance per document and
per language (``warmspec/status``'s ``inline``, ``/metrics``) and uses it for two things, per
language:

- **Suggestion length.** A suggestion's tokens cost model time whether or not they are accepted;
  what is accepted is what the user would have typed. So ``max_tokens`` follows the accepted
  lengths: a little over the 75th percentile of what the last 32 suggestions had accepted (in
  tokens, at the characters per token measured on the suggestions), rounded up to a few fixed
  lengths so the ghost-text cache keeps its keys, never over the connection's ``maxTokens``.
  Nothing accepted lately: the shortest length.
- **Debounce.** A client waits before asking; how long is worth it depends on how often a
  suggestion is taken: the advised debounce is the client's own scaled by 1.5 - rate (rate: the
  share of those 32 suggestions accepted at least in part), so 0.5x when everything is taken and
  1.5x when nothing is.

Both wait for 4 outcomes before they move. Owned by the event loop (the RPC and HTTP transports
share it); nothing here waits or touches the model.
"""

from __future__ import annotations

import math
import statistics
from collections import OrderedDict, deque
from typing import Iterable

from warmspec_protocol import Acceptance, InlineStatus, Latency

WINDOW = 32  # outcomes a language's tuning looks at
MIN_OUTCOMES = 4  # before tuning moves
LENGTHS = (4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)  # adapted max_tokens levels
LATENCY_SAMPLES = 512  # requests the latency quantiles are taken over
MAX_DOCUMENTS = 256  # documents whose acceptance is kept (the most recent)
MAX_LANGUAGES = 64


class Suggestion:
    """One suggestion a client was given, kept (per connection, bounded) until feedback ends it."""

    __slots__ = ("uri", "language", "text", "tokens", "accepted_chars", "shown", "done")

    def __init__(self, uri: str, language: str, text: str, tokens: int):
        self.uri = uri
        self.language = language
        self.text = text
        self.tokens = tokens  # decoded for it (0: from the cache)
        self.accepted_chars = 0
        self.shown = False
        self.done = False


class Tuner:
    """One language's recent outcomes: how much of each suggestion was accepted."""

    def __init__(self) -> None:
        self.outcomes: deque[int] = deque(maxlen=WINDOW)  # characters accepted per suggestion
        self.chars = 0  # characters and tokens of the suggestions decoded, for chars per token
        self.tokens = 0

    def max_tokens(self, cap: int) -> int:
        if len(self.outcomes) < MIN_OUTCOMES:
            return cap
        accepted = sorted(a for a in self.outcomes if a > 0)
        if not accepted:
            return min(LENGTHS[0], cap)
        p75 = accepted[math.ceil(0.75 * len(accepted)) - 1]
        per_token = self.chars / self.tokens if self.tokens else 3.0
        want = math.ceil(p75 / per_token * 1.25) + 1
        return min(next((n for n in LENGTHS if n >= want), LENGTHS[-1]), cap)

    def debounce_ms(self, base: int) -> int:
        if len(self.outcomes) < MIN_OUTCOMES:
            return base
        rate = sum(a > 0 for a in self.outcomes) / len(self.outcomes)
        return round(base * (1.5 - rate))


def _latency(samples: Iterable[float]) -> Latency:
    xs = sorted(samples)
    if not xs:
        return Latency()
    p90 = xs[min(len(xs) - 1, math.ceil(0.9 * len(xs)) - 1)]
    return Latency(count=len(xs), p50_ms=round(statistics.median(xs) * 1000, 1), p90_ms=round(p90 * 1000, 1))


class InlineMetrics:
    """Counters, latencies and tuners of the daemon's ghost text (see the module docstring)."""

    def __init__(self) -> None:
        self.counts = InlineStatus()  # the scalar counters; the rest is assembled in status()
        self.first_visible: deque[float] = deque(maxlen=LATENCY_SAMPLES)
        self.final: deque[float] = deque(maxlen=LATENCY_SAMPLES)
        self.total = Acceptance()
        self.documents: OrderedDict[str, Acceptance] = OrderedDict()
        self.languages: dict[str, Acceptance] = {}
        self.tuners: dict[str, Tuner] = {}

    # -- requests -----------------------------------------------------------------------------------

    def requested(self) -> None:
        self.counts.requests += 1

    def answered(self, *, first_visible_s: float | None, final_s: float, text: str, tokens: int,
                 finish: str, language: str) -> None:
        c = self.counts
        if first_visible_s is not None:
            self.first_visible.append(first_visible_s)
        if finish != "empty":  # nothing to continue: answered at once, and no suggestion's latency
            self.final.append(final_s)
        if finish == "cache":
            c.cache_hits += 1
        elif finish == "deadline":
            c.deadline += 1
        if tokens and text:
            t = self.tuner(language)
            t.chars += len(text)
            t.tokens += tokens

    def cancelled(self, tokens: int) -> None:
        """A request ended before its answer (``$/cancelRequest``, superseded, its document edited):
        whatever it decoded is thrown away."""
        self.counts.cancelled += 1
        self.counts.tokens_thrown_away += tokens

    def decoded(self, tokens: int, thrown_away: int = 0) -> None:
        """A ghost-text job ended having decoded ``tokens``, ``thrown_away`` of them in no answer
        (decoded after its deadline's answer)."""
        self.counts.tokens_generated += tokens
        self.counts.tokens_thrown_away += thrown_away

    # -- feedback -----------------------------------------------------------------------------------

    def tuner(self, language: str) -> Tuner:
        t = self.tuners.get(language)
        if t is None:
            if len(self.tuners) >= MAX_LANGUAGES:
                language = "other"
                t = self.tuners.get(language)
            if t is None:
                t = self.tuners[language] = Tuner()
        return t

    def _tallies(self, s: Suggestion) -> list[Acceptance]:
        doc = self.documents.pop(s.uri, None) or Acceptance()
        self.documents[s.uri] = doc  # most recent last
        while len(self.documents) > MAX_DOCUMENTS:
            self.documents.popitem(last=False)
        lang = s.language if s.language in self.languages or len(self.languages) < MAX_LANGUAGES else "other"
        return [self.total, doc, self.languages.setdefault(lang, Acceptance())]

    def feedback(self, s: Suggestion, event: str, accepted_chars: int | None) -> str:
        """Count one event for ``s``; returns the text it newly accepted ("" for none). A finished
        suggestion (accepted or dismissed) ignores what comes after."""
        if s.done:
            return ""
        tallies = self._tallies(s)
        if event == "shown":
            if not s.shown:
                s.shown = True
                for a in tallies:
                    a.shown += 1
                    a.chars_shown += len(s.text)
            return ""
        before = s.accepted_chars
        if event == "accepted":
            s.accepted_chars = len(s.text)
        elif event == "partial":
            s.accepted_chars = max(before, min(len(s.text), accepted_chars or 0))
        newly = s.accepted_chars - before
        for a in tallies:
            a.chars_accepted += newly
            if event == "accepted":
                a.accepted += 1
            elif event == "partial" and before == 0 and newly > 0:
                a.partial += 1
            elif event == "dismissed" and s.accepted_chars == 0:
                a.dismissed += 1
        if event in ("accepted", "dismissed"):
            s.done = True
            self.tuner(s.language).outcomes.append(s.accepted_chars)
            if s.text and s.tokens:
                self.counts.tokens_thrown_away += round(s.tokens * (1 - s.accepted_chars / len(s.text)))
        return s.text[before:s.accepted_chars]

    # -- tuning -------------------------------------------------------------------------------------

    def max_tokens(self, language: str, cap: int) -> int:
        t = self.tuners.get(language)
        return cap if t is None else t.max_tokens(cap)

    def debounce_ms(self, language: str, base: int) -> int:
        t = self.tuners.get(language)
        return base if t is None else t.debounce_ms(base)

    # -- introspection ------------------------------------------------------------------------------

    def status(self) -> InlineStatus:
        c = self.counts
        copy = lambda a: Acceptance(**{f: getattr(a, f) for f in Acceptance.__struct_fields__})  # noqa: E731
        return InlineStatus(
            requests=c.requests, cache_hits=c.cache_hits, cancelled=c.cancelled, deadline=c.deadline,
            first_visible=_latency(self.first_visible), final=_latency(self.final),
            tokens_generated=c.tokens_generated, tokens_thrown_away=c.tokens_thrown_away,
            next_edits=c.next_edits, alternatives=c.alternatives, prefetched=c.prefetched,
            prefetch_attached=c.prefetch_attached, acceptance=copy(self.total),
            documents={u: copy(a) for u, a in self.documents.items()},
            languages={k: copy(a) for k, a in self.languages.items()})
