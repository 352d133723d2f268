"""``warmspec ask``/``serve``/``lsp``/``stop`` run as a user runs them: subprocesses, with a runtime
directory of the test's own (``WARMSPEC_RUNTIME_DIR``) so no other daemon is touched. Daemons run
``--no-speculate``: it skips the verify-cost measurement (seconds to a minute on a busy CPU), and
speculation is tested elsewhere -- here the subject is the process and the protocol around it."""

from __future__ import annotations

import asyncio
import os
import re
import select
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from lsprotocol import types as lsp
from pygls.exceptions import JsonRpcException
from pygls.lsp.client import LanguageClient

from warmspec.client import Client, RpcError
from warmspec_protocol import rpc as wire
from warmspec_protocol.rpc import ErrorCode

SUMMARY = re.compile(r"(\d+) tokens, [\d.]+ tok/s, .*\d+ passes \([\d.]+ tok/pass\)")


@pytest.fixture
def env(tmp_path):
    e = dict(os.environ)
    e["WARMSPEC_RUNTIME_DIR"] = str(tmp_path / "rt")
    e.pop("WARMSPEC_API_KEY", None)
    yield e
    warmspec("stop", env=e)  # whatever a failed test left running


def warmspec(*args: str, env: dict, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "warmspec", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_ask_starts_a_daemon_reuses_it_and_stop_ends_it(env, tmp_path):
    runtime = Path(env["WARMSPEC_RUNTIME_DIR"])
    project = tmp_path / "project"
    project.mkdir()
    notes = project / "notes.md"
    notes.write_text("The password for the build server is kumquat.\n")
    question = ["ask", "--no-speculate", "--max-tokens", "8", "--workspace", str(project), "-f", str(notes),
                "What is the password for the build server?"]

    first = warmspec(*question, env=env)
    assert first.returncode == 0, first.stderr
    assert "daemon started" in first.stderr
    assert first.stdout.strip()
    tokens = SUMMARY.search(first.stderr)
    assert tokens and 0 < int(tokens.group(1)) <= 8, first.stderr
    assert oct(runtime.stat().st_mode & 0o777) == "0o700"
    assert oct((runtime / "warmspec.sock").stat().st_mode & 0o777) == "0o600"
    pid = int((runtime / "warmspec.pid").read_text())

    second = warmspec(*question, env=env)
    assert second.returncode == 0, second.stderr
    assert "daemon started" not in second.stderr  # reused
    assert int((runtime / "warmspec.pid").read_text()) == pid
    assert second.stdout == first.stdout  # greedy: the same answer
    with Client.unix(runtime / "warmspec.sock") as c:
        c.initialize()
        status = c.call("warmspec/status", None, wire.Status)
    assert status.workspace_files == 1  # -f was reported with warmspec/didRead
    assert status.requests_completed == 2

    other = warmspec("ask", "--model", str(tmp_path / "other.gguf"), "hi", env=env)
    assert other.returncode == 1 and "serves SmolLM2-135M-Instruct" in other.stderr

    # Ctrl-C cancels the request on the daemon, which keeps serving
    proc = subprocess.Popen([sys.executable, "-m", "warmspec", "ask", "--max-tokens", "400",
                             "Write a long story about a lighthouse keeper."], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    ready, _, _ = select.select([proc.stdout], [], [], 120)
    assert ready and proc.stdout.read1(64)  # the answer has started
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and b"cancelled" in err, err
    with Client.unix(runtime / "warmspec.sock") as c:
        c.initialize()
        status = c.call("warmspec/status", None, wire.Status)
    assert 16 < status.totals.completion_tokens < 16 + 100  # the story stopped early

    stop = warmspec("stop", env=env)
    assert stop.returncode == 0 and f"pid {pid}" in stop.stderr
    deadline = time.monotonic() + 20  # the lock is released just before the process ends
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(pid)
    assert not (runtime / "warmspec.sock").exists() and not (runtime / "warmspec.pid").exists()
    assert "no daemon is running" in warmspec("stop", env=env).stderr


def test_serve_refuses_a_public_address_without_an_api_key(env):
    result = warmspec("serve", "--host", "0.0.0.0", "--rpc-port", "0", env=env, timeout=60)
    assert result.returncode == 1 and "without --api-key" in result.stderr


def test_serve_over_tcp_and_http_with_an_api_key(env, tmp_path):
    """``--rpc-port`` serves the same JSON-RPC over TCP, ``--port`` the HTTP API; both want the key,
    and so does the socket."""
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "warmspec", "serve", "--no-speculate", "--rpc-port", "0",
                                 "--port", "0", "--api-key", "k3y"], env=env, stdout=out, stderr=out)
    try:
        deadline = time.monotonic() + 300
        while not (ready := re.search(r"ready: .*tcp 127\.0\.0\.1:(\d+), HTTP on (http://\S+?)(?: |$)",
                                      log.read_text(), re.M)):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        rpc_port, http = int(ready.group(1)), ready.group(2)
        with Client.tcp("127.0.0.1", rpc_port) as c:
            with pytest.raises(RpcError) as e:
                c.initialize()
            assert e.value.code == ErrorCode.UNAUTHORIZED
        with Client.tcp("127.0.0.1", rpc_port) as c:
            c.initialize(api_key="k3y")
            assert c.call("warmspec/models", None, wire.ModelsResult).requested is None
        with Client.unix(Path(env["WARMSPEC_RUNTIME_DIR"]) / "warmspec.sock") as c:
            with pytest.raises(RpcError):
                c.initialize()
        request = urllib.request.Request(f"{http}/v1/models", headers={"Authorization": "Bearer k3y"})
        with urllib.request.urlopen(request, timeout=30) as response:
            assert b"SmolLM2-135M-Instruct" in response.read()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    assert proc.returncode == 0


class Editor(LanguageClient):
    returncode: int | None = None

    async def server_exit(self, server) -> None:
        self.returncode = server.returncode


def test_lsp_on_stdio(env, tmp_path):
    """An editor spawning ``warmspec lsp``: initialize, a document, ghost text, a refused read, and
    LSP's shutdown/exit ending the process with status 0."""
    doc = tmp_path / "hello.py"
    text = "# Print a greeting to the user\nprint("
    uri = doc.as_uri()

    async def scenario():
        client = Editor("editor", "1")
        await client.start_io(sys.executable, "-m", "warmspec", "lsp", "--no-speculate", "--workspace",
                              str(tmp_path), env=env)
        result = await client.initialize_async(lsp.InitializeParams(
            capabilities=lsp.ClientCapabilities(), initialization_options={"inlineCompletion": {"maxTokens": 4}}))
        client.initialized(lsp.InitializedParams())
        client.text_document_did_open(lsp.DidOpenTextDocumentParams(
            text_document=lsp.TextDocumentItem(uri=uri, language_id="python", version=1, text=text)))
        ghost = await client.text_document_inline_completion_async(lsp.InlineCompletionParams(
            text_document=lsp.TextDocumentIdentifier(uri=uri), position=lsp.Position(line=1, character=6),
            context=lsp.InlineCompletionContext(trigger_kind=lsp.InlineCompletionTriggerKind.Invoked)))
        with pytest.raises(JsonRpcException) as refused:
            await client.protocol.send_request_async("warmspec/didRead", {"path": "/etc/hostname"})
        await client.shutdown_async(None)
        client.exit(None)
        await asyncio.wait_for(client.stop(), 60)  # returns once the server process has exited
        return result, ghost, refused.value, client.returncode

    result, ghost, refused, code = asyncio.run(scenario())
    assert result.capabilities.inline_completion_provider is not None
    assert ghost.items and ghost.items[0].insert_text
    assert refused.code == ErrorCode.PATH_REFUSED
    assert code == 0
