"""msgspec Structs of ``warmspec bench``: one input line of a prompts file, and ``results.json``."""

from __future__ import annotations

from msgspec import Struct, field

from .types import Message

__all__ = [
    "WorkspaceFiles",
    "BenchCase",
    "Machine",
    "Divergence",
    "CaseResult",
    "ReplayResult",
    "ModeSummary",
    "PrefixCacheSummary",
    "ReplaySummary",
    "Summary",
    "BenchResults",
]


# -- input: one JSON object a line ---------------------------------------------------------------


class WorkspaceFiles(Struct, kw_only=True):
    files: dict[str, str]  # path relative to the workspace root -> text


class BenchCase(Struct, kw_only=True):
    """A prompt (``messages``) or a conversation replayed turn by turn (``turns``, each the full
    message list sent at that turn). ``reference`` is an output to replay drafting against;
    ``workspace`` and ``read_files`` give the files a client reported reading."""

    id: str
    messages: list[Message] | None = None
    turns: list[list[Message]] | None = None
    max_tokens: int = 256
    reference: str | None = None
    workspace: WorkspaceFiles | None = None
    read_files: list[str] = []


# -- output: results.json -------------------------------------------------------------------------


class Machine(Struct, kw_only=True):
    cpu: str
    cores: int
    os: str
    python: str
    mlx: str
    mlx_lm: str
    device: str
    blas: str
    load_avg: float  # 1-minute load when the bench started: the machine may be shared
    # Kernels the model was loaded with in MLX's place, and what the load measured to choose them
    kernels: list[str] = []
    kernel_notes: list[str] = []


class Divergence(Struct, kw_only=True):
    """Where a mode's tokens first differ from plain's, and how close plain's choice was there:
    the top-2 logit margin of a one-position pass at that position. A near tie (a small margin)
    can resolve either way between kernels of different widths on a GPU; a wide margin is a bug."""

    position: int  # index into the output
    plain_token: int | None  # None: plain had ended
    other_token: int | None  # None: the mode had ended
    margin: float  # plain's top-1 minus top-2 logit at the position
    other_gap: float | None  # plain's top-1 logit minus its logit of the mode's token
    bug: bool  # margin above the tolerance a near tie allows


class CaseResult(Struct, kw_only=True):
    """One case (one turn of a conversation) in one mode; times are medians over repeats."""

    file: str
    id: str
    mode: str
    tokens: int
    decode_s: float
    prefill_s: float
    passes: int
    drafted: int
    accepted: int
    identical_to_plain: bool
    turn: int = 0
    ttft_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    gated_steps: int = 0
    paused_steps: int = 0  # steps run without proposing: drafting had cost time (median)
    # seconds the gate's ledger booked drafting as saving, by its clock (median; negative: lost).
    # Set beside plain's decode time less this mode's, it shows whether the ledger saw a loss
    booked_s: float = 0.0
    # what the ledger priced a plain step at, from the request's steady plain steps (median
    # seconds; 0: too few of them, it used the gate's estimate). Beside plain's decode time per
    # token, it shows whether the price was right
    ledger_plain_s: float = 0.0
    finish_reason: str = ""
    copy_fraction: float = 0.0
    load_avg: float = 0.0  # 1-minute load average after the case: above the core count, noisy
    divergence: Divergence | None = None  # where the tokens first differ from plain's
    decode_runs: list[float] = []  # each repeat's decode seconds, in run order (modes alternate per repeat)
    # per guess source ("request", "workspace", "recent", "mtp", ...): [drafted, accepted], summed
    # over the repeats (drafted/accepted above are medians)
    sources: dict[str, list[int]] = {}


class ReplayResult(Struct, kw_only=True):
    """Drafting and gate replayed against a known output, passes priced with a cost table."""

    file: str
    id: str
    variant: str  # prompt_only | in_prompt | workspace
    reference: str  # "case": the case's reference text; "plain": this run's plain output
    tokens: int
    passes: int
    drafted: int
    accepted: int
    tokens_per_pass: float
    projected_speedup: float
    cost_s: float  # the passes priced from the cost table
    plain_cost_s: float  # the same tokens one pass each
    copy_fraction: float = 0.0


class ModeSummary(Struct, kw_only=True):
    cases: int
    tokens: int
    decode_s: float
    tok_s: float
    speedup_vs_plain: float
    acceptance: float
    tokens_per_pass: float
    identical: str  # "n/m"
    min_speedup: float = 0.0  # the slowest case against plain
    min_case: str = ""
    # the same from paired repeats: per case the median over repeats of plain's run against the
    # mode's run of the same repeat (seconds apart), which cancels a host that drifts between repeats
    min_paired_speedup: float = 0.0
    min_paired_case: str = ""
    below_floor: int = 0  # cases under FLOOR (0.97x) against plain, by medians
    below_floor_paired: int = 0  # the same, paired
    # ``--recheck``: the cases run again because their first repeats put them under the floor,
    # and how many of them the first repeats alone put under it, paired (the counts above take
    # every repeat)
    rechecked: int = 0
    below_floor_first: int = 0
    # of the cases under the floor (by medians or paired), those whose ledger booked drafting as
    # losing more than the floor allows (``booked_s`` under -(1 - FLOOR) of their decode time).
    # The ledger compares steps of one run (each drafting step against the request's own plain
    # steps), so a host that drifts between runs moves it little; the ratios compare runs. On an
    # H100 whose plain repeats of one prompt spread a median 20%, each of the 5 cases our 36 prose
    # prompts put under the floor (float32 and 4-bit) had its ledger booking a gain, of 0.5-6.8%
    # of its decode time (docs/bench/gpu-s47/)
    below_floor_ledger: int = 0
    # the loop's steady plain step (``ledger_plain_s``) over plain decoding's time per token,
    # median over the cases that have one (0.0: none): what the speculative loop adds to a step
    # that drafts nothing (the ledger does not book it)
    loop_plain_step: float = 0.0
    divergences: int = 0
    max_divergence_margin: float = 0.0
    # the host's noise: per case, this mode's slowest repeat over its fastest (identical work for
    # plain), the median over cases and the largest; 1.0 with one repeat
    run_spread: float = 1.0
    max_run_spread: float = 1.0
    sources: dict[str, list[int]] = {}  # per guess source: [drafted, accepted] over every repeat


class PrefixCacheSummary(Struct, kw_only=True):
    turns_cold: int
    turns_warm: int
    ttft_cold_s: float
    ttft_warm_s: float


class ReplaySummary(Struct, kw_only=True):
    cases: int
    tokens: int
    passes: int
    tokens_per_pass: float
    projected_speedup: float
    acceptance: float


class Summary(Struct, kw_only=True, omit_defaults=True):
    plain: ModeSummary | None = None
    ngram: ModeSummary | None = None
    mtp: ModeSummary | None = None
    ngram_mtp: ModeSummary | None = field(default=None, name="ngram+mtp")
    draft: ModeSummary | None = None
    prefix_cache: PrefixCacheSummary | None = None
    replay: dict[str, ReplaySummary] = {}


class BenchResults(Struct, kw_only=True):
    machine: Machine
    model: str
    inputs: list[str]
    modes: list[str]
    repeat: int
    max_draft: int
    costs: dict[int, dict[int, float]]  # verify costs measured here at start: {context: {P: s}}
    plain_costs: dict[int, float] = {}  # pipelined plain step measured here: {context: s}
    replay_costs: str  # which table priced the replays: "measured" or a file
    cases: list[CaseResult]
    replays: list[ReplayResult]
    summary: Summary
    files: dict[str, Summary]  # the same summary per input file (edits and prose differ)
    # Each later turn of a conversation ran on a fresh engine that had only the disk tier of the
    # prefix cache (what a daemon restart between turns leaves): "warm" TTFT is after a restart.
    restart_between_turns: bool = False
    # repeats added to a case that its first ``repeat`` put under the floor (0: none)
    recheck: int = 0
