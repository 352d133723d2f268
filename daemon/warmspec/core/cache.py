"""Model caches: one rollback interface for every cache kind, and the prefix store.

Prefix caching: agents resend a growing conversation every turn. The engine keeps its live cache
as a ``CacheState`` and, when a request diverges from it, parks it in the ``PrefixStore``; a new
request starts from whichever state serves the longest prefix of its prompt. Attention layers
rewind to any length; recurrent layers and wrapped sliding windows only to a checkpoint taken at
regular intervals during prefill, at the end of each prompt and at the end of each answer.

A verify pass appends 1 + k positions to every layer's cache; when only n drafts are accepted the
last k - n positions must go. Each mlx-lm cache kind needs a different way back:

- ``KVCache`` (and its quantized and concatenating kin): trim, O(1).
- ``ChunkedKVCache`` (llama4's chunked local attention): trim, O(1), within a pass -- a pass
  keeps the positions it appends. It drops positions before ``start_position`` for good (it keeps
  about one chunk), so for the prefix cache it rewinds only while the rewound position's chunk is
  still whole, and otherwise from a checkpoint, as a wrapped sliding window does.
- ``RotatingKVCache`` (sliding-window attention): a multi-position update goes through its
  concatenating path, which leaves the buffer in temporal order with the new positions last, so
  slicing them off is exact even after the window has wrapped -- mlx-lm's own ``trim`` is exact
  only until it wraps, because it moves the write index without dropping the stale entries. A
  one-position update (a plain step run ahead) writes in place, possibly over the oldest slot, so
  it is undone from a snapshot of the buffer taken before it.
- ``ArraysCache`` (recurrent state of GatedDeltaNet / Mamba layers): a fixed-size state cannot be
  trimmed. Its arrays are replaced, never mutated, by a forward pass, so keeping references before
  the pass is a free snapshot; after a rejection the state is rebuilt from the snapshot, either
  from per-position states captured during the pass (``hybrid.py``) or by replaying the accepted
  tokens in one extra pass.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Iterable, Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, CacheList, ChunkedKVCache, RotatingKVCache


def layers(cache: Sequence[Any]) -> list[Any]:
    """Flatten ``CacheList`` containers into their leaf caches."""
    out: list[Any] = []
    for c in cache:
        if isinstance(c, CacheList):
            out.extend(layers(c.caches))
        else:
            out.append(c)
    return out


def is_recurrent(c: Any) -> bool:
    return isinstance(c, ArraysCache)


def has_recurrent(cache: Sequence[Any]) -> bool:
    return any(is_recurrent(c) for c in layers(cache))


def offset(cache: Sequence[Any]) -> int:
    """Number of positions the cache has seen (from its first attention layer)."""
    for c in layers(cache):
        if hasattr(c, "offset"):
            return int(c.offset)
    return 0


def _slice_rotating(c: RotatingKVCache, n: int) -> None:
    keep = c._idx - n
    c.keys = c.keys[..., :keep, :]
    c.values = c.values[..., :keep, :]
    c.offset -= n
    c._idx = keep


class Checkpoint:
    """Taken before a pass of ``n_inputs`` positions; ``rollback(n_keep)`` keeps the first ``n_keep``.

    ``tape`` may be set by a forward that captured per-position recurrent states
    (``{layer_index: [state after position 0, 1, ...]}``); with it a rejection costs no extra pass.
    """

    def __init__(self, cache: Sequence[Any], n_inputs: int):
        self.layers = layers(cache)
        self.n_inputs = n_inputs
        self.snapshots: dict[int, Any] = {}
        self.tape: dict[int, list[list[mx.array]]] | None = None
        for i, c in enumerate(self.layers):
            if is_recurrent(c):
                self.snapshots[i] = list(c.cache)
            elif isinstance(c, RotatingKVCache):
                # new handles: a one-position update writes the buffer in place
                self.snapshots[i] = (_copy(c.keys), _copy(c.values), c.offset, c._idx)
            elif isinstance(c, ChunkedKVCache):
                # a pass may drop positions from the front (``maybe_trim_front``) counting the
                # positions of a pass before it that is then cut: undone whole, it is restored
                self.snapshots[i] = (_copy(c.keys), _copy(c.values), c.offset, c.start_position)

    def rollback(self, n_keep: int) -> bool:
        """Drop the last ``n_inputs - n_keep`` positions. False: the caller must replay
        ``inputs[:n_keep]`` (every layer has then been restored to before the pass)."""
        drop = self.n_inputs - n_keep
        if drop == 0:
            return True
        if n_keep == 0:  # the whole pass (one queued past the answer's end): as it was before it
            self._restore_all()
            return True
        recurrent = [i for i in self.snapshots if is_recurrent(self.layers[i])]
        if recurrent and self.tape is None:
            self._restore_all()
            return False
        for i, c in enumerate(self.layers):
            if is_recurrent(c):
                c.cache = list(self.tape[i][n_keep - 1])
            elif isinstance(c, RotatingKVCache):
                if self.n_inputs == 1:  # written in place, maybe over the oldest slot: restore
                    c.keys, c.values, c.offset, c._idx = self.snapshots[i]
                else:
                    _slice_rotating(c, drop)
            else:
                c.trim(drop)
        return True

    def _restore_all(self) -> None:
        for i, c in enumerate(self.layers):
            if is_recurrent(c):
                c.cache = list(self.snapshots[i])
            elif isinstance(c, RotatingKVCache):
                c.keys, c.values, c.offset, c._idx = self.snapshots[i]
            elif isinstance(c, ChunkedKVCache):
                c.keys, c.values, c.offset, c.start_position = self.snapshots[i]
            else:
                c.trim(self.n_inputs)


# -- prefix caching ---------------------------------------------------------------------------------

def _copy(x: Any) -> Any:
    """A new handle on the same data: MLX arrays are copy-on-write, but two caches must never share
    one Python array object (an in-place update of one would rebind the other)."""
    if isinstance(x, mx.array):
        return mx.array(x)
    if isinstance(x, list):
        return [_copy(v) for v in x]
    if isinstance(x, tuple):
        return tuple(_copy(v) for v in x)
    return x


def _clone_layer(c: Any) -> Any:
    if isinstance(c, CacheList):
        return CacheList(*(_clone_layer(x) for x in c.caches))
    return type(c).from_state(_copy(c.state))


def trimmable_kind(c: Any) -> bool:
    """Attention caches that hold every position and can drop any suffix."""
    return not isinstance(c, (RotatingKVCache, ArraysCache, ChunkedKVCache)) and c.is_trimmable()


def _can_rewind(c: Any, t: int) -> bool:
    """Can this layer be brought back to ``t`` positions without a checkpoint?"""
    if isinstance(c, RotatingKVCache):
        # unwrapped and in temporal order: slot i holds position i
        return c.keys is None or (c.offset == c._idx and t <= c.offset)
    if isinstance(c, ChunkedKVCache):
        # its ``trim`` stops at ``start_position``; position t attends back to the start of its
        # chunk, which must still be held
        return c.keys is None or (c.start_position <= t - t % c.chunk_size and t <= c.offset)
    if isinstance(c, ArraysCache):
        return False
    return c.is_trimmable()


def _lcp(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n


def longest_usable(entries: Iterable[Any], target: Sequence[int]) -> tuple[Any, int]:
    """The entry whose ``usable(target)`` is largest (the first of equals), and that count; (None, 0)
    when none serves a token. Serves the memory store and the disk tier alike."""
    best, best_use = None, 0
    for e in entries:
        use = e.usable(target)
        if use > best_use:
            best, best_use = e, use
    return best, best_use


class CacheState:
    """A model cache, the tokens whose state it holds, and checkpoints of the layers that cannot
    be trimmed (recurrent state; sliding windows after they wrap) at chosen positions."""

    def __init__(self, cache: list[Any], tokens: Sequence[int] = (),
                 checkpoints: dict[int, dict[int, Any]] | None = None):
        self.cache = cache
        self.tokens = list(tokens)
        self.checkpoints: dict[int, dict[int, Any]] = checkpoints or {}
        self.last_used = time.monotonic()

    @property
    def nbytes(self) -> int:
        total = sum(c.nbytes for c in layers(self.cache) if not c.empty())
        for states in self.checkpoints.values():
            total += sum(_nbytes(s) for s in states.values())
        return total

    def _exact_layers(self) -> list[int]:
        return [i for i, c in enumerate(layers(self.cache)) if not trimmable_kind(c)]

    def checkpoint(self) -> None:
        """Remember the untrimmable layers' state at the current length."""
        exact = self._exact_layers()
        if exact and self.tokens:
            leaves = layers(self.cache)
            self.checkpoints[len(self.tokens)] = {i: _copy(leaves[i].state) for i in exact}

    def usable(self, target: Sequence[int]) -> int:
        """How many leading tokens of ``target`` this state can serve."""
        common = _lcp(self.tokens, target)
        if common == len(self.tokens) or all(_can_rewind(c, common) for c in layers(self.cache)):
            return common
        return max((t for t in self.checkpoints if t <= common), default=0)

    def rewind(self, t: int, fresh: Callable[[], list[Any]]) -> None:
        """Bring the cache back to its first ``t`` tokens (``t`` from ``usable``), in place."""
        if t == len(self.tokens):
            return
        if t == 0:
            self.cache, self.tokens, self.checkpoints = fresh(), [], {}
            return
        saved = self.checkpoints.get(t, {})
        for i, c in enumerate(layers(self.cache)):
            if i in saved:
                c.state = _copy(saved[i])
            elif not _can_rewind(c, t):
                raise ValueError(f"layer {i} cannot rewind to {t} without a checkpoint")
            elif isinstance(c, RotatingKVCache):
                _slice_rotating(c, c.offset - t)
            else:
                c.trim(c.offset - t)
        del self.tokens[t:]
        self.checkpoints = {p: s for p, s in self.checkpoints.items() if p <= t}

    def clone(self) -> "CacheState":
        """An independent copy (copy-on-write: nothing is copied until one side writes)."""
        return CacheState([_clone_layer(c) for c in self.cache], self.tokens, dict(self.checkpoints))


def _nbytes(x: Any) -> int:
    if isinstance(x, mx.array):
        return x.nbytes
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(v) for v in x)
    return 0


def default_budget_bytes() -> int:
    """A quarter of physical memory, at most 8 GiB: room for a few long agent conversations."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 16 << 30
    return min(total // 4, 8 << 30)


class PrefixStore:
    """Caches of earlier requests, reused by the longest usable prefix; LRU within a byte budget.

    Entries are few (a budget of gigabytes holds a handful of long conversations), so lookup
    compares the new prompt with each entry's tokens (a vectorized longest-common-prefix, well
    under a millisecond for 8k tokens) instead of maintaining a token trie. An entry whose tokens
    are a prefix of a newer entry's is dropped when the newer one arrives: its state is a prefix
    of the newer state and its checkpoints travel with the clone it was made from.
    """

    def __init__(self, budget_bytes: int | None = None):
        self.budget_bytes = default_budget_bytes() if budget_bytes is None else budget_bytes
        self.entries: list[CacheState] = []  # least recently used first
        self.hits = 0
        self.misses = 0
        self.tokens_reused = 0
        self.evictions = 0
        # Called with each evicted state (the disk tier spills it; see prefix_disk.py).
        self.on_evict: Callable[[CacheState], None] | None = None

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def best(self, target: Sequence[int]) -> tuple[CacheState | None, int]:
        return longest_usable(self.entries, target)

    def take(self, entry: CacheState) -> CacheState:
        """A copy of ``entry`` to continue decoding on; the entry stays, most recently used.
        The copy is independent, so a later ``put`` may evict or supersede the entry freely."""
        entry.last_used = time.monotonic()
        self.entries.remove(entry)
        self.entries.append(entry)
        return entry.clone()

    def put(self, state: CacheState) -> None:
        if not state.tokens:
            return
        n = len(state.tokens)
        kept = []
        for e in self.entries:
            if len(e.tokens) <= n and _lcp(e.tokens, state.tokens) == len(e.tokens):
                for p, saved in e.checkpoints.items():  # same tokens up to p: still valid
                    state.checkpoints.setdefault(p, saved)
            else:
                kept.append(e)
        self.entries = kept
        state.last_used = time.monotonic()
        self.entries.append(state)
        total = self.nbytes
        while total > self.budget_bytes and self.entries:
            gone = self.entries.pop(0)
            total -= gone.nbytes
            self.evictions += 1
            if self.on_evict is not None:
                self.on_evict(gone)

    def clear(self) -> None:
        self.entries.clear()
