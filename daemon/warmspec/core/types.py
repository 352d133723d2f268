"""The decode core's own small types: how to choose tokens, what a request cost, why it ended.

The core never sees a wire format. The server converts its requests into these at its edge and
these into its responses (``warmspec_protocol`` has wire twins of the same shape, with the
validation and documentation clients need); tools (bench, probes, soak) use these directly.
"""

from __future__ import annotations

from typing import Literal

from msgspec import Struct

FinishReason = Literal["stop", "length", "cancelled", "error"]


class SamplingParams(Struct, kw_only=True, frozen=True):
    """How the next token is chosen; temperature 0 is greedy. Plain and speculative decoding
    process logits the same way (temperature, then top-k, top-p, min-p), so speculative sampling
    is exact."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class SourceCount(Struct, kw_only=True):
    """Draft tokens one guess source had verified, and how many were accepted."""

    drafted: int = 0
    accepted: int = 0


class GenerationStats(Struct, kw_only=True):
    """What one request cost and how much speculation saved. ``passes`` counts forward passes
    while decoding (prefill excluded); ``sources`` splits drafted/accepted by guess source
    ("request": the prompt and the answer so far; "workspace": files read; "recent": earlier
    answers; "prediction": a client's predicted output; "mtp", "draft": model drafters)."""

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
    sources: dict[str, SourceCount] = {}

    @property
    def tokens_per_pass(self) -> float:
        return self.completion_tokens / self.passes if self.passes else 0.0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.completion_tokens / self.decode_s if self.decode_s > 0 else 0.0

    def count(self, source: str, drafted: int, accepted: int) -> None:
        """One verified draft: its source, its length and how many of its tokens were accepted."""
        c = self.sources.get(source)
        if c is None:
            c = self.sources[source] = SourceCount()
        c.drafted += drafted
        c.accepted += accepted
        for at, n in ((self.drafted_at, drafted), (self.accepted_at, accepted)):
            at.extend([0] * (n - len(at)))
            for i in range(n):
                at[i] += 1

    def add(self, other: "GenerationStats") -> None:
        """Fold ``other`` into these totals."""
        for f in ("prompt_tokens", "cached_tokens", "completion_tokens", "passes", "draft_passes",
                  "drafted", "accepted", "gated_steps", "paused_steps", "prefill_s", "decode_s", "draft_s"):
            setattr(self, f, getattr(self, f) + getattr(other, f))
        for name, c in other.sources.items():
            mine = self.sources.setdefault(name, SourceCount())
            mine.drafted += c.drafted
            mine.accepted += c.accepted
        for mine, theirs in ((self.drafted_at, other.drafted_at), (self.accepted_at, other.accepted_at)):
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, n in enumerate(theirs):
                mine[i] += n

    def summary(self) -> str:
        """One line a person can read, as logged per request."""
        line = (f"{self.completion_tokens} tokens, {self.decode_tok_s:.1f} tok/s, "
                f"prefill {self.prompt_tokens - self.cached_tokens} tok in {self.prefill_s:.2f} s")
        if self.cached_tokens:
            line += f" ({self.cached_tokens} cached)"
        if self.passes:
            line += f", {self.passes} passes ({self.tokens_per_pass:.2f} tok/pass)"
        if self.drafted:
            line += f", acceptance {self.acceptance:.0%} of {self.drafted} drafted"
            if len(self.drafted_at) > 1:
                line += " (by depth " + "/".join(f"{a / d:.0%}" for a, d in
                                                 zip(self.accepted_at[:4], self.drafted_at[:4]) if d) + ")"
        if self.gated_steps:
            line += f", {self.gated_steps} guesses gated off"
        if self.paused_steps:
            line += f", drafting paused {self.paused_steps} steps (it was losing time)"
        if self.accepted:
            line += ", accepted from " + ", ".join(
                f"{name} {c.accepted}" for name, c in sorted(self.sources.items(), key=lambda x: -x[1].accepted)
                if c.accepted)
        return line


class PrefixCacheStats(Struct, kw_only=True):
    """Reuse of earlier requests' caches: hits, tokens not prefilled again, memory held."""

    hits: int = 0
    misses: int = 0
    tokens_reused: int = 0
    entries: int = 0
    bytes: int = 0
    budget_bytes: int = 0
    evictions: int = 0
