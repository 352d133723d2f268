"""The gate: how many drafted tokens to verify this step (0 = a plain step).

It maximizes expected tokens per second of verify time, from two estimates the engine owns:

- ``CostTable``: seconds for one forward pass over P positions. Measured at load on this machine
  (a few seconds), because the shape is not P x one step and not even monotone: here on 2 CPU
  cores with OpenBLAS 16 positions cost 1.6x one; on an H200 with MLX CUDA a 5-position pass of
  an 8B 4-bit model costs 3.2x a step but an 8-position one 2.3x. Online, every observed pass
  rescales the whole table (context growth, machine load) and corrects the observed width.
- ``Rates``: acceptance, decayed, kept separately for short and long n-gram matches -- a
  3-token match in new prose ("of the") is right far less often than a 40-token match inside a
  file being copied, and one rate for both would either draft on prose or stop drafting on copies.
  Two rates per source and bin: of the first drafted token, and of each further one given the
  one before it was accepted (see ``Rates``).

With first-token acceptance f and continuation c, verifying k drafts yields
1 + f (1 + c + ... + c^(k-1)) tokens on average (drafts are accepted as a prefix), at cost(1 + k)
plus the host time of proposing. The gate picks
the k with the best ratio and compares it with a plain step as the engine runs it: pipelined
(queued before the previous token is read back), which on a GPU costs less than a synchronous
one-position pass -- comparing with the synchronous cost(1) flattered drafting there, and prose
ran up to 26% slower than plain on an H200.

Host time: proposing and gating take tens of microseconds to a millisecond of Python per step. On a
CPU step of 40-90 ms that is noise; on a GPU step of 5 ms it is not, and it is paid even when the
gate then answers 0. So the gate measures it (``observe_host``), adds it to a drafting step's cost,
and where proposals keep coming to nothing it backs off: it lets steps pass without proposing, so
that the host time spent on fruitless proposals stays under ``HOST_SHARE`` of plain decoding.

Device time of a drafter: an MTP head's drafts are computed inside the verify pass, a decoder
layer and an output projection per depth. The engine times them at first use and the gate
charges them per drafted token (``per_token``), apart from the pass's own cost.

Unverified proposals: a proposal gated off, or one that lost to another source's, is scored
against what the step then emitted (``shadow`` / ``settle``), so every bin's estimate follows
the text whether or not its proposals are verified.

The request's calibration: the acceptance estimates are learned across requests, per source and
bin, and a request that drafts worse than they say spreads its misses over many bins, each of
which must learn on its own. So each request keeps, per source, its first and later tokens
accepted against what the estimates expected of them, over about its last ten proposals, and
scales every estimate of that source by the two ratios, never up (``calibration``); not for a
source asked before it proposes (an MTP head), whose own rate already follows the request.

The ledger: everything above is an estimate. Each request also books what drafting actually
saved, by the clock, and pauses drafting while the balance shows a loss past ``LOSS_SHARE`` of
its decode time (``Ledger``), so that the floor under plain decoding holds where an estimate is
wrong.
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import time
from pathlib import Path
from typing import Callable, NamedTuple

log = logging.getLogger("warmspec.gate")

# Lower edges of the confidence bins acceptance is estimated in, per source. For the n-gram
# drafter they are match lengths 1, 2 (re-alignments), 3, 5, 9, 17 and 33 (agreement_confidence);
# a model drafter's confidence is its probability of its first token.
CONFIDENCE_BINS = (0.0, 0.5, 2 / 3, 0.75, 5 / 6, 0.9, 17 / 18, 33 / 34)
PRIOR_ACCEPTANCE = 0.5
DECAY = 0.9  # weight of history per observation: a proposal's first token, or a later one
PROBE_EVERY = 16  # a gated-off bin is retried with one draft token after this many refusals
HOST_SHARE = 0.01  # most of a plain step's time that fruitless proposing may cost on average
# Drafting must beat a plain step by this much. The estimates it is judged by are noisy (an H200's
# measured table is not even monotone: 4 positions 1.47x one, 16 positions 1.49x), and a marginal
# call lost more than it won: a list prompt drafting 521 tokens at 18% acceptance ran at 0.89x
# plain on an H200 with 4-bit weights.
MARGIN = 1.08
MAX_SKIP = 16  # at most this many steps pass without a proposal
# The request's calibration (``Gate.calibration``): how many expected accepted tokens of prior
# weight each of its two ratios starts from, at a ratio of 1; and the weight its tallies keep per
# proposal observed (they forget over about ten proposals, as a bin does: ``DECAY``).
CALIBRATION_PRIOR = 1.0
CALIBRATION_DECAY = 0.9
# The ledger (``Ledger``): what drafting may cost a request, measured, before it is paused; the
# first pause, in steps (it doubles at each pause of the same request, up to the last); what
# drafting may lose after it resumes, in plain steps, and over at least how many drafting steps.
LOSS_SHARE = 0.02
PAUSE_STEPS = 16
MAX_PAUSE_STEPS = 1024
TRIAL_STEPS = 3.0
TRIAL_DRAFTS = 3
MIN_PLAIN = 8  # the request's own plain steps the ledger needs before it prices a step by them
# Trying the other kind of plain step (see ``PlainSteps``): first after this many plain steps,
# then for this many steps every EXPLORE_EVERY (up to MAX_EXPLORE_EVERY when the kinds differ a
# lot); each kind needs MIN_STEPS timed steps before the measurement overrides the prior.
EXPLORE_FIRST = 16
EXPLORE_EVERY = 64
EXPLORE_STEPS = 4
MAX_EXPLORE_EVERY = 1024
MIN_STEPS = 3


class Rates(NamedTuple):
    """Acceptance of a source's drafts in one confidence bin: ``first``, of a proposal's first
    token; ``cont``, of each later token, given the one before it was accepted (None until a
    later token has been judged: then taken as ``first``, the one-rate assumption).

    Why two: on prose a proposal is mostly wrong from its first token, and once its first token is
    right the phrase it copies mostly goes on. Traced over 12 of our prose prompts (n-gram, this
    CPU), short matches' first tokens were accepted 25% of the time and their later ones 76%. One
    per-token rate (24%) prices a 7-token draft there at 1.3 tokens a pass, the two rates at 1.9,
    and where a pass of 8 positions costs little more than one of 2 (1.56x against 1.16x one
    position here) that decides whether a short match is worth drafting at all. The MTP head's
    held-back acceptance has the same shape the other way: 58% at depth 1, then about half of
    what remains at each depth.

    Why ``cont`` starts as ``first``: a proposal scored without a verify pass (``Gate.settle``)
    is mostly scored against one plain step's token, which says nothing of its later tokens; a
    fixed prior there (0.5) kept a drafter that was always right from ever being verified."""

    first: float
    cont: float | None = None

    @property
    def later(self) -> float:
        return self.first if self.cont is None else self.cont

    def expected(self, k: int) -> float:
        """Tokens a pass verifying ``k`` of these drafts yields on average (its own included)."""
        return 1.0 + self.first * sum(self.later ** i for i in range(k))

    def update(self, drafted: int, accepted: int) -> "Rates":
        """After ``drafted`` drafts of which the first ``accepted`` were accepted."""
        cont = self.cont
        for i in range(1, min(accepted + 1, drafted)):  # the later tokens that were judged
            cont = DECAY * (self.first if cont is None else cont) + (1 - DECAY) * (i < accepted)
        return Rates(DECAY * self.first + (1 - DECAY) * (accepted > 0), cont)


# Timing passes for the cost table: on a GPU a pass is ~5-15 ms, and two of them on a shared
# host were too few to order the widths (see ``CostTable.measure``); on a CPU two passes already
# take over 0.1 s.
MIN_SAMPLE_S = 0.1
MAX_REPEATS = 12


def _line(v0: float, v1: float) -> tuple[float, float, float]:
    """A cost measured at the first and the last context as ``(v0, rise, floor)``: at a fraction
    ``t`` of the way (``_fraction``; beyond them too) it is ``max(v0 + rise * t, floor)``, linear
    in context and never below half the smaller end (a line extrapolated to short contexts must
    not reach zero: the gate divides by it)."""
    return v0, v1 - v0, 0.5 * min(v0, v1)


def _fraction(context: int, ends: tuple[int, int]) -> float:
    """Where ``context`` lies between the first and the last measured context (0 with one)."""
    c0, c1 = ends
    return (context - c0) / (c1 - c0) if c1 != c0 else 0.0


class CostTable:
    """Seconds per forward pass over P positions at a context length, measured then tracked.

    Measured at two context lengths, because attention makes wide passes dearer as the context
    grows: here (2 cores, OpenBLAS, default model) 16 positions cost 1.8x one at 200 tokens of
    context but 2.5x at 1500 -- MLX's CPU ``exp`` is slow, and a verify pass takes the softmax
    over P x context scores. Between and beyond the two lengths the cost is linear in context.
    """

    def __init__(self, points: dict[int, dict[int, float]], plain: dict[int, float] | None = None):
        """``points``: {context length: {width P: seconds}}; every context must measure P = 1,
        and every cost must be a positive finite number of seconds (the gate divides by them).
        ``plain``: {context length: seconds per token of pipelined plain decoding}; without it a
        plain step is priced as a synchronous one-position pass."""
        if not points or any(1 not in row for row in points.values()):
            raise ValueError("a cost table needs the single-position cost at every context")
        for c, row in points.items():
            if c < 0 or any(p < 1 or not (math.isfinite(t) and t > 0) for p, t in row.items()):
                raise ValueError(f"invalid cost table row at context {c}: {row}")
        if any(c < 0 or not (math.isfinite(t) and t > 0) for c, t in (plain or {}).items()):
            raise ValueError(f"invalid pipelined plain costs: {plain}")
        self.points = {c: dict(sorted(row.items())) for c, row in sorted(points.items())}  # fixed
        self.plain_points = dict(sorted((plain or {}).items()))
        contexts = list(self.points)
        self._ends = (contexts[0], contexts[-1])  # the contexts a cost interpolates between
        self._col: list[tuple[float, float, float]] = [(0.0, 0.0, 0.0)]  # per width (``_column``)
        plains = list(self.plain_points)
        self._plain_ends = (plains[0], plains[-1]) if plains else None
        self._plain_line = (_line(self.plain_points[plains[0]], self.plain_points[plains[-1]])
                            if plains else None)
        self.scale = 1.0
        self.plain_scale = 1.0
        self.correction: dict[int, float] = {}

    @classmethod
    def measure(cls, forward: Callable[[int, int], None], widths: list[int],
                contexts: list[int], repeats: int = 2,
                plain: Callable[[int], float] | None = None) -> "CostTable":
        """Time ``forward(P, context)`` -- one synchronized pass of P positions on a warm cache of
        that many tokens, undone afterwards -- taking the median of ``repeats`` after one warm-up
        pass per width; and ``plain(context)``, seconds per token of pipelined plain decoding
        there (median of ``repeats``).

        Where passes are short (a GPU) each width is timed again until ``MIN_SAMPLE_S`` of passes
        or ``MAX_REPEATS`` of them: on the lent H100 two passes gave 4 positions 17.3 ms and 16
        positions 10.5 ms (``docs/bench/h100-s33``), a table the gate then trusted. And a row
        never falls as the width grows (each width costs at least the narrower ones' most): a
        wider pass does the narrower one's work and more, so a dip is noise, and reading it as
        a cheap wide pass is the error that makes drafting lose."""
        points: dict[int, dict[int, float]] = {}
        plains: dict[int, float] = {}
        for c in contexts:
            for p in widths:  # untimed: MLX CUDA compiles kernels per new shape (seconds each)
                forward(p, c)
            row: dict[int, float] = {}
            for p in widths:
                times: list[float] = []
                while len(times) < repeats or (sum(times) < MIN_SAMPLE_S and len(times) < MAX_REPEATS):
                    t = time.perf_counter()
                    forward(p, c)
                    times.append(time.perf_counter() - t)
                row[p] = max(statistics.median(times), max(row.values(), default=0.0))
            points[c] = row
            if plain is not None:
                plains[c] = statistics.median(plain(c) for _ in range(repeats))
        return cls(points, plains)

    @staticmethod
    def _row(row: dict[int, float], p: int) -> float:
        if p in row:
            return row[p]
        widths = list(row)
        lo = max((w for w in widths if w < p), default=widths[0])
        hi = min((w for w in widths if w > p), default=None)
        if hi is None:  # beyond the table: grow linearly from the last two points
            a, b = widths[-2:] if len(widths) > 1 else (widths[-1], widths[-1])
            slope = (row[b] - row[a]) / (b - a) if b != a else row[b]
            return row[b] + max(slope, 0.0) * (p - b)
        t = (p - lo) / (hi - lo)
        return row[lo] * (1 - t) + row[hi] * t

    def _base(self, p: int, context: int) -> float:
        b0, d, low = self._column(p)[p]
        return max(b0 + d * _fraction(context, self._ends), low)

    def cost(self, p: int, context: int = 0) -> float:
        return self._base(p, context) * self.scale * self.correction.get(p, 1.0)

    def costs(self, widths: int, context: int = 0) -> list[float]:
        """``[cost(p, context) for p in 0 .. widths]`` (index 0 unused), the same floats in one
        pass. Why: the gate prices every draft length up to the proposal's each time it is asked,
        and a call of ``cost`` per length was most of its time: 110 us for a 64-token proposal on
        this 2-core CPU, a fortieth of a 4-bit step of the default model on an H200, paid on
        every proposal the gate then turns down."""
        t = _fraction(context, self._ends)
        scale, corr = self.scale, self.correction
        return [0.0, *(max(b0 + d * t, low) * scale * corr.get(p, 1.0)
                       for p, (b0, d, low) in enumerate(self._column(widths)[1:widths + 1], 1))]

    def _column(self, widths: int) -> list[tuple[float, float, float]]:
        """Per width 0 .. at least ``widths``: its costs at the first and the last context as a
        ``_line`` (with one context, no rise). Kept because the gate
        prices every draft length on each step, and interpolating the table afresh was most of
        its host time (28 of 35 ms over 128 tokens of prose on this CPU)."""
        col = self._col
        if len(col) <= widths:
            r0, r1 = self.points[self._ends[0]], self.points[self._ends[1]]
            col.extend(_line(self._row(r0, p), self._row(r1, p)) for p in range(len(col), widths + 1))
        return col

    def base(self, p: int, context: int = 0) -> float:
        """The cost as measured at start-up, without the online corrections: a fixed yardstick
        for comparing times observed at different context lengths."""
        return self._base(p, context)

    def plain(self, context: int = 0) -> float:
        """Seconds per token of pipelined plain decoding at ``context``."""
        if self._plain_line is None:
            return self.cost(1, context)
        b0, d, low = self._plain_line
        return max(b0 + d * _fraction(context, self._plain_ends), low) * self.plain_scale

    def observe_plain(self, context: int, seconds: float, alpha: float = 0.05) -> None:
        """Fold in one pipelined plain step (the time between two read-backs)."""
        if not self.plain_points:
            return
        r = min(max(seconds / self.plain(context), 0.25), 4.0)
        self.plain_scale *= 1 + alpha * (r - 1)

    def relative(self, p: int, context: int = 0) -> float:
        return self.cost(p, context) / self.cost(1, context)

    def observe(self, p: int, context: int, seconds: float, alpha: float = 0.05,
                beta: float = 0.2) -> None:
        """Fold one timed pass in: the whole table drifts slowly (machine load), the observed
        width faster (its shape may differ from what the load-time measurement saw)."""
        r = min(max(seconds / self.cost(p, context), 0.25), 4.0)
        self.scale *= 1 + alpha * (r - 1)
        self.correction[p] = self.correction.get(p, 1.0) * (1 + beta * (r - 1))

    def save(self, path: Path) -> None:
        """Write the measured points (not the online corrections) atomically."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({
            "passes": {str(c): {str(p): t for p, t in row.items()} for c, row in self.points.items()},
            "plain": {str(c): t for c, t in self.plain_points.items()},
        }))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: Path) -> "CostTable | None":
        """A table saved by ``save``, or None if missing, unreadable or not a valid table (then
        measure again: a hand-edited or truncated file must not stop the daemon)."""
        try:
            raw = json.loads(path.read_text())
            return cls({int(c): {int(p): float(t) for p, t in row.items()} for c, row in raw["passes"].items()},
                       {int(c): float(t) for c, t in raw["plain"].items()})
        except (OSError, ValueError, AttributeError, KeyError, TypeError):
            return None

    @property
    def widths(self) -> list[int]:
        return list(next(iter(self.points.values())))

    def as_dict(self, context: int = 0) -> dict[int, float]:
        return {p: self.cost(p, context) for p in self.widths}


class PlainSteps:
    """How the engine runs greedy steps that verify nothing: queued ahead of the host
    (pipelined) or synchronously, whichever the decode loop itself measures faster.

    Why measured in the loop and not taken from the start-up table: on this 2-core CPU the table
    priced a pipelined step at 133.8 ms a token against 112.0 ms for a synchronous pass, so
    speculation ran its drafting-free steps synchronously, while plain decoding (always
    pipelined) ran at about 122 ms a token and n-gram on prose with nothing to copy at about
    126 ms: 2% lost on every such prompt. The timed pass has no host work in it and the timed
    steps no token handling; neither is what the loop runs. Here each step is timed from the
    previous one-token step's read-back to its own, with everything it really includes (the
    consumer's work, proposing, gating), relative to the table's one-position cost at that
    context (so that requests at different context lengths compare). The faster kind is kept
    and the other is tried for ``EXPLORE_STEPS`` steps every ``EXPLORE_EVERY`` plain steps while
    the two are within 5% of each other, less often the further apart they are (a kind 20%
    slower is tried every 256 steps: under 0.3% of the time lost to trying it).

    ``learn=False`` keeps ``prior`` (a GPU, where pipelining always paid: synchronous steps made
    prose up to 26% slower than plain on an H200; and replays, whose passes are priced).
    """

    def __init__(self, costs: CostTable, prior: bool, *, learn: bool = True):
        self.costs = costs
        self.learn = learn
        self.best = prior
        self.mean: dict[bool, float] = {}  # kind (True: pipelined) -> relative seconds a token
        self.count = {True: 0, False: 0}
        self.until = EXPLORE_FIRST  # plain steps before the other kind is tried
        self.trying = 0  # steps of the kind on trial still to run
        self.trial = not prior

    def ahead(self) -> bool:
        """Whether the next plain step runs ahead (called once per plain step)."""
        if not self.learn:
            return self.best
        if self.trying:
            self.trying -= 1
            return self.trial
        self.until -= 1
        if self.until <= 0:
            self.trying = EXPLORE_STEPS - 1
            self.until = self._interval()
            self.trial = not self.best
            return self.trial
        return self.best

    def _interval(self) -> int:
        a, b = self.mean.get(True), self.mean.get(False)
        if a is None or b is None:
            return EXPLORE_EVERY
        gap = abs(a - b) / min(a, b)
        return int(min(EXPLORE_EVERY * max(1.0, gap / 0.05), MAX_EXPLORE_EVERY))

    def observe(self, ahead: bool, seconds: float, context: int = 0) -> None:
        """Fold in one plain step of the given kind, timed read-back to read-back."""
        if not self.learn:
            return
        r = seconds / self.costs.base(1, context)
        old = self.mean.get(ahead)
        self.mean[ahead] = r if old is None else 0.9 * old + 0.1 * r
        self.count[ahead] += 1
        if min(self.count.values()) >= MIN_STEPS:
            best = self.mean[True] < self.mean[False]
            if best != self.best:
                log.info("plain steps now run %s: %.3f a token pipelined, %.3f synchronous "
                         "(x the one-position pass)", "pipelined" if best else "synchronously",
                         self.mean[True], self.mean[False])
            self.best = best


class Ledger:
    """What drafting has saved one request so far, by the clock; drafting pauses while it loses.

    Every drafting step is booked at the plain steps its tokens would have taken less its own
    time, read-back to read-back, which holds all it really cost: the pass, proposing, rollback,
    the consumer's work and any bubble in the pipeline. Every proposal that ended in a plain step
    is booked at its proposing time. A plain step books no saving: it is plain decoding, and its
    time beyond the estimate is the host's noise, not drafting's cost.

    A plain step is priced at the mean of this request's own steady plain steps (those that
    follow a plain step, timed the same way, once there are ``MIN_PLAIN`` of them), else at the
    gate's estimate: that estimate was 3.6 ms on an H200 in a tight loop while a plain step took
    7.6 ms in the bench, and a table measured on a busy host can be as far above. A plain step's
    own time is taken less the proposing done in it: plain decoding does not propose, and where
    the host is the bottleneck (a GPU step of a small model) that time lengthens the step one for
    one.

    The first plain step after a drafting step is not a steady one: where plain steps run ahead,
    its pass was queued behind the verify pass's read-back instead of during the step before, so
    it pays for refilling the pipeline. That is drafting's cost, and it is booked as such (its
    time beyond the price); it does not enter the price. Why: when drafting is frequent and
    mostly rejected, most plain steps are such refills; averaged into the price they made a plain
    step look as slow as a failed drafting step, and an H100 prose prompt that verified 460
    drafts, accepted 21 and ran at 0.82x plain booked no loss and never paused
    (``docs/bench/h100-s33``, own-advice-10).

    Drafting pauses when the balance is below both ``LOSS_SHARE`` of the request's decode time so
    far and ``TRIAL_STEPS`` plain steps under where it stood when drafting last resumed, over at
    least ``TRIAL_DRAFTS`` drafting steps (one slow step is the host's noise, not a trend). The
    next ``pause`` steps then run plain without proposing, and the pause doubles for the next
    time.

    Why: the gate decides from estimates -- the cost table, host time, acceptance per bin -- and
    where they are wrong nothing else notices. On an H200 a prose prompt (own-advice-10) drafted
    152 tokens at 11% acceptance and ran at 0.87x plain (medians of 3), each draft priced as a
    gain. The balance bounds the loss whatever went wrong: a request runs at most ``LOSS_SHARE``
    slower than plain decoding, plus about ``TRIAL_STEPS`` plain steps per resumption (at most
    log2 of its length over ``PAUSE_STEPS`` of them).
    """

    def __init__(self) -> None:
        self.balance = 0.0  # seconds drafting has saved (negative: lost)
        self.elapsed = 0.0  # decode time booked so far
        self.start = 0.0  # the balance when drafting last resumed
        self.drafts = 0  # drafting steps booked since then
        self.left = 0  # steps of the current pause still to run
        self.pause = PAUSE_STEPS
        self.pauses = 0
        self.paused = 0  # steps run without proposing because of a pause
        self.plain_mean = 0.0  # this request's steady plain steps, seconds each (decayed mean)
        self.plains = 0
        self.refills = 0  # plain steps right after a drafting step (booked to drafting)
        self.drafted = False  # the last step booked was a drafting step

    def charge(self, seconds: float) -> None:
        """Book time spent proposing for a step that then ran plain."""
        self.balance -= seconds

    def price(self, estimate: float) -> float:
        """What a plain step costs now: the request's own steady plain steps, else ``estimate``."""
        return self.plain_mean if self.plains >= MIN_PLAIN else estimate

    def book(self, tokens: int, seconds: float, estimate: float, drafting: bool,
             proposing: float = 0.0) -> bool:
        """Book one step that emitted ``tokens`` in ``seconds``, by drafting or plain, a plain
        step estimated at ``estimate`` seconds, ``proposing`` of the step's time spent proposing;
        True when this starts a pause."""
        self.elapsed += seconds
        plain = self.price(estimate)
        own = max(seconds - proposing, 0.0)
        if drafting:
            self.balance += tokens * plain - seconds
            self.drafts += 1
        elif self.drafted:  # refilling the pipeline after a drafting step: drafting's cost
            self.balance += tokens * plain - own
            self.refills += 1
        else:
            self.plain_mean = own if not self.plains else 0.9 * self.plain_mean + 0.1 * own
            self.plains += 1
        self.drafted = drafting
        if self.left or self.drafts < TRIAL_DRAFTS:
            return False
        if self.balance >= min(-LOSS_SHARE * self.elapsed, self.start - TRIAL_STEPS * plain):
            return False
        self.left, self.pause = self.pause, min(2 * self.pause, MAX_PAUSE_STEPS)
        self.pauses += 1
        return True

    def hold(self) -> bool:
        """Whether this step runs without proposing (a pause); the pause's end starts a trial."""
        if not self.left:
            return False
        self.left -= 1
        self.paused += 1
        if not self.left:
            self.start, self.drafts = self.balance, 0
        return True


class Gate:
    """``enabled=False`` always verifies everything proposed (for measurement and tests)."""

    def __init__(self, costs: CostTable, max_draft: int = 16, *, enabled: bool = True, timed: bool = True):
        self.costs = costs
        self.max_draft = max_draft
        self.enabled = enabled
        self.timed = timed  # False: host times are not observed (decisions from the cost table alone)
        self.rate: dict[tuple[str, int], Rates] = {}  # (source, bin) -> acceptance
        self.refusals: dict[tuple[str, int], int] = {}
        self.host_s = 0.0  # proposing + gating, per step (decayed mean)
        self.step_host_s = 0.0  # proposing + gating since the last step was booked (``observe_step``)
        self.host_source: dict[str, float] = {}  # a source's own proposing time (decayed mean)
        # Seconds per drafted token that a source's drafting adds to the verify pass on the device
        # (an MTP head's drafts are computed in the pass's graph: a decoder layer and an output
        # projection per depth), measured by the engine; scaled with the table (machine load).
        self.device_source: dict[str, float] = {}
        self.outside_s = 0.0  # per verify step, the time spent outside the pass (decayed mean)
        self.pipelined = False  # plain steps run ahead of the host (then their cost includes it)
        # verify passes are queued before the consumer handles the previous step (then the time
        # outside the pass overlaps the pass, and their observed cost includes it)
        self.overlapped = False
        # the pass will be queued on a token not read yet (a plain pass in flight), whose value
        # the first draft guesses (see ``_best``)
        self.guessing = False
        self.source_rate: dict[str, Rates] = {}  # acceptance of a source, all bins
        # steps a source was not asked since it last was (probes); its keys are the sources asked
        # before they propose (``depth``), which are not calibrated
        self.unasked: dict[str, int] = {}
        self.skip = 0  # steps left to pass without proposing
        self._shadow: tuple[list[int], float, str] | None = None  # a proposal not verified (``shadow``)
        self.skipped = 0  # steps that passed without proposing (for stats and tests)
        self.ledger = Ledger()  # the request's (``begin``)
        # this request's proposals, per source: first tokens accepted, and the estimates' sum
        self.accepted: dict[str, float] = {}
        self.expected: dict[str, float] = {}
        self.accepted_later: dict[str, float] = {}  # the same for tokens after an accepted one
        self.expected_later: dict[str, float] = {}

    def begin(self) -> None:
        """A request starts: a fresh ledger, and no proposal left over from one cut short."""
        self.ledger = Ledger()
        self.step_host_s = 0.0
        self._shadow = None
        self.accepted, self.expected, self.accepted_later, self.expected_later = {}, {}, {}, {}

    @staticmethod
    def bin(confidence: float, source: str = "") -> tuple[str, int]:
        return source, max(i for i, edge in enumerate(CONFIDENCE_BINS) if confidence >= edge - 1e-9)

    def acceptance(self, confidence: float, source: str = "") -> Rates:
        """The acceptance estimate for a proposal: learned per (source, confidence bin); before a
        bin has seen drafts, the drafter's own confidence (its bin's lower edge), at least
        ``PRIOR_ACCEPTANCE`` -- so a 40-token match is trusted from the start, and two sources
        compared before either was verified are compared by what each claims."""
        b = self.bin(confidence, source)
        return self.rate.get(b, Rates(max(CONFIDENCE_BINS[b[1]], PRIOR_ACCEPTANCE)))

    def calibration(self, source: str) -> tuple[float, float]:
        """How this request's drafts of ``source`` fare against the estimates, as two ratios, each
        at most 1: first tokens accepted over the sum of their estimated acceptance, and later
        tokens accepted (after an accepted one) over the sum of theirs; each from a prior of
        ``CALIBRATION_PRIOR`` at 1, the tallies decayed by ``CALIBRATION_DECAY`` per proposal
        observed (verified or scored unverified). They scale every bin's two rates of that source
        when the gate chooses (``value``, ``depth``); the estimates themselves learn as before.

        Why: the estimates are learned across requests, and a prose request after lists that
        copied well inherits them. On an H100 own-explain-18 verified 168 drafts, accepted 4 and
        ran at 0.92x plain, own-advice-06 260 drafts, 6 accepted, 0.77x: their misses fall in
        several bins, each cut by a tenth per miss (``DECAY``), while pooled per request a few
        misses are enough (with it, two runs: 12 and 122 drafts, 0.97x and 1.02x; 22 and none,
        0.97x and 1.00x).

        Why decayed: summed over the whole request (stop 37), a request whose first drafts
        missed never drafted again when its text later copied (own-essay-05 0.94x against 1.53x
        without; ``docs/bench/gpu-s37``), and it cost 5-8% of the aggregate without lifting the
        floor. Decayed, on one H100 lease, our 36 prose prompts twice in each order (medians of
        3, ``docs/bench/gpu-s38``): prompts below 0.97x 4 and 3 against 4 (of 34) and 6 without
        it, the slowest 0.94x and 0.90x (a prompt that drafted nothing) against 0.77x and 0.91x,
        at 2-3% of the aggregate (per-prompt geomean 1.231 and 1.215 against 1.274 and 1.243);
        public prose 1.88 against 1.90, slowest 1.12x against 1.08x. Letting the ratios rise
        above 1 drafted more where a request's first drafts happened to be right, and in the
        replays of ``docs/bench/gpu-s36`` left more prompts below 0.97x.

        Not for a source asked before it proposes (``depth``: an MTP head, whose drafts cost
        device time): it is not scored while it is not asked, so a ratio a run of misses pulled
        down hardly recovers, and its rate over all its proposals (``source_rates``, decayed per
        proposal) already follows the request, so the ratio counted the same misses twice. Four
        misses in a row of a head right half the time turned it off. On a 2-core CPU, public
        prose, medians of 3 (``docs/bench/cpu-s39``): with it the shipped head drafted 589 tokens
        (266 accepted) and n-gram + head ran 1.13x plain against n-gram's 1.16x, slowest 0.90x;
        without it 712 (309), 1.24x against 1.21x, slowest 1.04x."""
        if source in self.unasked:
            return 1.0, 1.0
        ratios = []
        for accepted, expected in ((self.accepted, self.expected),
                                   (self.accepted_later, self.expected_later)):
            x = expected.get(source, 0.0)
            ratios.append(1.0 if not x else min(
                (accepted.get(source, 0.0) + CALIBRATION_PRIOR) / (x + CALIBRATION_PRIOR), 1.0))
        return ratios[0], ratios[1]

    def _calibrated(self, rates: Rates, source: str) -> Rates:
        first, later = self.calibration(source)
        if first == 1.0 and later == 1.0:
            return rates
        return Rates(rates.first * first, rates.later * later)

    def source_rates(self, source: str) -> Rates:
        """A source's acceptance over all its proposals (``PRIOR_ACCEPTANCE`` before any)."""
        return self.source_rate.get(source, Rates(PRIOR_ACCEPTANCE))

    def value(self, available: int, confidence: float, context: int = 0, *,
              source: str = "") -> tuple[int, float]:
        """The best number of drafts to verify out of ``available`` proposed with ``confidence`` by
        ``source`` (``context`` tokens in the cache), and its expected tokens per second; 0 drafts
        when a plain step is worth more (by ``MARGIN``)."""
        k_max = min(available, self.max_draft)
        if k_max <= 0:
            return 0, 1.0 / self._plain_s(context)
        return self._best(k_max, self._calibrated(self.acceptance(confidence, source), source),
                          context, self.host_source.get(source, self.host_s), self.per_token(source))

    def per_token(self, source: str) -> float:
        """Device seconds one drafted token of ``source`` adds to its verify pass (0 for drafts
        proposed on the host)."""
        return self.device_source.get(source, 0.0) * self.costs.scale

    def _plain_s(self, context: int) -> float:
        """A plain step as the engine runs it: pipelined, the measured step (the time outside the
        pass overlaps the pass queued ahead, and observed steps include it); synchronous, the pass
        and then the time outside it."""
        if self.pipelined:
            return self.costs.plain(context)
        return self.costs.cost(1, context) + self._outside()

    def _outside(self) -> float:
        """What a step pays on top of its pass for the time outside it: nothing where the pass is
        queued before the consumer's work, which it overlaps."""
        return 0.0 if self.overlapped else self.outside_s

    def _best(self, k_max: int, a: Rates, context: int, host: float,
              per_token: float = 0.0) -> tuple[int, float]:
        """The best number of drafts out of ``k_max`` at acceptance ``a``, and its tokens per
        second (a plain step's when none beats it by ``MARGIN``).

        Where the pass is queued on a token not read yet (``guessing``: plain steps run ahead and
        one is in flight), the first draft guesses that token, and the pass runs on the real
        token and the other drafts: k drafts cost a pass of k positions, not 1 + k, and the
        guess gains nothing by itself -- the token comes from the pass in flight whatever was
        guessed; it only lets the later drafts count. Such a pass is worth ``expected(k) - first``
        tokens against the plain pass it replaces. Priced as an ordinary pass instead (k drafts
        ``expected(k)`` tokens), a proposal was credited its first draft's acceptance for
        nothing: traced on own-list-13 on this CPU with BLIS, where plain steps run ahead, drafting
        steps the gate priced at 89-106 ms took 94-180 ms, and n-gram ran 0.95x plain."""
        plain = 1.0 / self._plain_s(context)
        best_k, best = 0, plain * MARGIN
        expected, term, later = 1.0, a.first, a.later
        shift = 0
        if self.guessing:  # the guess's own acceptance yields no token, and it takes no position
            expected, shift = 1.0 - a.first, 1
        outside = self._outside()
        costs = self.costs.costs(1 + k_max, context)
        for k in range(1, k_max + 1):
            expected += term  # a.expected(k), built up
            term *= later
            v = expected / (costs[1 + k - shift] + host + outside + k * per_token)
            if v > best:
                best_k, best = k, v
        return best_k, best if best_k else plain

    def depth(self, source: str, k_max: int, context: int = 0) -> int:
        """How many tokens to ask ``source`` for before it has proposed (0: don't ask), from its
        acceptance over all its proposals, its own measured proposing time and the device time
        its drafts add to the pass (``per_token``). For a drafter whose
        proposals cost a pass of their own per token (an MTP head: a decoder layer and an output
        projection per depth), not asking is what saves the time: on an H200 asking the head every
        step, with 64 drafts each, held prose at 0.97x plain where n-gram alone ran 1.35x. A
        source turned off is asked for one token every ``PROBE_EVERY`` steps, so that its
        estimate follows the text."""
        if k_max <= 0:
            return 0
        if not self.enabled:
            return k_max
        best_k, _ = self._best(k_max, self._calibrated(self.source_rates(source), source), context,
                               self.host_source.get(source, 0.0), self.per_token(source))
        if best_k:
            self.unasked[source] = 0
            return best_k
        self.unasked[source] = self.unasked.get(source, 0) + 1
        if self.unasked[source] >= PROBE_EVERY:
            self.unasked[source] = 0
            return 1
        return 0

    def observe_outside(self, seconds: float) -> None:
        """Fold in the time between a verify step's end and the next step's start: the consumer's
        work on what it emitted (detokenizing, streaming, stop strings) and the loop's own. A
        pipelined plain step overlaps it with the pass queued ahead and its observed cost
        includes it; a verify step is synchronous and pays it on top of the pass. Left out, on
        an H200 (the measured plain step 3.6 ms in a tight loop, 7.6 ms in the bench) a one-token
        draft looked cheaper than a plain step at any acceptance, and the gate drafted at 11%
        acceptance: prose ran at 0.86x plain. Where plain steps are synchronous too (a CPU) both
        pay it, and it favours neither."""
        if not self.timed:
            return
        self.outside_s = seconds if self.outside_s == 0.0 else 0.9 * self.outside_s + 0.1 * seconds

    def observe_source(self, source: str, seconds: float) -> None:
        """Fold in the host time one proposal of ``source`` took."""
        if not self.timed:
            return
        old = self.host_source.get(source)
        self.host_source[source] = seconds if old is None else 0.9 * old + 0.1 * seconds

    def choose(self, available: int, confidence: float, context: int = 0, *, source: str = "") -> int:
        """Drafts to verify out of ``available`` proposed with ``confidence`` by ``source``, with
        ``context`` tokens in the cache."""
        k_max = min(available, self.max_draft)
        if k_max <= 0 or not self.enabled:
            return max(k_max, 0)
        best_k, _ = self.value(available, confidence, context, source=source)
        if best_k == 0:
            b = self.bin(confidence, source)
            self.refusals[b] = self.refusals.get(b, 0) + 1
            if self.refusals[b] >= PROBE_EVERY:  # keep the estimate alive where it is gated off
                self.refusals[b] = 0
                return 1
        return best_k

    def observe(self, confidence: float, drafted: int, accepted: int, *, source: str = "") -> None:
        """Update the bin's and the source's rates: ``accepted`` of ``drafted`` drafts accepted
        (a prefix, then one rejection if short of all)."""
        if drafted <= 0:
            return
        b = self.bin(confidence, source)
        rates = self.acceptance(confidence, source)
        if source not in self.unasked:  # the request's calibration (``calibration``)
            self._tally(source, rates, drafted, accepted)
        self.rate[b] = rates.update(drafted, accepted)
        self.source_rate[source] = self.source_rates(source).update(drafted, accepted)

    def _tally(self, source: str, rates: Rates, drafted: int, accepted: int) -> None:
        for tally in (self.expected, self.accepted, self.expected_later, self.accepted_later):
            if source in tally:
                tally[source] *= CALIBRATION_DECAY
        self.expected[source] = self.expected.get(source, 0.0) + rates.first
        self.accepted[source] = self.accepted.get(source, 0.0) + (accepted > 0)
        later = min(accepted + 1, drafted) - 1  # later tokens judged (as ``Rates.update``)
        if later > 0:
            self.expected_later[source] = self.expected_later.get(source, 0.0) + later * rates.later
            self.accepted_later[source] = self.accepted_later.get(source, 0.0) + accepted - 1

    def shadow(self, tokens: list[int], confidence: float, source: str) -> None:
        """Keep a greedy proposal that will not be verified (gated off, or another source's
        taken instead), to be scored against the tokens the step emits (``settle``)."""
        self._shadow = (tokens, confidence, source) if tokens else None

    def settle(self, emitted: list[int]) -> None:
        """Score the shadowed proposal against what the step emitted, as a verify pass would
        have: its agreeing prefix accepted, then one rejection where it differs.

        Why: a bin's estimate learned only from verified drafts goes stale where it is not
        verified, and decides that it stays unverified. With an MTP head beside n-gram lookup,
        the head's proposals won the steps where n-gram's short matches were estimated low,
        those estimates never saw the loop the answer fell into, and a list prompt that loops
        (own-list-14) ran 47 passes with the head against 40 with n-gram alone, the head
        drafting nothing. Scoring costs a comparison of a few tokens; the probe it replaces
        (``PROBE_EVERY``) cost a verify pass. Greedy only: under sampling an agreeing token is
        not what rejection sampling accepts."""
        if self._shadow is None:
            return
        tokens, confidence, source = self._shadow
        self._shadow = None
        n = min(len(tokens), len(emitted))
        agree = next((i for i in range(n) if tokens[i] != emitted[i]), n)
        self.observe(confidence, agree + (agree < n), agree, source=source)
        self.refusals[self.bin(confidence, source)] = 0  # the estimate is alive: no probe needed

    # -- host time -------------------------------------------------------------------------------

    def should_propose(self) -> bool:
        """False on steps that pass without proposing (see ``observe_host`` and ``Ledger``)."""
        if self.ledger.hold():
            return False
        if self.skip > 0:
            self.skip -= 1
            self.skipped += 1
            return False
        return True

    def observe_host(self, seconds: float, *, drafting: bool, context: int = 0) -> None:
        """Fold in the host time of one proposal; after one that came to nothing, pause proposing
        for as many steps as keep its cost under ``HOST_SHARE`` of a plain step (at most
        ``MAX_SKIP``); the request's ledger is charged its time."""
        if not self.timed:
            return
        self.host_s = seconds if self.host_s == 0.0 else 0.9 * self.host_s + 0.1 * seconds
        self.step_host_s += seconds
        if not drafting and self.enabled:
            self.ledger.charge(seconds)
            self.skip = min(int(self.host_s / (HOST_SHARE * self.costs.plain(context))), MAX_SKIP)

    def observe_step(self, tokens: int, seconds: float, *, drafting: bool, context: int = 0) -> None:
        """Book one step in the request's ``Ledger``: ``tokens`` emitted in ``seconds``,
        read-back to read-back, by a drafting step or a plain one."""
        proposing, self.step_host_s = self.step_host_s, 0.0
        if not (self.timed and self.enabled):
            return
        if self.ledger.book(tokens, seconds, self._plain_s(context), drafting, proposing):
            log.info("drafting paused for %d steps: it has cost %.1f ms over %.1f ms of decoding",
                     self.ledger.left, -1e3 * self.ledger.balance, 1e3 * self.ledger.elapsed)
