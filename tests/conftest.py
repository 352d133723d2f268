"""Shared fixtures. The run itself is re-executed on an optimized BLAS by ``warmspec._pytest_blas``
(enabled in pyproject's addopts), so model tests run at the speed users get."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="session")
def default_lm():
    """The embedded default model (SmolLM2-135M-Instruct), fetched once into the user cache."""
    from warmspec.model import load

    return load(None)


@pytest.fixture(scope="session")
def default_costs():
    """Verify costs of the default model on a 2-core CPU with OpenBLAS (docs/bench/cpu-full), fixed
    rather than measured: the gate's choices follow the table, and a table measured while the
    machine is busy (CI beside other work) made them, and the passes they take, vary from run to
    run. ``test_engine`` tests the measurement itself."""
    from warmspec.core.gate import CostTable

    return CostTable(CPU_COSTS)


CPU_COSTS = {
    64: {1: 0.0886, 2: 0.0995, 4: 0.1095, 8: 0.1183, 12: 0.1378, 16: 0.1362, 24: 0.1654, 32: 0.1754,
         33: 0.1922},
    1024: {1: 0.0871, 2: 0.1053, 4: 0.1257, 8: 0.1580, 12: 0.2000, 16: 0.2020, 24: 0.2761, 32: 0.3198,
           33: 0.3384},
}


def chat_prompt(lm, text: str) -> list[int]:
    tok = lm.tokenizer
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))


# A small Python file for copy-heavy prompts: edits and echoes copy it.
SAMPLE_FILE = '''import os
from pathlib import Path


def cache_dir() -> Path:
    """Per-user model cache."""
    if env := os.environ.get("WARMSPEC_CACHE"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "warmspec"


def default_model_path() -> Path:
    return cache_dir() / "models" / "model.gguf"
'''


def wait_idle(scheduler, timeout: float = 120) -> None:
    """Wait until ``scheduler`` runs no job and has none queued: a request that was cancelled or
    abandoned stops between prefill chunks or decode steps, but not at once. Fails after
    ``timeout`` seconds (generous: the machine may be shared)."""
    import time

    deadline = time.monotonic() + timeout
    while scheduler.active is not None or scheduler.queue_depth:
        assert time.monotonic() < deadline, f"the scheduler is still busy after {timeout} s"
        time.sleep(0.01)
