"""The decode core: prefill, the one verify step and everything it needs -- the target pass,
guess sources, the gate, rollback for every cache kind, the prefix store, sampling. Nothing here
imports the server or a wire format; callers (the server, bench, probes, soak) use this API.

- ``engine``: ``Engine`` -- prefill, the decode loop (pipelined plain steps, verify passes).
- ``target``: the target pass ``verify(inputs, cache) -> Pass``; plain and hybrid-capturing.
- ``drafter``: the drafter interface ``propose(k) -> Proposal``, ``commit(tokens, pass)``;
  implementations: ``ngram`` (the conversation, workspace files, recent answers, a client's
  prediction), ``mtp`` (a model's multi-token-prediction head), ``draft_model``.
- ``gate``: measured pass costs and acceptance -> draft length and source.
- ``cache``: rollback (``Checkpoint``), ``CacheState`` and the ``PrefixStore``; ``hybrid``: the
  GatedDeltaNet pass that captures per-position states.
- ``sampling``: greedy, truncations, exact speculative sampling; ``types``: the core's own types.
"""

from importlib import import_module
from typing import Any

from .drafter import Drafter, Proposal
from .gate import CostTable, Gate
from .ngram import DEFAULT_MIN_N, NgramDrafter, NgramIndex, Source
from .types import FinishReason, GenerationStats, PrefixCacheStats, SamplingParams, SourceCount

# Loaded on first use: they import MLX, and the CLI imports this package before it re-executes
# itself on OpenBLAS -- MLX loaded before that would bind the slow bundled BLAS.
_LAZY = {name: "engine" for name in ("MAX_DRAFT", "Delta", "Engine", "EngineError", "Finished", "Run",
                                     "default_cost_cache")}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Delta", "Drafter", "Engine", "EngineError", "Finished", "Run", "MAX_DRAFT", "default_cost_cache",
    "CostTable", "Gate", "Proposal", "NgramDrafter", "NgramIndex", "Source", "DEFAULT_MIN_N",
    "FinishReason", "GenerationStats", "PrefixCacheStats", "SamplingParams", "SourceCount",
]
