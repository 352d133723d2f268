"""Model caches: one rollback interface for every cache kind, and the prefix store.

A verify pass appends 1 + k positions to every layer's cache; when only n drafts are accepted the
last k - n positions must go. Each mlx-lm cache kind needs a different way back:

- ``KVCache`` (and its quantized, concatenating and chunked kin): trim, O(1).
- ``RotatingKVCache`` (sliding-window attention): a multi-position update goes through its
  concatenating path, which leaves the buffer in temporal order with the new positions last, so
  slicing them off is exact even after the window has wrapped -- mlx-lm's own ``trim`` is exact
  only until it wraps, because it moves the write index without dropping the stale entries.
- ``ArraysCache`` (recurrent state of GatedDeltaNet / Mamba layers): a fixed-size state cannot be
  trimmed. Its arrays are replaced, never mutated, by a forward pass, so keeping references before
  the pass is a free snapshot; after a rejection the state is rebuilt from the snapshot, either
  from per-position states captured during the pass (``hybrid.py``) or by replaying the accepted
  tokens in one extra pass.
"""

from __future__ import annotations

from typing import Any, Sequence

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, CacheList, RotatingKVCache


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
                self.snapshots[i] = (c.keys, c.values, c.offset, c._idx)

    def rollback(self, n_keep: int) -> bool:
        """Drop the last ``n_inputs - n_keep`` positions. False: the caller must replay
        ``inputs[:n_keep]`` (every layer has then been restored to before the pass)."""
        drop = self.n_inputs - n_keep
        if drop == 0:
            return True
        recurrent = [i for i in self.snapshots if is_recurrent(self.layers[i])]
        if recurrent and self.tape is None:
            self._restore_all()
            return False
        for i, c in enumerate(self.layers):
            if is_recurrent(c):
                c.cache = list(self.tape[i][n_keep - 1])
            elif isinstance(c, RotatingKVCache):
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
            else:
                c.trim(self.n_inputs)
