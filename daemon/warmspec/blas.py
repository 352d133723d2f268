"""Run MLX on an optimized BLAS on Linux.

MLX's Linux CPU wheel bundles the reference BLAS. Measured on a 2-core x86_64 machine: a 1024x1024
float32 matmul takes 0.26 s with it and 0.009 s with the system OpenBLAS, and a 16-position forward
pass of the default model costs 14x one position instead of 1.6x -- which decides whether verifying
a long draft pays at all. The library has to be in place before the process loads MLX, so the
process re-executes itself once with ``LD_PRELOAD`` set.

Which library: ``WARMSPEC_BLAS`` = ``openblas`` (the default), ``blis`` or ``bundled``. BLIS
(its OpenMP build, on all usable cores) multiplies the few rows of a decode step without packing
the weights first, and on this 2-core AMD EPYC VM (``docs/bench/cpu-s45``) a pass of the default
model at 64 tokens of context cost 44 / 52 / 62 / 89 ms at 1 / 2 / 4 / 8 positions against
OpenBLAS's 64 / 75 / 100 / 104, and plain decoding ran at 21.8 tok/s against 12.6. It is not
the default yet because speculation has not been shown to hold its floor on it: a plain step
there runs pipelined in 47 ms while a synchronous verify pass of 2 positions costs 65 (OpenBLAS:
88 and 96), so drafting pays only above about 40% acceptance, and on 5 public prose prompts
n-gram + head ran 0.96x plain (slowest 0.89x), though at 21.1 tok/s against OpenBLAS's 13.6.
"""

from __future__ import annotations

import ctypes.util
import os
import sys
from pathlib import Path

_OPENBLAS = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
    "/usr/local/lib/libopenblas.so.0",
)
# BLIS built with OpenMP (Debian's libblis4-openmp); its pthread build spawned threads per call
# and ran a 2-position pass at 119 ms against 59 single-threaded.
_BLIS = (
    "/usr/lib/x86_64-linux-gnu/blis-openmp/libblis.so.4",
    "/usr/lib/aarch64-linux-gnu/blis-openmp/libblis.so.4",
)
LIBRARIES = {"openblas": _OPENBLAS, "blis": _BLIS}
# Which library ``WARMSPEC_BLAS`` unset means. OpenBLAS: see the module's docstring for why BLIS,
# faster at plain decoding, is not the default yet.
DEFAULT = "openblas"
_MARK = "WARMSPEC_BLAS_CHECKED"
HINT = (
    "warmspec: MLX is using its bundled reference BLAS (about 30x slower on matmul). "
    "Install OpenBLAS for full speed: sudo apt-get install libopenblas0-pthread"
)


class BlasError(ValueError):
    pass


def wanted() -> str:
    """The library asked for: ``WARMSPEC_BLAS`` (openblas, blis or bundled), else ``DEFAULT``."""
    name = os.environ.get("WARMSPEC_BLAS", DEFAULT).strip().lower() or DEFAULT
    if name not in (*LIBRARIES, "bundled"):
        raise BlasError(f"WARMSPEC_BLAS={name!r}: expected one of {', '.join((*LIBRARIES, 'bundled'))}")
    return name


def find(name: str = "openblas") -> str | None:
    """Path of the system's ``name`` library (``LIBRARIES``), or None. ``WARMSPEC_OPENBLAS``
    overrides OpenBLAS's path."""
    override = os.environ.get("WARMSPEC_OPENBLAS")
    if name == "openblas" and override:
        return override if Path(override).exists() else None
    for path in LIBRARIES[name]:
        if Path(path).exists():
            return path
    found = ctypes.util.find_library(name) if name == "openblas" else None
    return found if found and Path(found).is_absolute() else None


def _kind(path: str) -> str | None:
    base = Path(path).name
    return "openblas" if "openblas" in base else "blis" if "blis" in base else None


def preloaded() -> str | None:
    """The optimized BLAS this process was started with, if any."""
    for entry in os.environ.get("LD_PRELOAD", "").replace(":", " ").split():
        if _kind(entry):
            return entry
    return None


def _threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def reexec_with_blas(argv: list[str]) -> None:
    """Re-execute ``argv`` with the optimized BLAS (``wanted()``) preloaded when on Linux and not
    done yet. BLIS is single-threaded unless told: it gets ``BLIS_NUM_THREADS`` = the usable
    cores, unless set. BLIS asked for but not installed: OpenBLAS, with a hint.

    Returns normally when nothing is to be done (not Linux, already preloaded or checked, MLX
    already imported, ``WARMSPEC_BLAS=bundled``); prints one hint when no library is installed;
    exits (status 2) on a ``WARMSPEC_BLAS`` it does not know. Never returns when it re-executes.
    """
    if not sys.platform.startswith("linux") or os.environ.get(_MARK):
        return
    try:
        name = wanted()
    except BlasError as e:
        raise SystemExit(f"warmspec: {e}") from None
    if name == "bundled" or preloaded():
        return
    if "mlx.core" in sys.modules:  # too late: the loader has bound MLX to its BLAS
        return
    env = dict(os.environ)
    env[_MARK] = "1"
    lib = find(name)
    if lib is None and name == "blis":
        print("warmspec: WARMSPEC_BLAS=blis but BLIS is not installed (sudo apt-get install "
              "libblis4-openmp); using OpenBLAS", file=sys.stderr)
        name, lib = "openblas", find("openblas")
    if lib is None:
        print(HINT, file=sys.stderr)
        os.environ[_MARK] = "1"
        return
    if name == "blis":
        env.setdefault("BLIS_NUM_THREADS", str(_threads()))
    env["LD_PRELOAD"] = " ".join(x for x in (lib, env.get("LD_PRELOAD", "")) if x)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *argv], env)


def describe() -> str:
    """Which BLAS MLX runs on in this process, for logs and bench reports."""
    if not sys.platform.startswith("linux"):
        return "platform default (Accelerate on macOS)"
    lib = preloaded()
    if lib is None:
        return "MLX bundled reference BLAS"
    if _kind(lib) == "blis":
        return f"BLIS ({lib}, {os.environ.get('BLIS_NUM_THREADS', '1')} threads)"
    return f"OpenBLAS ({lib})"
