"""Memory: what a model will take before it is loaded, what is free, and what the daemon holds.

A model larger than free memory does not fail cleanly: Linux swaps or kills the process (the
OOM killer picks the biggest, usually the daemon, in the middle of a load that took a minute),
macOS compresses and swaps until the machine crawls. So ``model.load`` first adds up the tensor
sizes from the file headers (GGUF tensor infos, safetensors headers: no weights are read), as
they will be resident -- float32 when dequantized on a CPU -- and refuses with a message when
they do not fit in what is available.

Available: ``MemAvailable`` on Linux, lowered to a cgroup's ``memory.max`` headroom in a
container; on Apple silicon the GPU's recommended working set (``mx.device_info``).
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import struct
import sys
from pathlib import Path

from warmspec_protocol import MemoryStats

# Beside the weights: the KV cache of a few thousand tokens, MLX's buffer cache, Python, the
# tokenizer. The default model's daemon measured 0.9 GB resident for 0.54 GB of weights.
HEADROOM_BYTES = 512 << 20


class NotEnoughMemory(RuntimeError):
    """The model cannot fit; ``str()`` says how much it needs and how much there is."""


def _meminfo() -> dict[str, int]:
    out = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            out[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return out


def _cgroup_headroom() -> int | None:
    """Bytes left under a cgroup v2 ``memory.max`` (containers), or None without a limit."""
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
    except (OSError, ValueError):
        return None
    return None if limit == "max" else max(int(limit) - used, 0)


def available_bytes() -> int | None:
    """Memory a new model may take without swapping; None when this platform does not say."""
    info = _meminfo()
    if "MemAvailable" in info:
        free = info["MemAvailable"]
        cg = _cgroup_headroom()
        return min(free, cg) if cg is not None else free
    import mlx.core as mx

    if sys.platform == "darwin" and mx.metal.is_available():
        dev = mx.device_info()
        budget = dev.get("max_recommended_working_set_size") or dev.get("memory_size")
        return int(budget) - mx.get_active_memory() if budget else None
    return None


def _status_bytes(field: str) -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def rss_bytes() -> int:
    """Resident set now (Linux); 0 where the platform does not say."""
    return _status_bytes("VmRSS")


def peak_rss_bytes() -> int:
    peak = _status_bytes("VmHWM")
    if peak:
        return peak
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024


def stats() -> MemoryStats:
    import mlx.core as mx

    return MemoryStats(rss_bytes=rss_bytes(), peak_rss_bytes=peak_rss_bytes(),
                       available_bytes=available_bytes() or 0, mlx_active_bytes=mx.get_active_memory(),
                       mlx_peak_bytes=mx.get_peak_memory(), mlx_cache_bytes=mx.get_cache_memory())


# -- sizes from file headers ------------------------------------------------------------------------

_GGUF_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
# ggml tensor types: bytes per block and elements per block (F32, F16, Q4_0, Q4_1, Q5_0, Q5_1,
# Q8_0, Q8_1, then the k-quants and BF16); unknown types count at 1 byte an element.
_GGML_BLOCKS = {0: (4, 1), 1: (2, 1), 2: (18, 32), 3: (20, 32), 6: (22, 32), 7: (24, 32), 8: (34, 32),
                9: (36, 32), 10: (84, 256), 11: (110, 256), 12: (144, 256), 13: (176, 256),
                14: (210, 256), 15: (292, 256), 30: (2, 1)}


def _gguf_tensors(path: Path) -> list[tuple[int, int]]:
    """``(elements, stored bytes)`` of each tensor of a GGUF file, from its header alone."""
    with open(path, "rb") as f:
        def take(fmt: str):
            size = struct.calcsize("<" + fmt)
            raw = f.read(size)
            if len(raw) < size:
                raise ValueError("truncated GGUF header")
            return struct.unpack("<" + fmt, raw)

        def skip_string() -> None:
            f.seek(take("Q")[0], 1)

        def skip_value(kind: int) -> None:
            if kind == 8:
                skip_string()
            elif kind == 9:
                inner, n = take("IQ")
                if inner in _GGUF_SCALAR:
                    f.seek(_GGUF_SCALAR[inner] * n, 1)
                else:
                    for _ in range(n):
                        skip_value(inner)
            elif kind in _GGUF_SCALAR:
                f.seek(_GGUF_SCALAR[kind], 1)
            else:
                raise ValueError(f"unknown GGUF value type {kind}")

        if f.read(4) != b"GGUF":
            raise ValueError("not a GGUF file")
        _version, n_tensors, n_kv = take("IQQ")
        for _ in range(n_kv):
            skip_string()
            skip_value(take("I")[0])
        out = []
        for _ in range(n_tensors):
            skip_string()
            (n_dims,) = take("I")
            elements = 1
            for d in take("Q" * n_dims):
                elements *= d
            kind, _offset = take("IQ")
            block_bytes, block_elems = _GGML_BLOCKS.get(kind, (1, 1))
            out.append((elements, elements * block_bytes // block_elems))
        return out


def _safetensors_tensors(path: Path) -> list[tuple[str, str, int, int]]:
    """``(name, dtype, elements, stored bytes)`` from a safetensors header."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    out = []
    for name, t in header.items():
        if name == "__metadata__":
            continue
        elements = 1
        for d in t["shape"]:
            elements *= d
        begin, end = t["data_offsets"]
        out.append((name, t["dtype"], elements, end - begin))
    return out


def model_bytes(path: Path, *, dequantize: bool) -> int:
    """Resident bytes of a model's weights once loaded: as stored, or float32 when dequantized
    (a quantized weight's elements are its packed uint32 words times 32 / bits)."""
    if path.is_file():
        tensors = _gguf_tensors(path)
        return sum(e * 4 for e, _ in tensors) if dequantize else sum(b for _, b in tensors)
    config = json.loads((path / "config.json").read_text()) if (path / "config.json").exists() else {}
    quant = config.get("quantization") or config.get("quantization_config") or {}
    bits = int(quant.get("bits", 0) or 0)
    total = 0
    for f in sorted(path.glob("*.safetensors")):
        tensors = _safetensors_tensors(f)
        scaled = {name.rsplit(".", 1)[0] for name, *_ in tensors if name.endswith(".scales")}
        for name, dtype, elements, stored in tensors:
            stem, _, leaf = name.rpartition(".")
            if not dequantize:
                total += stored
            elif stem in scaled and leaf in ("scales", "biases"):
                continue
            elif stem in scaled and bits:
                total += elements * (32 // bits) * 4
            else:
                total += elements * 4
    return total


def load_bytes(path: Path, *, dequantize: bool) -> int:
    """Peak bytes while loading: dequantizing holds the stored tensors and their float32 copies
    at once."""
    resident = model_bytes(path, dequantize=dequantize)
    if not dequantize:
        return resident
    files = [path] if path.is_file() else list(path.glob("*.safetensors"))
    return resident + sum(f.stat().st_size for f in files)


def check_fits(need: int, what: str) -> None:
    """Raise ``NotEnoughMemory`` when ``need`` bytes (plus headroom) exceed what is available."""
    free = available_bytes()
    if free is None or need + HEADROOM_BYTES <= free:
        return
    gib = lambda b: f"{b / (1 << 30):.1f} GiB"  # noqa: E731
    raise NotEnoughMemory(
        f"{what} needs about {gib(need)} of memory ({gib(need + HEADROOM_BYTES)} with the cache and "
        f"runtime) but only {gib(free)} is available: close other programs, or choose a smaller or "
        "quantized model")


_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """``"2G"``, ``"512M"``, ``"1.5g"``, ``"4096"`` (bytes) -> bytes; ``"0"``/``"off"`` -> 0."""
    import re

    t = text.strip().lower()
    if t in ("off", "no", "none"):
        return 0
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?", t)
    if not m:
        raise ValueError(f"not a size: {text!r} (examples: 2G, 512M, 0, off)")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2)])


def size_arg(text: str) -> int:
    import argparse

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def check_model(path: Path, *, dequantize: bool, name: str) -> None:
    """Refuse (``NotEnoughMemory``) a model whose load would not fit; headers that cannot be read
    are left to the loader, which says what is wrong with the file."""
    try:
        need = load_bytes(path, dequantize=dequantize)
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return
    check_fits(need, f"{name} ({'float32' if dequantize else 'as stored'})")


# glibc's mallopt parameters (malloc.h), and the values the daemon sets: see ``tune_malloc``.
M_MMAP_THRESHOLD, M_ARENA_MAX = -3, -8
MMAP_THRESHOLD_BYTES = 1 << 20
ARENA_MAX = 2


def tune_malloc() -> bool:
    """Keep glibc's heap from growing with the daemon's uptime; True where it was set.

    glibc serves a large allocation with its own mapping and unmaps it on free, then raises its
    threshold to that size, so the next allocations of the size come from the heap: a disk-tier
    state of 12-40 MB read between long-lived KV arrays leaves holes the heap cannot return. Under
    ``warmspec soak`` the non-MLX part of the daemon crept ~4 MiB a minute that way, the one
    criterion the soak failed (window peaks 10.2% apart, the limit 10%). Fixing the threshold at
    1 MiB keeps every large block a mapping of its own, and two arenas bound the per-thread heaps
    of the daemon's threads. Not done where the user set either by environment
    (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_ARENA_MAX``), nor off glibc."""
    if not sys.platform.startswith("linux"):
        return False
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") or os.environ.get("MALLOC_ARENA_MAX"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has neither)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(mallopt(M_ARENA_MAX, ARENA_MAX))
