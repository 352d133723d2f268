"""Idle unload: a daemon nobody has asked for a while gives its memory back, and takes it again on
the next request.

An editor starts the daemon and forgets it; the weights (0.54 GB for the default model in
float32, 36 GB for a 9B one) and the parked prefix caches would stay resident all day. After
``--keep-alive`` without a request (default 30 minutes: an editor's lunch break, not every
pause between two edits) the worker thread spills every cached prefix to the disk tier, drops
the weights and caches and returns MLX's buffer cache; the daemon keeps listening. The next
request reloads the model (a few seconds) -- its transport shows the progress to clients that
can (``warmspec/progress`` on JSON-RPC; HTTP clients just wait, with keep-alive comments) -- and
the first turn of a conversation is then served from the disk tier, not prefilled cold.

Everything here runs on the scheduler's worker thread, which owns the engine: no request can be
decoding while it unloads or reloads. Sampling options are per request and never reload.
"""

from __future__ import annotations

import gc
import logging
import argparse
import re
import sys
import time
from typing import Callable, NamedTuple

import msgspec

log = logging.getLogger("warmspec.keepalive")

DEFAULT_KEEP_ALIVE_S = 30 * 60.0
NEVER = ("never", "forever", "inf", "infinite", "-1")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float | None:
    """``"30m"``, ``"1h30m"``, ``"90s"``, ``"45"`` (seconds) -> seconds; ``"never"`` (``forever``,
    ``inf``, ``-1``) -> None: never unload; ``"0"``: unload as soon as the daemon is idle."""
    text = text.strip().lower()
    if text in NEVER:
        return None
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    parts = re.findall(r"(\d+(?:\.\d+)?)([smhd])", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"not a duration: {text!r} (examples: 30m, 1h, 90s, 0, never)")
    return sum(float(n) * _UNITS[u] for n, u in parts)


class Duration(NamedTuple):
    text: str  # as given, to pass on to a daemon started in the background
    seconds: float | None


def duration_arg(text: str) -> Duration:
    """``--keep-alive`` for argparse."""
    try:
        return Duration(text, parse_duration(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


class Progress(msgspec.Struct):
    """A job event before any text: what the daemon is doing for it (a reload after idle unload).
    ``fraction`` 1.0 marks the end."""

    message: str
    fraction: float | None = None


def _release_os_memory() -> None:
    """Give freed pages back to the OS: MLX's buffer cache, then glibc's heap (freed buffers
    below glibc's mmap threshold stay in the heap otherwise). Measured in process with the default
    model: 745 MB resident loaded, 256 MB after dropping the weights and MLX's cache, 111 MB after
    ``malloc_trim``."""
    import mlx.core as mx

    gc.collect()
    mx.clear_cache()
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):  # not glibc (musl): nothing to trim
            pass


class KeepAlive:
    """Unloads ``engine``'s weights and caches after ``idle_s`` seconds without a job (None:
    never) and reloads them with ``load`` (which returns a ``LoadedModel`` of the same model)
    before the next one."""

    def __init__(self, engine, load: Callable[[], object], idle_s: float | None):
        self.engine = engine
        self.load = load
        self.idle_s = idle_s
        self.state = "loaded"
        self.loads = 1
        self.unloads = 0
        self.last_active = time.monotonic()

    @property
    def idle_for(self) -> float:
        return time.monotonic() - self.last_active

    def wait_s(self) -> float | None:
        """How long the idle worker may sleep before it should unload (None: no deadline)."""
        if self.idle_s is None or self.state != "loaded":
            return None
        return max(self.idle_s - self.idle_for, 0.0)

    def idle(self) -> None:
        """The worker found nothing to do: unload once the deadline has passed."""
        if self.state == "loaded" and self.idle_s is not None and self.idle_for >= self.idle_s:
            self.unload()

    def unload(self) -> None:
        engine = self.engine
        self.state = "unloading"
        t = time.perf_counter()
        if engine.disk is not None:
            engine.disk.spill_all(engine)
            engine.disk.flush()
        from ..core.cache import CacheState

        engine.store.clear()
        engine.live = CacheState([])
        engine.set_model(None)
        _release_os_memory()
        self.state = "unloaded"
        self.unloads += 1
        log.info("idle for %.0f s: unloaded the model and its caches in %.1f s (prefixes on disk)",
                 self.idle_for, time.perf_counter() - t)

    def ready(self, report: Callable[[Progress], None]) -> str | None:
        """Before a job: reload if unloaded, reporting progress. Returns None when the model is
        there, else the reason it could not be loaded (the job fails with it; the next one
        tries again)."""
        if self.state == "loaded":
            return None
        from ..model import ModelError

        self.state = "loading"
        report(Progress("loading the model (unloaded while idle)", 0.0))
        t = time.perf_counter()
        try:
            lm = self.load()
        except ModelError as e:
            self.state = "unloaded"
            log.warning("reload after idle unload failed: %s", e)
            return str(e)
        engine = self.engine
        engine.set_model(lm.model)
        engine.reset()
        self._check_identity()
        self.loads += 1
        self.state = "loaded"
        took = time.perf_counter() - t
        log.info("reloaded the model in %.1f s", took)
        report(Progress(f"loaded the model in {took:.1f} s", 1.0))
        return None

    def _check_identity(self) -> None:
        """A model file replaced while unloaded: the disk tier's states belong to the old one."""
        disk = self.engine.disk
        if disk is None:
            return
        from ..core.prefix_disk import DiskTier, model_identity

        identity = model_identity(self.engine.lm)
        if identity != disk.identity:
            log.warning("the model's weights changed while unloaded: prefix states of the old ones unused")
            disk.close()
            DiskTier(disk.root, identity, disk.budget_bytes).attach(self.engine)

    def done(self) -> None:
        """After a job: the idle clock starts again."""
        self.last_active = time.monotonic()
