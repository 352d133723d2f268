"""Choosing the BLAS MLX runs on (``warmspec.blas``): the setting, the re-exec, a real child on BLIS."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from warmspec import blas


def test_the_setting_names_a_library_or_fails_clearly(monkeypatch):
    monkeypatch.delenv("WARMSPEC_BLAS", raising=False)
    assert blas.wanted() == blas.DEFAULT == "openblas"
    monkeypatch.setenv("WARMSPEC_BLAS", " BLIS ")
    assert blas.wanted() == "blis"
    monkeypatch.setenv("WARMSPEC_BLAS", "mkl")
    with pytest.raises(blas.BlasError, match="openblas, blis, bundled"):
        blas.wanted()


def test_a_preloaded_library_is_recognized_and_described(monkeypatch):
    monkeypatch.setenv("LD_PRELOAD", "/x/libfoo.so /usr/lib/blis-openmp/libblis.so.4")
    monkeypatch.setenv("BLIS_NUM_THREADS", "3")
    assert blas.preloaded() == "/usr/lib/blis-openmp/libblis.so.4"
    assert blas.describe().startswith("BLIS (") and "3 threads" in blas.describe()
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/openblas-pthread/libopenblas.so.0")
    assert blas.describe().startswith("OpenBLAS (")
    monkeypatch.setenv("LD_PRELOAD", "/x/libfoo.so")
    assert blas.preloaded() is None and blas.describe() == "MLX bundled reference BLAS"


class Execed(Exception):
    pass


def _reexec(monkeypatch, blis: Path, **env) -> dict[str, str]:
    """Run ``reexec_with_blas`` as a fresh process would (MLX not loaded, not yet checked) with
    BLIS at ``blis``, and return the environment it would re-execute with."""
    monkeypatch.setitem(blas.LIBRARIES, "blis", (str(blis),))
    monkeypatch.delitem(sys.modules, "mlx.core", raising=False)
    for k in ("WARMSPEC_BLAS_CHECKED", "LD_PRELOAD", "BLIS_NUM_THREADS"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    seen = {}

    def execve(path, argv, environ):
        seen.update(environ)
        raise Execed

    monkeypatch.setattr(blas.os, "execve", execve)
    with pytest.raises(Execed):
        blas.reexec_with_blas(["-c", "pass"])
    return seen


def test_blis_is_preloaded_on_every_usable_core_unless_told(monkeypatch, tmp_path):
    lib = tmp_path / "libblis.so.4"
    lib.write_bytes(b"")
    env = _reexec(monkeypatch, lib, WARMSPEC_BLAS="blis")
    assert env["LD_PRELOAD"].split()[0] == str(lib)
    assert env["BLIS_NUM_THREADS"] == str(len(os.sched_getaffinity(0)))
    assert env["WARMSPEC_BLAS_CHECKED"] == "1"
    env = _reexec(monkeypatch, lib, WARMSPEC_BLAS="blis", BLIS_NUM_THREADS="1")
    assert env["BLIS_NUM_THREADS"] == "1"


CHILD = """
import numpy as np, mlx.core as mx
from warmspec import blas
a = np.random.default_rng(0).standard_normal((3, 96)).astype(np.float32)
w = np.random.default_rng(1).standard_normal((200, 96)).astype(np.float32)
got = np.array(mx.array(a) @ mx.array(w).T)
print(blas.describe())
print(float(np.abs(got - a @ w.T).max()))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or blas.find("blis") is None,
                    reason="BLIS (libblis4-openmp, installed by install.sh on Debian) is not here")
def test_a_process_asked_for_blis_runs_on_it():
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "WARMSPEC_BLAS_CHECKED")}
    env["WARMSPEC_BLAS"] = "blis"
    code = f"from warmspec import blas; blas.reexec_with_blas(['-c', {CHILD!r}])\n{CHILD}"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True, timeout=120).stdout.splitlines()
    assert out[0].startswith("BLIS (") and "libblis.so.4" in out[0]
    assert float(out[1]) < 1e-3


def test_blis_missing_falls_back_to_openblas_and_a_wrong_name_exits(monkeypatch, tmp_path, capsys):
    openblas = tmp_path / "libopenblas.so.0"
    openblas.write_bytes(b"")
    monkeypatch.setenv("WARMSPEC_OPENBLAS", str(openblas))
    env = _reexec(monkeypatch, tmp_path / "absent" / "libblis.so.4", WARMSPEC_BLAS="blis")
    assert env["LD_PRELOAD"].split()[0] == str(openblas) and "BLIS_NUM_THREADS" not in env
    assert "BLIS is not installed" in capsys.readouterr().err
    monkeypatch.setenv("WARMSPEC_BLAS", "atlas")
    with pytest.raises(SystemExit, match="WARMSPEC_BLAS='atlas'"):
        blas.reexec_with_blas(["-c", "pass"])
