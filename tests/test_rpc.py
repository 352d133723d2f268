"""The JSON-RPC transport against real clients: pygls's LanguageClient over TCP, and warmspec's own
client over the Unix socket. The daemon runs in this process (its event loop on a thread) around
the session's model, so only decoding costs time: prompts are short and answers a few tokens."""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from pathlib import Path

import msgspec
import pytest
from lsprotocol import types as lsp
from pygls.exceptions import JsonRpcException
from pygls.lsp.client import LanguageClient

from warmspec.client import Client, RpcError
from warmspec.engine import Delta, Engine
from warmspec.gate import CostTable
from warmspec.server.app import App, Limits
from warmspec.server.inline import CompletionCache, cursor_context
from warmspec.server.rpc import RpcService
from warmspec.server.scheduler import Job
from warmspec.workspace import PRIORITY_CONVERSATION
from warmspec_protocol import FunctionCall, ToolCall
from warmspec_protocol import rpc as wire
from warmspec_protocol.rpc import ErrorCode

from conftest import wait_idle

FAST_COSTS = CostTable({0: {1: 1.0, 2: 1.1, 33: 2.0}})  # skips the verify-cost measurement


class InProcessDaemon:
    """``RpcService`` on a background event loop: a Unix socket and a TCP port, as ``serve`` has."""

    def __init__(self, lm, tmp: Path, *, api_key: str | None = None, limits: Limits | None = None,
                 workspace: bool = True):
        self.root = tmp / "ws"
        self.root.mkdir()
        self.api_key = api_key
        self.app = App(lm, Engine(lm, costs=FAST_COSTS), workspace_roots=[self.root] if workspace else [],
                       api_key=api_key, limits=limits)
        self.app.start()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.service = RpcService(self.app)
        self.socket = tmp / "rpc.sock"
        self.run(self.service.serve_unix(self.socket))
        self.port = self.run(self.service.serve_tcp("127.0.0.1", 0))

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=120)

    def wait_idle(self, timeout: float = 120) -> None:
        """Until no job runs or waits: a cancelled or abandoned request stops between prefill
        chunks or decode steps, a moment after its client has gone."""
        wait_idle(self.app.scheduler, timeout)

    def client(self) -> Client:
        c = Client.unix(self.socket, timeout=10)
        c.initialize(api_key=self.api_key)
        return c

    def close(self) -> None:
        self.run(self.service.close())
        self.app.stop()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def daemon(default_lm, tmp_path_factory):
    d = InProcessDaemon(default_lm, tmp_path_factory.mktemp("rpc"))
    yield d
    d.close()


def chat(text: str, max_tokens: int, **kw) -> wire.ChatParams:
    return wire.ChatParams(messages=[wire.Message(role="user", content=text)], max_tokens=max_tokens,
                           temperature=0.0, **kw)


def ask(daemon: InProcessDaemon, text: str, max_tokens: int) -> str:
    with daemon.client() as c:
        return c.call("warmspec/chat", chat(text, max_tokens), wire.GenerateResult).text


# -- pygls's LanguageClient over TCP ---------------------------------------------------------------


async def lsp_client(daemon: InProcessDaemon, **options) -> tuple[LanguageClient, lsp.InitializeResult]:
    client = LanguageClient("test", "1")
    await client.start_tcp("127.0.0.1", daemon.port)
    result = await client.initialize_async(lsp.InitializeParams(
        capabilities=lsp.ClientCapabilities(), initialization_options=options or None))
    client.initialized(lsp.InitializedParams())
    return client, result


async def close(client: LanguageClient) -> None:
    await client.shutdown_async(None)
    client.exit(None)
    await client.stop()


def test_initialize_advertises_inline_completion_and_full_sync(daemon):
    async def scenario():
        client, result = await lsp_client(daemon)
        await close(client)
        return result

    result = asyncio.run(scenario())
    caps = result.capabilities
    assert caps.inline_completion_provider is not None
    assert caps.text_document_sync.change == lsp.TextDocumentSyncKind.Full
    assert caps.text_document_sync.open_close is True
    assert result.server_info.name == "warmspec"


def test_chat_streams_deltas_then_cancel_leaves_engine_consistent(daemon):
    """Deltas carry the request id and add up to the result; a request cancelled mid-stream stops
    within a step or two, and the next request gets the same greedy answer as before."""
    question = "Name three primary colours."

    async def scenario():
        client, _ = await lsp_client(daemon)
        deltas = []

        @client.feature("warmspec/delta")
        def on_delta(params):
            deltas.append(params)

        first = await client.protocol.send_request_async("warmspec/chat", msgspec.to_builtins(chat(question, 8)),
                                                         msg_id=1)
        before = daemon.app.engine.totals.completion_tokens
        pending = client.protocol.send_request_async(
            "warmspec/chat", msgspec.to_builtins(chat("Write a long story about a dragon.", 60)), msg_id=2)
        while sum(d.id == 2 for d in deltas) < 2:
            await asyncio.sleep(0.01)
        client.protocol.notify("$/cancelRequest", lsp.CancelParams(id=2))
        with pytest.raises(JsonRpcException) as cancelled:
            await pending
        cancelled_tokens = daemon.app.engine.totals.completion_tokens - before
        again = await client.protocol.send_request_async("warmspec/chat", msgspec.to_builtins(chat(question, 8)),
                                                         msg_id=3)
        await close(client)
        return deltas, first, cancelled.value, cancelled_tokens, again

    deltas, first, cancelled, cancelled_tokens, again = asyncio.run(scenario())
    assert "".join(d.text for d in deltas if d.id == 1) == first.text
    assert first.finish_reason == "length" and first.stats.completion_tokens == 8
    assert first.tok_s > 0 and 0 < first.ttft_s < 60
    assert cancelled.code == ErrorCode.REQUEST_CANCELLED
    assert cancelled_tokens < 20  # stopped long before its 60 tokens
    assert again.text == first.text
    assert "".join(d.text for d in deltas if d.id == 3) == again.text


def test_document_sync_and_inline_completion(daemon):
    """didOpen/didChange/didClose reach the workspace index; ghost text continues the buffer,
    repeats come from the cache (also while typing the suggestion), and a newer request for the
    document supersedes an older one."""
    path = daemon.root / "fib.py"
    uri = path.as_uri()
    text = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return "
    ws = daemon.app.workspace

    def at_end(src: str) -> lsp.Position:
        lines = src.split("\n")
        return lsp.Position(line=len(lines) - 1, character=len(lines[-1]))

    def inline(client, src):
        return client.text_document_inline_completion_async(lsp.InlineCompletionParams(
            text_document=lsp.TextDocumentIdentifier(uri=uri), position=at_end(src),
            context=lsp.InlineCompletionContext(trigger_kind=lsp.InlineCompletionTriggerKind.Automatic)))

    async def wait_for(predicate):
        for _ in range(500):
            if predicate():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the workspace index was not updated")

    async def scenario():
        client, _ = await lsp_client(daemon, inlineCompletion={"maxTokens": 6})
        client.text_document_did_open(lsp.DidOpenTextDocumentParams(
            text_document=lsp.TextDocumentItem(uri=uri, language_id="python", version=1, text=text)))
        await wait_for(lambda: ws.document_text(uri) == text and path in ws.files)

        older = asyncio.ensure_future(inline(client, text))
        await asyncio.sleep(0)
        newer = await inline(client, text)
        with pytest.raises(JsonRpcException) as superseded:
            await older
        hits = daemon.service.ghost.cache.hits
        repeat = await inline(client, text)
        assert daemon.service.ghost.cache.hits == hits + 1

        suggestion = newer.items[0].insert_text
        typed = text + suggestion[:1]
        client.text_document_did_change(lsp.DidChangeTextDocumentParams(
            text_document=lsp.VersionedTextDocumentIdentifier(uri=uri, version=2),
            content_changes=[lsp.TextDocumentContentChangeWholeDocument(text=typed)]))
        await wait_for(lambda: ws.document_text(uri) == typed)
        rest = await inline(client, typed)
        assert daemon.service.ghost.cache.hits == hits + 2

        client.text_document_did_close(lsp.DidCloseTextDocumentParams(
            text_document=lsp.TextDocumentIdentifier(uri=uri)))
        await wait_for(lambda: ws.document_text(uri) is None)
        with pytest.raises(JsonRpcException) as closed:
            await inline(client, typed)
        await close(client)
        return superseded.value, newer, repeat, suggestion, rest, closed.value

    superseded, newer, repeat, suggestion, rest, closed = asyncio.run(scenario())
    assert superseded.code == ErrorCode.CONTENT_MODIFIED
    assert suggestion.strip()  # the model wrote something
    assert newer.items[0].range.start == at_end(text)
    assert repeat.items[0].insert_text == suggestion
    assert rest.items[0].insert_text == suggestion[1:]
    assert closed.code == ErrorCode.INVALID_PARAMS and "not open" in closed.message


def test_inline_ghost_text_is_the_greedy_continuation(daemon):
    """What the editor gets is exactly what the model writes after the buffer's text before the
    cursor, ending at the line's end when the cursor is mid-line."""
    uri = (daemon.root / "capitals.txt").as_uri()
    before, after = "Paris is the capital of France.\nThe capital of Italy is", " not a secret.\n"

    async def scenario():
        client, _ = await lsp_client(daemon, inlineCompletion={"maxTokens": 6})
        client.text_document_did_open(lsp.DidOpenTextDocumentParams(
            text_document=lsp.TextDocumentItem(uri=uri, language_id="plaintext", version=1, text=before + after)))
        got = await client.text_document_inline_completion_async(lsp.InlineCompletionParams(
            text_document=lsp.TextDocumentIdentifier(uri=uri), position=lsp.Position(line=1, character=23),
            context=lsp.InlineCompletionContext(trigger_kind=lsp.InlineCompletionTriggerKind.Invoked)))
        await close(client)
        return got

    got = asyncio.run(scenario())
    app = daemon.app
    job = app.job(app.text_prompt(before), app.sampling(temperature=0.0), max_tokens=6, stop=["\n"])
    expected = daemon.run(_run_job(daemon, job))
    assert expected and "\n" not in expected
    assert got.items[0].insert_text == expected


async def _run_job(daemon, job: Job) -> str:
    ticket = daemon.app.scheduler.submit(job)
    async for ev in ticket:
        if not isinstance(ev, Delta):
            return ev.text


def test_cursor_context_cuts_at_lines():
    text = "line one\nline two\nline three\nline four\n"
    offset = text.index("three") + 2
    prefix, suffix = cursor_context(text, offset, prefix_chars=12, suffix_chars=12)
    assert prefix == "line th"  # "two\n" fit the budget but starts mid-line
    assert suffix == "ree"  # "\nline fou" fit, but ends mid-line
    assert cursor_context(text, offset, 100, 100) == (text[:offset], text[offset:])


def test_completion_cache_serves_typed_through_suggestion():
    cache = CompletionCache()
    cache.store("x = ", "\n", "compute(1)")
    assert cache.lookup("x = ", "\n") == "compute(1)"
    assert cache.lookup("x = comp", "\n") == "ute(1)"
    assert cache.lookup("x = cx", "\n") is None  # typed something else
    assert cache.lookup("x = ", "y\n") is None  # a different suffix


def test_chat_indexes_the_files_its_tool_calls_read(daemon):
    """An agent speaking JSON-RPC resends its history as HTTP agents do: the file a tool call read
    becomes a draft source of that conversation, over either transport."""
    lib = daemon.root / "lib.py"
    lib.write_text("def area(r):\n    return 3.14159 * r * r\n")
    call = ToolCall(id="call_1", function=FunctionCall(name="read_file",
                                                        arguments={"path": str(lib)}))
    messages = [wire.Message(role="user", content="Read lib.py and rename area to circle_area."),
                wire.Message(role="assistant", content="", tool_calls=[call]),
                wire.Message(role="tool", content=lib.read_text(), tool_call_id="call_1")]
    with daemon.client() as c:
        result = c.call("warmspec/chat", wire.ChatParams(messages=messages, max_tokens=2,
                                                         temperature=0.0), wire.GenerateResult)
    assert result.finish_reason in ("stop", "length")
    assert lib.resolve() in daemon.app.workspace.files
    ranks = [priority for _, priority in daemon.app.workspace.sources(daemon.app.conversation_of(messages))]
    assert PRIORITY_CONVERSATION in ranks  # read in this conversation: it ranks first among files


def test_did_read_refuses_paths_outside_the_workspace(daemon, tmp_path):
    inside = daemon.root / "notes.md"
    inside.write_text("# Notes\nSpeculative decoding keeps the model's output exact.\n")
    outside = tmp_path / "secret.txt"
    outside.write_text("not for the model")
    escape = daemon.root / "escape.txt"
    escape.symlink_to(outside)

    async def scenario():
        client, _ = await lsp_client(daemon)
        ok = await client.protocol.send_request_async("warmspec/didRead", {"path": str(inside),
                                                                           "conversation": "c1"})
        errors = []
        for path in (str(outside), outside.as_uri(), str(escape), "/etc/passwd"):
            with pytest.raises(JsonRpcException) as refused:
                await client.protocol.send_request_async("warmspec/didRead", {"path": path})
            errors.append(refused.value)
        await close(client)
        return ok, errors

    ok, errors = asyncio.run(scenario())
    assert ok.path == str(inside.resolve()) and ok.workspace_files >= 1
    assert inside.resolve() in daemon.app.workspace.files
    for e in errors:
        assert e.code == ErrorCode.PATH_REFUSED and "outside the workspace" in e.message
    assert outside.resolve() not in daemon.app.workspace.files


def test_roots_named_in_initialize_are_added_for_local_clients_only(default_lm, tmp_path):
    """A client on the Unix socket (the daemon's user) may add its project to the workspace roots
    through ``workspaceFolders``, and read from it right away; a TCP client naming one changes
    nothing; and the home directory and / are never added. A daemon of its own, started without
    roots: the module's keeps its single root."""
    d = InProcessDaemon(default_lm, tmp_path, workspace=False)
    try:
        remote = tmp_path / "remote"
        local = tmp_path / "project"
        for project in (remote, local):
            project.mkdir()
            (project / "main.py").write_text("print('hello')\n")

        def read(c: Client, project: Path) -> wire.DidReadResult:
            return c.call("warmspec/didRead", wire.DidReadParams(path=str(project / "main.py")), wire.DidReadResult)

        with Client.tcp("127.0.0.1", d.port) as c:
            c.initialize(roots=[remote, Path.home(), Path("/")])
            with pytest.raises(RpcError) as refused:
                read(c, remote)
        assert "no workspace roots" in refused.value.message
        with Client.unix(d.socket) as c:
            c.initialize(roots=[local, Path.home(), Path("/")])
            indexed = read(c, local)
            with pytest.raises(RpcError) as still_refused:
                read(c, remote)
            status = c.call("warmspec/status", None, wire.Status)
    finally:
        d.close()
    assert refused.value.code == still_refused.value.code == ErrorCode.PATH_REFUSED
    assert indexed.path == str((local / "main.py").resolve())
    assert status.workspace_roots == [str(local.resolve())]


# -- warmspec's client over the socket -----------------------------------------------------------------


def test_eight_concurrent_clients_get_their_own_answers(daemon):
    """Eight socket clients at once each get exactly the answer their prompt gets alone, and a
    ninth, cancelled mid-stream, disturbs none of them."""
    prompts = [f"Give one word that rhymes with {w}." for w in
               ("cat", "dog", "sun", "tree", "cake", "light", "bed", "fish")]
    alone = [ask(daemon, p, 5) for p in prompts]
    assert len(set(alone)) > 1  # the prompts really differ in their answers

    answers: dict[int, str] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(prompts) + 1)

    def one(i: int) -> None:
        with daemon.client() as c:
            start.wait()
            answers[i] = c.call("warmspec/chat", chat(prompts[i], 5), wire.GenerateResult).text

    def cancelled() -> None:
        with daemon.client() as c:
            start.wait()
            got = []
            with pytest.raises(RpcError) as e:
                c.wait(c.start("warmspec/chat", chat("Tell me a long story.", 40)), wire.GenerateResult,
                       on_delta=got.append, interrupted=lambda: len(got) >= 1)
            assert e.value.code == ErrorCode.REQUEST_CANCELLED

    def catching(fn, *args) -> None:
        try:
            fn(*args)
        except BaseException as e:  # re-raised by the assertion below, from the main thread
            errors.append(e)

    threads = [threading.Thread(target=catching, args=(one, i)) for i in range(len(prompts))]
    threads.append(threading.Thread(target=catching, args=(cancelled,)))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors
    assert [answers[i] for i in range(len(prompts))] == alone


def test_bad_requests_get_precise_errors_and_the_connection_lives(daemon):
    with Client.unix(daemon.socket) as c:
        with pytest.raises(RpcError) as e:
            c.call("warmspec/status", None, wire.NoParams)
        assert e.value.code == ErrorCode.SERVER_NOT_INITIALIZED
        c.initialize()
        cases = [
            ("warmspec/chat", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": "8"},
             ErrorCode.INVALID_PARAMS, "$.max_tokens"),
            ("warmspec/chat", {"messages": [{"role": "robot", "content": "hi"}]},
             ErrorCode.INVALID_PARAMS, "$.messages[0].role"),
            ("warmspec/chat", {"messages": [{"role": "user", "content": "hi"}], "max_token": 8},
             ErrorCode.INVALID_PARAMS, "max_token"),
            ("warmspec/chat", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10 ** 6},
             ErrorCode.INVALID_PARAMS, "max_tokens must be between 1 and"),
            ("warmspec/complete", {"prompt": ""}, ErrorCode.INVALID_PARAMS, "$.prompt"),
            ("warmspec/complete", [1, 2], ErrorCode.INVALID_PARAMS, "params as an object"),
            ("warmspec/nope", {}, ErrorCode.METHOD_NOT_FOUND, "warmspec/nope"),
            ("warmspec/delta", {}, ErrorCode.METHOD_NOT_FOUND, "warmspec/delta"),
            ("textDocument/didOpen", {}, ErrorCode.INVALID_REQUEST, "notification"),
            ("textDocument/inlineCompletion", {"position": 3}, ErrorCode.INVALID_PARAMS, "inlineCompletion"),
        ]
        for method, params, code, mention in cases:
            with pytest.raises(RpcError) as e:
                c.call(method, params, wire.GenerateResult)
            assert (e.value.code, mention in e.value.message) == (code, True), (method, e.value.message)
        status = c.call("warmspec/status", None, wire.Status)  # still serving
        assert status.model.id == daemon.app.lm.name


def test_oversized_request_is_refused(default_lm, tmp_path):
    d = InProcessDaemon(default_lm, tmp_path, limits=Limits(max_body_bytes=1000))
    try:
        with d.client() as c:
            c.send(wire.Request(id=9, method="warmspec/complete", params={"prompt": "x" * 2000}))
            reply = c.read(10)
            assert reply.error.code == ErrorCode.INVALID_REQUEST and "over the limit" in reply.error.message
            with pytest.raises(ConnectionError):
                c.read(10)  # the stream cannot be resynchronized: the daemon hangs up
        with d.client() as c:
            assert c.call("warmspec/models", None, wire.ModelsResult).models[0].id == default_lm.name
    finally:
        d.close()


def test_api_key_is_required_on_the_socket(default_lm, tmp_path):
    d = InProcessDaemon(default_lm, tmp_path, api_key="s3cret")
    try:
        for key, mention in ((None, "needs"), ("wrong", "different")):
            with Client.unix(d.socket) as c:
                with pytest.raises(RpcError) as e:
                    c.initialize(api_key=key)
                assert e.value.code == ErrorCode.UNAUTHORIZED and mention in e.value.message
                with pytest.raises(ConnectionError):
                    c.read(10)  # one guess per connection
        with d.client() as c:  # the right key
            assert c.call("warmspec/models", None, wire.ModelsResult).models
    finally:
        d.close()


def test_time_to_first_token_overhead(daemon, capsys):
    """Reports (no timed assertion) what the socket adds to the time to first token: paired, the
    client's TTFT minus the daemon's own for the same request; unpaired, against submitting the
    same job in process."""
    params = chat("Say hello.", 1)
    app = daemon.app
    prompt = app.chat_prompt([wire.Message(role="user", content="Say hello.")])
    paired, socket_ttft, in_process = [], [], []

    async def first_token_in_process() -> float:
        job = app.job(prompt, app.sampling(temperature=0.0), max_tokens=1)
        t = time.perf_counter()
        ticket = app.scheduler.submit(job)
        async for ev in ticket:
            if isinstance(ev, Delta):
                elapsed = time.perf_counter() - t
        return elapsed

    with daemon.client() as c:
        for _ in range(8):
            first = []
            t = time.perf_counter()
            result = c.wait(c.start("warmspec/chat", params), wire.GenerateResult,
                            on_delta=lambda d: first.append(time.perf_counter() - t) if not first else None)
            socket_ttft.append(first[0])
            paired.append(first[0] - result.ttft_s)
            in_process.append(daemon.run(first_token_in_process()))
    med = statistics.median
    with capsys.disabled():
        print(f"\nTTFT over the socket: median {med(socket_ttft) * 1000:.1f} ms; in process "
              f"{med(in_process) * 1000:.1f} ms; added by the transport (paired) "
              f"median {med(paired) * 1000:.2f} ms, max {max(paired) * 1000:.2f} ms")
    assert all(p > 0 for p in paired)
