"""The prefix cache's disk tier: warm conversation states that survive a restart.

A coding agent's conversation costs a cold prefill of its whole prefix after every daemon restart
(31 s for a 3k-token prefix of the default model on a 2-core CPU, against 1 s warm). So states the
memory store evicts, and every state at shutdown or idle unload, are written here, and a request
whose prompt the memory tier serves poorly loads the longest usable prefix from disk instead.

One file per state, in the safetensors layout (readable by ``mx.load``): every array of the cache
-- attention KV, sliding windows with their offset/_idx/keep, recurrent ``ArraysCache`` state, and
the checkpoints of the layers that cannot rewind -- plus a header (``__metadata__["warmspec"]``)
with the format version, the model identity (the weights file, its size and mtime, the dtype
choice, MLX's version and a sample of the weights themselves), the tokens, the checkpoint
positions and a SHA-256 of header and payload. A file that is truncated, corrupt or made for
other weights is dropped and logged and the request prefills cold: never a different answer.

Threads: the decode thread only snapshots a state (numpy views of its evaluated arrays, a few
milliseconds) and queues it; one writer thread hashes and writes, keeps the index and the disk
budget (LRU by bytes), and publishes the index as an immutable tuple. Reads happen on the decode
thread, and only when the tokens they save are worth more than reading the file. The writer never
calls MLX: it touches numpy views of arrays that nobody mutates any more (an evicted state has no
other owner; MLX never updates a buffer in place while another reference holds it).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import shutil
import struct
import threading
import time
from pathlib import Path
from typing import Any, Sequence

import mlx.core as mx
import msgspec
import numpy as np
from mlx_lm.models import cache as mlx_cache

from .cache import CacheState, _can_rewind, _lcp, layers, longest_usable
from ..model import LoadedModel

log = logging.getLogger("warmspec.prefix_disk")

FORMAT = 1
SUFFIX = ".safetensors"
# Reading a state back: page cache or NVMe give 1-3 GB/s; 1 GB/s keeps the estimate honest on
# slower disks. With the default model a prefix token is 46 KB, so a load costs ~46 us a token
# against ~10 ms a token of prefill on this CPU: a load wins unless it saves almost nothing.
READ_BYTES_PER_S = 1e9
DEFAULT_PREFILL_S_PER_TOKEN = 0.002  # until the engine has measured its own
# Evicted states waiting for the writer hold their memory until written; beyond this many bytes
# a new eviction is dropped (logged) rather than queued: the writer must never grow memory.
MAX_PENDING_BYTES = 1 << 30

_DTYPES = {mx.float32: ("F32", np.float32), mx.float16: ("F16", np.float16),
           mx.bfloat16: ("BF16", np.uint16), mx.int32: ("I32", np.int32), mx.uint32: ("U32", np.uint32),
           mx.int64: ("I64", np.int64), mx.uint64: ("U64", np.uint64), mx.int16: ("I16", np.int16),
           mx.uint16: ("U16", np.uint16), mx.int8: ("I8", np.int8), mx.uint8: ("U8", np.uint8),
           mx.bool_: ("BOOL", np.bool_)}
_BY_NAME = {name: (dt, npt) for dt, (name, npt) in _DTYPES.items()}


class CorruptEntry(ValueError):
    """A file that cannot be trusted: truncated, checksum mismatch, other weights or format."""


def default_budget_bytes(root: Path) -> int:
    """A tenth of the free space where the cache lives, at most 4 GiB: dozens of long agent
    conversations of a small model, a few of a 9B one."""
    probe = root
    while not probe.exists():
        probe = probe.parent
    return min(shutil.disk_usage(probe).free // 10, 4 << 30)


def model_identity(lm: LoadedModel) -> str:
    """A digest of everything that makes a saved state valid for this model: the weights file (path,
    size, mtime), the dtype choice, MLX's version, every parameter's name, shape and dtype, and a
    sample of each parameter's values (random-weight models have no file; a changed file at the
    same path changes the sample)."""
    from mlx.utils import tree_flatten

    h = hashlib.sha256(f"warmspec-prefix-{FORMAT}|{mx.__version__}|{lm.quantized}".encode())
    src = Path(lm.source)
    if src.exists():
        files = sorted(src.glob("*.safetensors")) if src.is_dir() else [src]
        for f in files:
            st = f.stat()
            h.update(f"|{f.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
    else:
        h.update(f"|{lm.source}".encode())
    params = tree_flatten(lm.model.parameters())
    samples = []
    for name, p in params:
        h.update(f"|{name}{tuple(p.shape)}{p.dtype}".encode())
        flat = p.reshape(-1)
        samples.append(flat[:: max(flat.size // 8, 1)][:8].astype(mx.float32))
    mx.eval(samples)
    for s in samples:
        h.update(np.asarray(s).tobytes())
    return h.hexdigest()


# -- states <-> arrays and a JSON skeleton -----------------------------------------------------------


def _skeleton(x: Any, arrays: dict[str, mx.array]) -> Any:
    """``x`` (a cache's state: arrays, scalars, None, nested lists and tuples) as JSON, each array
    replaced by a reference into ``arrays``."""
    if isinstance(x, mx.array):
        name = f"a{len(arrays)}"
        arrays[name] = x
        return {"$a": name}
    if isinstance(x, tuple):
        return {"$t": [_skeleton(v, arrays) for v in x]}
    if isinstance(x, list):
        return [_skeleton(v, arrays) for v in x]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    raise TypeError(f"cannot save a cache state holding {type(x).__name__}")


def _unskeleton(x: Any, arrays: dict[str, mx.array]) -> Any:
    if isinstance(x, dict):
        if "$a" in x:
            return arrays[x["$a"]]
        return tuple(_unskeleton(v, arrays) for v in x["$t"])
    if isinstance(x, list):
        return [_unskeleton(v, arrays) for v in x]
    return x


def _cache_class(name: str) -> type:
    cls = getattr(mlx_cache, name, None)
    if not (isinstance(cls, type) and issubclass(cls, mlx_cache._BaseCache)):
        raise CorruptEntry(f"unknown cache class {name!r}")
    return cls


class Snapshot(msgspec.Struct):
    """A state ready for the writer: its header and numpy views of its evaluated arrays."""

    key: str
    meta: dict
    arrays: list[tuple[str, str, np.ndarray]]  # (name, safetensors dtype, data)
    nbytes: int


def token_key(tokens: Sequence[int]) -> str:
    return hashlib.sha256(np.asarray(tokens, dtype=np.int32).tobytes()).hexdigest()[:32]


def snapshot(state: CacheState, identity: str) -> Snapshot:
    """Runs on the decode thread: the arrays are evaluated here, the writer only reads bytes."""
    arrays: dict[str, mx.array] = {}
    layout = [{"class": type(c).__name__, "state": _skeleton(c.state, arrays)} for c in state.cache]
    checkpoints = {str(p): {str(i): _skeleton(s, arrays) for i, s in saved.items()}
                   for p, saved in sorted(state.checkpoints.items())}
    mx.eval(list(arrays.values()))
    views = []
    for name, a in arrays.items():
        dtype, _ = _DTYPES[a.dtype]
        views.append((name, dtype, np.asarray(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)))
    meta = {"format": FORMAT, "identity": identity, "mlx": mx.__version__, "tokens": list(state.tokens),
            "checkpoints": sorted(state.checkpoints), "layout": layout, "saved": checkpoints,
            "rewindable": all(_can_rewind(c, 0) for c in layers(state.cache))}
    return Snapshot(token_key(state.tokens), meta, views, sum(v.nbytes for _, _, v in views))


def _digest(meta: dict, chunks: Sequence[memoryview | bytes]) -> str:
    h = hashlib.sha256(json.dumps({k: v for k, v in meta.items() if k != "checksum"},
                                  sort_keys=True).encode())
    for c in chunks:
        h.update(c)
    return h.hexdigest()


def write_file(path: Path, snap: Snapshot) -> int:
    """Write ``snap`` as a safetensors file, atomically (a temporary file renamed into place)."""
    data = [np.ascontiguousarray(v) for _, _, v in snap.arrays]
    meta = dict(snap.meta, checksum=_digest(snap.meta, [memoryview(d).cast("B") for d in data]))
    header: dict[str, Any] = {"__metadata__": {"warmspec": json.dumps(meta)}}
    offset = 0
    for (name, dtype, _), d in zip(snap.arrays, data):
        header[name] = {"dtype": dtype, "shape": list(d.shape), "data_offsets": [offset, offset + d.nbytes]}
        offset += d.nbytes
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(head)))
            f.write(head)
            for d in data:
                f.write(memoryview(d).cast("B"))
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
    return 8 + len(head) + offset


def read_header(path: Path) -> tuple[dict, dict, int]:
    """``(tensor table, warmspec metadata, data offset)``; ``CorruptEntry`` if unreadable."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CorruptEntry("truncated header")
        n = struct.unpack("<Q", raw)[0]
        if n > 256 << 20:
            raise CorruptEntry("header too large")
        head = f.read(n)
    if len(head) < n:
        raise CorruptEntry("truncated header")
    try:
        table = json.loads(head)
        meta = json.loads(table.pop("__metadata__")["warmspec"])
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptEntry(f"unreadable header ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CorruptEntry(f"format {meta.get('format') if isinstance(meta, dict) else '?'}, not {FORMAT}")
    return table, meta, 8 + n


def read_state(path: Path, identity: str) -> CacheState:
    """Read, verify and rebuild a state (on the decode thread).

    ``mx.load`` reads each array straight into its own MLX buffer, and the checksum is taken over
    those buffers: no copy of the file in a Python ``bytes`` and no second copy into MLX. The
    copies (a 12-40 MB buffer and its arrays, made on the decode thread and freed at once) were
    what the disk tier added to the C heap under ``warmspec soak``: the heap's size held at
    ~750 MiB from 2 minutes on with the tier off, and grew 727 -> 783 MiB over the next 3 with it
    on, while MLX's own memory was the same in both (docs/bench/soak-cpu/memory.md)."""
    table, meta, start = read_header(path)
    if meta.get("identity") != identity:
        raise CorruptEntry("saved for other weights")
    try:
        spans = [(name, t["dtype"], t["shape"], *t["data_offsets"]) for name, t in table.items()]
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptEntry(f"bad tensor table ({e})") from None
    end = max((e for *_, e in spans), default=0)
    if path.stat().st_size != start + end:
        raise CorruptEntry(f"truncated: {path.stat().st_size - start} bytes of data, the header says {end}")
    for name, dtype, shape, b, e in spans:
        if dtype not in _BY_NAME:
            raise CorruptEntry(f"unknown dtype {dtype}")
        if not (isinstance(shape, list) and 0 <= b <= e
                and e - b == int(np.prod(shape, dtype=np.int64)) * np.dtype(_BY_NAME[dtype][1]).itemsize):
            raise CorruptEntry(f"bad tensor table entry {name}")
    try:
        arrays: dict[str, mx.array] = mx.load(str(path)) if spans else {}
    except RuntimeError as e:  # what the header check above let through
        raise CorruptEntry(f"unreadable payload ({e})") from None
    if set(arrays) != {name for name, *_ in spans}:
        raise CorruptEntry("the payload's arrays are not the header's")
    mx.eval(list(arrays.values()))
    ordered = sorted(spans, key=lambda s: s[3])  # the checksum runs over the payload in file order
    if _digest(meta, [_bytes_of(arrays[name]) for name, *_ in ordered]) != meta.get("checksum"):
        raise CorruptEntry("checksum mismatch")
    cache = [_cache_class(L["class"]).from_state(_unskeleton(L["state"], arrays)) for L in meta["layout"]]
    checkpoints = {int(p): {int(i): _unskeleton(s, arrays) for i, s in saved.items()}
                   for p, saved in meta["saved"].items()}
    return CacheState(cache, meta["tokens"], checkpoints)


def _bytes_of(a: mx.array) -> memoryview:
    """The bytes of an evaluated array, without a copy."""
    if a.dtype == mx.bfloat16:  # numpy has no bfloat16
        a = a.view(mx.uint16)
    return memoryview(np.asarray(a)).cast("B")


# -- the index ---------------------------------------------------------------------------------------


class DiskEntry(msgspec.Struct, frozen=True):
    key: str
    path: Path
    tokens: tuple[int, ...]
    checkpoints: tuple[int, ...]
    rewindable: bool
    nbytes: int
    last_used: float

    def usable(self, target: Sequence[int]) -> int:
        """What ``CacheState.usable`` will say once loaded, from the header alone."""
        common = _lcp(self.tokens, target)
        if common == len(self.tokens) or self.rewindable:
            return common
        return max((t for t in self.checkpoints if t <= common), default=0)


def _entry(path: Path, meta: dict, nbytes: int, last_used: float) -> DiskEntry:
    return DiskEntry(key=path.name.removesuffix(SUFFIX), path=path, tokens=tuple(meta["tokens"]),
                     checkpoints=tuple(meta["checkpoints"]), rewindable=bool(meta["rewindable"]),
                     nbytes=nbytes, last_used=last_used)


class DiskStats(msgspec.Struct, kw_only=True):
    entries: int = 0
    bytes: int = 0
    budget_bytes: int = 0
    hits: int = 0  # states loaded from disk
    tokens_loaded: int = 0
    writes: int = 0
    dropped: int = 0  # corrupt, truncated or foreign files removed
    spills_skipped: int = 0  # evictions not written: the writer was too far behind


class DiskTier:
    """Saved states of one model under ``root/<identity>``, within ``budget_bytes`` of disk."""

    def __init__(self, root: Path, identity: str, budget_bytes: int | None = None):
        self.root = Path(root)
        self.identity = identity
        self.dir = self.root / identity[:24]
        self.dir.mkdir(parents=True, exist_ok=True)
        self.budget_bytes = default_budget_bytes(self.root) if budget_bytes is None else budget_bytes
        self.stats = DiskStats(budget_bytes=self.budget_bytes)
        self.engine = None
        self.entries: tuple[DiskEntry, ...] = ()  # published by the writer; least recently used first
        self._queue: queue.Queue = queue.Queue()
        self._pending = 0  # bytes of snapshots queued, not yet written
        self._lock = threading.Lock()  # guards _pending only
        self._scan()
        self._thread = threading.Thread(target=self._write_loop, name="warmspec-prefix-disk", daemon=True)
        self._thread.start()

    @classmethod
    def for_model(cls, lm: LoadedModel, root: Path | None = None, budget_bytes: int | None = None) -> "DiskTier":
        from .. import fetch

        return cls(root or fetch.cache_dir() / "prefix", model_identity(lm), budget_bytes)

    def attach(self, engine) -> None:
        """Hook into ``engine``: evictions of its prefix store are spilled here, and its prefill
        asks here on a miss (``Engine._prefill``)."""
        self.engine = engine
        engine.disk = self
        engine.store.on_evict = self.spill

    # -- decode thread --------------------------------------------------------------------------

    def best(self, target: Sequence[int]) -> tuple[DiskEntry | None, int]:
        return longest_usable(self.entries, target)

    def load(self, target: Sequence[int], better_than: int) -> CacheState | None:
        """The state on disk serving the longest prefix of ``target``, if it serves more than
        ``better_than`` tokens by enough to pay for reading it; None otherwise or when the file is
        bad (dropped and logged: the caller prefills as if it had never been there)."""
        entry, use = self.best(target)
        if entry is None or not self._worth(use - better_than, entry.nbytes):
            return None
        try:
            state = read_state(entry.path, self.identity)
        except FileNotFoundError:  # evicted by the writer a moment ago
            return None
        except (CorruptEntry, OSError, ValueError, KeyError, TypeError, IndexError) as e:
            log.warning("prefix cache file %s dropped: %s", entry.path.name, e)
            self.stats.dropped += 1
            self._queue.put(("drop", entry.key))
            return None
        if state.usable(target) != use:  # the header promised what the payload does not hold
            log.warning("prefix cache file %s dropped: its state serves %d tokens, not %d",
                        entry.path.name, state.usable(target), use)
            self.stats.dropped += 1
            self._queue.put(("drop", entry.key))
            return None
        self.stats.hits += 1
        self.stats.tokens_loaded += use
        self._queue.put(("touch", entry.key))
        log.info("prefix cache: %d tokens loaded from disk (%.1f MB)", use, entry.nbytes / 1e6)
        return state

    def _worth(self, gain: int, nbytes: int) -> bool:
        if gain <= 0:
            return False
        t = self.engine.totals if self.engine is not None else None
        filled = t.prompt_tokens - t.cached_tokens if t is not None else 0
        per_token = t.prefill_s / filled if t is not None and filled > 0 and t.prefill_s > 0 \
            else DEFAULT_PREFILL_S_PER_TOKEN
        return gain * per_token > nbytes / READ_BYTES_PER_S

    def spill(self, state: CacheState, *, force: bool = False) -> None:
        """Queue ``state`` for writing (an eviction: ``force`` False, dropped when the writer is far
        behind; shutdown: ``force`` True). Skipped when the same state is on disk already."""
        if not state.tokens:
            return
        key = token_key(state.tokens)
        if any(e.key == key and set(e.checkpoints) >= set(state.checkpoints) for e in self.entries):
            return
        snap = snapshot(state, self.identity)
        with self._lock:
            if not force and self._pending + snap.nbytes > MAX_PENDING_BYTES:
                self.stats.spills_skipped += 1
                log.warning("prefix cache: an evicted state of %d tokens not written: %d MB still queued",
                            len(state.tokens), self._pending >> 20)
                return
            self._pending += snap.nbytes
        self._queue.put(("write", snap))

    def spill_all(self, engine) -> None:
        """Every state the engine holds, the live one included: at shutdown and before an idle
        unload. The caller owns the engine (its worker is stopped or is the caller)."""
        for state in [*engine.store.entries, engine.live]:
            self.spill(state, force=True)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued is written; False on timeout."""
        done = threading.Event()
        self._queue.put(("flush", done))
        return done.wait(timeout)

    def close(self, timeout: float = 60.0) -> None:
        self.flush(timeout)
        self._queue.put(("stop", None))
        self._thread.join(timeout)

    def describe(self) -> DiskStats:
        entries = self.entries
        return msgspec.structs.replace(self.stats, entries=len(entries), bytes=sum(e.nbytes for e in entries))

    # -- writer thread ----------------------------------------------------------------------------

    def _scan(self) -> None:
        """Index this model's files, drop bad ones, and fit everything under ``root`` (other
        models' files too, oldest first) into the budget."""
        entries = []
        for path in self.dir.iterdir():
            if path.name.endswith(".tmp"):  # a write cut short by a crash
                path.unlink(missing_ok=True)
                continue
            if not path.name.endswith(SUFFIX):
                continue
            try:
                table, meta, start = read_header(path)
                size = path.stat().st_size
                end = max((t["data_offsets"][1] for t in table.values()), default=0)
                if size != start + end:
                    raise CorruptEntry(f"{size} bytes, the header says {start + end}")
                if meta.get("identity") != self.identity:
                    raise CorruptEntry("saved for other weights")
                if token_key(meta["tokens"]) != path.name.removesuffix(SUFFIX):
                    raise CorruptEntry("named for other tokens")
                entries.append(_entry(path, meta, size, path.stat().st_mtime))
            except (CorruptEntry, OSError, KeyError, TypeError, ValueError) as e:
                log.warning("prefix cache file %s dropped: %s", path.name, e)
                self.stats.dropped += 1
                path.unlink(missing_ok=True)
        entries.sort(key=lambda e: e.last_used)
        self.entries = tuple(entries)
        others = sorted((p.stat().st_mtime, p.stat().st_size, p) for d in self.root.iterdir()
                        if d.is_dir() and d != self.dir for p in d.glob("*" + SUFFIX))
        total = sum(e.nbytes for e in entries) + sum(s for _, s, _ in others)
        for _, size, p in others:
            if total <= self.budget_bytes:
                break
            p.unlink(missing_ok=True)
            total -= size
        self._fit()

    def _fit(self) -> None:
        entries = list(self.entries)
        total = sum(e.nbytes for e in entries)
        while entries and total > self.budget_bytes:
            gone = entries.pop(0)
            gone.path.unlink(missing_ok=True)
            total -= gone.nbytes
        self.entries = tuple(entries)

    def _write_loop(self) -> None:
        while True:
            kind, item = self._queue.get()
            if kind == "stop":
                return
            if kind == "flush":
                item.set()
            elif kind == "touch":
                now = time.time()
                self.entries = tuple(sorted((msgspec.structs.replace(e, last_used=now) if e.key == item else e
                                             for e in self.entries), key=lambda e: e.last_used))
                path = self.dir / (item + SUFFIX)
                if path.exists():
                    os.utime(path, (now, now))
            elif kind == "drop":
                (self.dir / (item + SUFFIX)).unlink(missing_ok=True)
                self.entries = tuple(e for e in self.entries if e.key != item)
            else:
                try:
                    self._write(item)
                finally:
                    with self._lock:
                        self._pending -= item.nbytes

    def _write(self, snap: Snapshot) -> None:
        if snap.nbytes > self.budget_bytes:
            return
        path = self.dir / (snap.key + SUFFIX)
        try:
            size = write_file(path, snap)
        except OSError as e:  # a full disk must not take the daemon down: the state is only lost
            log.warning("prefix cache: could not write %s: %s", path.name, e)
            return
        self.stats.writes += 1
        new = _entry(path, snap.meta, size, time.time())
        kept = []
        for e in self.entries:
            if e.key == new.key:
                continue
            if len(e.tokens) <= len(new.tokens) and new.usable(e.tokens) == len(e.tokens) \
                    and set(e.checkpoints) <= set(new.checkpoints) | {len(e.tokens)}:
                e.path.unlink(missing_ok=True)  # the new state serves all this one did
                continue
            kept.append(e)
        self.entries = (*kept, new)
        self._fit()
