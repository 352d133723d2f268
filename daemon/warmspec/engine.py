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
import time
from pathlib import Path
from typing import Callable, Iterator, Sequence

import mlx.core as mx
import msgspec
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from warmspec_protocol import FinishReason, GenerationStats, PrefixCacheStats, SamplingParams

from . import hybrid
from .cache import CacheState, Checkpoint, PrefixStore, trimmable_kind, has_recurrent, layers
from .drafting import DEFAULT_MIN_N, Drafter, NgramDrafter, Source
from .gate import CostTable, Gate
from .model import LoadedModel
from .sampling import distribution, make_rng, sample, verify_sampled
from .tokenizer import TextStream

log = logging.getLogger("warmspec.engine")

PREFILL_CHUNK = 512
MAX_DRAFT = 32
# Recurrent / wrapped sliding-window layers can resume a prefix only from a checkpoint; one every
# 2048 prompt tokens bounds the re-prefill after a mid-prompt divergence (~2-4 s on this CPU)
# while a checkpoint of a Qwen3.5-9B-sized hybrid costs ~50 MB.
CHECKPOINT_EVERY = 2048
# A discarded tail at least this long is parked in the prefix store instead of dropped.
KEEP_TAIL = 32


def default_cost_cache(lm: LoadedModel, max_draft: int = MAX_DRAFT) -> Path:
    """Where this machine's verify costs for ``lm`` are kept: keyed by everything that changes
    them (model file, device, BLAS, MLX version, draft width, host)."""
    from . import blas, fetch

    src = Path(lm.source)
    stamp = src.stat().st_mtime_ns if src.exists() else 0
    key = "|".join(map(str, (src.resolve() if src.exists() else lm.source, stamp, lm.device,
                             lm.quantized, blas.describe(), mx.__version__, max_draft,
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
        recurrent_rollback: str = "capture",
        prefix_budget_bytes: int | None = None,
        checkpoint_every: int = CHECKPOINT_EVERY,
        cost_cache: Path | None = None,
    ):
        self.lm = lm
        self.model = lm.model
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
        # structure is known, else restore and replay the accepted tokens.
        self.capture = (recurrent_rollback == "capture" and has_recurrent(self.live.cache)
                        and hybrid.supports(self.model))
        self.replays = 0
        self.gated = gated
        self.cost_cache = cost_cache
        self.observe_costs = observe_costs  # False for replays, whose passes are priced, not timed
        self._costs = costs
        self._gate: Gate | None = None
        self.totals = GenerationStats()

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
            self._gate = Gate(self.costs, max_draft=self.max_draft, enabled=self.gated)
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

    # -- measurement ----------------------------------------------------------------------------

    def measure_costs(self, contexts: Sequence[int] = (64, 1024), repeats: int = 2) -> CostTable:
        """Time verify passes of the widths the gate may pick, on a scratch cache, at a short
        and a long context (a few seconds on a CPU)."""
        vocab = getattr(getattr(self.model, "args", None), "vocab_size", 1000)
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

        top = self.max_draft + 1
        widths = sorted({w for w in (1, 2, 4, 8, 12, 16, 24, 32, 48) if w < top} | {top})
        limit = self.lm.context_length or 1 << 30
        table = CostTable.measure(forward, widths, [c for c in contexts if c + top < limit], repeats)
        for c in table.points:
            log.info("verify cost at context %d (x one position): %s", c,
                     ", ".join(f"{p}:{table.relative(p, c):.2f}" for p in table.widths))
        return table

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
        drafter: Drafter | None = None,
        cancelled: Callable[[], bool] | None = None,
    ) -> Iterator[Delta | Finished]:
        """Stream text deltas, then one ``Finished`` with the whole text and statistics."""
        stats = GenerationStats(prompt_tokens=len(prompt))
        text = TextStream(self.tokenizer, stop)
        out: list[int] = []
        run = Run(params, max_tokens, stats)
        self.current = stats
        steps = self.generate_tokens(prompt, run, speculate=speculate, sources=sources,
                                     drafter=drafter, cancelled=cancelled)
        try:
            for new in steps:
                out.extend(new)
                delta = "".join(text.push(t) for t in new)
                if text.stopped:
                    run.finish_reason = "stop"
                if delta or text.stopped:
                    yield Delta(delta, new)
                if text.stopped:
                    break
        finally:
            steps.close()
            self.current = None
        tail = text.finish()
        if tail:
            yield Delta(tail, [])
        self._add_totals(stats)
        log.info("request: %s, finish %s", stats.summary(), run.finish_reason)
        yield Finished(run.finish_reason, text.text, out, stats, text.matched)

    def _add_totals(self, s: GenerationStats) -> None:
        t = self.totals
        for f in ("prompt_tokens", "cached_tokens", "completion_tokens", "passes", "draft_passes",
                  "drafted", "accepted", "gated_steps"):
            setattr(t, f, getattr(t, f) + getattr(s, f))
        t.prefill_s += s.prefill_s
        t.decode_s += s.decode_s

    # -- token level ----------------------------------------------------------------------------

    def generate_tokens(
        self,
        prompt: Sequence[int],
        run: Run,
        *,
        speculate: bool | None = None,
        sources: Sequence[Source] = (),
        drafter: Drafter | None = None,
        cancelled: Callable[[], bool] | None = None,
    ) -> Iterator[list[int]]:
        """Yield the tokens accepted by each pass (cut at end-of-sequence and the budget).

        ``drafter`` replaces the default n-gram drafter over the prompt and ``sources``.
        """
        prompt = list(prompt)
        if not prompt:
            raise EngineError("empty prompt")
        limit = self.lm.context_length
        if limit and len(prompt) >= limit:
            raise EngineError(f"prompt of {len(prompt)} tokens does not fit the context of {limit}")
        if limit:
            run.budget = min(run.budget, limit - len(prompt))
        speculate = self.speculate if speculate is None else speculate
        run.stats.prompt_tokens = len(prompt)
        t0 = time.perf_counter()
        self._prefill(prompt, run.stats)
        run.stats.prefill_s = time.perf_counter() - t0
        if drafter is None and speculate:
            drafter = NgramDrafter(prompt, sources, min_n=self.min_n)
        if drafter is not None:
            self.gate  # measure verify costs now (once), not inside the timed decode
        t0 = time.perf_counter()
        eos = self.tokenizer.eos_ids
        if drafter is None and run.params.greedy and all(trimmable_kind(c) for c in layers(self.cache)):
            passes = self._greedy_pipeline(prompt[-1], run)
        else:
            passes = self._steps(prompt[-1], run, drafter)
        try:
            if cancelled is not None and cancelled():
                run.finish_reason = "cancelled"
                return
            for new in passes:
                end = next((i for i, t in enumerate(new) if t in eos), None)
                new = new[: run.budget if end is None else min(end, run.budget)]
                if end is not None and end <= run.budget:
                    run.finish_reason = "stop"
                    run.budget = 0
                else:
                    run.budget -= len(new)
                run.stats.completion_tokens += len(new)
                run.stats.decode_s = time.perf_counter() - t0
                if new:
                    if drafter is not None:
                        drafter.extend(new)
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

    def _steps(self, pending: int, run: Run, drafter: Drafter | None) -> Iterator[list[int]]:
        """Verify passes, one at a time: each needs the previous pass's tokens to draft."""
        while True:
            new = self._step(pending, run, drafter)
            yield new
            pending = new[-1]

    def _greedy_pipeline(self, pending: int, run: Run) -> Iterator[list[int]]:
        """Plain greedy decoding with the next pass queued before the current token is read, as
        mlx-lm's ``generate_step`` does, so the device never idles while Python handles a token.
        On an H200 a step of the default model is a few milliseconds, most of it launch and
        Python overhead: without this the plain baseline would be slower than mlx-lm's and every
        speedup measured against it flattered. Only for attention caches: the pass computed
        ahead is trimmed away when decoding stops."""

        def forward(y: mx.array) -> mx.array:
            return mx.argmax(self.model(y.reshape(1, 1), cache=self.cache)[0, -1])

        fed = pending
        y = forward(mx.array(pending))
        mx.async_eval(y)
        ahead = False
        try:
            while True:
                nxt = forward(y)  # queued on the device before y is read
                mx.async_eval(nxt)
                ahead = True
                token = y.item()
                run.stats.passes += 1
                self.live.tokens.append(fed)
                fed = token
                yield [token]
                y = nxt
        finally:
            if ahead:  # the cache holds the last token fed ahead; emitted tokens end before it
                for c in layers(self.cache):
                    c.trim(1)

    def _prefill(self, prompt: list[int], stats: GenerationStats) -> None:
        """Bring the live cache to hold ``prompt[:-1]``, starting from the state (live or stored)
        that serves the longest prefix of it."""
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
            self.store.put(self.live)
            self.store.take(entry)
            self.live = entry.clone()
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

    def _step(self, pending: int, run: Run, drafter: Drafter | None) -> list[int]:
        """One pass: verify ``pending`` + drafts; return the accepted drafts + the next token."""
        drafts: list[int] = []
        match_len = 0
        if drafter is not None and run.budget > 1:
            proposal = drafter.propose(min(self.max_draft, run.budget - 1))
            if proposal is not None:
                match_len = proposal.match_len
                k = self.gate.choose(len(proposal.tokens), match_len, len(self.cache_tokens))
                drafts = proposal.tokens[:k]
                if k == 0:
                    run.stats.gated_steps += 1
        inputs = [pending, *drafts]
        ckpt = Checkpoint(self.cache, len(inputs)) if drafts else None
        t = time.perf_counter()
        if ckpt is not None and self.capture:
            logits, ckpt.tape = hybrid.verify_forward(self.model, mx.array([inputs]), self.cache)
            logits = logits[0]
        else:
            logits = self.model(mx.array([inputs]), cache=self.cache)[0]
        params = run.params
        if params.greedy:
            targets = mx.argmax(logits, axis=-1).tolist()
            n = 0
            while n < len(drafts) and drafts[n] == targets[n]:
                n += 1
            nxt = targets[n]
        else:
            rows = np.array(logits.astype(mx.float32))
            if drafts:
                n, nxt = verify_sampled(rows, drafts, params, run.rng)
            else:
                n, nxt = 0, sample(distribution(rows[0], params), run.rng)
        if self._costs is not None and self.observe_costs:
            self._costs.observe(len(inputs), len(self.cache_tokens), time.perf_counter() - t)
        run.stats.passes += 1
        if ckpt is not None:
            if not ckpt.rollback(n + 1):
                self.model(mx.array([inputs[: n + 1]]), cache=self.cache)
                mx.eval([c.state for c in self.cache])
                run.stats.passes += 1
                self.replays += 1
            self.gate.observe(match_len, len(drafts), n)
            run.stats.draft_passes += 1
            run.stats.drafted += len(drafts)
            run.stats.accepted += n
        self.live.tokens.extend(inputs[: n + 1])
        return [*drafts[:n], nxt]
