"""``warmspec bench``: measured speedup of n-gram speculation over plain decoding, and replays
that project it onto hardware we don't have.

Measurement. Every case runs in every mode in one process, the modes alternating (plain, ngram,
plain, ngram, ...), greedy, each mode on one long-lived ``Engine`` whose prefix cache is flushed
between cases. Speedups are ratios of decode tok/s taken side by side on the same machine at the
same moment, because absolute tok/s drifts with the neighbours' load. Even the ratio does when the
load is heavy: at a load average of 4-5 on 2 cores, prose cases drafting ~1 token a pass measured
1.2-2.3x, hence ``--repeat`` (medians) and the load average recorded per case. As important as the
speed: ngram's token ids must equal plain's on every case.

Replay. Given an output known in advance (a case's ``reference``, or plain's output from this
run), the real engine -- the same drafter, gate and verify loop -- runs against a replay model
whose logits put all mass on the reference's next token. Greedy verification then accepts
exactly the drafts that agree with the reference, and every pass is priced from a cost table
(measured here, or ``--costs`` from other hardware) as ``cost(1 + k, context)``. The step loop
is not re-implemented here, so a replay cannot drift from the engine: a test checks that
replaying plain's output reproduces the real ngram run's passes and acceptance exactly.

Nothing here imports MLX at module level: the CLI imports this module before it re-executes
itself on OpenBLAS, and MLX loaded before that would bind the slow bundled BLAS.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Sequence

import msgspec

from warmspec_protocol import Message
from .core import GenerationStats, SamplingParams
from warmspec_protocol.bench import (
    BenchCase,
    BenchResults,
    CaseResult,
    Divergence,
    Machine,
    ModeSummary,
    PrefixCacheSummary,
    ReplayResult,
    ReplaySummary,
    Summary,
)

from . import blas, probes
from .core import CostTable, Source
from .core.gate import MIN_PLAIN
from .workspace import Workspace, WorkspaceError

if TYPE_CHECKING:
    from .core.engine import Engine
    from .model import LoadedModel
    from .tokenizer import Tokenizer

MODES = ("plain", "ngram", "mtp", "ngram+mtp", "draft")  # plain, then the guess sources
GREEDY = SamplingParams()
# A token counts as copied when it lies in an 8-token span seen before: in the prompt, a file
# read, or earlier in the output. Measured over the 40 workspace edits: a reference against its
# own old file is 97% covered at 8 tokens (98% at 3); against another case's file 0% at 8 but 4%
# at 3 -- short n-grams such as "self." recur in any Python.
COPY_SPAN = 8
WARMUP_TOKENS = 8
# A greedy output that differs from plain's where plain's top-2 logits were further apart than this
# is not a near tie resolved differently by a wider pass: it is a bug. (Seen on an H200 in float32:
# a flip at a margin of 3.2e-3. On CPU float32 a wide pass's logits are within ~5e-5 of one-position
# passes', and no output has differed yet.)
TIE_MARGIN = 0.05
# Speculation must not make a prompt slower than plain decoding: a case under this ratio is counted.
FLOOR = 0.97
VARIANTS = ("prompt_only", "in_prompt", "workspace")


# -- inputs ---------------------------------------------------------------------------------------


def read_cases(paths: Sequence[Path], limit: int | None = None) -> list[tuple[str, BenchCase]]:
    """``(file name, case)`` for the first ``limit`` cases of each file, in file order."""
    out = []
    for path in paths:
        lines = [line for line in path.read_bytes().splitlines() if line.strip()]
        for line in lines[:limit]:
            case = msgspec.json.decode(line, type=BenchCase)
            if not case.messages and not case.turns:
                raise ValueError(f"{path.name}: case {case.id!r} has neither messages nor turns")
            out.append((path.name, case))
    return out


def read_costs(path: Path) -> CostTable:
    """A cost table in the shape ``{context: {width: seconds}}``, e.g. a published GPU curve."""
    return CostTable(msgspec.json.decode(path.read_bytes(), type=dict[int, dict[int, float]]))


def chat_ids(tokenizer: Tokenizer, messages: Sequence[Message]) -> list[int]:
    chat = [{"role": m.role, "content": m.content} for m in messages]
    return tokenizer.encode(tokenizer.apply_chat_template(chat))


def pasted(case: BenchCase) -> list[Message]:
    """The case's messages with its read files pasted before the first user message: what a
    client without a workspace index would have to send."""
    files = case.workspace.files if case.workspace else {}
    text = "".join(f"Here is the current content of `{p}`:\n\n```\n{files[p].rstrip()}\n```\n\n"
                   for p in case.read_files if p in files)
    messages = list(case.messages or case.turns[-1])
    i = next(i for i, m in enumerate(messages) if m.role == "user")
    messages[i] = msgspec.structs.replace(messages[i], content=text + messages[i].content)
    return messages


def open_workspace(root: Path, case: BenchCase, tokenizer: Tokenizer) -> Workspace:
    """Write the case's files under ``root`` and index every one of them: the files read in this
    conversation (``read_files``) at conversation priority, the others as read earlier. The others
    are there as distractors -- thirty neighbouring files share plenty of short n-grams with the
    file being edited."""
    root = root.resolve()
    files = case.workspace.files if case.workspace else {}
    for rel, text in files.items():
        path = (root / rel).resolve()
        if root in path.parents:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    workspace = Workspace([root], tokenizer)
    for rel in files:
        try:
            workspace.did_read(rel, conversation=case.id if rel in case.read_files else None)
        except WorkspaceError as e:
            print(f"warmspec bench: {case.id}: skipped workspace file: {e}", file=sys.stderr)
    return workspace


class Prepared(msgspec.Struct):
    """A case made ready to run: prompt ids per turn, draft sources, and what it may copy from."""

    turns: list[list[int]]
    sources: list[Source]
    copied_from: list[list[int]]  # per turn: prompt + files read, for the copy fraction
    workspace: Workspace | None = None


def prepare(case: BenchCase, tokenizer: Tokenizer, root: Path) -> Prepared:
    turns = [chat_ids(tokenizer, t) for t in (case.turns or [case.messages])]
    workspace = open_workspace(root, case, tokenizer) if case.workspace else None
    sources = workspace.sources(conversation=case.id) if workspace else []
    read = [t for p in case.read_files if case.workspace and p in case.workspace.files
            for t in tokenizer.encode(case.workspace.files[p])]
    return Prepared(turns, sources, [p + read for p in turns], workspace)


def copy_fraction(output: Sequence[int], source: Sequence[int], span: int = COPY_SPAN) -> float:
    """Share of ``output`` tokens inside a ``span``-token window seen before, in ``source`` or
    earlier in ``output``: what an n-gram drafter could have guessed. Earlier output counts
    because small models loop: the 135M default answers the first edit with 747 tokens of one
    repeated line -- 0% covered by the prompt, 94% by its own earlier output, drafted at 6-9
    tokens a pass."""
    if not output:
        return 0.0
    seen = {tuple(source[i : i + span]) for i in range(len(source) - span + 1)}
    covered = [False] * len(output)
    for j in range(len(output) - span + 1):
        window = tuple(output[j : j + span])
        if window in seen:
            covered[j : j + span] = [True] * span
        seen.add(window)
    return sum(covered) / len(output)


def divergence(lm: LoadedModel, prompt: Sequence[int], plain: Sequence[int],
               other: Sequence[int]) -> Divergence | None:
    """Where ``other`` first differs from ``plain``, and plain's top-2 logit margin there, from a
    one-position pass as plain decoding runs it (the context prefilled in the engine's chunks,
    then the last token alone). None when the two are equal."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from .core.engine import PREFILL_CHUNK

    i = next((j for j, (a, b) in enumerate(zip(plain, other)) if a != b), min(len(plain), len(other)))
    if i == len(plain) == len(other):
        return None
    context = [*prompt, *plain[:i]]
    cache = make_prompt_cache(lm.model)
    for start in range(0, len(context) - 1, PREFILL_CHUNK):
        lm.model(mx.array([context[start : min(start + PREFILL_CHUNK, len(context) - 1)]]), cache=cache)
        mx.eval([c.state for c in cache])
    logits = lm.model(mx.array([context[-1:]]), cache=cache)[0, -1].astype(mx.float32)
    top = mx.sort(logits)[-2:].tolist()
    margin = top[1] - top[0]
    other_token = other[i] if i < len(other) else None
    gap = top[1] - logits[other_token].item() if other_token is not None else None
    return Divergence(position=i, plain_token=plain[i] if i < len(plain) else None,
                      other_token=other_token, margin=margin, other_gap=gap, bug=margin > TIE_MARGIN)


# -- measured runs --------------------------------------------------------------------------------


class Sample(msgspec.Struct):
    tokens: list[int]
    stats: GenerationStats
    ttft_s: float
    finish_reason: str
    booked_s: float = 0.0  # what the gate's ledger booked drafting as saving (``Ledger.balance``)
    ledger_plain_s: float = 0.0  # its price of a plain step from the request's own (0: too few)


def decode(engine: Engine, prompt: list[int], max_tokens: int, sources: Sequence[Source] = ()) -> Sample:
    """One greedy generation; time to first token is prefill plus the first pass."""
    from .core.engine import Run

    run = Run(GREEDY, max_tokens, GenerationStats())
    out: list[int] = []
    ttft = None
    t0 = time.perf_counter()
    for new in engine.generate_tokens(prompt, run, sources=sources):
        if ttft is None:
            ttft = time.perf_counter() - t0
        out.extend(new)
    ledger = engine.gate.ledger
    booked = ledger.balance if engine.speculate else 0.0
    own = ledger.plain_mean if engine.speculate and ledger.plains >= MIN_PLAIN else 0.0
    return Sample(out, run.stats, ttft or time.perf_counter() - t0, run.finish_reason, booked, own)


def flush(engine: Engine) -> None:
    """Forget every cached prefix and earlier answer, so that runs are independent: ``reset`` drops
    the live state, the prefix store would serve a repeat of the same prompt from a parked one, and
    the engine drafts from its recent answers."""
    engine.reset()
    engine.store.clear()
    engine.recent.clear()


def run_modes(engines: dict[str, Engine], prep: Prepared, max_tokens: int,
              repeat: int, restart: bool = False) -> dict[str, list[list[Sample]]]:
    """``{mode: [[sample per turn] per repeat]}``, the modes alternating within each repeat.
    Each run starts from an empty cache; a conversation's turns share it, as in the daemon.
    ``restart``: before each later turn the engine is replaced by a fresh one that has only the
    states its predecessor saved to disk (``engines`` is updated)."""
    samples: dict[str, list[list[Sample]]] = {mode: [] for mode in engines}
    for _ in range(repeat):
        for mode in engines:
            flush(engines[mode])
            with tempfile.TemporaryDirectory(prefix="warmspec-bench-disk-") as disk:
                if restart:
                    engines[mode] = restarted(engines[mode], Path(disk), save=False)
                turns = []
                for i, p in enumerate(prep.turns):
                    if restart and i:
                        engines[mode] = restarted(engines[mode], Path(disk))
                    turns.append(decode(engines[mode], p, max_tokens, prep.sources))
                if restart:
                    engines[mode].disk.close()
                    engines[mode].disk = engines[mode].store.on_evict = None
            samples[mode].append(turns)
    return samples


def restarted(engine: Engine, disk: Path, *, save: bool = True) -> Engine:
    """What a daemon restart leaves of ``engine``: its prefix states saved to ``disk`` (at shutdown,
    when ``save``), then a fresh engine of the same model and settings reading them. The model stays
    loaded in this process, so the figure is the disk tier's, not a model load's."""
    from .core import Engine
    from .core.prefix_disk import DiskTier, model_identity

    old = engine.disk
    if save and old is not None:
        old.spill_all(engine)
    if old is not None:
        old.close()
    identity = old.identity if old is not None else model_identity(engine.lm)
    fresh = Engine(engine.lm, speculate=engine.speculate, max_draft=engine.max_draft,
                   costs=CostTable(engine.costs.points) if engine._costs is not None else None)
    DiskTier(disk, identity, budget_bytes=8 << 30).attach(fresh)
    return fresh


def case_rows(file: str, case: BenchCase, prep: Prepared, samples: dict[str, list[list[Sample]]],
              load_avg: float = 0.0, lm: LoadedModel | None = None) -> list[CaseResult]:
    """One row per mode and turn: medians over repeats; identical means every repeat's token
    ids equal plain's first run (so plain rows also catch nondeterminism). With ``lm``, a row that
    is not identical says where and at what margin its first differing repeat diverged."""
    plain = samples.get("plain")
    rows = []
    for mode, repeats in samples.items():
        for turn in range(len(prep.turns)):
            runs = [r[turn] for r in repeats]
            ref = plain[0][turn].tokens if plain else None
            st = [s.stats for s in runs]
            rows.append(CaseResult(
                file=file, id=case.id, mode=mode, turn=turn,
                tokens=len(runs[0].tokens),
                decode_s=statistics.median(s.decode_s for s in st),
                prefill_s=statistics.median(s.prefill_s for s in st),
                ttft_s=statistics.median(s.ttft_s for s in runs),
                passes=statistics.median_low(s.passes for s in st),
                drafted=statistics.median_low(s.drafted for s in st),
                accepted=statistics.median_low(s.accepted for s in st),
                gated_steps=statistics.median_low(s.gated_steps for s in st),
                paused_steps=statistics.median_low(s.paused_steps for s in st),
                booked_s=round(statistics.median(s.booked_s for s in runs), 6),
                ledger_plain_s=round(statistics.median(s.ledger_plain_s for s in runs), 6),
                decode_runs=[round(s.decode_s, 6) for s in st],
                sources=source_counts({n: (c.drafted, c.accepted) for n, c in s.sources.items()} for s in st),
                prompt_tokens=st[0].prompt_tokens,
                cached_tokens=st[0].cached_tokens,
                finish_reason=runs[0].finish_reason,
                identical_to_plain=ref is not None and all(s.tokens == ref for s in runs),
                copy_fraction=copy_fraction(ref if ref is not None else runs[0].tokens,
                                            prep.copied_from[turn]),
                load_avg=load_avg,
                divergence=next((divergence(lm, prep.turns[turn], ref, s.tokens) for s in runs
                                 if s.tokens != ref), None) if lm is not None and ref is not None else None,
            ))
    return rows


def source_counts(counts: Iterable[dict]) -> dict[str, list[int]]:
    """[drafted, accepted] per guess source, summed over ``counts`` (dicts of source ->
    (drafted, accepted))."""
    out: dict[str, list[int]] = {}
    for c in counts:
        for name, (drafted, accepted) in c.items():
            d = out.setdefault(name, [0, 0])
            d[0] += drafted
            d[1] += accepted
    return dict(sorted(out.items()))


# -- replay ---------------------------------------------------------------------------------------


class Script:
    """What the replay model predicts -- the prompt, the reference, then end-of-sequence -- and
    the log of passes it served, as ``(context, width)``."""

    def __init__(self, prompt: Sequence[int], reference: Sequence[int], end: int):
        self.tokens = [*prompt, *reference, end]
        self.prompt_len = len(prompt)
        self.vocab = max(self.tokens) + 1
        self.passes: list[tuple[int, int]] = []

    def targets(self, start: int, width: int) -> list[int]:
        """The token following each of positions ``start .. start + width - 1``."""
        last = len(self.tokens) - 1
        return [self.tokens[min(i + 1, last)] for i in range(start, start + width)]

    def decode_passes(self) -> list[tuple[int, int]]:
        """Passes after the prefill: prefill chunks all start before the prompt's last token."""
        return [(c, w) for c, w in self.passes if c >= self.prompt_len - 1]


def replay_engine(lm: LoadedModel, costs: CostTable, max_draft: int) -> Engine:
    """An ``Engine`` over a replay model, with a frozen cost table (``observe_costs=False``) and
    no host time (``observe_host=False``): the gate decides from ``costs`` alone, as it would on
    the hardware they were measured on, and the same replay makes the same decisions however
    busy this machine is.

    The model is a script reader: its cache is mlx-lm's ``KVCache`` fed one dummy key per
    position, so the engine's rollback trims it like any attention cache, and the cache offset
    says which position each input row is. Logits are one-hot on the script's next token.
    """
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.models.cache import KVCache

    from .core.engine import Engine
    from .model import LoadedModel

    class ReplayModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.script = Script([], [], 0)

        def make_cache(self) -> list[KVCache]:
            return [KVCache()]

        def __call__(self, inputs: mx.array, cache: list[KVCache]) -> mx.array:
            start, width = cache[0].offset, inputs.shape[1]
            dummy = mx.zeros((1, 1, width, 1))
            cache[0].update_and_fetch(dummy, dummy)
            self.script.passes.append((start, width))
            targets = mx.array(self.script.targets(start, width))
            onehot = mx.arange(self.script.vocab)[None, :] == targets[:, None]
            return onehot.astype(mx.float32)[None]

    replay_lm = LoadedModel(model=ReplayModel(), tokenizer=lm.tokenizer,
                            name=f"replay of {lm.name}", source="replay")
    return Engine(replay_lm, speculate=True, max_draft=max_draft, costs=costs, gated=True,
                  observe_costs=False, observe_host=False)


class Replayed(msgspec.Struct):
    tokens: list[int]
    stats: GenerationStats
    cost_s: float  # priced passes
    plain_cost_s: float  # the same output decoded one token per pass

    @property
    def projected_speedup(self) -> float:
        return self.plain_cost_s / self.cost_s if self.cost_s else 0.0


def replay(engine: Engine, prompt: list[int], reference: Sequence[int], *,
           max_tokens: int | None = None, sources: Sequence[Source] = ()) -> Replayed:
    """Decode ``reference`` after ``prompt`` on a ``replay_engine``, pricing each pass.

    ``max_tokens`` is the budget of the run whose output ``reference`` is (it caps the last
    drafts exactly as there); by default the reference plus the end-of-sequence token. Plain
    decoding would spend one pass per token, plus one for end-of-sequence when it stopped.
    """
    from .core.engine import Run

    eos = engine.tokenizer.eos_ids
    # End with the token that closes the turns of the prompt's chat template (SmolLM2:
    # <|im_end|>, not <|endoftext|>): the model ends its answer with it, and the drafter may
    # propose it from the prompt, so the choice decides whether that draft is accepted.
    end = next((t for t in reversed(prompt) if t in eos), min(eos, default=0))
    if max_tokens is None:
        max_tokens = len(reference) + (1 if eos else 0)
    engine.model.script = script = Script(prompt, reference, end)
    flush(engine)
    run = Run(GREEDY, max_tokens, GenerationStats())
    out = [t for new in engine.generate_tokens(prompt, run, sources=sources) for t in new]
    costs = engine.costs
    cost = sum(costs.cost(width, context) for context, width in script.decode_passes())
    plain_passes = len(out) + (run.finish_reason == "stop")
    plain = sum(costs.cost(1, len(prompt) - 1 + i) for i in range(plain_passes))
    return Replayed(out, run.stats, cost, plain)


def replay_variants(case: BenchCase, tokenizer: Tokenizer,
                    prep: Prepared) -> dict[str, tuple[list[int], list[Source]]]:
    """``{variant: (prompt, sources)}``: the prompt alone; for workspace cases also the read
    files pasted into the prompt, and the prompt with the whole workspace index."""
    prompt = prep.turns[-1]
    variants = {"prompt_only": (prompt, [])}
    if prep.workspace is not None:
        variants["in_prompt"] = (chat_ids(tokenizer, pasted(case)), [])
        variants["workspace"] = (prompt, prep.sources)
    return variants


def replay_engines(lm: LoadedModel, costs: CostTable, max_draft: int) -> dict[str, Engine]:
    """One replay engine per variant, each gate keeping its own acceptance history across cases
    as the daemon's single engine does."""
    return {v: replay_engine(lm, CostTable(costs.points), max_draft) for v in VARIANTS}


def replay_case(file: str, case: BenchCase, prep: Prepared, engines: dict[str, Engine],
                reference: list[int], source: str, max_tokens: int | None) -> list[ReplayResult]:
    tokenizer = engines["prompt_only"].tokenizer
    rows = []
    for variant, (prompt, sources) in replay_variants(case, tokenizer, prep).items():
        r = replay(engines[variant], prompt, reference, max_tokens=max_tokens, sources=sources)
        st = r.stats
        rows.append(ReplayResult(
            file=file, id=case.id, variant=variant, reference=source,
            tokens=st.completion_tokens, passes=st.passes, drafted=st.drafted,
            accepted=st.accepted, tokens_per_pass=st.tokens_per_pass,
            projected_speedup=r.projected_speedup, cost_s=r.cost_s, plain_cost_s=r.plain_cost_s,
            copy_fraction=copy_fraction(reference, prep.copied_from[-1]),
        ))
    return rows


# -- summaries ------------------------------------------------------------------------------------


def _key(r: CaseResult) -> tuple[str, str, int]:
    return r.file, r.id, r.turn


def _rate(tokens: float, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else 0.0


def case_speedup(row: CaseResult, plain: CaseResult) -> float:
    base = _rate(plain.tokens, plain.decode_s)
    return _rate(row.tokens, row.decode_s) / base if base else 0.0


def paired_speedup(row: CaseResult, plain: CaseResult) -> float:
    """The median over repeats of the mode's tok/s against plain's in the same repeat. Why: on the
    H200 one case's plain runs went 117, 119, 212, 233, 244 tok/s (docs/bench/h200-s21/diag-f32.txt):
    the host changes state between repeats, and medians taken per mode can pair a slow state with
    a fast one; runs of one repeat are seconds apart. Without per-repeat times (one repeat, or an
    older results.json): ``case_speedup``."""
    if len(row.decode_runs) < 2 or len(row.decode_runs) != len(plain.decode_runs):
        return case_speedup(row, plain)
    return statistics.median(p / m if m > 0 else 0.0 for p, m in zip(plain.decode_runs, row.decode_runs)) \
        * (row.tokens / plain.tokens if plain.tokens else 0.0)


def run_spread(row: CaseResult) -> float:
    """The slowest repeat's decode time over the fastest's. For plain, whose repeats do identical
    work, it is the host's own noise, the yardstick for a per-case ratio: on the H200, plain's runs
    of one prompt differed by a median 23% (up to 67%) across 36 prompts, every step of a slow run
    slower alike, with no spikes and whether or not Python's collector ran or MLX's buffer cache was
    cleared (docs/bench/h200-s24/noise/)."""
    runs = [t for t in row.decode_runs if t > 0]
    return max(runs) / min(runs) if len(runs) > 1 else 1.0


def first(row: CaseResult, repeat: int) -> CaseResult:
    """The row as its first ``repeat`` runs alone measured it (its decode time their median)."""
    runs = row.decode_runs[:repeat]
    if len(runs) == len(row.decode_runs):
        return row
    return msgspec.structs.replace(row, decode_runs=runs, decode_s=statistics.median(runs))


def is_below_floor(row: CaseResult, plain: CaseResult) -> bool:
    """Whether a mode's row of one case is under the floor against plain's, by medians or paired."""
    return min(case_speedup(row, plain), paired_speedup(row, plain)) < FLOOR


def under_floor(rows: list[CaseResult]) -> bool:
    """Whether any mode's row of one case is under the floor against plain's."""
    plain = {_key(r): r for r in rows if r.mode == "plain"}
    return any(is_below_floor(r, plain[_key(r)]) for r in rows if r.mode != "plain" and _key(r) in plain)


def mode_summary(rows: list[CaseResult], plain: dict[tuple[str, str, int], CaseResult],
                 repeat: int | None = None) -> ModeSummary:
    """Totals over the mode's rows; the speedup is over the rows plain also ran: the ratio of
    total decode tok/s (plain decode time / mode decode time when outputs are identical).
    ``repeat``: the repeats every case ran first (rows with more runs were rechecked)."""
    tokens = sum(r.tokens for r in rows)
    decode_s = sum(r.decode_s for r in rows)
    both = [r for r in rows if _key(r) in plain]
    base = _rate(sum(plain[_key(r)].tokens for r in both), sum(plain[_key(r)].decode_s for r in both))
    drafted = sum(r.drafted for r in rows)
    passes = sum(r.passes for r in rows)
    per_case = [(case_speedup(r, plain[_key(r)]), r.id) for r in both]
    paired = [(paired_speedup(r, plain[_key(r)]), r.id) for r in both]
    slowest = min(per_case, default=(0.0, ""))
    slowest_paired = min(paired, default=(0.0, ""))
    margins = [r.divergence.margin for r in rows if r.divergence is not None]
    spreads = [run_spread(r) for r in rows]
    rechecked = [r for r in both if repeat and len(r.decode_runs) > repeat]
    under = [r for r in both if is_below_floor(r, plain[_key(r)])]
    steps = [r.ledger_plain_s * p.tokens / p.decode_s for r in both
             if r.ledger_plain_s > 0 and (p := plain[_key(r)]).decode_s > 0 and p.tokens]
    return ModeSummary(
        rechecked=len(rechecked),
        below_floor_first=sum(paired_speedup(first(r, repeat), first(plain[_key(r)], repeat)) < FLOOR
                              for r in rechecked),
        cases=len(rows), tokens=tokens, decode_s=decode_s, tok_s=_rate(tokens, decode_s),
        speedup_vs_plain=_rate(sum(r.tokens for r in both), sum(r.decode_s for r in both)) / base
        if base else 0.0,
        acceptance=sum(r.accepted for r in rows) / drafted if drafted else 0.0,
        tokens_per_pass=tokens / passes if passes else 0.0,
        identical=f"{sum(r.identical_to_plain for r in rows)}/{len(rows)}",
        min_speedup=slowest[0], min_case=slowest[1],
        min_paired_speedup=slowest_paired[0], min_paired_case=slowest_paired[1],
        below_floor=sum(s < FLOOR for s, _ in per_case), below_floor_paired=sum(s < FLOOR for s, _ in paired),
        below_floor_ledger=sum(r.booked_s < -(1 - FLOOR) * r.decode_s for r in under),
        loop_plain_step=statistics.median(steps) if steps else 0.0,
        divergences=len(margins), max_divergence_margin=max(margins, default=0.0),
        run_spread=statistics.median(spreads) if spreads else 1.0,
        max_run_spread=max(spreads, default=1.0),
        sources=source_counts(r.sources for r in rows),
    )


def prefix_cache_summary(rows: list[CaseResult]) -> PrefixCacheSummary | None:
    """Time to first token of conversations: first turns (cold cache) against later turns, which
    resend the earlier ones and should find them in the prefix cache. All modes pooled."""
    multi = {(r.file, r.id) for r in rows if r.turn > 0}
    cold = [r.ttft_s for r in rows if (r.file, r.id) in multi and r.turn == 0]
    warm = [r.ttft_s for r in rows if r.turn > 0]
    if not warm:
        return None
    return PrefixCacheSummary(turns_cold=len(cold), turns_warm=len(warm),
                              ttft_cold_s=statistics.median(cold), ttft_warm_s=statistics.median(warm))


def replay_summary(rows: list[ReplayResult]) -> ReplaySummary:
    """Totals over cases: tokens per pass, and priced plain time over priced speculative time."""
    tokens = sum(r.tokens for r in rows)
    passes = sum(r.passes for r in rows)
    drafted = sum(r.drafted for r in rows)
    cost = sum(r.cost_s for r in rows)
    return ReplaySummary(
        cases=len(rows), tokens=tokens, passes=passes,
        tokens_per_pass=tokens / passes if passes else 0.0,
        projected_speedup=sum(r.plain_cost_s for r in rows) / cost if cost else 0.0,
        acceptance=sum(r.accepted for r in rows) / drafted if drafted else 0.0,
    )


def summarize(rows: list[CaseResult], replays: list[ReplayResult], repeat: int | None = None) -> Summary:
    plain = {_key(r): r for r in rows if r.mode == "plain"}
    modes = {m: mode_summary([r for r in rows if r.mode == m], plain, repeat) for m in MODES
             if any(r.mode == m for r in rows)}
    variants = {v: replay_summary([r for r in replays if r.variant == v]) for v in VARIANTS
                if any(r.variant == v for r in replays)}
    return Summary(**{mode_attr(m): v for m, v in modes.items()}, prefix_cache=prefix_cache_summary(rows), replay=variants)


# -- the run --------------------------------------------------------------------------------------


def machine(lm=None) -> Machine:
    import mlx.core as mx

    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                 if line.startswith("model name")]
        cpu = names[0] if names else cpu
    return Machine(cpu=cpu, cores=os.cpu_count() or 0, os=platform.platform(),
                   python=platform.python_version(), mlx=mx.__version__,
                   mlx_lm=metadata.version("mlx-lm"), device=str(mx.default_device()),
                   blas=blas.describe(), load_avg=os.getloadavg()[0],
                   kernels=list(lm.kernels) if lm else [], kernel_notes=list(lm.kernel_notes) if lm else [])


def _progress(i: int, n: int, file: str, case: BenchCase, rows: list[CaseResult],
              replays: list[ReplayResult]) -> None:
    plain = {_key(r): r for r in rows if r.mode == "plain"}
    turns = any(r.turn for r in rows)
    parts = []
    for r in rows:
        part = f"{r.mode}{f' turn {r.turn + 1}' if turns else ''} {_rate(r.tokens, r.decode_s):.1f} tok/s"
        if r.mode != "plain" and _key(r) in plain:
            part += (f" ({case_speedup(r, plain[_key(r)]):.2f}x, {r.tokens / max(r.passes, 1):.1f}"
                     f" tok/pass, {'identical' if r.identical_to_plain else 'DIFFERS'})")
        parts.append(part)
    parts += [f"replay {r.variant} {r.tokens_per_pass:.1f} tok/pass" for r in replays]
    print(f"[{i}/{n}] {file} {case.id}: " + " | ".join(parts), file=sys.stderr, flush=True)


def mode_attr(mode: str) -> str:
    """The ``Summary`` field of a mode ("ngram+mtp" -> ngram_mtp)."""
    return mode.replace("+", "_")


def model_drafters(lm: LoadedModel, modes: Sequence[str], mtp_path: Path | None,
                   draft_model: str | None) -> dict:
    """The MTP head and draft model the modes ``mtp`` and ``draft`` need, loaded once and shared:
    the head attaches to the loaded target, never a second copy of its weights."""
    from .core.draft_model import DraftModel
    from .core.mtp import MTPError
    from .heads import resolve_head

    out: dict = {}
    if any("mtp" in m for m in modes):
        try:
            out["mtp"] = resolve_head(mtp_path or "shipped", lm)
        except MTPError as e:
            raise ValueError(f"mode mtp: --mtp {mtp_path or 'shipped'}: {e}") from None
    if "draft" in modes:
        if draft_model is None:
            raise ValueError("mode draft needs --draft-model M")
        out["draft_model"] = DraftModel.load(draft_model, lm)
    return out


def bench(lm: LoadedModel, inputs: Sequence[Path], out: Path, *, modes: Sequence[str] = ("plain", "ngram"),
          repeat: int = 1, limit: int | None = None, max_tokens_cap: int | None = None,
          replay_outputs: bool = False, max_draft: int | None = None, costs: CostTable | None = None,
          replay_costs: CostTable | None = None, replay_costs_name: str | None = None,
          resume: bool = False, mtp_path: Path | None = None, draft_model: str | None = None,
          restart_between_turns: bool = False, recheck: int = 0) -> BenchResults:
    """Run every case of ``inputs`` in every mode, replay the cases that have a reference (and,
    with ``replay_outputs``, plain's outputs of the others), and write results.json, report.md
    and speedup.png under ``out``.

    ``costs``: the verify cost table of the ngram engine (measured here when None);
    ``replay_costs``: the table that prices replays (default: ``costs`` as it was before the
    ngram engine began adjusting its copy to observed passes), named ``replay_costs_name``.

    The files are rewritten after every case, and ``resume`` keeps the cases an earlier run left
    in ``out/results.json`` (with its cost table, so every case is priced alike): the full CPU run
    takes ~2.5 hours on 2 cores (~3.3 minutes a file-edit case, plain decoding at 8-10 tok/s), and
    a run cut short must not cost its finished cases.
    """
    from .core.engine import MAX_DRAFT, Engine, EngineError

    max_draft = max_draft or MAX_DRAFT
    cases = read_cases(inputs, limit)
    wants_replay = replay_outputs or any(c.reference for _, c in cases)
    prior = read_prior(out, lm.name, modes, repeat, max_draft) if resume else None
    if prior is not None:
        costs = costs or (CostTable(prior.costs, prior.plain_costs) if prior.costs else None)
        replay_costs_name = replay_costs_name or prior.replay_costs or None
    measured = costs is None and (any(m != "plain" for m in modes) or (wants_replay and replay_costs is None))
    if measured:
        print("warmspec bench: measuring verify costs…", file=sys.stderr, flush=True)
        costs = Engine(lm, max_draft=max_draft).measure_costs()
    if replay_costs_name is None:
        replay_costs_name = "measured" if measured and replay_costs is None else "given"
    drafters = model_drafters(lm, modes, mtp_path, draft_model)
    engines = {m: Engine(lm, speculate=m != "plain", max_draft=max_draft,
                         drafting=None if m == "plain" else m, **drafters,
                         costs=CostTable(costs.points, costs.plain_points) if costs else None)
               for m in modes}
    replayers = replay_engines(lm, replay_costs or costs, max_draft) if wants_replay else {}
    info = machine(lm)
    for engine in engines.values():  # the first passes of a process allocate: not in case 1
        decode(engine, chat_ids(lm.tokenizer, [Message(role="user", content="Hello!")]),
               WARMUP_TOKENS)
    rows: list[CaseResult] = list(prior.cases) if prior else []
    replays: list[ReplayResult] = list(prior.replays) if prior else []
    finished = {(r.file, r.id) for r in rows} | {(r.file, r.id) for r in replays}
    names = [p.name for p in inputs]

    def results() -> BenchResults:
        return BenchResults(
            machine=info, model=lm.name, inputs=names, modes=list(modes), repeat=repeat,
            max_draft=max_draft, costs=costs.points if costs else {},
            plain_costs=costs.plain_points if costs else {},
            replay_costs=replay_costs_name if replayers else "", cases=rows, replays=replays,
            summary=summarize(rows, replays, repeat),
            files={f: summarize([r for r in rows if r.file == f], [r for r in replays if r.file == f],
                                repeat)
                   for f in names},
            restart_between_turns=restart_between_turns, recheck=recheck,
        )

    for i, (file, case) in enumerate(cases, 1):
        if (file, case.id) in finished:
            continue
        max_tokens = min(case.max_tokens, max_tokens_cap or case.max_tokens)
        with tempfile.TemporaryDirectory(prefix="warmspec-bench-") as tmp:
            prep = prepare(case, lm.tokenizer, Path(tmp))
            try:
                samples = run_modes(engines, prep, max_tokens, repeat, restart_between_turns)
                # with a recheck the rows are read twice: a divergence's pass only the last time
                new = case_rows(file, case, prep, samples, os.getloadavg()[0], None if recheck else lm)
                if recheck:
                    if under_floor(new):  # the host's noise, or a loss? run it again
                        more = run_modes(engines, prep, max_tokens, recheck, restart_between_turns)
                        for mode, runs in more.items():
                            samples[mode] += runs
                    new = case_rows(file, case, prep, samples, os.getloadavg()[0], lm)
            except EngineError as e:
                print(f"warmspec bench: {file} {case.id}: skipped: {e}", file=sys.stderr)
                continue
            done: list[ReplayResult] = []
            if replayers and case.reference:
                done = replay_case(file, case, prep, replayers,
                                   lm.tokenizer.encode(case.reference), "case", None)
            elif replayers and "plain" in samples and len(prep.turns) == 1:
                done = replay_case(file, case, prep, replayers, samples["plain"][0][0].tokens,
                                   "plain", max_tokens)
        rows += new
        replays += done
        _progress(i, len(cases), file, case, new, done)
        write(results(), out)
    final = results()
    write(final, out)
    return final


def read_prior(out: Path, model: str, modes: Sequence[str], repeat: int,
               max_draft: int) -> BenchResults | None:
    """The results an earlier run left in ``out``, if it measured the same thing; None when there
    are none. A run with another model or other settings is refused (ValueError), not mixed in."""
    path = out / "results.json"
    if not path.exists():
        return None
    prior = msgspec.json.decode(path.read_bytes(), type=BenchResults)
    theirs = (prior.model, prior.modes, prior.repeat, prior.max_draft)
    if theirs != (model, list(modes), repeat, max_draft):
        raise ValueError(f"{path} holds another run (model, modes, repeat, max draft = {theirs}): "
                         "--resume needs the same settings, or a new --out")
    return prior


def write(results: BenchResults, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_bytes(msgspec.json.format(msgspec.json.encode(results), indent=2))
    (out / "report.md").write_text(report(results))
    plot(results, out / "speedup.png")


# -- report ---------------------------------------------------------------------------------------


def _table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    cell = lambda v: str(v).replace("|", "\\|")  # noqa: E731
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]


def report(res: BenchResults) -> str:
    m = res.machine
    lines = [
        f"# warmspec bench: {res.model}", "",
        (f"- machine: {m.cpu}, {m.cores} cores, {m.os}; {m.device}, {m.blas}; MLX {m.mlx}, "
         f"mlx-lm {m.mlx_lm}, Python {m.python}; load average {m.load_avg:.2f} at start"),
        f"- kernels in MLX's place: {', '.join(m.kernels) or 'none'}"
        + "".join(f"\n  - {n}" for n in m.kernel_notes),
        (f"- inputs: {', '.join(res.inputs)}; modes {', '.join(res.modes) or 'none'} alternating "
         f"per case, greedy, repeat {res.repeat} (medians); max draft {res.max_draft}"
         + (f"; a case under {FLOOR}x after them ran {res.recheck} more repeats (rechecked: its "
            f"figures take them all)" if res.recheck else "")),
        ("- speedup: plain decode tok/s against the mode's on the same cases; identical: token "
         "ids equal plain's; load: the 1-minute load average after the case (above the core "
         "count, other processes competed for the CPU and timings are noisy); paired: the "
         "median over repeats of each repeat's ratio (its runs are seconds apart), which a host "
         "that drifts between repeats moves less; slowest run / fastest: per case, the mode's "
         "slowest repeat over its fastest -- for plain, identical work, so the host's own noise, "
         "the yardstick for a per-case ratio; the ledger lost on: of the cases below the floor, "
         "those whose own ledger (drafting steps against the same run's plain steps) booked "
         f"drafting as losing over {1 - FLOOR:.0%} of their decode time -- a case below the floor "
         "whose ledger booked no such loss is more likely the host's noise than drafting's; loop's "
         "plain step / plain's: the speculative loop's steady plain step over plain decoding's "
         "time per token, median over cases; a case's ledger: what its ledger booked drafting as "
         "saving, over its decode time (negative: lost)"), "",
        "## Per input file", "",
    ]
    summary_rows = []
    for f, s in res.files.items():
        for mode in MODES:
            ms: ModeSummary | None = getattr(s, mode_attr(mode))
            if ms is not None:
                other = mode != "plain"
                slowest = f"{ms.min_speedup:.2f}x ({ms.min_case})" if other else ""
                paired = f"{ms.min_paired_speedup:.2f}x ({ms.min_paired_case})" if other else ""
                below = f"{ms.below_floor} / {ms.below_floor_paired}" if other else ""
                if other and ms.rechecked:
                    below += f" ({ms.rechecked} rechecked; {ms.below_floor_first} paired before)"
                if other and (ms.below_floor or ms.below_floor_paired):
                    below += f"; the ledger lost on {ms.below_floor_ledger}"
                loop = f"{ms.loop_plain_step:.2f}" if ms.loop_plain_step else ""
                spread = (f"{ms.run_spread:.2f} / {ms.max_run_spread:.2f}" if res.repeat > 1 else "")
                summary_rows.append((f, mode, ms.cases, ms.tokens, f"{ms.decode_s:.1f}",
                                     f"{ms.tok_s:.1f}", f"{ms.speedup_vs_plain:.2f}x", slowest, paired,
                                     below, f"{ms.acceptance:.0%}", f"{ms.tokens_per_pass:.2f}", ms.identical,
                                     spread, loop))
    lines += _table(("file", "mode", "cases", "tokens", "decode s", "tok/s", "speedup vs plain",
                     "slowest case", "slowest case, paired", f"below {FLOOR}x (medians / paired)",
                     "acceptance", "tokens/pass", "identical", "slowest run / fastest (median / max)",
                     "loop's plain step / plain's"),
                    summary_rows)
    diverged = [r for r in res.cases if r.divergence is not None]
    if diverged:
        lines += ["", "## Divergences from plain", "",
                  (f"First differing token per case, with plain's top-2 logit margin there (a "
                   f"one-position pass). A margin under {TIE_MARGIN} is a near tie that a pass of "
                   f"another width may resolve the other way; above it the difference is a BUG."), ""]
        lines += _table(("file", "id", "turn", "mode", "position", "plain token", "mode's token",
                         "margin", "gap to mode's token", "verdict"),
                        [(r.file, r.id, r.turn, r.mode, r.divergence.position, r.divergence.plain_token,
                          r.divergence.other_token, f"{r.divergence.margin:.2e}",
                          "" if r.divergence.other_gap is None else f"{r.divergence.other_gap:.2e}",
                          "BUG" if r.divergence.bug else "near tie") for r in diverged])
    prefix = [(f, s.prefix_cache) for f, s in res.files.items() if s.prefix_cache]
    if prefix:
        after = " after a restart" if res.restart_between_turns else ""
        lines += ["", f"## Prefix cache: time to first token (all modes pooled){after}", ""]
        if res.restart_between_turns:
            lines += [("Later turns ran on a fresh engine that had only what its predecessor saved "
                       "to the disk tier (`--restart-between-turns`); the model stayed loaded."), ""]
        lines += _table(("file", "cold turns", f"turns{after}", "TTFT cold s", f"TTFT{after} s"),
                        [(f, p.turns_cold, p.turns_warm, f"{p.ttft_cold_s:.3f}", f"{p.ttft_warm_s:.3f}")
                         for f, p in prefix])
    if res.replays:
        lines += ["", (f"## Replay: drafting and gate against a known output, priced with the "
                       f"{res.replay_costs} cost table"), "",
                  ("prompt_only: drafts from the prompt and the output; in_prompt: the read files "
                   "pasted into the prompt; workspace: every workspace file indexed, the read ones "
                   "at conversation priority. The gate drafts by the cost table, so tokens/pass "
                   "depends on it too: in_prompt's prompt is longer by the files, and where a wide "
                   "pass costs more at a longer context (CPU) it drafts less there."), ""]
        lines += _table(("file", "variant", "cases", "tokens", "tokens/pass", "acceptance",
                         "projected speedup"),
                        [(f, v, r.cases, r.tokens, f"{r.tokens_per_pass:.2f}", f"{r.acceptance:.0%}",
                          f"{r.projected_speedup:.2f}x")
                         for f, s in res.files.items() for v, r in s.replay.items()])
    plain = {_key(r): r for r in res.cases if r.mode == "plain"}
    lines += ["", "## Cases", ""]
    lines += _table(
        ("file", "id", "turn", "mode", "tokens", "prefill s", "TTFT s", "decode s", "tok/s",
         "speedup", "paired", "passes", "tokens/pass", "accepted/drafted", "identical", "copy fraction",
         "load", "ledger"),
        [(r.file, r.id, r.turn, r.mode, r.tokens, f"{r.prefill_s:.2f}", f"{r.ttft_s:.3f}",
          f"{r.decode_s:.2f}", f"{_rate(r.tokens, r.decode_s):.1f}",
          f"{case_speedup(r, plain[_key(r)]):.2f}x" if _key(r) in plain else "",
          f"{paired_speedup(r, plain[_key(r)]):.2f}x" if _key(r) in plain else "",
          r.passes, f"{r.tokens / r.passes:.2f}" if r.passes else "", f"{r.accepted}/{r.drafted}",
          "yes" if r.identical_to_plain else "NO", f"{r.copy_fraction:.0%}", f"{r.load_avg:.1f}",
          f"{r.booked_s / r.decode_s:+.1%}" if r.mode != "plain" and r.decode_s > 0 else "")
         for r in res.cases])
    if res.replays:
        lines += ["", "## Replays", ""]
        lines += _table(("file", "id", "variant", "reference", "tokens", "passes", "tokens/pass",
                         "accepted/drafted", "projected speedup", "copy fraction"),
                        [(r.file, r.id, r.variant, r.reference, r.tokens, r.passes,
                          f"{r.tokens_per_pass:.2f}", f"{r.accepted}/{r.drafted}",
                          f"{r.projected_speedup:.2f}x", f"{r.copy_fraction:.0%}")
                         for r in res.replays])
    return "\n".join(lines) + "\n"


COPY_AXIS = (f"copy fraction\n(share of the output in {COPY_SPAN}-token spans seen before: "
             "prompt, files read, earlier output)")


def plot(res: BenchResults, path: Path) -> None:
    """Measured per-case speedup against copy fraction, one colour per input file; beside it the
    replays' projected speedups, one colour per variant and one marker per input file."""
    try:
        import matplotlib
    except ImportError:
        print("warmspec bench: no speedup.png: matplotlib is missing (pip install 'warmspec[bench]')",
              file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p, present in ((_plot_measured, any(r.mode != "plain" for r in res.cases)),
                                   (_plot_replays, bool(res.replays))) if present]
    fig, axes = plt.subplots(1, max(len(panels), 1), figsize=(6.5 * max(len(panels), 1) + 0.5, 5.5),
                             squeeze=False)
    for draw, ax in zip(panels, axes[0]):
        draw(ax, res, plt.get_cmap("tab10"))
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
        ax.set_xlabel(COPY_AXIS, fontsize=9)
        if ax.get_legend_handles_labels()[0]:  # a panel of modes with no plain run has no points
            ax.legend(loc="best", fontsize=8)
        ax.grid(alpha=0.3)
    if not panels:
        axes[0][0].text(0.5, 0.5, "nothing to plot: no ngram runs, no replays", ha="center")
    m = res.machine
    fig.suptitle(f"warmspec n-gram speculation vs plain greedy decoding: {res.model}\n"
                 f"{m.cpu}, {m.cores} cores, {m.device}, {m.blas.split(' (')[0]}, MLX {m.mlx}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _plot_measured(ax, res: BenchResults, cmap) -> None:
    plain = {_key(r): r for r in res.cases if r.mode == "plain"}
    for i, f in enumerate(res.inputs):
        pts = [(r.copy_fraction, case_speedup(r, plain[_key(r)])) for r in res.cases
               if r.file == f and r.mode != "plain" and _key(r) in plain]
        if pts:
            ax.scatter(*zip(*pts), color=cmap(i % 10), label=f"{f} ({len(pts)} cases)", alpha=0.8)
    ax.set(ylabel="measured decode speedup, ngram vs plain (x)", title="measured on this machine")


def _plot_replays(ax, res: BenchResults, cmap) -> None:
    for i, f in enumerate(res.inputs):
        for j, v in enumerate(VARIANTS):
            pts = [(r.copy_fraction, r.projected_speedup) for r in res.replays
                   if r.file == f and r.variant == v]
            if pts:
                ax.scatter(*zip(*pts), color=cmap(j), marker="os^Dv<>"[i % 7], alpha=0.7,
                           label=f"{v}: {f} ({len(pts)})")
    ax.set(ylabel="projected decode speedup (x)",
           title=f"replayed, passes priced with the {Path(res.replay_costs).name} cost table")


def print_summary(res: BenchResults, file=sys.stdout) -> None:
    for f, s in res.files.items():
        parts = []
        for mode in MODES:
            ms: ModeSummary | None = getattr(s, mode_attr(mode))
            if ms is not None and mode != "plain":
                # without plain among the modes there is nothing to compare with or to be identical to
                vs = (f"{ms.speedup_vs_plain:.2f}x vs plain ({ms.tok_s:.1f} tok/s), slowest case "
                      f"{ms.min_speedup:.2f}x (paired {ms.min_paired_speedup:.2f}x), "
                      if "plain" in res.modes else f"{ms.tok_s:.1f} tok/s (no plain mode to compare with), ")
                if ms.rechecked and "plain" in res.modes:
                    vs += (f"{ms.below_floor_paired} under {FLOOR}x paired after {ms.rechecked} "
                           f"rechecked ({ms.below_floor_first} on their first repeats), ")
                if (ms.below_floor or ms.below_floor_paired) and "plain" in res.modes:
                    vs += f"the ledger lost on {ms.below_floor_ledger} of those under {FLOOR}x, "
                if ms.loop_plain_step:
                    vs += f"the loop's plain step {ms.loop_plain_step:.2f}x plain's, "
                parts.append(f"{mode} {vs}"
                             f"acceptance {ms.acceptance:.0%}, {ms.tokens_per_pass:.2f} tok/pass"
                             + (f", identical {ms.identical}" if "plain" in res.modes else "")
                             + (", accepted/drafted by source " + ", ".join(
                                 f"{name} {a}/{d}" for name, (d, a) in ms.sources.items())
                                if ms.sources else "")
                             + (f" ({ms.divergences} diverged, max margin {ms.max_divergence_margin:.2e}"
                                f"{', BUG' if ms.max_divergence_margin > TIE_MARGIN else ''})"
                                if ms.divergences else ""))
            elif ms is not None and len(res.modes) == 1:
                parts.append(f"{mode} {ms.tok_s:.1f} tok/s")
            elif ms is not None and res.repeat > 1:
                parts.append(f"plain's own repeats differ by {ms.run_spread - 1:.0%} "
                             f"(median case; at most {ms.max_run_spread - 1:.0%})")
        if s.prefix_cache:
            p = s.prefix_cache
            warm = "after a restart" if res.restart_between_turns else "warm"
            parts.append(f"TTFT cold {p.ttft_cold_s:.2f} s, {warm} {p.ttft_warm_s:.2f} s "
                         f"({p.ttft_cold_s / p.ttft_warm_s if p.ttft_warm_s else 0:.1f}x lower)")
        parts += [f"replay {v}: {r.tokens_per_pass:.2f} tok/pass, projected {r.projected_speedup:.2f}x"
                  for v, r in s.replay.items()]
        print(f"{f}: " + ("; ".join(parts) or "no cases"), file=file)


# -- command line ---------------------------------------------------------------------------------


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "bench", help="measure speculative against plain decoding on prompt files",
        description="Run each case in every mode (alternating, greedy, one process) and write "
                    "DIR/results.json, DIR/report.md and DIR/speedup.png.")
    p.add_argument("prompts", nargs="*", type=Path, metavar="PROMPTS.jsonl")
    p.add_argument("--out", type=Path, required=True, metavar="DIR")
    p.add_argument("--model", "-m", default=None, help="model to load (default: the embedded one)")
    p.add_argument("--modes", default="plain,ngram",
                   help="comma-separated modes among plain,ngram,mtp,draft (empty: replay only; "
                        "default plain,ngram)")
    p.add_argument("--mtp", type=Path, default=None, metavar="PATH",
                   help="the MTP head for mode mtp (checkpoint directory or head file; default: the "
                        "head shipped for the default model, also named by 'shipped')")
    p.add_argument("--draft-model", default=None, metavar="M", help="the draft model for mode draft")
    p.add_argument("--repeat", type=int, default=1, help="runs per case and mode (medians)")
    p.add_argument("--recheck", type=int, default=0, metavar="N",
                   help=f"run a case N more times (alternating as before) when its first repeats put a "
                        f"mode under {FLOOR}x plain: on a noisy host, a loss that holds is drafting's, "
                        f"one that goes away was the host's; the report counts both")
    p.add_argument("--limit", type=int, default=None, help="first N cases of each file")
    p.add_argument("--resume", action="store_true",
                   help="keep the cases already in DIR/results.json and run only the others")
    p.add_argument("--replay", action="store_true",
                   help="also replay plain's outputs of cases without a reference")
    p.add_argument("--costs", type=Path, default=None, metavar="COSTS.json",
                   help="price replays with this {context: {width: seconds}} table")
    p.add_argument("--max-tokens-cap", type=int, default=None, metavar="N",
                   help="decode at most N tokens per case")
    p.add_argument("--max-draft", type=int, default=None, help="most tokens drafted per step")
    p.add_argument("--weights", choices=("auto", "float32", "quantized"), default="auto",
                   help="auto: float32 on a CPU (MLX's CPU quantized matmul is slower), as stored "
                        "on a GPU; float32 makes greedy outputs comparable across devices")
    p.add_argument("--restart-between-turns", action="store_true",
                   help="run each later turn of a conversation on a fresh engine that has only the "
                        "prefix states saved to disk: time to first token after a daemon restart")
    p.add_argument("--probe", action="append", default=[], choices=probes.PROBES,
                   help="also measure: blas (decode on this process's BLAS vs each other one installed: "
                        "OpenBLAS, BLIS, MLX's bundled one), rollback "
                        "(hybrid per-position capture vs replay), typing (ghost text over a scripted "
                        "typing session, feedback adaptation off and on: DIR/typing.md); writes DIR/probes.md")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .model import ModelError, load

    modes = [m for m in args.modes.split(",") if m]
    if not args.prompts and not args.probe:
        print("warmspec bench: give PROMPTS.jsonl files, --probe, or both", file=sys.stderr)
        return 2
    if any(m not in MODES for m in modes) or len(set(modes)) != len(modes) or args.repeat < 1 \
            or args.recheck < 0:
        print(f"warmspec bench: --modes takes distinct modes among {','.join(MODES)}; "
              "--repeat at least 1, --recheck at least 0", file=sys.stderr)
        return 2
    try:
        read_cases(args.prompts, args.limit)  # fail on bad input before loading the model
        replay_costs = read_costs(args.costs) if args.costs else None
    except (OSError, ValueError, msgspec.DecodeError) as e:
        print(f"warmspec bench: {e}", file=sys.stderr)
        return 2
    try:
        lm = load(args.model, dequantize={"auto": None, "float32": True, "quantized": False}[args.weights])
    except ModelError as e:
        print(f"warmspec bench: {e}", file=sys.stderr)
        return 1
    if args.probe:
        print(probes.run(args.probe, args.out, lm, args.model))
    if not args.prompts:
        return 0
    try:
        results = bench(lm, args.prompts, args.out, modes=modes, repeat=args.repeat,
                        limit=args.limit, max_tokens_cap=args.max_tokens_cap,
                        replay_outputs=args.replay, max_draft=args.max_draft,
                        replay_costs=replay_costs,
                        replay_costs_name=str(args.costs) if args.costs else None,
                        resume=args.resume, mtp_path=args.mtp, draft_model=args.draft_model,
                        restart_between_turns=args.restart_between_turns, recheck=args.recheck)
    except (ValueError, msgspec.DecodeError) as e:  # --resume over another run's; a mode's drafter
        print(f"warmspec bench: {e}", file=sys.stderr)
        return 2
    except ModelError as e:  # a draft model that cannot be loaded
        print(f"warmspec bench: {e}", file=sys.stderr)
        return 1
    print_summary(results)
    print(f"wrote {args.out}/results.json, report.md, speedup.png", file=sys.stderr)
    return 0
