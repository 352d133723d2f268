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
from warmspec.core.engine import Delta, Engine
from warmspec.core.gate import CostTable
from warmspec.server.app import App, Limits
from warmspec.server.inline import CompletionCache, Window, cursor_context
from warmspec.server import rpc
from warmspec.server.rpc import RpcService
from warmspec.server.scheduler import Job
from warmspec.workspace import PRIORITY_CONVERSATION
from warmspec_protocol import FunctionCall, ToolCall
from warmspec_protocol import rpc as wire
from warmspec_protocol.rpc import ErrorCode

import tiny
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

    def at(prefix: str, suffix: str = "\n", uri: str = "file:///a.py", max_tokens: int = 8) -> Window:
        return Window(uri=uri, prefix=prefix, suffix=suffix, model="m", max_tokens=max_tokens, stop=("\n\n",))

    cache.store(at("x = "), "compute(1)")
    assert cache.lookup(at("x = ")) == "compute(1)"
    assert cache.lookup(at("x = comp")) == "ute(1)"
    assert cache.lookup(at("x = cx")) is None  # typed something else
    assert cache.lookup(at("x = ", "y\n")) is None  # a different suffix
    assert cache.lookup(at("x = ", uri="file:///b.py")) is None  # another document
    assert cache.lookup(at("x = ", max_tokens=9)) is None  # other settings
    assert cache.lookup(at("# a\nx = ")) is None  # the window holds more text above


def inline_at_end(client: LanguageClient, uri: str, src: str):
    lines = src.split("\n")
    return client.text_document_inline_completion_async(lsp.InlineCompletionParams(
        text_document=lsp.TextDocumentIdentifier(uri=uri), position=lsp.Position(line=len(lines) - 1,
                                                                                 character=len(lines[-1])),
        context=lsp.InlineCompletionContext(trigger_kind=lsp.InlineCompletionTriggerKind.Invoked)))


def ghost_alone(daemon: InProcessDaemon, uri: str, src: str, max_tokens: int) -> str:
    """The suggestion at the end of ``src`` computed without the cache: the job, run alone."""
    ghost = daemon.service.ghost
    window = ghost.window(uri, src, len(src), wire.InlineCompletionSettings(max_tokens=max_tokens))
    return daemon.run(_run_job(daemon, ghost.job(window, label="alone")))


# Long enough that the prompt's 4096-character window reaches far above the last 512 characters.
FILLER = "".join(f"limit_{i} = {i} * 16  # bytes\n" for i in range(30))
TAIL = "\n\ndef total_limit():\n    return "


@pytest.fixture(scope="module")
def tiny_daemon(tmp_path_factory):
    """A daemon around a tiny random-weight model (byte tokenizer): prompts of thousands of
    characters cost milliseconds."""
    import tiny

    d = InProcessDaemon(tiny.build("llama"), tmp_path_factory.mktemp("tiny"))
    yield d
    d.close()


def test_ghost_text_after_an_edit_far_above_the_cursor_is_not_stale(tiny_daemon):
    """An edit 800 characters above the cursor is inside the prompt's window: the suggestion
    for the old text must not be served for the new one (it was, while the cache compared only
    the last 512 characters before the cursor)."""
    daemon = tiny_daemon
    uri = (daemon.root / "limits.py").as_uri()
    before = "# Memory limits, in bytes.\n" + FILLER + TAIL
    after = "# Time limits, in seconds.\nTIMEOUT = 30\n" + FILLER + TAIL
    assert len(before) - len(TAIL) > 512 * 1.5 and len(after) < 4096

    async def scenario():
        client, _ = await lsp_client(daemon, inlineCompletion={"maxTokens": 4})
        client.text_document_did_open(lsp.DidOpenTextDocumentParams(
            text_document=lsp.TextDocumentItem(uri=uri, language_id="python", version=1, text=before)))
        await inline_at_end(client, uri, before)
        client.text_document_did_change(lsp.DidChangeTextDocumentParams(
            text_document=lsp.VersionedTextDocumentIdentifier(uri=uri, version=2),
            content_changes=[lsp.TextDocumentContentChangeWholeDocument(text=after)]))
        hits = daemon.service.ghost.cache.hits
        got = await inline_at_end(client, uri, after)
        misses = daemon.service.ghost.cache.hits == hits
        await close(client)
        return got, misses

    got, missed = asyncio.run(scenario())
    assert missed, "served the suggestion cached for the text before the edit"
    assert [i.insert_text for i in got.items] == [t for t in [ghost_alone(daemon, uri, after, 4)] if t]


def test_ghost_text_is_not_served_from_another_document(tiny_daemon):
    """Two documents that end in the same 800 characters but differ above: the second one's
    suggestion is its own, not the first one's from the cache."""
    daemon = tiny_daemon
    one, two = (daemon.root / "one.py").as_uri(), (daemon.root / "two.py").as_uri()
    texts = {one: "# Network limits.\nimport socket\n" + FILLER + TAIL,
             two: "# Disk limits.\nimport shutil\n" + FILLER + TAIL}

    async def scenario():
        client, _ = await lsp_client(daemon, inlineCompletion={"maxTokens": 4})
        for uri, text in texts.items():
            client.text_document_did_open(lsp.DidOpenTextDocumentParams(
                text_document=lsp.TextDocumentItem(uri=uri, language_id="python", version=1, text=text)))
        await inline_at_end(client, one, texts[one])
        hits = daemon.service.ghost.cache.hits
        got = await inline_at_end(client, two, texts[two])
        missed = daemon.service.ghost.cache.hits == hits
        again = await inline_at_end(client, two, texts[two])
        await close(client)
        return got, missed, again, daemon.service.ghost.cache.hits - hits

    got, missed, again, hits = asyncio.run(scenario())
    assert missed, "served the suggestion cached for another document"
    assert [i.insert_text for i in got.items] == [t for t in [ghost_alone(daemon, two, texts[two], 4)] if t]
    assert again == got and hits == 1  # its own answer is cached


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


# -- editor documents: limits and ownership (raw frames, a tiny model: nothing is generated) ------------


@pytest.fixture
def tiny_daemon(tmp_path):
    d = InProcessDaemon(tiny.build("llama"), tmp_path)
    (d.root / "sync.txt").write_text("a file to read: its reply means the indexer got this far\n")
    yield d
    d.close()


def wait_until(predicate, what: str) -> None:
    deadline = time.monotonic() + 30
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def open_doc(c: Client, uri: str, text: str) -> None:
    c.notify("textDocument/didOpen", {"textDocument": {"uri": uri, "languageId": "python", "version": 1,
                                                       "text": text}})


def change_doc(c: Client, uri: str, text: str, version: int = 2) -> None:
    c.notify("textDocument/didChange", {"textDocument": {"uri": uri, "version": version},
                                        "contentChanges": [{"text": text}]})


def close_doc(c: Client, uri: str) -> None:
    c.notify("textDocument/didClose", {"textDocument": {"uri": uri}})


def ghost_at_start(c: Client, uri: str) -> dict:
    """Ghost text at the start of the buffer: no prefix to continue, so an open document answers
    no items without decoding."""
    return c.call("textDocument/inlineCompletion", {"textDocument": {"uri": uri},
                                                    "position": {"line": 0, "character": 0},
                                                    "context": {"triggerKind": 1}}, dict)


def is_open(c: Client, uri: str) -> bool:
    """Whether the connection holds ``uri`` (an error other than "not open" is re-raised)."""
    try:
        ghost_at_start(c, uri)
        return True
    except RpcError as e:
        if "is not open" not in e.message:
            raise
        return False


def synced(d: InProcessDaemon, c: Client) -> None:
    """Wait until the indexer has done what ``c`` sent so far: didRead runs on the same thread,
    after the document jobs queued before it."""
    c.call("warmspec/didRead", wire.DidReadParams(path=str(d.root / "sync.txt")), wire.DidReadResult)


def test_a_document_over_the_size_limit_is_refused_before_it_is_stored(tiny_daemon):
    """Neither pygls's store nor the workspace keeps a buffer over max_file_bytes, opened or grown
    by a change; ghost text for it says why; the daemon keeps serving."""
    d = tiny_daemon
    ws = d.app.workspace
    ws.max_file_bytes = 4096
    big, small = (d.root / "big.py").as_uri(), (d.root / "small.py").as_uri()
    with d.client() as c:
        open_doc(c, big, "x = 1\n" * 1000)  # 6000 bytes
        open_doc(c, small, "y = 2\n")
        assert not is_open(c, big) and is_open(c, small)
        with pytest.raises(RpcError) as refused:
            ghost_at_start(c, big)
        (conn,) = d.service.connections
        assert big not in conn.documents and small in conn.documents
        synced(d, c)
        assert ws.document_text(big) is None and d.root / "big.py" not in ws.files
        assert ws.document_text(small) == "y = 2\n"

        change_doc(c, small, "y = 2\n" * 1000)  # a change past the limit closes the buffer
        assert not is_open(c, small)
        synced(d, c)
        assert ws.document_text(small) is None
        assert c.call("warmspec/status", None, wire.Status).model.id == d.app.lm.name
    assert refused.value.code == ErrorCode.INVALID_PARAMS
    assert "6000 bytes, over the 4096-byte limit" in refused.value.message


def test_open_documents_are_bounded_per_connection_and_in_total(tiny_daemon, monkeypatch):
    monkeypatch.setattr(rpc, "MAX_DOCUMENTS_PER_CONNECTION", 2)
    monkeypatch.setattr(rpc, "MAX_DOCUMENTS", 3)
    d = tiny_daemon
    uri = {name: (d.root / f"{name}.py").as_uri() for name in "abcde"}
    with d.client() as c1, d.client() as c2:
        for name in "abc":
            open_doc(c1, uri[name], f"{name} = 1\n")
        assert [is_open(c1, uri[n]) for n in "abc"] == [True, True, False]
        with pytest.raises(RpcError) as per_connection:
            ghost_at_start(c1, uri["c"])
        open_doc(c1, uri["a"], "a = 2\n")  # open already: counts once
        assert is_open(c1, uri["a"])
        open_doc(c2, uri["d"], "d = 1\n")
        open_doc(c2, uri["e"], "e = 1\n")
        assert is_open(c2, uri["d"]) and not is_open(c2, uri["e"])
        with pytest.raises(RpcError) as in_total:
            ghost_at_start(c2, uri["e"])
        close_doc(c1, uri["b"])
        open_doc(c2, uri["e"], "e = 1\n")
        assert is_open(c2, uri["e"])
    assert "MAX_DOCUMENTS_PER_CONNECTION" in per_connection.value.message
    assert "MAX_DOCUMENTS)" in in_total.value.message


def test_documents_are_owned_per_connection(tiny_daemon):
    """Two editors with one file open: the newest buffer is what drafts, and one editor's
    didClose leaves the other's buffer open (and drafting)."""
    d = tiny_daemon
    ws = d.app.workspace
    path = d.root / "shared.py"
    uri = path.as_uri()
    with d.client() as first, d.client() as second:
        open_doc(first, uri, "first = 1\n")
        synced(d, first)
        open_doc(second, uri, "second = 2\n")
        synced(d, second)
        assert ws.document_text(uri) == indexed(ws, path) == "second = 2\n"  # the newest wins
        close_doc(second, uri)
        synced(d, second)
        assert ws.document_text(uri) == indexed(ws, path) == "first = 1\n"  # still open in the first
        assert is_open(first, uri) and not is_open(second, uri)


def test_notifications_leave_no_bookkeeping_behind(tiny_daemon):
    """pygls 2.1 files every notification's handler future under a fresh id and never removes it
    (only a request's reply does): an editor's didChange per keystroke grew its connection by ~1 KB
    each, for as long as the editor stayed connected (the soak's typing editors)."""
    d = tiny_daemon
    uri = (d.root / "typed.py").as_uri()
    with d.client() as c:
        open_doc(c, uri, "x = 0\n")
        for version in range(2, 202):
            change_doc(c, uri, f"x = {version}\n", version)
        synced(d, c)
        (conn,) = d.service.connections
        assert len(conn.protocol._request_futures) <= 1  # at most the didRead in flight


def test_documents_are_released_when_their_connection_ends(tiny_daemon):
    """An editor that goes away without didClose: its documents are closed, and the watcher
    follows the file on disk again (it leaves open buffers alone)."""
    d = tiny_daemon
    ws = d.app.workspace
    path = d.root / "left.py"
    path.write_text("on_disk = 0\n")
    uri = path.as_uri()
    with d.client() as c:
        open_doc(c, uri, "in_the_buffer = 1\n")
        synced(d, c)
        assert ws.document_text(uri) == indexed(ws, path) == "in_the_buffer = 1\n"
    # the socket closed with the document still open
    wait_until(lambda: ws.document_text(uri) is None, "the connection's documents to be released")
    path.write_text("on_disk = 1\n")
    wait_until(lambda: indexed(ws, path) == "on_disk = 1\n", "the watcher to re-index the released file")


def indexed(ws, path: Path) -> str:
    """The text the workspace drafts from for ``path`` (byte tokens)."""
    return next(bytes(idx.tokens).decode() for idx, _ in ws.sources() if idx.name == str(path.resolve()))


def test_a_chat_naming_unreadable_files_in_tool_calls_still_runs(tiny_daemon, monkeypatch, caplog):
    """Files a tool call names that cannot be read -- no permission (simulated: tests run as root,
    see test_workspace.unreadable), a directory, a broken symlink -- are skipped, the unreadable
    one with a warning; the readable one is indexed and the chat answers (it failed with an
    internal error, and so would every later turn of the conversation)."""
    from test_workspace import unreadable

    d = tiny_daemon
    good, locked, folder, broken = (d.root / n for n in ("good.py", "locked.py", "folder", "broken.py"))
    good.write_text("def good():\n    return 1\n")
    locked.write_text("def locked():\n    return 2\n")
    folder.mkdir()
    broken.symlink_to(d.root / "missing.py")
    unreadable(monkeypatch, locked)
    calls = [ToolCall(id=f"call_{i}", function=FunctionCall(name="read_file", arguments={"path": str(p)}))
             for i, p in enumerate((locked, folder, broken, good))]
    messages = [wire.Message(role="user", content="Read these files."),
                wire.Message(role="assistant", content="", tool_calls=calls),
                *(wire.Message(role="tool", content="...", tool_call_id=c.id) for c in calls)]
    with d.client() as c:
        result = c.call("warmspec/chat", wire.ChatParams(messages=messages, max_tokens=2, temperature=0.0),
                        wire.GenerateResult)
    assert result.finish_reason in ("stop", "length")
    assert d.app.workspace.files == [good.resolve()]
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("locked.py cannot be read" in w for w in warnings), warnings


def test_a_failing_indexer_job_is_logged_loudly(tiny_daemon, monkeypatch, caplog):
    """Indexing a document is a job on the indexer thread that nobody waits for: a failure other
    than WorkspaceError (a bug) is logged as an error with its traceback, not lost in an unread
    future, and the indexer goes on with the next job."""
    d = tiny_daemon
    ws = d.app.workspace
    uri = (d.root / "doc.py").as_uri()

    def broken(*args, **kwargs):
        raise RuntimeError("the tokenizer broke")

    with d.client() as c:
        monkeypatch.setattr(ws, "did_open", broken)
        open_doc(c, uri, "x = 1\n")
        synced(d, c)
        wait_until(lambda: any(r.levelname == "ERROR" and "the tokenizer broke" in r.getMessage()
                               for r in caplog.records), "the failure to be logged")
        monkeypatch.undo()
        change_doc(c, uri, "x = 2\n")
        synced(d, c)
        assert ws.document_text(uri) == "x = 2\n"
    (record,) = [r for r in caplog.records if r.levelname == "ERROR"]
    assert "_index_pending" in record.getMessage() and record.exc_info is not None


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


# -- limits before work ---------------------------------------------------------------------------------


class EncodeSpy:
    """Stands in for a tokenizer's ``encode``: counts calls, and while ``hold`` is set blocks in
    them (``entered`` says one has begun) until ``release`` is set."""

    def __init__(self, encode):
        self.encode = encode
        self.calls = 0
        self.hold = False
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, *args, **kwargs):
        self.calls += 1
        if self.hold:
            self.entered.set()
            assert self.release.wait(60), "the test never released the tokenizer"
        return self.encode(*args, **kwargs)


@pytest.fixture
def spied(tiny_daemon, monkeypatch):
    tok = tiny_daemon.app.lm.tokenizer
    spy = EncodeSpy(tok.encode)
    monkeypatch.setattr(tok, "encode", spy)
    yield spy
    spy.release.set()


def test_a_prompt_that_cannot_fit_is_refused_without_tokenizing(tiny_daemon, spied):
    """Longer than the context times the longest token (one character, for a byte tokenizer): refused
    at once with a clear error, the tokenizer never called; and a full queue is refused before
    tokenizing too."""
    app = tiny_daemon.app
    huge = "x" * (app.max_prompt_chars + 1)
    with tiny_daemon.client() as c:
        with pytest.raises(RpcError) as complete:
            c.call("warmspec/complete", wire.CompleteParams(prompt=huge, max_tokens=2), wire.GenerateResult)
        with pytest.raises(RpcError) as chat_:
            c.call("warmspec/chat", chat(huge, 2), wire.GenerateResult)
        assert spied.calls == 0
        app.scheduler.max_queue = 0
        try:
            with pytest.raises(RpcError) as busy:
                c.call("warmspec/complete", wire.CompleteParams(prompt="hello", max_tokens=2), wire.GenerateResult)
        finally:
            app.scheduler.max_queue = 256
        assert c.call("warmspec/complete", wire.CompleteParams(prompt="hello", max_tokens=2),
                      wire.GenerateResult).stats.prompt_tokens == 5
    for e in (complete.value, chat_.value):
        assert e.code == ErrorCode.INVALID_PARAMS and "cannot fit the context of 4096 tokens" in e.message, e
    assert busy.value.code == ErrorCode.BUSY and "queue full" in busy.value.message
    assert spied.calls == 1  # the last request only


@pytest.mark.parametrize("method", ["warmspec/complete", "textDocument/inlineCompletion"])
def test_tokenizing_one_request_does_not_stall_other_connections(tiny_daemon, spied, method):
    """While one connection's prompt is being tokenized (held inside the tokenizer here), another
    connection's warmspec/status is answered: the tokenizer runs off the event loop."""
    uri = (tiny_daemon.root / "stall.py").as_uri()
    text = "def stall():\n    return " + method
    with tiny_daemon.client() as busy, tiny_daemon.client() as other:
        # the hold is set before the request is sent: set after it, a daemon that tokenized first
        # let the request through unheld and the test waited for nothing (one fresh-clone CI run)
        if method == "warmspec/complete":
            spied.hold = True
            msg_id = busy.start(method, wire.CompleteParams(prompt=text, max_tokens=2))
        else:
            busy.notify("textDocument/didOpen", {"textDocument": {"uri": uri, "languageId": "python",
                                                                  "version": 1, "text": text}})
            deadline = time.monotonic() + 30  # the document's own tokenizing (its index) is not held
            while spied.calls < 1 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert spied.calls >= 1, "didOpen never indexed the document"
            spied.hold = True
            msg_id = busy.start(method, {"textDocument": {"uri": uri}, "position": {"line": 1, "character": 10},
                                         "context": {"triggerKind": 1}})
        assert spied.entered.wait(30), "the request never reached the tokenizer"
        other.start("warmspec/status", None)
        status = other.read(30)  # the tokenizer holds on for 60 s: this reply comes while it does
        spied.release.set()
        reply = busy.read(60)
        while reply is not None and reply.id != msg_id:
            reply = busy.read(60)
    assert status is not None, "warmspec/status waited for another connection's tokenizing"
    assert msgspec.convert(status.result, wire.Status).model.id == tiny_daemon.app.lm.name
    assert reply is not None and reply.error is msgspec.UNSET


def test_a_client_without_the_key_cannot_send_a_big_frame(tmp_path):
    """Before the key is presented the daemon reads a frame the size of an initialize, not its
    16 MiB body limit: a 1 MiB initialize -- with the right key, even -- is refused, the
    connection closed; an ordinary one is served."""
    import tiny

    d = InProcessDaemon(tiny.build("llama"), tmp_path, api_key="k3y")
    try:
        big = {"processId": None, "capabilities": {"experimental": "x" * (1 << 20)},
               "initializationOptions": {"apiKey": "k3y"}}
        with Client.unix(d.socket, timeout=10) as c:
            try:
                c.send(wire.Request(id=1, method="initialize", params=big))
            except (BrokenPipeError, ConnectionResetError):
                pass  # the daemon hung up before reading it all
            reply = c.read(10)
            assert reply is not None and reply.error is not msgspec.UNSET, reply
            assert reply.error.code == ErrorCode.INVALID_REQUEST and "over the limit" in reply.error.message
            with pytest.raises(ConnectionError):
                c.read(10)
        with d.client() as c:  # initialized with the key: the full limit applies
            prompt = "y" * (200 << 10)
            assert c.call("warmspec/complete", wire.CompleteParams(prompt=prompt[:4000], max_tokens=1),
                          wire.GenerateResult).stats.prompt_tokens == 4000
            with pytest.raises(RpcError) as too_long:  # read, decoded and refused for its size
                c.call("warmspec/complete", wire.CompleteParams(prompt=prompt, max_tokens=1), wire.GenerateResult)
            assert "cannot fit" in too_long.value.message
    finally:
        d.close()


def test_connections_over_the_limit_are_refused(tmp_path):
    """``Limits.max_connections`` counts socket and TCP connections together; the one over it gets
    a JSON-RPC error and is closed, and once one closes a new one is served."""
    import tiny

    d = InProcessDaemon(tiny.build("llama"), tmp_path, limits=Limits(max_connections=2))
    try:
        first = d.client()
        second = Client.tcp("127.0.0.1", d.port, timeout=10)
        second.initialize()
        with Client.unix(d.socket, timeout=10) as third:
            reply = third.read(10)
            assert reply is not None and reply.error.code == ErrorCode.BUSY, reply
            assert "too many connections" in reply.error.message
            with pytest.raises(ConnectionError):
                third.read(10)
        assert second.call("warmspec/status", None, wire.Status).pid  # the two open ones are served
        first.close()
        deadline = time.monotonic() + 30
        while d.service._open >= 2:
            assert time.monotonic() < deadline, "the closed connection was never released"
            time.sleep(0.05)
        with d.client() as fourth:
            assert fourth.call("warmspec/status", None, wire.Status).pid
        second.close()
    finally:
        d.close()


def test_endless_headers_and_huge_content_lengths_get_errors(tiny_daemon):
    """Header lines that never end in a blank line are cut off once they pass the header limit (the
    daemon answers and hangs up, instead of reading them forever); a Content-Length of thousands
    of digits is a parse error for that frame only."""
    with Client.unix(tiny_daemon.socket, timeout=10) as c:
        c.sock.sendall(b"Content-Length: " + b"9" * 5000 + b"\r\n\r\n")
        reply = c.read(10)
        assert reply is not None and reply.error.code == ErrorCode.PARSE_ERROR, reply
        assert "invalid Content-Length" in reply.error.message
        c.initialize()  # the stream is still in step
        try:
            c.sock.sendall(b"X-Padding: " + b"a" * 1000 + b"\r\n" * 1 + b"".join(
                b"X-Padding-%d: %s\r\n" % (i, b"a" * 1000) for i in range(100)))
        except (BrokenPipeError, ConnectionResetError):
            pass
        reply = c.read(10)
        assert reply is not None and reply.error.code == ErrorCode.PARSE_ERROR, reply
        assert "headers longer than" in reply.error.message
        with pytest.raises(ConnectionError):
            c.read(10)
