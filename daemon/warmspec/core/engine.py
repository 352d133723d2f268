"""The decode loop: prefill, then one verify loop for plain and speculative decoding alike.

Each step feeds the last emitted token plus k drafted tokens (k = 0 is a plain step) through the
model in one pass, keeps the longest prefix of drafts the model agrees with plus the model's own
next token, and rolls every cache back past the rejected positions. Greedy agreement is
``draft == argmax``; at temperature it is exact speculative sampling against the same processed
distribution plain sampling uses (``sampling.verify_sampled``). So the output is the model's own:
token-identical to plain greedy decoding in float32, and distributed as plain sampling otherwise.

The engine owns its state explicitly: the live cache and the tokens it holds, the cost table and
acceptance estimates of the gate, and cumulative statistics.
"""

from __future__ import annotations

import hashlib
import logging
import platform
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator, NamedTuple, Sequence

import mlx.core as mx
import msgspec
import numpy as np
from mlx_lm.generate import generation_stream, wired_limit
from mlx_lm.models.cache import make_prompt_cache

from .types import FinishReason, GenerationStats, PrefixCacheStats, SamplingParams

from . import hybrid
from .cache import CacheState, Checkpoint, PrefixStore, has_recurrent, layers
from .target import Pass, Target
from .drafters import CombinedDrafter, DraftModelDrafter, MtpDrafter

if TYPE_CHECKING:
    from .draft_model import DraftModel
    from .mtp import MTPHead
from .drafter import Drafter
from .ngram import DEFAULT_MIN_N, NgramDrafter, RecentAnswers, Source
from .gate import CostTable, Gate, PlainSteps
from ..model import LoadedModel
from .sampling import make_rng, probabilities, verify_sampled
from ..tokenizer import TextStream

log = logging.getLogger("warmspec.engine")

PREFILL_CHUNK = 512
# The small model's long answers are mostly loops and copies, drafted right nearly always: with a
# ceiling of 32, 41% of the passes on the public edits were full (replayed: 14.8 tokens a pass);
# 64 lets those passes carry twice as much (18.6). The gate still picks each pass's width by its
# measured cost, so where a wide pass is dear it stays narrow.
MAX_DRAFT = 64
# Recurrent / wrapped sliding-window layers can resume a prefix only from a checkpoint; one every
# 2048 prompt tokens bounds the re-prefill after a mid-prompt divergence (~2-4 s on this CPU)
# while a checkpoint of a Qwen3.5-9B-sized hybrid costs ~50 MB.
CHECKPOINT_EVERY = 2048
# A discarded tail at least this long is parked in the prefix store instead of dropped.
KEEP_TAIL = 32
# Speculative decoding runs plain steps ahead (pipelined) where that makes them at least this much
# cheaper than a synchronous pass.
PIPELINE_GAIN = 0.95
DRAFTING = ("ngram", "mtp", "ngram+mtp", "draft")
CLEAR_EVERY = 256  # tokens between clears of MLX's buffer cache, as mlx-lm's generate_step


def default_cost_cache(lm: LoadedModel, max_draft: int = MAX_DRAFT) -> Path:
    """Where this machine's verify costs for ``lm`` are kept: keyed by everything that changes
    them (model file, device, BLAS, MLX version, the kernels put in MLX's place, draft width,
    host)."""
    from .. import blas, fetch

    src = Path(lm.source)
    stamp = src.stat().st_mtime_ns if src.exists() else 0
    key = "|".join(map(str, (src.resolve() if src.exists() else lm.source, stamp, lm.device,
                             lm.quantized, blas.describe(), mx.__version__, "+".join(lm.kernels), max_draft,
                             platform.node(), platform.machine())))
    return fetch.cache_dir() / "costs" / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.json"


class EngineError(ValueError):
    """A request the engine cannot serve (e.g. longer than the context); a client error."""


class Delta(msgspec.Struct):
    """Text that became final in one step, and the token ids behind it."""

    text: str
    tokens: list[int]


class Finished(msgspec.Struct):
    finish_reason: FinishReason
    text: str
    tokens: list[int]
    stats: GenerationStats
    stop: str | None = None  # the stop string that ended the text, if one did


class Run:
    """One request's decoding state, alive for the duration of ``Engine.generate_tokens``."""

    def __init__(self, params: SamplingParams, max_tokens: int, stats: GenerationStats):
        self.params = params
        self.budget = max_tokens
        self.stats = stats
        self.rng = make_rng(params)
        self.finish_reason: FinishReason = "length"


class Draft(NamedTuple):
    """Tokens to verify in the next pass, the drafter's confidence, their source and, when they
    were sampled, their distributions; or the tokens still on the device (``device``: the verify
    pass is queued on them, and ``tokens`` stays empty until it is read back)."""

    tokens: list[int]
    confidence: float = 0.0
    source: str = ""
    q: list | None = None
    device: mx.array | None = None

    @property
    def width(self) -> int:
        return len(self.tokens) if self.device is None else int(self.device.shape[0])


NO_DRAFT = Draft([])


class _Ahead:
    """A one-position pass queued on the device: its input (known once read), its lazy argmax and
    the pass itself (to undo it, and its hidden state)."""

    __slots__ = ("fed", "y", "pass_")

    def __init__(self, fed: int | None, y: mx.array, pass_: Pass):
        self.fed = fed
        self.y = y
        self.pass_ = pass_


class _Job:
    """A verify pass queued on the device and not read back yet: what it was fed (``head``: the
    last emitted token, or a plain pass queued ahead whose token is guessed by the draft's first),
    the drafts after it, and its lazy result (greedy: the argmax of every position; sampled: the
    processed distributions)."""

    __slots__ = ("head", "pass_", "draft", "drafts", "guess", "q", "out", "queued", "overlapped")

    def __init__(self, head: "int | _Ahead", pass_: Pass, draft: "Draft", drafts: list[int],
                 guess: int | None, q: list | None, out: mx.array, queued: float, overlapped: bool):
        self.head = head
        self.pass_ = pass_
        self.draft = draft
        self.drafts = drafts
        self.guess = guess
        self.q = q
        self.out = out
        self.queued = queued  # when the pass was handed to the device
        self.overlapped = overlapped  # queued before the consumer saw the previous step


class Step(NamedTuple):
    """What one step emitted, and the target's hidden states at the positions that produced it
    (row i produced token i; None unless a drafter conditions on them)."""

    tokens: list[int]
    hidden: mx.array | None = None


class Engine:
    def __init__(
        self,
        lm: LoadedModel,
        *,
        speculate: bool = True,
        max_draft: int = MAX_DRAFT,
        min_n: int = DEFAULT_MIN_N,
        prefill_chunk: int = PREFILL_CHUNK,
        costs: CostTable | None = None,
        gated: bool = True,
        observe_costs: bool = True,
        observe_host: bool = True,
        recurrent_rollback: str = "capture",
        prefix_budget_bytes: int | None = None,
        checkpoint_every: int = CHECKPOINT_EVERY,
        cost_cache: Path | None = None,
        mtp: "MTPHead | None" = None,
        draft_model: "DraftModel | None" = None,
        drafting: str | None = None,
    ):
        self.lm = lm
        self._model = lm.model
        self.tokenizer = lm.tokenizer
        self.speculate = speculate
        self.max_draft = max_draft
        self.min_n = min_n
        self.prefill_chunk = prefill_chunk
        self.live = CacheState(make_prompt_cache(self.model))
        self.store = PrefixStore(prefix_budget_bytes)
        self.disk = None  # prefix_disk.DiskTier, attached by the daemon: states that outlive it
        self.current: GenerationStats | None = None  # the running request's, for the status page
        self.checkpoint_every = checkpoint_every
        if recurrent_rollback not in ("capture", "replay"):
            raise ValueError("recurrent_rollback must be 'capture' or 'replay'")
        # Hybrids: capture per-position recurrent states in the verify pass where the model's
        # structure is known and the capture is exact on this device (not where mlx-lm uses its
        # fused Metal kernel), else restore and replay the accepted tokens.
        self.capture = (recurrent_rollback == "capture" and has_recurrent(self.live.cache)
                        and hybrid.supports(self.model) and hybrid.capture_exact(self.model))
        self.target = Target(self._model, capture=self.capture)
        self.input_rows = self.target.vocab_size  # ids a pass may be fed (None: not checked)
        # Which guess source drafts: "ngram" (the conversation, files read, recent answers),
        # "mtp" (the model's MTP head) or "draft" (a draft model); by default the model drafter
        # when one is loaded.
        self.mtp = mtp
        self.draft_model = draft_model
        self.drafting = drafting or ("ngram+mtp" if mtp else "draft" if draft_model else "ngram")
        if self.drafting not in DRAFTING or ("mtp" in self.drafting and mtp is None) or \
                (self.drafting == "draft" and draft_model is None):
            raise ValueError(f"drafting {self.drafting!r} needs its model: one of {DRAFTING}")
        self.gated = gated
        self.cost_cache = cost_cache
        self.observe_costs = observe_costs  # False for replays, whose passes are priced, not timed
        # False: the gate leaves this host's own time out (proposing, the time outside the pass),
        # so that its decisions depend on the cost table alone: replays, and a run compared with one
        self.observe_host = observe_host
        self._costs = costs
        self._gate: Gate | None = None
        self._plain_steps: PlainSteps | None = None
        self.totals = GenerationStats()
        self.resets = 0  # live caches dropped after a failure: a healthy daemon keeps this at 0
        self._last_read: float | None = None  # when the last pipelined token was read
        self._proposing_s = 0.0  # host time spent proposing since then
        self.recent = RecentAnswers(min_n=min_n)  # earlier answers, drafted from

    @property
    def costs(self) -> CostTable:
        """Verify-pass costs, measured on first use unless given or saved by an earlier run on
        this machine (``cost_cache``): the measurement takes 5-15 s on a 2-core CPU, which an
        editor would otherwise wait through at every start."""
        if self._costs is None and self.cost_cache is not None:
            self._costs = CostTable.load(self.cost_cache)
            if self._costs is not None:
                log.info("verify costs from %s", self.cost_cache)
        if self._costs is None:
            self._costs = self.measure_costs()
            if self.cost_cache is not None:
                self._costs.save(self.cost_cache)
        return self._costs

    @property
    def gate(self) -> Gate:
        if self._gate is None:
            self._gate = Gate(self.costs, max_draft=self.max_draft, enabled=self.gated, timed=self.observe_host)
            if self.mtp is not None and "mtp" in self.drafting:
                self._gate.device_source[MtpDrafter.source] = self.measure_head()
        return self._gate

    @property
    def cache(self) -> list:
        return self.live.cache

    @property
    def cache_tokens(self) -> list[int]:
        return self.live.tokens

    def prefix_stats(self) -> PrefixCacheStats:
        st = self.store
        return PrefixCacheStats(hits=st.hits, misses=st.misses, tokens_reused=st.tokens_reused,
                                entries=len(st.entries), bytes=st.nbytes, budget_bytes=st.budget_bytes,
                                evictions=st.evictions)

    def reset(self) -> None:
        """Drop the live cache (after a failure left it in an unknown state)."""
        self.live = CacheState(make_prompt_cache(self.model))
        self.resets += 1

    # -- measurement ----------------------------------------------------------------------------

    def measure_costs(self, contexts: Sequence[int] = (64, 1024), repeats: int = 2) -> CostTable:
        """Time verify passes of the widths the gate may pick, on a scratch cache, at a short
        and a long context (a few seconds on a CPU)."""
        vocab = self.target.vocab_size or 1000  # not ``args.vocab_size``: hybrids and llama4 nest it
        rng = np.random.default_rng(0)
        ids = lambda n: rng.integers(0, min(vocab, 30000), size=n).tolist()  # noqa: E731
        state = {"context": -1, "cache": None}

        def forward(p: int, context: int) -> None:
            if state["context"] != context:
                state["cache"] = make_prompt_cache(self.model)
                self.model(mx.array([ids(context)]), cache=state["cache"])
                mx.eval([c.state for c in state["cache"]])
                state["context"] = context
            cache = state["cache"]
            ckpt = Checkpoint(cache, p)
            mx.eval(mx.argmax(self.model(mx.array([ids(p)]), cache=cache)[0], axis=-1))
            ckpt.rollback(0)

        def plain(context: int, steps: int = 12) -> float:
            """Seconds per token of pipelined greedy steps (as ``_decode`` runs them)."""
            forward(1, context)  # the scratch cache at ``context``
            cache = state["cache"]
            ckpt = Checkpoint(cache, steps + 1)
            step = lambda y: mx.argmax(self.model(y.reshape(1, 1), cache=cache)[0, -1])  # noqa: E731
            y = step(mx.array(ids(1)[0]))
            mx.async_eval(y)
            reads = []
            for _ in range(steps):
                nxt = step(y)
                mx.async_eval(nxt)
                y.item()
                reads.append(time.perf_counter())
                y = nxt
            y.item()
            ckpt.rollback(0)
            return (reads[-1] - reads[0]) / (len(reads) - 1)

        top = self.max_draft + 1
        widths = sorted({w for w in (1, 2, 4, 8, 12, 16, 24, 32, 48) if w < top} | {top})
        limit = self.lm.context_length or 1 << 30
        table = CostTable.measure(forward, widths, [c for c in contexts if c + top < limit], repeats,
                                  plain=plain)
        for c in table.points:
            log.info("verify cost at context %d (x one position): %s; pipelined plain step %.2f", c,
                     ", ".join(f"{p}:{table.relative(p, c):.2f}" for p in table.widths),
                     table.plain(c) / table.cost(1, c))
        return table

    def measure_head(self, context: int = 64, depth: int = 4, repeats: int = 3) -> float:
        """Seconds per drafted token of the MTP head's greedy drafts on the device (median of
        ``repeats`` drafts ``depth`` deep, over a head cache of ``context`` committed positions).

        Its drafts are computed in the verify pass's graph, so the pass pays for them: each depth
        is a decoder layer and the output projection over the draft vocabulary. On this 2-core
        CPU a depth costs 2.2-2.7 ms against 47 ms for a plain step (5-6%), and four depths a
        fifth of a step. Unpriced, the gate took the head's passes for as cheap as the n-gram
        drafter's and the timed passes charged the head's time to their width: a list prompt
        that loops (own-list-14) ran 36.4 tok/s with the head against 47.0 with n-gram alone."""
        head = self.mtp
        rng = np.random.default_rng(0)
        # ids the embedding has rows for, as ``measure_costs`` (ids up to 1000 on a 256-token test
        # model read outside the table and crashed a test run in seven)
        tokens = mx.array(rng.integers(0, min(self.target.vocab_size or 1000, 1000), size=(1, context)))
        hidden = mx.array(rng.standard_normal((1, context, head.parts.hidden_size)).astype(np.float32))
        hidden = hidden.astype(head.parts.embed(tokens[:, :1]).dtype)  # as the target's states
        cache = head.make_cache()
        mx.eval(head.draft_lazy(hidden, tokens, cache, 1))  # the committed positions
        times = []
        for i in range(repeats + 1):  # the first is a warm-up (kernels compiled per shape)
            t = time.perf_counter()
            mx.eval(head.draft_lazy(hidden[:, -1:], tokens[:, -1:], cache, depth))
            if i:
                times.append(time.perf_counter() - t)
            head.rewind(cache, context)
        per_token = statistics.median(times) / depth
        log.info("MTP head: %.2f ms a drafted token (%.0f%% of a one-position pass)", per_token * 1e3,
                 100 * per_token / self.costs.cost(1, context))
        return per_token

    # -- text level -----------------------------------------------------------------------------

    def generate(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        *,
        max_tokens: int,
        stop: Sequence[str] = (),
        speculate: bool | None = None,
        sources: Sequence[Source] = (),
        prediction: Sequence[int] = (),
        drafter: Drafter | None = None,
        cancelled: Callable[[], bool] | None = None,
    ) -> Iterator[Delta | Finished]:
        """Stream text deltas, then one ``Finished`` with the whole text and statistics.

        Together the deltas carry every token of ``Finished.tokens``, in order: a token whose
        text is held back (part of a UTF-8 character, or what may become a stop string) travels
        with the next delta that has text."""
        stats = GenerationStats(prompt_tokens=len(prompt))
        text = TextStream(self.tokenizer, stop)
        out: list[int] = []
        held: list[int] = []  # tokens not yet sent in a delta
        run = Run(params, max_tokens, stats)
        self.current = stats
        steps = self.generate_tokens(prompt, run, speculate=speculate, sources=sources,
                                     prediction=prediction, drafter=drafter, cancelled=cancelled)
        try:
            for new in steps:
                delta = ""
                for i, t in enumerate(new):
                    delta += text.push(t)
                    if text.stopped:
                        # a pass may accept drafts past the stop string: count only the tokens
                        # plain decoding would have emitted, up to the one that completed it
                        stats.completion_tokens -= len(new) - (i + 1)
                        new = new[: i + 1]
                        run.finish_reason = "stop"
                        break
                out.extend(new)
                held.extend(new)
                if delta or text.stopped:
                    yield Delta(delta, held)
                    held = []
                if text.stopped:
                    break
        finally:
            steps.close()
            self.current = None
        tail = text.finish()
        if tail or held:
            yield Delta(tail, held)
        self.totals.add(stats)
        log.info("request: %s, finish %s", stats.summary(), run.finish_reason)
        yield Finished(run.finish_reason, text.text, out, stats, text.matched)


    # -- token level ----------------------------------------------------------------------------

    def generate_tokens(self, prompt: Sequence[int], run: Run, **kw) -> Iterator[list[int]]:
        """Yield the tokens accepted by each pass (cut at end-of-sequence and the budget); see
        ``_generate_tokens``. Runs as mlx-lm's generation does, for device memory on Apple GPUs: on
        its generation stream, under the recommended wired limit, with MLX's buffer cache cleared
        every ``CLEAR_EVERY`` tokens and at the end.

        It ends with nothing in flight on the stream: a consumer that stops early (ghost text at
        the end of a line, a stop string, a cancel) leaves the pass queued ahead running, and a
        process that exits while MLX's stream thread is inside OpenBLAS hangs in OpenBLAS's
        shutdown (a matmul left by ``async_eval``: 3 exits of 3 hung; synchronized, none). mlx-lm
        synchronizes there only under a wired limit (Metal). The wait is at most that one pass,
        which the next request's passes would queue behind anyway."""
        with mx.stream(generation_stream), wired_limit(self.model, [generation_stream]):
            produced = 0
            steps = self._generate_tokens(prompt, run, **kw)
            try:
                for new in steps:
                    produced += len(new)
                    if produced >= CLEAR_EVERY:
                        produced = 0
                        mx.clear_cache()
                    yield new
            finally:
                steps.close()  # its own cleanup (the pass run ahead, checkpoints) now, not at GC
                mx.synchronize(generation_stream)
                mx.clear_cache()

    def _generate_tokens(
        self,
        prompt: Sequence[int],
        run: Run,
        *,
        speculate: bool | None = None,
        sources: Sequence[Source] = (),
        prediction: Sequence[int] = (),
        drafter: Drafter | None = None,
        cancelled: Callable[[], bool] | None = None,
    ) -> Iterator[list[int]]:
        """Yield the tokens accepted by each pass (cut at end-of-sequence and the budget).

        ``drafter`` replaces the default n-gram drafter over the prompt and ``sources``;
        ``prediction`` is the client's guess of the answer (OpenAI's predicted outputs), drafted
        first: from the answer's first token, and ranked above every other source.
        """
        prompt = list(prompt)
        if not prompt:
            raise EngineError("empty prompt")
        rows = self.input_rows
        if rows is not None and not 0 <= min(prompt) <= max(prompt) < rows:
            bad = next(t for t in prompt if not 0 <= t < rows)
            raise EngineError(f"token id {bad} has no row in the model's embedding ({rows} rows): "
                              "the tokenizer does not match the weights")
        limit = self.lm.context_length
        if limit and len(prompt) >= limit:
            raise EngineError(f"prompt of {len(prompt)} tokens does not fit the context of {limit}")
        if limit:
            run.budget = min(run.budget, limit - len(prompt))
        speculate = self.speculate if speculate is None else speculate
        run.stats.prompt_tokens = len(prompt)
        t0 = time.perf_counter()
        whole = self._prefill(prompt, run.stats, cancelled)
        run.stats.prefill_s = time.perf_counter() - t0
        if not whole:
            run.finish_reason = "cancelled"
            return
        if drafter is None and speculate:
            drafter = self._drafter(prompt, sources, prediction, run.params)
        if drafter is not None:
            self.gate  # measure verify costs now (once), not inside the timed decode
            if drafter.wants_hidden:
                self.target.tap_hidden()
        t0 = time.perf_counter()
        self._last_read = None
        answer: list[int] = []
        passes = self._decode(prompt[-1], run, drafter)
        try:
            if cancelled is not None and cancelled():
                run.finish_reason = "cancelled"
                return
            for new in passes:
                run.stats.decode_s = time.perf_counter() - t0
                if new:
                    answer.extend(new)
                    yield new
                if run.budget <= 0:
                    break
                if cancelled is not None and cancelled():
                    run.finish_reason = "cancelled"
                    break
        finally:
            passes.close()
            run.stats.decode_s = time.perf_counter() - t0
            self.live.checkpoint()  # the end of the answer: the next turn resends it
            self.recent.add(answer)

    def _emit(self, step: Step, run: Run, drafter: Drafter | None) -> list[int]:
        """What a step emits: its tokens cut at end-of-sequence and at the budget (which reaches
        0 when the answer ends), told to the drafter with their hidden states."""
        new = step.tokens
        end = next((i for i, t in enumerate(new) if t in self.tokenizer.eos_ids), None)
        new = new[: run.budget if end is None else min(end, run.budget)]
        if end is not None and end <= run.budget:
            run.finish_reason = "stop"
            run.budget = 0
        else:
            run.budget -= len(new)
        run.stats.completion_tokens += len(new)
        if new and drafter is not None:
            self.gate.settle(new)  # a proposal left unverified, scored against what came
            drafter.commit(new, None if step.hidden is None else step.hidden[: len(new)])
        return new

    def _decode(self, pending: int, run: Run, drafter: Drafter | None) -> Iterator[list[int]]:
        """The decode loop: yield what each step emits (``_emit``), for plain and speculative
        decoding.

        While the drafter has nothing the gate will verify, greedy decoding is pipelined as
        mlx-lm's ``generate_step`` is: the next one-position pass is queued on the device before
        the current token is read back, so the device never idles while Python handles a token
        and proposes. On an H200 a step of the default model is a few milliseconds, most of it
        launch and host work: run synchronously, the gated-off steps made prose up to 26% slower
        than plain decoding there. A proposal is verified in a pass queued on the still-unread
        token (its first draft guesses that token; the gate prices such a pass without the guess,
        ``Gate._best``).

        Verify passes are pipelined too, where plain steps are: once a pass is read back, its
        tokens are told to the drafter, the next step is proposed and its pass queued, and only
        then does the consumer get the tokens (detokenizing, streaming, stop strings), so the
        device computes while the host handles them. Read back synchronously, a verify step
        paid that host time on top of its pass while a pipelined plain step hid it: on an H200
        public prose drafted 1.54 tokens a pass and ran 1.02x plain (prose-05, h200-s23).

        On a CPU, whose cores run both the pass queued ahead and the host, whether running ahead
        pays is measured in this loop (``PlainSteps``), and verify passes are queued early only
        where plain steps run ahead. A pass in flight when the choice turns is read without
        queuing another behind it. Sampled plain steps are verify passes without drafts (the
        sampler runs on the host), pipelined on a GPU.

        The answer's first token comes from a synchronous pass and reaches the consumer before a
        pass is queued behind it: with the second pass queued behind it, reading it back waited
        for both on a CPU, whose cores run the two (the first token of a ghost-text request took
        a median of 258 ms on this 2-core VM, one pass 141 ms; now 147 ms).
        """
        greedy = run.params.greedy
        steps = self.plain_steps if drafter is not None and greedy else None
        if drafter is not None:
            self.gate.begin()
        # steps are booked in the gate's ledger (what drafting saved, by the clock)
        booked = drafter is not None and self.observe_costs
        emitted: float | None = None  # when the last step's tokens were read back
        queued: _Ahead | _Job | None = None  # a pass in flight, not read back yet
        sync_plain = False  # the next step was decided: a synchronous plain step
        first = True
        synced: float | None = None  # when the last synchronous plain step's token was read
        try:
            while True:
                # 1. this step's tokens: read the pass in flight, else run one now
                verified = False  # a pass read synchronously: it pays the time outside it
                drafting = False  # the step verified drafts
                if isinstance(queued, _Job):
                    job, queued = queued, None
                    step = self._finish(job, run)
                    synced = None
                    verified = not job.overlapped
                    drafting = job.draft.width > 0
                elif isinstance(queued, _Ahead):
                    if steps is not None and not steps.ahead():
                        # back to synchronous steps: read the pass in flight, queue none behind it
                        token = self._commit(queued, run)
                        synced = time.perf_counter()
                        done, queued = queued, None
                    else:
                        nxt = self._queue(queued.y, None)  # on the device before queued's token is read
                        last = self._last_read
                        token = self._commit(queued, run)
                        if steps is not None and last is not None:
                            steps.observe(True, self._last_read - last, len(self.cache_tokens))
                        nxt.fed = token
                        done, queued = queued, nxt  # before the yield: the consumer may stop there
                    step = Step([token], self._hidden(done.pass_, 1))
                else:
                    draft = NO_DRAFT if sync_plain else self._drafts(drafter, run, False)
                    if not (sync_plain or draft.width or not greedy or first or
                            (steps is not None and not steps.ahead())):
                        queued = self._queue(mx.array([pending]), pending)
                        continue
                    sync_plain = False
                    step = self._finish(self._start(pending, draft, run, False), run)
                    verified = True
                    drafting = draft.width > 0
                    out = time.perf_counter()
                    if steps is not None:
                        if synced is not None and not draft.width:
                            steps.observe(False, out - synced, len(self.cache_tokens))
                        synced = None if draft.width else out
                # 2. what it emits, told to the drafter
                new = self._emit(step, run, drafter)
                if booked:
                    now = time.perf_counter()
                    if emitted is not None:
                        self.gate.observe_step(len(new), now - emitted, drafting=drafting,
                                               context=len(self.cache_tokens))
                    emitted = now
                if run.budget <= 0:
                    yield new
                    return
                pending = step.tokens[-1]
                # 3. the next pass, queued before the consumer gets these tokens where that pays
                early = not first and self._overlap(steps)
                first = False
                if early:
                    queued, sync_plain = self._next(queued, pending, run, drafter, steps)
                t = time.perf_counter()
                yield new
                if verified and drafter is not None:
                    self.gate.observe_outside(time.perf_counter() - t)
                if not early and isinstance(queued, _Ahead):
                    queued, sync_plain = self._next(queued, pending, run, drafter, steps)
        finally:
            if drafter is not None:
                run.stats.paused_steps = self.gate.ledger.paused
            if isinstance(queued, _Job):  # a pass queued past the answer's end: undo it
                self.target.keep(queued.pass_, 0, self.cache)
                queued = queued.head
            if isinstance(queued, _Ahead):
                self.target.keep(queued.pass_, 0, self.cache)

    def _overlap(self, steps: PlainSteps | None) -> bool:
        """Whether the next pass is queued before the consumer gets a step's tokens: where plain
        steps run ahead (``PlainSteps``), and always on a GPU."""
        if steps is not None:
            return steps.best
        return mx.default_device().type != mx.DeviceType.cpu

    def _next(self, queued: "_Ahead | None", pending: int, run: Run, drafter: Drafter | None,
              steps: PlainSteps | None) -> "tuple[_Ahead | _Job | None, bool]":
        """Propose after ``pending`` and queue the pass that verifies it: on a plain pass in flight
        (``queued``, whose token the draft's first guesses), else on ``pending``; with nothing to
        verify, a plain pass ahead (or, where plain steps run synchronously now, nothing queued
        and True: the next step is a synchronous plain one, already decided)."""
        overlapped = self._overlap(steps)
        draft = self._drafts(drafter, run, overlapped, guessing=isinstance(queued, _Ahead))
        if isinstance(queued, _Ahead):
            return (self._start(queued, draft, run, overlapped) if draft.width else queued), False
        if draft.width or not run.params.greedy:
            return self._start(pending, draft, run, True), False
        if steps is None or steps.ahead():
            return self._queue(mx.array([pending]), pending), False
        return None, True

    def _drafter(self, prompt: list[int], sources: Sequence[Source], prediction: Sequence[int],
                 params: SamplingParams) -> Drafter:
        """This request's guess source (see ``drafting``)."""
        context = lambda: len(self.cache_tokens)  # noqa: E731
        if self.drafting == "mtp":
            return MtpDrafter(self.mtp, params, self.gate, context)
        if self.drafting == "draft":
            return DraftModelDrafter(self.draft_model, prompt, params)
        ngram = NgramDrafter(prompt, [*sources, *self.recent.sources()], min_n=self.min_n,
                             prediction=prediction)
        if self.drafting == "ngram+mtp":
            return CombinedDrafter(ngram, MtpDrafter(self.mtp, params, self.gate, context), self.gate,
                                   context)
        return ngram

    @property
    def model(self):
        return self._model

    @model.setter
    def model(self, model) -> None:
        """The model the step runs (tests wrap it); the target pass follows."""
        self._model = model
        self.target = Target(model, capture=self.capture) if model is not None else None

    def set_model(self, model) -> None:
        """Swap the weights: None frees them (idle unload), then the same model loaded again. The
        target pass and an MTP head (which holds the target's embedding, norm and output head by
        reference) follow, so nothing keeps the old weights alive."""
        self.model = self.lm.model = model
        if self.mtp is not None:
            self.mtp.retarget(model)

    @property
    def replays(self) -> int:
        return self.target.replays

    @staticmethod
    def _hidden(p: Pass, n: int) -> mx.array | None:
        return None if p.hidden is None else p.hidden[:n]

    @property
    def plain_steps(self) -> PlainSteps:
        """How speculation runs its plain steps: learned online on a CPU (see ``PlainSteps``),
        from the cost table's guess at first; always pipelined on a GPU."""
        if self._plain_steps is None:
            learn = self.observe_costs and mx.default_device().type == mx.DeviceType.cpu
            self._plain_steps = PlainSteps(self.costs, self._pipelining_pays(), learn=learn)
        return self._plain_steps

    def _pipelining_pays(self) -> bool:
        """Whether plain steps should run ahead while speculating: where a pipelined step costs
        no less than a synchronous one (a CPU, whose cores run both the graph and the host), the
        pass queued ahead is wasted each time a proposal appears. On a GPU it always pays (the
        device runs the pass while the host builds the next and handles a token, as mlx-lm's
        ``generate_step`` relies on); comparing the measured costs there misjudged it: the
        observed plain step includes the consumer's time per token and the timed one-position
        pass does not, and with 4-bit weights on an H200 the check answered no from the start."""
        if mx.default_device().type != mx.DeviceType.cpu:
            return True
        costs = self.costs
        context = len(self.cache_tokens)
        return costs.plain(context) < PIPELINE_GAIN * costs.cost(1, context)

    def _queue(self, token: mx.array, fed: int | None) -> _Ahead:
        """Queue a one-position greedy pass on ``token`` (possibly not yet computed)."""
        p = self.target.verify(token.reshape(1), self.cache)
        y = mx.argmax(p.logits[-1])
        mx.async_eval(y) if p.hidden is None else mx.async_eval(y, p.hidden)
        return _Ahead(fed, y, p)

    def _commit(self, ahead: _Ahead, run: Run) -> int:
        """Read a queued pass's token: its input now belongs to the cache."""
        token = ahead.y.item()
        now = time.perf_counter()
        if self._last_read is not None and self._costs is not None and self.observe_costs:
            # a plain step as plain decoding runs it: without the time spent proposing
            self._costs.observe_plain(len(self.cache_tokens), now - self._last_read - self._proposing_s)
        self._last_read = now
        self._proposing_s = 0.0
        run.stats.passes += 1
        self.live.tokens.append(ahead.fed)
        return token

    def _drafts(self, drafter: Drafter | None, run: Run, overlapped: bool, *,
                guessing: bool = False) -> Draft:
        """What to verify after the last emitted token, by the gate (no tokens: a plain step).
        ``overlapped``: the pass will be queued before the consumer handles the last step;
        ``guessing``: on a plain pass in flight, whose token the first draft guesses. The
        drafter's and gate's host time is measured for the gate: on a device where a step takes
        milliseconds it is part of what drafting costs."""
        if drafter is None or run.budget <= 1:
            return NO_DRAFT
        gate = self.gate
        gate.pipelined = run.params.greedy and self.plain_steps.best  # priced as plain steps run
        gate.overlapped = overlapped
        gate.guessing = guessing
        if not gate.should_propose():
            return NO_DRAFT
        t = time.perf_counter()
        proposal = drafter.propose(min(self.max_draft, run.budget - 1))
        k = 0
        if proposal is not None and proposal.device is not None:
            # on the device: its depth was the gate's choice (``Gate.depth``), made before drafting
            k = proposal.width
        elif proposal is not None:
            # nothing after an end-of-sequence token can be emitted: don't verify it
            # nor an id the embedding has no row for (a tokenizer that does not match the
            # weights; a lookup past the table reads outside it, unchecked on the CPU)
            eos, rows = self.tokenizer.eos_ids, self.input_rows or 1 << 62
            available = next((i + (tok in eos) for i, tok in enumerate(proposal.tokens)
                              if tok in eos or not 0 <= tok < rows), len(proposal.tokens))
            k = gate.choose(available, proposal.confidence, len(self.cache_tokens),
                            source=proposal.source)
            if k == 0:
                run.stats.gated_steps += 1
                if run.params.greedy:
                    gate.shadow(proposal.tokens, proposal.confidence, proposal.source)
        spent = time.perf_counter() - t
        self._proposing_s += spent
        run.stats.draft_s += spent
        gate.observe_host(spent, drafting=k > 0, context=len(self.cache_tokens))
        if not k:
            return NO_DRAFT
        if proposal.device is not None:
            return Draft([], proposal.confidence, proposal.source, None, proposal.device)
        q = proposal.q[:k] if proposal.q is not None else None
        return Draft(proposal.tokens[:k], proposal.confidence, proposal.source, q)

    def _prefill(self, prompt: list[int], stats: GenerationStats,
                 cancelled: Callable[[], bool] | None = None) -> bool:
        """Bring the live cache to hold ``prompt[:-1]``, starting from the state (live or stored)
        that serves the longest prefix of it. False if ``cancelled`` cut it between chunks.

        A cut prefill keeps what it computed: the live state then holds the chunks done so far
        (with a checkpoint at the cut for the layers that cannot be trimmed), so a retry of the
        same prompt, or a longer one, continues from there. A prompt of thousands of tokens is
        seconds of prefill on a CPU; an editor that supersedes its ghost text or an agent that
        hangs up must not hold the worker for them."""
        target = prompt[:-1]
        fresh = lambda: make_prompt_cache(self.model)  # noqa: E731
        live_use = self.live.usable(target)
        entry, entry_use = self.store.best(target)
        loaded = self.disk.load(target, max(live_use, entry_use)) if self.disk is not None else None
        if loaded is not None:  # a state from disk (e.g. before a restart) serves more
            self.store.put(self.live)
            self.live = loaded
            reused = loaded.usable(target)
        elif entry is not None and entry_use > live_use:
            parked = self.live
            self.live = self.store.take(entry)  # before parking: that may evict the entry
            self.store.put(parked)
            reused = entry_use
        else:
            if len(self.live.tokens) - live_use >= KEEP_TAIL:
                self.store.put(self.live)  # park the tail for a later request; continue on a copy
                self.live = self.live.clone()
            reused = live_use
        self.live.rewind(reused, fresh)
        store = self.store
        if reused:
            store.hits += 1
            store.tokens_reused += reused
        else:
            store.misses += 1
        stats.cached_tokens = reused
        rest = target[reused:]
        exact = bool(self.live._exact_layers())
        i = 0
        while i < len(rest):
            if cancelled is not None and cancelled():
                if exact:
                    self.live.checkpoint()
                return False
            n = min(self.prefill_chunk, len(rest) - i)
            if exact:  # end chunks on checkpoint positions
                pos = len(self.live.tokens)
                n = min(n, self.checkpoint_every - pos % self.checkpoint_every)
            chunk = rest[i : i + n]
            self.model(mx.array([chunk]), cache=self.cache)
            mx.eval([c.state for c in self.cache])
            self.live.tokens.extend(chunk)
            i += n
            if exact and len(self.live.tokens) % self.checkpoint_every == 0:
                self.live.checkpoint()
        if exact:
            self.live.checkpoint()  # the end of the prompt: where the next turn usually diverges
        return True

    def _start(self, head: int | _Ahead, draft: Draft, run: Run, overlapped: bool) -> _Job:
        """Queue one pass verifying ``head`` + drafts (no drafts: a plain step); ``_finish`` reads it.

        ``head`` is the last emitted token, or a pass queued ahead whose token is not read yet:
        then ``drafts[0]`` guesses that token and the pass is queued on it unread, so the device
        goes straight from one pass to the next; a wrong guess rejects every draft, and the
        model's token after the real one is still right.
        """
        drafts, q, device = draft.tokens, draft.q, draft.device
        guess = None
        if isinstance(head, _Ahead):
            first = head.y.reshape(1)
            if device is not None:
                x = mx.concatenate([first, device[1:].astype(first.dtype)])
            else:
                guess, drafts = drafts[0], drafts[1:]
                q = q[1:] if q is not None else None
                x = mx.concatenate([first, mx.array(drafts, dtype=first.dtype)]) if drafts else first
        else:
            self._last_read = None
            x = (mx.concatenate([mx.array([head], dtype=device.dtype), device]) if device is not None
                 else mx.array([head, *drafts]))
        t = time.perf_counter()
        p = self.target.verify(x, self.cache)
        out = mx.argmax(p.logits, axis=-1) if run.params.greedy else probabilities(p.logits, run.params)
        mx.async_eval(*(a for a in (out, p.hidden, device) if a is not None))
        return _Job(head, p, draft, drafts, guess, q, out, t, overlapped)

    def _finish(self, job: _Job, run: Run) -> Step:
        """Read a queued verify pass back: emit the accepted drafts + the next token, and roll
        every cache back past the rest."""
        head, p, drafts, guess = job.head, job.pass_, job.drafts, job.guess
        if job.draft.device is not None:  # read back with the pass
            drafts = job.draft.device.tolist()
            if isinstance(head, _Ahead):
                guess, drafts = drafts[0], drafts[1:]
        t = job.queued
        if guess is not None:
            pending = self._commit(head, run)
            # a synchronous pass queued ahead is timed from its head's read; an overlapped one is
            # not timed (both passes ran while the consumer worked: no width can be told apart)
            t = None if job.overlapped else time.perf_counter()
        else:
            pending = head
        hit = guess is None or guess == pending
        if run.params.greedy:
            targets = job.out.tolist()
            n = 0
            if hit:
                while n < len(drafts) and drafts[n] == targets[n]:
                    n += 1
            nxt = targets[n]
        else:
            n, nxt = verify_sampled(job.out, drafts, run.rng, job.q)
        self._last_read = None
        run.stats.passes += 1
        inputs = [pending, *drafts]
        run.stats.passes += self.target.keep(p, n + 1, self.cache, inputs[: n + 1])
        if drafts or guess is not None:
            draft = job.draft
            drafted = len(drafts) + (guess is not None)
            accepted = (n + (guess is not None)) if hit else 0
            self.gate.observe(draft.confidence, drafted, accepted, source=draft.source)
            run.stats.count(draft.source, drafted, accepted)
            run.stats.draft_passes += 1
            run.stats.drafted += drafted
            run.stats.accepted += accepted
        if self._costs is not None and self.observe_costs and t is not None:
            # the whole step, rollback and bookkeeping included: what drafting costs over a plain
            # step (overlapped: from the pass's queuing, with the consumer's work it overlapped);
            # less the device drafter's share, which the gate prices per drafted token
            elapsed = time.perf_counter() - t
            if job.draft.device is not None:
                elapsed -= job.draft.device.shape[0] * self.gate.per_token(job.draft.source)
            self._costs.observe(1 + len(drafts), len(self.cache_tokens), elapsed)
        self.live.tokens.extend(inputs[: n + 1])
        out = [*drafts[:n], nxt]
        hidden = self._hidden(p, n + 1)
        if guess is None:
            return Step(out, hidden)
        if hidden is not None:
            hidden = mx.concatenate([head.pass_.hidden[:1], hidden])
        return Step([pending, *out], hidden)
