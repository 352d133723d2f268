"""Coding agents as clients, as a new user runs them.

Agents send no ``max_tokens`` and expect the whole answer (aider's whole-file edits), and read the
context length from ``/v1/models``: first both on a tiny random model (seconds), then aider itself,
installed from PyPI, editing a file through ``warmspec serve`` on the default model.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import anthropic
import msgspec
import pytest

import tiny
from test_http import COSTS, Server
from warmspec.client import Client
from warmspec.core import Delta, Engine, Finished, GenerationStats
from warmspec.core import CostTable
from warmspec.server.app import App, Limits
from warmspec.server.rpc import RpcService
from warmspec_protocol import rpc as wire

CONTEXT = 1500  # more than the 1024 tokens the daemon once gave a request without max_tokens


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    """A tiny random model with a 1500-token context (byte tokens, no end-of-sequence: it writes
    until something stops it), over HTTP and JSON-RPC."""
    lm = dataclasses.replace(tiny.build("llama"), context_length=CONTEXT)
    srv = Server(App(lm, Engine(lm, costs=CostTable(COSTS))))
    srv.socket = tmp_path_factory.mktemp("rpc") / "rpc.sock"
    srv.service = RpcService(srv.app)
    asyncio.run_coroutine_threadsafe(srv.service.serve_unix(srv.socket), srv.loop).result(30)
    yield srv
    asyncio.run_coroutine_threadsafe(srv.service.close(), srv.loop).result(30)
    srv.close()


def test_without_max_tokens_the_answer_runs_to_the_end_of_the_context(tiny_server):
    prompt = "def main():\n"
    n = len(tiny_server.app.text_prompt(prompt))
    r = tiny_server.openai().completions.create(model="m", prompt=prompt, temperature=0)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == CONTEXT - n  # not 1024: the context ended it
    with Client.unix(tiny_server.socket, timeout=120) as c:
        c.initialize()
        result = c.call("warmspec/complete", wire.CompleteParams(prompt=prompt, temperature=0), wire.GenerateResult)
    assert result.stats.completion_tokens == CONTEXT - n and result.text == r.choices[0].text

    # bounded by the daemon's limit, which a request cannot exceed either
    tiny_server.app.limits = Limits(max_tokens=100)
    try:
        r = tiny_server.openai().completions.create(model="m", prompt=prompt, temperature=0)
        assert r.usage.completion_tokens == 100 and r.choices[0].finish_reason == "length"
        status, _, _ = tiny_server.post("/v1/completions", {"prompt": prompt, "max_tokens": 101}, key=None)
        assert status == 400
    finally:
        tiny_server.app.limits = Limits()


def test_models_tell_the_context_length(tiny_server):
    m = tiny_server.openai().models.retrieve(tiny_server.app.lm.name)
    assert m.model_extra["max_model_len"] == m.model_extra["max_context_length"] == CONTEXT  # vLLM, LM Studio
    assert m.model_extra["context_length"] == CONTEXT
    listed = tiny_server.openai().models.list().data[0]
    assert listed.id == m.id and listed.model_extra["max_model_len"] == CONTEXT
    a = anthropic.Anthropic(base_url=tiny_server.url, api_key="unused", max_retries=0).models.list()
    assert [x.id for x in a.data] == [m.id]  # the extra fields do not trouble the other SDK


# -- aider, from PyPI ------------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent
AIDER_VENV = ROOT / ".venv-aider"  # install.sh --test puts aider here: its pinned dependencies clash with ours
SHAPES = '''import math


def area_of_circle(radius):
    return math.pi * radius * radius


def area_of_square(side):
    return side * side


def perimeter_of_square(side):
    return 4 * side
'''


@pytest.fixture(scope="module")
def aider() -> Path:
    """The aider executable: $WARMSPEC_AIDER, else install.sh's .venv-aider, else on PATH. Missing,
    the aider tests skip -- except under CI, where install.sh --test must have installed it."""
    for candidate in (os.environ.get("WARMSPEC_AIDER"), AIDER_VENV / "bin" / "aider", shutil.which("aider")):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    if os.environ.get("CI"):
        pytest.fail(f"aider is not installed: ./install.sh --test puts it in {AIDER_VENV}")
    pytest.skip(f"aider is not installed (./install.sh --test puts it in {AIDER_VENV})")


def context_of(base_url: str, model: str) -> int:
    with urllib.request.urlopen(f"{base_url}/v1/models/{model}", timeout=30) as r:
        return msgspec.json.decode(r.read())["max_model_len"]


def run_aider(aider: Path, work: Path, base_url: str, model: str, message: str, *files: str) -> tuple[str, str]:
    """aider in non-interactive mode, whole-file edits, no git, offline: its update check,
    analytics and model-metadata download are off, and a proxy on a closed port makes anything
    else that tries the internet fail at once (and show in its output). The context length comes
    from the daemon's /v1/models, as a user would write it into aider's model metadata file.
    Returns aider's output and the raw exchange with the model (--llm-history-file)."""
    context = context_of(base_url, model)
    home = work.parent / "home"
    home.mkdir(exist_ok=True)
    metadata = home / "model-metadata.json"
    metadata.write_text(msgspec.json.encode({f"openai/{model}": {
        "max_input_tokens": context, "max_tokens": context, "max_output_tokens": context,
        "input_cost_per_token": 0, "output_cost_per_token": 0, "litellm_provider": "openai",
        "mode": "chat"}}).decode())
    history = home / "llm-history.txt"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "ANTHROPIC_", "AIDER_"))}
    env.update(HOME=str(home), OPENAI_API_KEY="unused", LITELLM_LOCAL_MODEL_COST_MAP="True",
               HTTP_PROXY="http://127.0.0.1:9", HTTPS_PROXY="http://127.0.0.1:9", NO_PROXY="127.0.0.1,localhost",
               TERM="dumb")
    proc = subprocess.run(
        [str(aider), "--model", f"openai/{model}", "--openai-api-base", f"{base_url}/v1",
         "--model-metadata-file", str(metadata), "--edit-format", "whole", "--no-git", "--yes-always",
         "--no-check-update", "--no-show-release-notes", "--analytics-disable", "--no-show-model-warnings",
         "--map-tokens", "0", "--no-pretty", "--no-fancy-input", "--no-detect-urls",
         "--no-suggest-shell-commands", "--no-restore-chat-history", "--llm-history-file", str(history),
         "--message", message, *files],
        cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "127.0.0.1', port=9" not in out, out  # nothing tried to reach the internet
    return out, history.read_text()


def listing(answer: str, name: str) -> str | None:
    """The file aider's whole format takes from an answer: the fenced block after the file name
    (the last one, when the model wrote several)."""
    found = re.findall(rf"^{re.escape(name)}\n```[^\n]*\n(.*?)^```", answer, re.M | re.S)
    return found[-1] if found else None


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_aider_edits_a_file_through_warmspec_serve(aider, tmp_path):
    """aider (PyPI), default model, `warmspec serve` as a user starts it: aider sends no max_tokens
    and the answer runs to its end (finish "stop"); the file is what the model's listing says."""
    work = tmp_path / "project"
    work.mkdir()
    (work / "shapes.py").write_text(SHAPES)
    port = free_port()
    env = dict(os.environ, WARMSPEC_RUNTIME_DIR=str(tmp_path / "rt"))
    log = (tmp_path / "serve.log").open("w")
    daemon = subprocess.Popen([sys.executable, "-m", "warmspec", "serve", "--port", str(port), "--workspace", str(work)],
                              env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600  # loading, and measuring verify costs the first time on a machine
        while True:
            assert daemon.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=5) as r:
                    model = msgspec.json.decode(r.read())["model"]
                break
            except OSError:
                assert time.monotonic() < deadline, "the daemon did not come up"
                time.sleep(0.5)
        context = context_of(base, model)
        out, history = run_aider(aider, work, base, model,
                                 "Rename area_of_square to square_area in shapes.py.",
                                 "shapes.py")
    finally:
        daemon.send_signal(signal.SIGINT)
        daemon.wait(60)
        log.close()
    answer = history.split("LLM RESPONSE", 1)[1].split("\n", 1)[1]
    answer = "\n".join(line.removeprefix("ASSISTANT ").removeprefix("ASSISTANT") for line in answer.splitlines())
    new = listing(answer, "shapes.py")
    assert new is not None, out
    assert (work / "shapes.py").read_text() == new != SHAPES  # aider wrote what the model answered
    # One request, without max_tokens (aider sends none), answered to its end: the model stopped,
    # or -- a small model may loop -- the context ended; never a daemon default in between.
    served = [line for line in (tmp_path / "serve.log").read_text().splitlines() if "warmspec.engine INFO request:" in line]
    assert len(served) == 1, served
    m = re.search(r"request: (\d+) tokens, .*prefill (\d+) tok in [\d.]+ s(?: \((\d+) cached\))?.*finish (\w+)$", served[0])
    completion, prompt = int(m.group(1)), int(m.group(2)) + int(m.group(3) or 0)
    assert m.group(4) == "stop" or (m.group(4) == "length" and prompt + completion == context), served


class WholeFileEngine:
    """Stands in for ``Engine`` behind a real ``App``, scheduler and HTTP server: answers aider's
    whole-file format with a file of ~3000 characters, one token per character, cut where the
    job's ``max_tokens`` says -- so an answer cut by a daemon default shows in the file."""

    speculate = False

    def __init__(self, name: str, text: str):
        self.totals = GenerationStats()
        self.reply = f"Here it is:\n\n{name}\n```\n{text}```\n"
        self.budgets: list[tuple[int, int]] = []  # (prompt tokens, max_tokens) per request

    def reset(self) -> None:
        pass

    def generate(self, prompt, params, *, max_tokens, stop=(), speculate=None, sources=(), prediction=(),
                 cancelled=None):
        self.budgets.append((len(prompt), max_tokens))
        reply = self.reply[:max_tokens]
        for i in range(0, len(reply), 16):
            yield Delta(reply[i:i + 16], [])
        stats = GenerationStats(prompt_tokens=len(prompt), completion_tokens=len(reply), passes=len(reply))
        yield Finished("length" if len(reply) < len(self.reply) else "stop", reply, [], stats)


def test_aider_gets_a_whole_file_longer_than_1024_tokens(aider, default_lm, tmp_path):
    """A whole-file answer of ~3000 tokens reaches aider whole (the daemon once cut every request
    without max_tokens at 1024): the real aider, App, scheduler and HTTP API, a scripted engine."""
    work = tmp_path / "project"
    work.mkdir()
    old = "".join(f"def f{i}(x):\n    return x + {i}\n\n\n" for i in range(100))
    (work / "many.py").write_text(old)
    new = old.replace("return x + 7\n", "return x + 7  # seven\n")
    engine = WholeFileEngine("many.py", new)
    srv = Server(App(default_lm, engine))
    try:
        run_aider(aider, work, srv.url, default_lm.name, "Mark f7 with a comment.", "many.py")
    finally:
        srv.close()
    # every request (aider then summarizes the chat in a second one) got the rest of the context
    assert len(engine.reply) > 3000 and engine.budgets
    assert all(prompt + budget == default_lm.context_length for prompt, budget in engine.budgets), engine.budgets
    assert (work / "many.py").read_text() == new
