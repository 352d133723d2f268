"""The live status page, in a real browser: headless Chromium (Debian's ``chromium``; install.sh
--test installs it) loads ``/`` from a daemon while a request decodes, the test reads the figures
from the rendered page through the DevTools protocol, sees them change between polls, and saves a
screenshot to docs/status-page.png."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import aiohttp
import pytest

from warmspec_protocol import rpc as wire

from conftest import SAMPLE_FILE
from daemon_proc import Daemon

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SCREENSHOT = Path(__file__).parents[1] / "docs" / "status-page.png"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run", "--remote-debugging-port=0",
         "--window-size=1280,1700", "--hide-scrollbars"]

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (./install.sh --test)")


class Page:
    """One browser tab driven over the DevTools protocol."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse):
        self.ws = ws
        self.ids = iter(range(1, 1 << 30))

    async def call(self, method: str, **params):
        msg_id = next(self.ids)
        await self.ws.send_json({"id": msg_id, "method": method, "params": params})
        while True:
            msg = await self.ws.receive_json(timeout=60)
            if msg.get("id") == msg_id:
                assert "error" not in msg, msg
                return msg["result"]

    async def text(self, element_id: str) -> str | None:
        """The element's text; None while the page has not loaded it."""
        r = await self.call("Runtime.evaluate", returnByValue=True,
                            expression=f"(document.getElementById({element_id!r}) || {{}}).textContent ?? null")
        return r["result"].get("value")

    async def number(self, element_id: str) -> float | None:
        t = await self.text(element_id)
        try:
            return float(t)
        except (TypeError, ValueError):
            return None

    async def until(self, what, predicate, timeout: float = 120.0):
        deadline = time.monotonic() + timeout
        while True:
            value = await what()
            if predicate(value):
                return value
            assert time.monotonic() < deadline, f"the page never showed it; last {value!r}"
            await asyncio.sleep(0.2)


def start_browser(profile: Path) -> tuple[subprocess.Popen, int]:
    # Not the OpenBLAS preload the test run carries: Chromium's zygote children die with it.
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    proc = subprocess.Popen([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "about:blank"], env=env,
                            stdout=subprocess.DEVNULL, stderr=open(profile.parent / "chromium.log", "wb"))
    port_file = profile / "DevToolsActivePort"
    deadline = time.monotonic() + 60
    while not (port_file.exists() and port_file.read_text().strip()):
        assert proc.poll() is None and time.monotonic() < deadline, "chromium did not start"
        time.sleep(0.1)
    return proc, int(port_file.read_text().split()[0])


def test_status_page_shows_a_decoding_request_live(tmp_path):
    daemon = Daemon(tmp_path, speculate=True)
    browser = None
    try:
        # A request that decodes for a while, drafting from the file it copies.
        prompt = f"Repeat this file exactly, then explain it:\n```\n{SAMPLE_FILE}\n```"
        chat = wire.ChatParams(messages=[{"role": "user", "content": prompt}], max_tokens=400)
        with daemon.client() as c:  # a first one, for the rolling figures and the prefix cache
            c.call("warmspec/chat", wire.ChatParams(messages=[{"role": "user", "content": "Hello!"}],
                                                    max_tokens=8), wire.GenerateResult)
        result: list = []
        worker = threading.Thread(target=lambda: result.append(_chat(daemon, chat)), daemon=True)
        worker.start()
        daemon.wait_for(lambda st: st.active)

        browser, port = start_browser(tmp_path / "profile")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=30) as r:
            target = next(t for t in json.load(r) if t["type"] == "page")

        async def drive():
            async with aiohttp.ClientSession() as s:
                async with s.ws_connect(target["webSocketDebuggerUrl"], max_msg_size=64 << 20) as ws:
                    page = Page(ws)
                    await page.call("Page.enable")
                    await page.call("Page.navigate", url=daemon.url + "/")
                    tokens = await page.until(lambda: page.number("cur-tokens"), lambda v: v is not None and v > 0)
                    polls = await page.number("polls")
                    later = await page.until(lambda: page.number("cur-tokens"), lambda v: v is None or v > tokens)
                    # the screenshot once drafting has had a chance (a plain start, then copying)
                    await page.until(lambda: page.number("cur-tokens"), lambda v: v is None or v >= 60, 300)
                    seen = {k: await page.text(k) for k in ("state", "model", "active", "queued", "bandwidth",
                                                             "ceiling", "step-mb", "cur-tpp", "pc-hits",
                                                             "rss", "roll-n")}
                    assert await page.number("polls") > polls  # it keeps polling
                    svg = await page.call("Runtime.evaluate", returnByValue=True, expression=(
                        "[document.querySelectorAll('#costs polyline').length,"
                        " document.querySelectorAll('#roof circle').length]"))
                    shot = await page.call("Page.captureScreenshot", format="png")
                    return tokens, later, seen, svg["result"]["value"], base64.b64decode(shot["data"])

        tokens, later, seen, (cost_lines, roof_points), png = asyncio.run(drive())
        print(f"\nstatus page: {seen}, tokens {tokens:.0f} then {later}")
        assert seen["state"] == "decoding" and seen["active"] == "1" and seen["queued"] == "0"
        assert seen["model"] == "SmolLM2-135M-Instruct"
        assert float(seen["bandwidth"]) > 0 and float(seen["ceiling"]) > 0
        assert 500 < float(seen["step-mb"]) < 1000  # 538 MB of weights + the KV cache
        assert float(seen["cur-tpp"]) >= 1.0 and seen["roll-n"] == "1" and seen["rss"].endswith("MB")
        assert cost_lines == 2 and roof_points >= 1  # two contexts measured; recent and running
        SCREENSHOT.parent.mkdir(exist_ok=True)
        SCREENSHOT.write_bytes(png)
        worker.join(600)
        assert result and result[0].stats.completion_tokens > 0
    finally:
        if browser is not None:
            browser.kill()
            browser.wait(30)
        daemon.kill()


def _chat(daemon: Daemon, chat: wire.ChatParams) -> wire.GenerateResult:
    with daemon.client() as c:
        return c.call("warmspec/chat", chat, wire.GenerateResult)
