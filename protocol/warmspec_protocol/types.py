"""msgspec Structs for everything warmspec sends or receives."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

__all__ = [
    "SamplingParams",
    "FunctionCall",
    "ToolCall",
    "Message",
    "SourceCount",
    "GenerationStats",
    "FinishReason",
    "ModelInfo",
    "PrefixCacheStats",
    "MemoryStats",
    "Acceptance",
    "Latency",
    "InlineStatus",
    "Status",
]

FinishReason = Literal["stop", "length", "cancelled", "error"]

MAX_STOP_STRINGS = 16


class SamplingParams(Struct, kw_only=True, forbid_unknown_fields=True):
    """How the next token is chosen. temperature 0 means greedy.

    The same processed distribution (temperature, then top-k, top-p, min-p) is used by plain and
    speculative decoding, so speculative sampling is exact.
    """

    temperature: Annotated[float, Meta(ge=0.0, le=10.0)] = 0.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Meta(ge=0)] = 0
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    seed: Annotated[int, Meta(ge=0, le=2**63 - 1)] | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class FunctionCall(Struct, kw_only=True):
    """A function an assistant turn called; ``arguments`` as chat templates expect (they ``tojson``
    a dict), or the raw text when it was not JSON."""

    name: str
    arguments: Any


class ToolCall(Struct, kw_only=True, omit_defaults=True):
    id: str | None = None
    type: str = "function"
    function: FunctionCall


class Message(Struct, kw_only=True, omit_defaults=True):
    """One chat turn, as chat templates read it: plain-text ``content``; an assistant turn may
    carry ``tool_calls``, a ``tool`` turn answers one by ``tool_call_id``."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class SourceCount(Struct, kw_only=True):
    """Draft tokens one guess source proposed for verification, and how many were accepted."""

    drafted: int = 0
    accepted: int = 0


class GenerationStats(Struct, kw_only=True, omit_defaults=False):
    """What one request cost and how much speculation saved.

    ``passes`` counts forward passes during decoding (prefill excluded); ``tokens_per_pass`` is
    completion tokens over passes, 1.0 without speculation.
    """

    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    passes: int = 0
    draft_passes: int = 0  # passes that verified at least one drafted token
    drafted: int = 0
    accepted: int = 0
    gated_steps: int = 0  # a guess was available but the gate judged a plain pass cheaper
    paused_steps: int = 0  # steps run without proposing: drafting had cost time (the gate's ledger)
    draft_s: float = 0.0  # host time spent proposing: the drafters' share of decode_s
    # per depth (draft position 1, 2, ...): drafts verified there and accepted there
    drafted_at: list[int] = []
    accepted_at: list[int] = []
    # per guess source ("request": the prompt and the answer so far; "workspace": files read;
    # "recent": earlier answers; "prediction": a client's predicted output)
    sources: dict[str, SourceCount] = {}

    @property
    def tokens_per_pass(self) -> float:
        return self.completion_tokens / self.passes if self.passes else 0.0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_draft_length(self) -> float:
        return self.drafted / self.draft_passes if self.draft_passes else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.completion_tokens / self.decode_s if self.decode_s > 0 else 0.0

    def summary(self) -> str:
        """One line a person can read, as logged per request."""
        line = (
            f"{self.completion_tokens} tokens, {self.decode_tok_s:.1f} tok/s, "
            f"prefill {self.prompt_tokens - self.cached_tokens} tok in {self.prefill_s:.2f} s"
        )
        if self.cached_tokens:
            line += f" ({self.cached_tokens} cached)"
        if self.passes:
            line += f", {self.passes} passes ({self.tokens_per_pass:.2f} tok/pass)"
        if self.drafted:
            line += (f", acceptance {self.acceptance:.0%} of {self.drafted} drafted"
                     f" (mean draft {self.mean_draft_length:.1f})")
        if self.gated_steps:
            line += f", {self.gated_steps} guesses gated off"
        if self.paused_steps:
            line += f", drafting paused {self.paused_steps} steps (it was losing time)"
        if self.accepted:
            line += ", accepted from " + ", ".join(
                f"{name} {c.accepted}" for name, c in sorted(self.sources.items(), key=lambda x: -x[1].accepted)
                if c.accepted)
        return line

    def count(self, source: str, drafted: int, accepted: int) -> None:
        c = self.sources.get(source)
        if c is None:
            c = self.sources[source] = SourceCount()
        c.drafted += drafted
        c.accepted += accepted


class ModelInfo(Struct, kw_only=True):
    """The loaded model."""

    id: str
    source: str
    device: str
    quantized: bool
    context_length: int | None
    parameters_bytes: int
    defaults: SamplingParams


class PrefixCacheStats(Struct, kw_only=True):
    """Reuse of earlier requests' caches: hits, tokens not prefilled again, memory held."""

    hits: int = 0
    misses: int = 0
    tokens_reused: int = 0
    entries: int = 0
    bytes: int = 0
    budget_bytes: int = 0
    evictions: int = 0
    # The disk tier (states saved at eviction, shutdown and idle unload; read after a restart).
    disk_entries: int = 0
    disk_bytes: int = 0
    disk_budget_bytes: int = 0  # 0: no disk tier
    disk_hits: int = 0
    disk_tokens_loaded: int = 0
    disk_writes: int = 0
    disk_dropped: int = 0  # truncated, corrupt or foreign files removed


class MemoryStats(Struct, kw_only=True):
    """The daemon's resident set (now and its peak), MLX's own accounting, and the memory
    available to load more (Linux ``MemAvailable``; Metal's recommended working set)."""

    rss_bytes: int = 0
    peak_rss_bytes: int = 0
    available_bytes: int = 0
    mlx_active_bytes: int = 0
    mlx_peak_bytes: int = 0
    mlx_cache_bytes: int = 0


class Acceptance(Struct, kw_only=True):
    """What became of the ghost-text suggestions of one document or language, as the editor
    reported them (``warmspec/inlineCompletionFeedback``). ``partial``: accepted in part (next word,
    next line); ``chars_accepted`` counts the characters of every full and partial accept."""

    shown: int = 0
    accepted: int = 0
    partial: int = 0
    dismissed: int = 0
    chars_shown: int = 0
    chars_accepted: int = 0

    @property
    def rate(self) -> float:
        """Suggestions shown that were accepted, wholly or in part."""
        return (self.accepted + self.partial) / self.shown if self.shown else 0.0


class Latency(Struct, kw_only=True):
    """Median and 90th percentile, in milliseconds, over the most recent requests (``count``)."""

    count: int = 0
    p50_ms: float = 0.0
    p90_ms: float = 0.0


class InlineStatus(Struct, kw_only=True):
    """Ghost text since the daemon started. ``first_visible`` is the time from reading a request to
    the first character of its suggestion a client can see (the first partial with a non-blank
    character; the answer itself when it came from the cache), ``final`` to the answer. Requests
    end ``cancelled`` (``$/cancelRequest``, a newer request or an edit of the document while it
    ran), at their ``deadline`` (answered with the text so far), or with the whole suggestion.
    ``tokens_generated`` counts the tokens decoded for suggestions, ``tokens_thrown_away`` those
    of suggestions dismissed, cancelled or not accepted in full (by character share).
    ``prefetched`` counts the suggestions started at a typing ``didChange`` (``prefetch``),
    ``prefetch_attached`` the requests that were served by one while it ran.
    ``documents`` (the most recent 256) and ``languages`` hold the editors' feedback."""

    requests: int = 0
    cache_hits: int = 0
    cancelled: int = 0
    deadline: int = 0
    first_visible: Latency = msgspec.field(default_factory=Latency)
    final: Latency = msgspec.field(default_factory=Latency)
    tokens_generated: int = 0
    tokens_thrown_away: int = 0
    next_edits: int = 0  # warmspec/nextEdit answers with an edit
    alternatives: int = 0  # warmspec/alternatives requests served
    prefetched: int = 0
    prefetch_attached: int = 0
    acceptance: Acceptance = msgspec.field(default_factory=Acceptance)
    documents: dict[str, Acceptance] = {}
    languages: dict[str, Acceptance] = {}


class Status(Struct, kw_only=True):
    """What the daemon is doing: model, queue, cumulative statistics, memory. ``pid`` tells clients
    whether they share one daemon; ``workspace_roots`` are the directories whose files it may index
    (``--workspace`` and those editors added)."""

    pid: int
    model: ModelInfo
    blas: str
    uptime_s: float
    queue: int
    active: bool
    requests_completed: int
    requests_failed: int
    totals: GenerationStats
    workspace_files: int = 0
    workspace_bytes: int = 0
    workspace_roots: list[str] = []
    prefix_cache: PrefixCacheStats = msgspec.field(default_factory=PrefixCacheStats)
    engine_resets: int = 0  # live caches dropped after an internal error (0 when healthy)
    memory: MemoryStats = msgspec.field(default_factory=MemoryStats)
    # Idle unload (``serve --keep-alive``): "unloaded" frees weights and caches until a request.
    model_state: Literal["loaded", "unloading", "unloaded", "loading"] = "loaded"
    keep_alive_s: float | None = None  # null: never unloaded
    idle_s: float = 0.0  # since the last request finished
    loads: int = 1  # times the weights were loaded (1 + reloads after idle unloads)
    inline: InlineStatus = msgspec.field(default_factory=InlineStatus)


def to_builtins(obj: Struct) -> dict:
    return msgspec.to_builtins(obj)
