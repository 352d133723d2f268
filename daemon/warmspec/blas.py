"""Run MLX on an optimized BLAS on Linux.

MLX's Linux CPU wheel bundles the reference BLAS. Measured on a 2-core x86_64 machine: a 1024x1024
float32 matmul takes 0.26 s with it and 0.009 s with the system OpenBLAS, and a 16-position forward
pass of the default model costs 14x one position instead of 1.6x -- which decides whether verifying
a long draft pays at all. The library has to be in place before the process loads MLX, so the
process re-executes itself once with ``LD_PRELOAD`` set.
"""

from __future__ import annotations

import ctypes.util
import os
import sys
from pathlib import Path

_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
    "/usr/local/lib/libopenblas.so.0",
)
_MARK = "WARMSPEC_BLAS_CHECKED"
HINT = (
    "warmspec: MLX is using its bundled reference BLAS (about 30x slower on matmul). "
    "Install OpenBLAS for full speed: sudo apt-get install libopenblas0-pthread"
)


def find_openblas() -> str | None:
    """Path of a system OpenBLAS shared library, or None."""
    override = os.environ.get("WARMSPEC_OPENBLAS")
    if override:
        return override if Path(override).exists() else None
    for path in _CANDIDATES:
        if Path(path).exists():
            return path
    name = ctypes.util.find_library("openblas")
    return name if name and Path(name).is_absolute() else None


def preloaded() -> str | None:
    """The OpenBLAS this process was started with, if any."""
    for entry in os.environ.get("LD_PRELOAD", "").replace(":", " ").split():
        if "openblas" in Path(entry).name:
            return entry
    return None


def reexec_with_openblas(argv: list[str]) -> None:
    """Re-execute ``argv`` with OpenBLAS preloaded when on Linux and not done yet.

    Returns normally when nothing is to be done (not Linux, already preloaded or checked, MLX
    already imported, ``WARMSPEC_BLAS=bundled``); prints one hint when no OpenBLAS is installed.
    Never returns when it re-executes.
    """
    if not sys.platform.startswith("linux") or os.environ.get(_MARK):
        return
    if os.environ.get("WARMSPEC_BLAS") == "bundled" or preloaded():
        return
    if "mlx.core" in sys.modules:  # too late: the loader has bound MLX to its BLAS
        return
    env = dict(os.environ)
    env[_MARK] = "1"
    lib = find_openblas()
    if lib is None:
        print(HINT, file=sys.stderr)
        os.environ[_MARK] = "1"
        return
    env["LD_PRELOAD"] = " ".join(x for x in (lib, env.get("LD_PRELOAD", "")) if x)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *argv], env)


def describe() -> str:
    """Which BLAS MLX runs on in this process, for logs and bench reports."""
    if not sys.platform.startswith("linux"):
        return "platform default (Accelerate on macOS)"
    lib = preloaded()
    return f"OpenBLAS ({lib})" if lib else "MLX bundled reference BLAS"
