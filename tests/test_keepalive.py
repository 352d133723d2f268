"""Idle unload: after ``--keep-alive`` without a request the daemon frees its weights and caches
(resident memory drops, measured through a real daemon), keeps listening, and the next request
reloads the model -- telling JSON-RPC clients with ``warmspec/progress`` -- and answers as before.
Memory checks: a model that cannot fit in available memory is refused before it is read."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from warmspec import memory
from warmspec.core.engine import Engine, Finished
from warmspec.core.gate import CostTable
from warmspec.model import ModelError, load
from warmspec.server.app import App
from warmspec.server.keepalive import KeepAlive, Progress, parse_duration
from warmspec.server.scheduler import JobError
from warmspec.core import SamplingParams
from warmspec_protocol import rpc as wire

import tiny
from daemon_proc import Daemon

COSTS = {0: {1: 1.0, 2: 1.05, 33: 1.5}}


def test_durations():
    assert parse_duration("30m") == 1800 and parse_duration("1h30m") == 5400
    assert parse_duration("90s") == 90 and parse_duration("45") == 45 and parse_duration("0") == 0
    assert parse_duration("never") is None and parse_duration("-1") is None
    for bad in ("5q", "m", "1h 2m", ""):
        with pytest.raises(ValueError):
            parse_duration(bad)
    assert memory.parse_size("2G") == 2 << 30 and memory.parse_size("512MiB") == 512 << 20
    assert memory.parse_size("off") == 0


def run(app: App, prompt: list[int], temperature: float = 0.0) -> list:
    async def go():
        params = SamplingParams(temperature=temperature, seed=1)
        ticket = app.scheduler.submit(app.job(prompt, params, max_tokens=16))
        return [ev async for ev in ticket]
    return asyncio.run(go())


def tiny_app(idle_s, loader=None):
    lm = tiny.build("llama")
    engine = Engine(lm, costs=CostTable(COSTS))
    app = App(lm, engine)
    app.scheduler.keepalive = KeepAlive(engine, loader or (lambda: tiny.build("llama")), idle_s)
    app.start()
    return app


def wait_state(app, state):
    import time

    deadline = time.monotonic() + 60
    while app.keepalive.state != state:
        assert time.monotonic() < deadline, app.keepalive.state
        time.sleep(0.02)


def test_unload_when_idle_then_reload_with_progress_and_the_same_answer():
    app = tiny_app(0.0)  # 0: unload as soon as idle
    try:
        prompt = list(b"hello hello hello")
        first = run(app, prompt)
        wait_state(app, "unloaded")
        assert app.engine.model is None and app.lm.model is None and not app.engine.store.entries
        assert app.status().model_state == "unloaded"
        assert app.status().model.parameters_bytes > 0  # still reported while unloaded
        again = run(app, prompt)
        progress = [e for e in again if isinstance(e, Progress)]
        assert [p.fraction for p in progress] == [0.0, 1.0]
        assert again[-1].tokens == first[-1].tokens
        assert app.keepalive.loads == 3  # at start; 0 s unloaded it before the first request too
    finally:
        app.stop()


def test_sampling_changes_never_reload():
    app = tiny_app(None)  # never unloads
    try:
        prompt = list(b"abc abc abc")
        for t in (0.0, 0.7, 1.3, 0.0):
            assert isinstance(run(app, prompt, t)[-1], Finished)
        assert app.keepalive.loads == 1 and app.keepalive.state == "loaded"
    finally:
        app.stop()


def test_a_failed_reload_fails_the_request_and_the_next_one_retries():
    calls = []

    def loader():  # call 1: before the first request (0 s unloads at start); call 2 fails
        calls.append(1)
        if len(calls) == 2:
            raise ModelError("model X needs about 9.0 GiB of memory but only 1.0 GiB is available")
        return tiny.build("llama")

    app = tiny_app(0.0, loader)
    try:
        prompt = list(b"xyz xyz")
        run(app, prompt)
        wait_state(app, "unloaded")
        failed = run(app, prompt)
        assert isinstance(failed[-1], JobError) and "9.0 GiB" in failed[-1].message
        assert isinstance(run(app, prompt)[-1], Finished)
    finally:
        app.stop()


def test_the_memory_check_refuses_a_model_that_cannot_fit(monkeypatch, default_lm):
    need = memory.model_bytes(Path(default_lm.source), dequantize=True)
    assert need == default_lm.nbytes  # the header-only estimate is the resident size, exactly
    monkeypatch.setattr(memory, "available_bytes", lambda: 200 << 20)
    with pytest.raises(ModelError, match=r"needs about [\d.]+ GiB .* only 0\.2 GiB is available"):
        load(None)
    monkeypatch.setattr(memory, "available_bytes", lambda: 8 << 30)
    memory.check_model(Path(default_lm.source), dequantize=True, name="x")  # fits: no error


def test_idle_unload_frees_memory_in_a_real_daemon(tmp_path):
    """The resident set of a daemon serving the default model, after a request and after the
    idle unload; the next request reloads (progress notified) and gives the same answer."""
    daemon = Daemon(tmp_path, "--keep-alive", "8s")
    try:
        chat = wire.ChatParams(messages=[{"role": "user", "content": "Name three colours."}], max_tokens=24)
        with daemon.client() as c:
            first = c.call("warmspec/chat", chat, wire.GenerateResult)
            loaded = c.call("warmspec/status", None, wire.Status)
        assert loaded.model_state == "loaded", "the status call came more than 8 s after the answer"
        unloaded = daemon.wait_for(lambda st: st.model_state == "unloaded")
        freed = loaded.memory.rss_bytes - unloaded.memory.rss_bytes
        print(f"\nresident set: {loaded.memory.rss_bytes / 1e6:.0f} MB loaded, "
              f"{unloaded.memory.rss_bytes / 1e6:.0f} MB after the idle unload ({freed / 1e6:.0f} MB freed; "
              f"weights {loaded.model.parameters_bytes / 1e6:.0f} MB)")
        assert freed > 0.8 * loaded.model.parameters_bytes
        assert unloaded.prefix_cache.disk_entries >= 1  # the warm prefix went to disk first
        progress = []
        with daemon.client() as c:
            msg = c.start("warmspec/chat", chat)
            again = c.wait(msg, wire.GenerateResult, on_progress=progress.append)
            st = c.call("warmspec/status", None, wire.Status)
        assert again.text == first.text
        assert [p.fraction for p in progress] == [0.0, 1.0]
        assert st.loads == 2 and st.prefix_cache.disk_hits == 1  # and the prompt came from disk
    finally:
        daemon.kill()
