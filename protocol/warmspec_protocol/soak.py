"""msgspec Structs of ``warmspec soak``: its settings and ``results.json``."""

from __future__ import annotations

from typing import Literal

from msgspec import Struct

from .bench import Machine
from .types import Status

__all__ = [
    "Intent",
    "Outcome",
    "SoakSettings",
    "RequestRecord",
    "MemorySample",
    "KindSummary",
    "ReplayRecord",
    "DaemonRun",
    "Criterion",
    "SoakResults",
]

# What the harness meant a request to do, and what happened to it. ``cancelled`` and ``malformed``
# are outcomes the harness asked for (a superseded ghost text, a dropped stream, a bad frame
# answered with an error); ``failed`` is every other way a request did not get its answer.
Intent = Literal["normal", "cancel", "disconnect", "malformed", "cut"]
Outcome = Literal["ok", "failed", "cancelled", "malformed"]


class SoakSettings(Struct, kw_only=True):
    """The load, as given on the command line; the same settings and seed give the same requests."""

    seconds: float
    seed: int
    model: str | None
    editors: int
    relay_editors: int  # of the editors, how many speak through a ``warmspec lsp`` stdio relay
    agents: int
    max_tokens: int  # chats: most tokens per answer
    inline_prefix_chars: int
    inline_suffix_chars: int
    inline_max_tokens: int
    tool_chars: int  # most characters of a file in one tool result
    long_prompt_chars: int  # prompts of the requests cancelled during prefill
    prefix_budget_bytes: int
    workspace_files: int
    sample_s: float  # resident memory and status, every this many seconds
    warmup_fraction: float  # resident memory is judged after this share of the run
    drain_s: float  # after the load, how long requests in flight may take to finish
    request_timeout_s: float  # a request without its answer after this long has failed
    daemon_args: list[str] = []  # more ``warmspec serve`` options, for both daemons (--daemon-arg)


class RequestRecord(Struct, kw_only=True, omit_defaults=True):
    """One request of the load. ``id`` is ``actor#n``: the same request in every run with the
    same seed and settings (how many an actor got through in the time varies)."""

    id: str
    actor: str
    kind: str
    transport: Literal["unix", "relay", "http"]
    intent: Intent
    outcome: Outcome
    started_s: float  # since the load began
    latency_s: float | None = None  # to the whole answer (or the error)
    ttft_s: float | None = None  # to the first streamed text (streamed kinds only)
    cancel_latency_s: float | None = None  # from $/cancelRequest to the daemon's reply
    greedy: bool = False
    key: str | None = None  # identity of what was sent, for the replay
    text: str | None = None  # the answer, for greedy requests that were not cancelled
    tokens: int | None = None  # its token count, where the API reports one
    error: str | None = None  # failed: what went wrong; cancelled/malformed: the daemon's answer


class MemorySample(Struct, kw_only=True):
    t_s: float
    rss_bytes: int
    status_latency_s: float | None = None  # warmspec/status round trip: a stalled event loop shows here
    queue: int | None = None
    active: bool | None = None
    prefix_cache_bytes: int | None = None
    prefix_cache_entries: int | None = None
    workspace_bytes: int | None = None
    mlx_active_bytes: int | None = None  # arrays alive in MLX (weights, caches, live passes)
    mlx_cache_bytes: int | None = None  # freed buffers MLX keeps for reuse


class KindSummary(Struct, kw_only=True):
    kind: str
    requests: int
    ok: int
    failed: int
    cancelled: int
    malformed: int
    ttft_p50_s: float | None = None
    ttft_p99_s: float | None = None
    latency_p50_s: float | None = None
    latency_p99_s: float | None = None
    cancel_latency_p50_s: float | None = None
    cancel_latency_p99_s: float | None = None


class ReplayRecord(Struct, kw_only=True, omit_defaults=True):
    """One distinct greedy request, run alone after the load, against every answer it got under
    load (``load_ids``)."""

    key: str
    kind: str
    load_ids: list[str]
    equal: bool
    text: str | None = None  # the answer alone
    tokens: int | None = None
    differing: list[str] = []  # the load requests whose answer was not the one alone
    difference: str | None = None  # where the first differing answer parts from it
    error: str | None = None  # the replay itself failed


class DaemonRun(Struct, kw_only=True, omit_defaults=True):
    role: Literal["load", "replay"]
    pid: int
    log: str
    ready_s: float  # from start to answering
    alive: bool = True  # still running when the harness came to stop it
    exit_code: int | None = None  # after SIGTERM
    stop_s: float | None = None
    log_errors: list[str] = []  # ERROR lines and tracebacks in its log
    status: Status | None = None  # warmspec/status at the end


class Criterion(Struct, kw_only=True):
    name: str
    passed: bool
    detail: str


class SoakResults(Struct, kw_only=True):
    settings: SoakSettings
    machine: Machine
    model: str
    started_at: str
    load_s: float  # how long the load ran (drain included)
    warmup_s: float
    harness_cpu_s: float  # CPU the harness used itself: the clients must not be the load
    replay_daemon: str  # which daemon answered the replays, and why
    files: list[str]  # the workspace: stdlib modules (``json__decoder.py`` is ``json/decoder.py``)
    keystrokes: int  # didChange notifications sent
    daemons: list[DaemonRun]
    requests: list[RequestRecord]
    kinds: list[KindSummary]
    memory: list[MemorySample]
    replays: list[ReplayRecord]
    criteria: list[Criterion]
    passed: bool
