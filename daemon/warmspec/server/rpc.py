"""JSON-RPC 2.0 with LSP base framing, on pygls: stdio, a Unix socket and TCP.

pygls serves one connection per server object (its protocol holds a single writer), so each
connection -- the editor on stdio, every socket or TCP client -- gets its own ``Connection`` (a
pygls ``LanguageServer``), and all of them share one ``RpcService``: the App, ghost text (with its
cache, see inline.py) and the document indexer.

pygls does dispatch, the LSP lifecycle and capabilities, the per-connection document store,
request bookkeeping and ``$/cancelRequest``. This module does what pygls's reader loop leaves out
-- it drops a malformed frame, bad JSON or a bad envelope with a log line and no reply, so a
client would wait forever -- : every frame is read and checked here, every bad one answered with
a JSON-RPC error, and ``warmspec/*`` params are decoded into msgspec Structs before pygls sees them.

pygls's document store is bounded here (a document's size, the count per connection and in
total) before it stores anything, and each connection's documents are indexed under its name, so
one editor's didClose or hang-up closes only its own buffers.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import os
import socket
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from functools import cache, partial
from pathlib import Path
from typing import Any, BinaryIO, Callable, Literal
from urllib.parse import unquote

import msgspec
from cattrs import Converter, transform_error
from cattrs.errors import ClassValidationError
from lsprotocol import types as lsp
from pygls.exceptions import JsonRpcException
from pygls.io_ import StdoutWriter
from pygls.lsp.server import LanguageServer
from pygls.protocol import (JsonRPCNotification, JsonRPCRequestMessage, LanguageServerProtocol,
                            default_converter, lsp_method)
from pygls.workspace import TextDocument

from warmspec_protocol import GenerationStats
from warmspec_protocol import rpc as wire
from warmspec_protocol.rpc import ErrorCode

from .. import __version__
from ..core import Delta, EngineError, Finished
from ..core import GenerationStats as CoreStats
from ..workspace import WorkspaceError, path_from_uri
from . import nextedit
from .app import App, to_wire
from .feedback import Suggestion
from .framing import HEADER_LIMIT, FrameError, frame, read_frame
from .inline import GhostText
from .keepalive import Progress
from .scheduler import PRIORITY_NORMAL, Busy, Job, Ticket

log = logging.getLogger("warmspec.rpc")

# Open documents (LSP buffers) one connection may hold, and all connections together. A buffer is
# at most the workspace's max_file_bytes (1 MiB by default), so this bounds the text held to
# 512 MiB in the worst case; an editor typically holds a few dozen buffers of tens of KB. A
# didOpen beyond either is refused (logged; the document is not stored, so ghost text for it
# answers with the reason).
MAX_DOCUMENTS_PER_CONNECTION = 128
MAX_DOCUMENTS = 512
# Suggestions a connection remembers for its feedback (warmspec/inlineCompletionFeedback): an
# editor reports on the one it shows, and maybe a few alternatives.
MAX_SUGGESTIONS = 64
# Accepted ghost text kept per language as a drafting source of its own (the newest characters).
ACCEPTED_CHARS = 16 << 10
MAX_ACCEPTED_LANGUAGES = 64

# A suggestion cut at its deadline is answered this much before it: encoding and writing the answer
# took ~2 ms, and at the budget exactly the typing probe's answers arrived 252 ms into a 250 ms one.
ANSWER_MARGIN_S = 0.005
PARTIAL = "warmspec/inlineCompletionPartial"
ACCEPTED_OWNER = "warmspec-accepted"  # the workspace's owner of the accepted-text documents

# stdio: an editor spawned this process; unix: the socket, 0600 in a 0700 directory (same user);
# tcp: anyone who can reach the port.
Transport = Literal["stdio", "unix", "tcp"]


class RpcError(JsonRpcException):
    """A request the daemon refuses; pygls answers it with ``code`` and ``message``."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message=message, code=int(code))


# -- pygls, adapted --------------------------------------------------------------------------------


@cache
def shared_converter() -> Converter:
    """One cattrs converter for all connections: building one takes milliseconds."""
    return default_converter()


class WarmspecProtocol(LanguageServerProtocol):
    """pygls's LSP protocol, changed where a shared daemon differs from a one-editor server:
    msgspec Structs serialize, refusals are answered without a traceback in the log, and ``exit``
    ends this connection, not the process."""

    _server: "Connection"

    def _serialize_message(self, data: Any) -> Any:
        if isinstance(data, msgspec.Struct):
            return msgspec.to_builtins(data)
        return super()._serialize_message(data)

    def _send_handler_result(self, future: Future, *, msg_id: Any) -> None:
        if not future.cancelled() and isinstance(error := future.exception(), RpcError):
            self._request_futures.pop(msg_id, None)
            routine = error.code == ErrorCode.CONTENT_MODIFIED  # superseded ghost text: every keystroke
            log.log(logging.DEBUG if routine else logging.INFO, "%s #%s refused: %s", self._server.name,
                    msg_id, error.message)
            self._send_response(msg_id, error=error.to_response_error())
            return
        super()._send_handler_result(future, msg_id=msg_id)

    def _execute_handler(self, msg_id: Any, handler: Callable, callback: Callable, args: Any = None,
                         kwargs: Any = None) -> None:
        """pygls 2.1 files a notification's future under a fresh id and never takes it out again
        (a request's reply does): a typing editor's connection grew ~1 KB a keystroke. A
        notification's future is dropped once it is done."""
        if callback == self._check_handler_result:
            callback = partial(self._notification_done, msg_id)
        super()._execute_handler(msg_id=msg_id, handler=handler, callback=callback, args=args, kwargs=kwargs)

    def _notification_done(self, msg_id: Any, future: Future) -> None:
        self._request_futures.pop(msg_id, None)
        self._check_handler_result(future)

    @lsp_method(lsp.INITIALIZE)
    def lsp_initialize(self, params: lsp.InitializeParams) -> Any:
        result = yield from super().lsp_initialize(params)
        # pygls advertises its built-in workspace/executeCommand and workspace-folder handling;
        # warmspec serves neither, and an editor should not be told otherwise.
        result.capabilities.execute_command_provider = None
        result.capabilities.workspace = None
        return result

    @lsp_method(lsp.EXIT)
    def lsp_exit(self, *args: Any) -> None:
        self._server.close()

    @lsp_method(lsp.TEXT_DOCUMENT_DID_OPEN)
    def lsp_text_document__did_open(self, params: lsp.DidOpenTextDocumentParams) -> Any:
        """pygls stores every document it is sent: refuse one too large, or past the limits on
        open documents, before it does (``Connection.document_refusal``)."""
        doc = params.text_document
        if (refusal := self._server.document_refusal(doc.uri, doc.text, opening=True)) is not None:
            self._server.refuse_document(doc.uri, refusal)
            return
        self._server.refused.pop(unquote(doc.uri), None)
        yield from super().lsp_text_document__did_open(params)

    @lsp_method(lsp.TEXT_DOCUMENT_DID_CHANGE)
    def lsp_text_document__did_change(self, params: lsp.DidChangeTextDocumentParams) -> Any:
        """pygls's, with the size limit: a change that makes the buffer too large closes it (the
        stored text could no longer follow the editor's). Whole-document changes -- the sync kind
        advertised -- are checked before they are applied, incremental ones after."""
        uri = params.text_document.uri
        conn = self._server
        doc = self.workspace.text_documents.get(unquote(uri))
        if doc is None:
            log.debug("%s: didChange for %s, which is not open", conn.name, uri)
            return
        changes = params.content_changes
        if changes and all(isinstance(c, lsp.TextDocumentContentChangeWholeDocument) for c in changes):
            if (refusal := conn.document_refusal(uri, changes[-1].text)) is not None:
                conn.refuse_document(uri, refusal)
                return
            changes = changes[-1:]
        for change in changes:
            self.workspace.update_text_document(params.text_document, change)
        if (refusal := conn.document_refusal(uri, doc.source)) is not None:
            conn.refuse_document(uri, refusal)
            return
        if (handler := self.fm.features.get(lsp.TEXT_DOCUMENT_DID_CHANGE)) is not None:
            yield handler, (params,), None

    def send_error(self, msg_id: wire.RequestId | None, code: ErrorCode, message: str) -> None:
        """An error pygls cannot send: its error message type drops a null id."""
        if self.writer is not None:
            self.writer.write(error_frame(msg_id, code, message))


def error_frame(msg_id: wire.RequestId | None, code: ErrorCode, message: str) -> bytes:
    return frame(msgspec.json.encode(wire.ErrorResponse(id=msg_id, error=wire.ErrorObject(code=int(code),
                                                                                        message=message))))


# -- one connection --------------------------------------------------------------------------------

_FEATURES: list[tuple[str, Callable, Any]] = []


def feature(method: str, options: Any = None) -> Callable:
    """Register a handler on every connection (pygls registers features per server object)."""

    def register(f: Callable) -> Callable:
        _FEATURES.append((method, f, options))
        return f

    return register


TYPED_MAX = 64  # the longest insertion taken for typing (a paste is not followed)


def typed_cursor(before: str, after: str) -> int | None:
    """Where the cursor is when ``after`` came from ``before`` by typing: one insertion of at most
    ``TYPED_MAX`` characters at one place, the cursor at its end; None for anything else (a
    deletion, a replacement, a paste). The common prefix is found by halving, with whole-slice
    comparisons: a keystroke in a 100 kB buffer costs microseconds, not a character loop."""
    grown = len(after) - len(before)
    if not 0 < grown <= TYPED_MAX:
        return None
    lo, hi = 0, len(before)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if before[:mid] == after[:mid]:
            lo = mid
        else:
            hi = mid - 1
    if after[lo + grown:] != before[lo:]:
        return None
    return lo + grown


class Prefetch:
    """Ghost text started at a typing keystroke, before the client asks.

    Clients debounce (150 ms by default) and then ask; on this 2-core CPU one pass of the default
    model takes about as long (141-166 ms), so a suggestion's first character came at a median of
    210 ms after the request. Started at the ``didChange`` that typed the character, the job has
    used the debounce: a request for the same window attaches to it, gets what it has decoded at
    once and the rest as it comes. The next edit of the document cancels it, as it cancels a
    request; an answer it completes is cached like a request's. Measured in the typing replay
    (``--compare prefetch``): 102 of 123 requests showed a first character, at a median of 47 ms
    after the request, against 18 at 154 ms without, for 3.2x the model time (a job per
    keystroke). Opt-in for that cost."""

    def __init__(self, window: Any):
        self.window = window
        self.text = ""
        self.tokens = 0
        self.task: asyncio.Task = None  # type: ignore[assignment]  # set right after
        self.listener: Callable[[str], None] | None = None
        self.attached = False

    def delta(self, d: Delta) -> None:
        if not d.text:
            return
        self.text += d.text
        self.tokens += len(d.tokens)
        if self.listener is not None:
            self.listener(self.text)


class Connection(LanguageServer):
    """One client. On stdio (the editor spawned us) no api key is asked for. A ``local``
    connection -- stdio or the Unix socket, so the same user -- may add its editor's project to the
    workspace roots; a TCP client may not widen what the daemon reads."""

    def __init__(self, service: "RpcService", name: str, *, transport: Transport):
        super().__init__("warmspec", __version__, text_document_sync_kind=lsp.TextDocumentSyncKind.Full,
                         protocol_cls=WarmspecProtocol, converter_factory=shared_converter)
        self.service = service
        self.app = service.app
        self.name = name
        self.local = transport in ("stdio", "unix")
        self.authorized = transport == "stdio" or service.app.api_key is None
        self.initialized = False
        self.shut_down = False
        self.closing = False
        self.settings = wire.InlineCompletionSettings()
        self.tickets: set[Ticket] = set()
        self.winding: set[asyncio.Task] = set()  # cancelled jobs read to their end (run_job's deadline)
        self.inline: dict[str, asyncio.Task] = {}  # the running inline completion per document
        self.prefetches: dict[str, Prefetch] = {}  # ghost text started at a keystroke, per document
        self.asks_ghost_text = False  # this client has asked for an inline completion (then prefetch)
        self.superseded: weakref.WeakSet[asyncio.Task] = weakref.WeakSet()
        # inline completion requests read but not yet handled: when they were read, their extras
        self.inline_requests: OrderedDict[wire.RequestId, tuple[float, wire.InlineCompletionExtras | None]] = \
            OrderedDict()
        self.suggestions: OrderedDict[tuple[wire.RequestId, int], Suggestion] = OrderedDict()
        self.edits: dict[str, nextedit.EditHistory] = {}  # per open document (unquoted uri)
        self.refused: dict[str, str] = {}  # documents not stored, and why (newest last, bounded)
        self._reader: asyncio.StreamReader | None = None
        for method, handler, options in _FEATURES:
            self.feature(method, options)(handler)

    # -- the read loop ------------------------------------------------------------------------------

    async def serve(self, reader: asyncio.StreamReader, writer: Any) -> None:
        self._reader = reader
        self.protocol.set_writer(writer)
        limits = self.app.limits
        log.debug("%s connected", self.name)
        try:
            while not self.closing:
                # Until the key is presented, only a frame the size of an initialize is read.
                limit = limits.max_body_bytes if self.authorized else limits.max_preauth_frame_bytes
                try:
                    body = await read_frame(reader, limit)
                except FrameError as e:
                    log.info("%s: bad frame: %s", self.name, e.message)
                    self.protocol.send_error(None, e.code, e.message)
                    if e.fatal:
                        break
                    continue
                if body is None:
                    break
                self.receive(body)
        finally:
            self._abandon()
            log.debug("%s disconnected", self.name)

    def close(self) -> None:
        """End this connection: the read loop stops, the transport closes."""
        self.closing = True
        writer = self.protocol.writer
        if writer is not None and not isinstance(writer, StdoutWriter):
            writer.close()
        if self._reader is not None:
            self._reader.feed_eof()

    @property
    def exit_code(self) -> int:
        """LSP's: 0 when ``shutdown`` came before ``exit`` (or the end of input)."""
        return 0 if self.shut_down else 1

    def _abandon(self) -> None:
        """The client is gone: stop decoding for it, and close the documents it left open."""
        for ticket in list(self.tickets):
            ticket.cancel()
        for task in self.inline.values():
            task.cancel()
        for pf in self.prefetches.values():
            pf.task.cancel()
        self.service.connections.discard(self)
        self.service.release_documents(self)

    # -- one message ----------------------------------------------------------------------------------

    def receive(self, body: bytes) -> None:
        """Check one message and hand it to pygls; answer anything wrong with an error."""
        try:
            obj = msgspec.json.decode(body)
        except msgspec.DecodeError as e:
            return self.protocol.send_error(None, ErrorCode.PARSE_ERROR, f"invalid JSON: {e}")
        if not isinstance(obj, dict):
            what = "batches are not supported" if isinstance(obj, list) else "a message must be an object"
            return self.protocol.send_error(None, ErrorCode.INVALID_REQUEST, what)
        raw_id = obj.get("id")
        msg_id = raw_id if isinstance(raw_id, (int, str)) and not isinstance(raw_id, bool) else None
        try:
            env = msgspec.convert(obj, wire.Envelope)
        except msgspec.ValidationError as e:
            return self.protocol.send_error(msg_id, ErrorCode.INVALID_REQUEST,
                                            f"not a JSON-RPC 2.0 message: {e}")
        is_request = env.id is not msgspec.UNSET and env.method is not msgspec.UNSET
        try:
            self._route(env, obj)
        except RpcError as e:
            if is_request:
                self.protocol.send_error(msg_id, ErrorCode(e.code), e.message)
            else:
                log.warning("%s: dropped notification %s: %s", self.name, env.method, e.message)
        except Exception:  # a bug, not a bad client: say so loudly, answer, keep serving
            log.exception("%s: internal error handling %s", self.name, env.method)
            if is_request:
                self.protocol.send_error(msg_id, ErrorCode.INTERNAL_ERROR, "internal error (see the daemon log)")

    def _route(self, env: wire.Envelope, obj: dict) -> None:
        method = env.method
        if method is msgspec.UNSET:
            if env.result is msgspec.UNSET and env.error is msgspec.UNSET:
                raise RpcError(ErrorCode.INVALID_REQUEST, "a message needs a method, a result or an error")
            log.debug("%s: ignored a response (the daemon sends no requests)", self.name)
            return
        if env.id is msgspec.UNSET:
            return self._notification(method, env, obj)
        if env.id is None:
            raise RpcError(ErrorCode.INVALID_REQUEST, "a request id must be a number or a string")
        if self.shut_down:
            raise RpcError(ErrorCode.INVALID_REQUEST, "shutdown was requested: only exit is accepted")
        if method == lsp.INITIALIZE and self.initialized:
            raise RpcError(ErrorCode.INVALID_REQUEST, "already initialized")
        if method != lsp.INITIALIZE and not self.initialized:
            raise RpcError(ErrorCode.SERVER_NOT_INITIALIZED, "send initialize first")
        spec = wire.METHODS.get(method)
        if spec is not None and not spec.to_client:
            if not spec.request:
                raise RpcError(ErrorCode.INVALID_REQUEST, f"{method} is a notification: send it without an id")
            params = self._params(spec, env.params)
            self.protocol.handle_message(JsonRPCRequestMessage(id=env.id, method=method, jsonrpc="2.0",
                                                               params=params))
        elif method in wire.LSP_REQUESTS:
            message = self._structure(method, obj)
            if method == lsp.TEXT_DOCUMENT_INLINE_COMPLETION:
                self._note_inline_request(env.id, env.params)
            self.protocol.handle_message(message)
        elif method in wire.LSP_NOTIFICATIONS:
            raise RpcError(ErrorCode.INVALID_REQUEST, f"{method} is a notification: send it without an id")
        else:
            raise RpcError(ErrorCode.METHOD_NOT_FOUND, f"unknown method {method!r}")

    def _notification(self, method: str, env: wire.Envelope, obj: dict) -> None:
        if method != lsp.EXIT and not (self.initialized and not self.shut_down):
            log.debug("%s: dropped %s (not initialized, or shut down)", self.name, method)
            return
        spec = wire.METHODS.get(method)
        if spec is not None and spec.notification and not spec.to_client:
            params = self._params(spec, env.params)
            self.protocol.handle_message(JsonRPCNotification(method=method, jsonrpc="2.0", params=params))
        elif method in wire.LSP_NOTIFICATIONS:
            self.protocol.handle_message(self._structure(method, obj))
        else:
            log.debug("%s: ignored notification %r", self.name, method)

    def _note_inline_request(self, msg_id: wire.RequestId, params: Any) -> None:
        """When an inline completion request was read (its budget runs from then), and its
        ``warmspec`` extras; the handler takes them."""
        raw = params.get("warmspec") if isinstance(params, dict) else None
        extras = None
        if raw is not None:
            try:
                extras = msgspec.convert(raw, wire.InlineCompletionExtras)
            except msgspec.ValidationError as e:
                raise RpcError(ErrorCode.INVALID_PARAMS,
                               f"invalid params for textDocument/inlineCompletion: {e} (in $.warmspec)") from None
        self.inline_requests[msg_id] = (time.perf_counter(), extras)
        while len(self.inline_requests) > MAX_SUGGESTIONS:  # handlers that never ran (cancelled first)
            self.inline_requests.popitem(last=False)

    @staticmethod
    def _params(spec: wire.MethodSpec, raw: Any) -> msgspec.Struct:
        if raw is msgspec.UNSET or raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise RpcError(ErrorCode.INVALID_PARAMS, f"{spec.name} takes its params as an object")
        try:
            return msgspec.convert(raw, spec.params)
        except msgspec.ValidationError as e:
            raise RpcError(ErrorCode.INVALID_PARAMS, f"invalid params for {spec.name}: {e}") from None

    def _structure(self, method: str, obj: dict) -> Any:
        """An LSP message as lsprotocol's type, with cattrs' errors as one readable message."""
        try:
            return shared_converter().structure(obj, self.protocol.get_message_type(method))
        except ClassValidationError as e:
            detail = "; ".join(transform_error(e, path="$"))
        except (ValueError, TypeError, KeyError) as e:
            detail = f"{type(e).__name__}: {e}"
        raise RpcError(ErrorCode.INVALID_PARAMS, f"invalid params for {method}: {detail}")

    def report_server_error(self, error: Exception, source: Any) -> None:
        # pygls would show notification errors in the editor; a refused didRead is routine.
        log.warning("%s: %s", self.name, error)

    # -- generation ---------------------------------------------------------------------------------

    async def generate(self, prompt: list[int], opts: wire.GenerateOptions, method: str) -> wire.GenerateResult:
        """Run one chat/complete job, streaming ``warmspec/delta`` tied to the request id."""
        started = time.perf_counter()
        msg_id = self.protocol.msg_id
        app = self.app
        try:
            params = app.sampling(temperature=opts.temperature, top_p=opts.top_p, top_k=opts.top_k,
                                  min_p=opts.min_p, seed=opts.seed)
            prediction = await asyncio.to_thread(app.prediction_tokens, opts.prediction)
            job = app.job(prompt, params, max_tokens=opts.max_tokens, stop=opts.stop,
                          speculate=opts.speculate, conversation=opts.conversation,
                          priority=PRIORITY_NORMAL, label=f"{self.name} #{msg_id}", prediction=prediction)
        except EngineError as e:
            raise RpcError(ErrorCode.INVALID_PARAMS, str(e)) from None
        first: float | None = None

        def on_delta(delta: Delta) -> None:
            nonlocal first
            if first is None:
                first = time.perf_counter() - started
            if delta.text:
                self.protocol.notify("warmspec/delta", wire.DeltaParams(id=msg_id, text=delta.text,
                                                                      tokens=len(delta.tokens)))

        def on_progress(p: Progress) -> None:
            self.protocol.notify("warmspec/progress", wire.ProgressParams(id=msg_id, message=p.message,
                                                                        fraction=p.fraction))

        fin = await self.run_job(job, on_delta, on_progress)
        ttft = first if first is not None else time.perf_counter() - started
        log.info("%s #%s %s: %s after %d tokens, first token in %.0f ms", self.name, msg_id, method,
                 fin.finish_reason, fin.stats.completion_tokens, ttft * 1000)
        return wire.GenerateResult(text=fin.text, finish_reason=fin.finish_reason,
                                   stats=to_wire(fin.stats, GenerationStats),
                                   tok_s=fin.stats.decode_tok_s, ttft_s=ttft)

    async def run_job(self, job: Job, on_delta: Callable[[Delta], None] | None = None,
                      on_progress: Callable[[Progress], None] | None = None, *,
                      deadline: float | None = None, on_end: Callable[[Finished], None] | None = None) -> Finished:
        """Submit ``job`` and wait for it. If this task is cancelled (``$/cancelRequest``, a newer
        inline completion, the client hanging up) the job stops within one decode step, and the
        cancellation is answered once it has: a client that then asks again, or asks for the
        status, finds the engine idle.

        ``deadline`` (a ``time.perf_counter()`` time): then the job is told to stop and this
        returns at once with the text decoded so far (finish reason ``cancelled``), while the job
        winds down behind it -- the step or prefill under way is not waited for, so the answer
        keeps the budget however busy the engine is. ``on_end`` sees the job's own ``Finished``
        however it ended (what it cost), also after such an early return or this task's
        cancellation."""
        try:
            ticket = self.app.scheduler.submit(job)
        except EngineError as e:
            raise RpcError(ErrorCode.BUSY, str(e)) from None
        self.tickets.add(ticket)
        text: list[str] = []
        tokens: list[int] = []
        handed_off = False
        try:
            while True:
                left = None if deadline is None else deadline - time.perf_counter()
                if left is not None and left <= 0:
                    ticket.cancel()
                    self._wind_down(ticket, on_end)
                    handed_off = True
                    return Finished("cancelled", "".join(text), tokens,
                                    CoreStats(prompt_tokens=len(job.prompt), completion_tokens=len(tokens)))
                try:
                    event = await ticket.next_event(left)
                except asyncio.TimeoutError:
                    continue
                if isinstance(event, Delta):
                    text.append(event.text)
                    tokens.extend(event.tokens)
                    if on_delta is not None:
                        on_delta(event)
                elif isinstance(event, Finished):
                    if on_end is not None:
                        on_end(event)
                    return event
                elif isinstance(event, Progress):
                    if on_progress is not None:
                        on_progress(event)
                else:
                    code = ErrorCode.INVALID_PARAMS if event.client_error else ErrorCode.INTERNAL_ERROR
                    raise RpcError(code, event.message)
        finally:
            if not handed_off:
                self.tickets.discard(ticket)
                if not ticket.done:
                    ticket.cancel()
                    if self.app.scheduler.active is ticket:  # a queued job just never runs
                        async for event in ticket:
                            if isinstance(event, Finished) and on_end is not None:
                                on_end(event)

    def _wind_down(self, ticket: Ticket, on_end: Callable[[Finished], None] | None) -> None:
        """Read a cancelled ticket to its end in the background (it stays in ``tickets`` until
        then, so a hang-up still reaches it), giving its ``Finished`` to ``on_end``."""

        async def drain() -> None:
            try:
                async for event in ticket:
                    if isinstance(event, Finished) and on_end is not None:
                        on_end(event)
            finally:
                self.tickets.discard(ticket)

        task = asyncio.ensure_future(drain())
        self.winding.add(task)
        task.add_done_callback(self.winding.discard)

    # -- inline completion ----------------------------------------------------------------------------

    def open_document(self, uri: str) -> TextDocument:
        """The client's buffer for ``uri`` -- never a file read from disk, which would let a
        client have any file the daemon can read put into a prompt."""
        docs = self.workspace.text_documents
        doc = docs.get(uri) or docs.get(unquote(uri))
        if doc is None:
            if (reason := self.refused.get(unquote(uri))) is not None:
                raise RpcError(ErrorCode.INVALID_PARAMS, f"{uri} is not open: it was refused ({reason})")
            raise RpcError(ErrorCode.INVALID_PARAMS, f"{uri} is not open: send textDocument/didOpen first")
        return doc

    @property
    def documents(self) -> dict[str, TextDocument]:
        """This connection's open buffers (pygls's store, keyed by unquoted URI)."""
        return self.workspace.text_documents if self.initialized else {}

    def document_refusal(self, uri: str, text: str, *, opening: bool = False) -> str | None:
        """Why a buffer may not be stored, or None: over the workspace's size limit for files, or
        (a document not yet open here) past the limits on open documents."""
        limit = self.app.workspace.max_file_bytes
        size = len(text.encode("utf-8", errors="replace"))
        if size > limit:
            return f"{size} bytes, over the {limit}-byte limit on documents"
        if opening and unquote(uri) not in self.documents:
            if len(self.documents) >= MAX_DOCUMENTS_PER_CONNECTION:
                return (f"this connection has {MAX_DOCUMENTS_PER_CONNECTION} documents open, the most "
                        "one connection may (MAX_DOCUMENTS_PER_CONNECTION): close some first")
            if self.service.open_documents() >= MAX_DOCUMENTS:
                return (f"the daemon's connections have {MAX_DOCUMENTS} documents open, the most it "
                        "holds (MAX_DOCUMENTS): close some first")
        return None

    def refuse_document(self, uri: str, reason: str) -> None:
        """Log the refusal, keep its reason for ghost-text requests, and close the document if it
        was open (a change made it too large)."""
        log.warning("%s: document %s refused: %s", self.name, uri, reason)
        key = unquote(uri)
        self.refused.pop(key, None)
        self.refused[key] = reason
        if len(self.refused) > MAX_DOCUMENTS_PER_CONNECTION:
            del self.refused[next(iter(self.refused))]
        if key in self.documents:
            self.workspace.remove_text_document(uri)
            self.forget_document(uri)

    def forget_document(self, uri: str) -> None:
        """A document is closed (pygls dropped it): stop its ghost text, unindex its buffer."""
        if (task := self.inline.pop(uri, None)) is not None:
            task.cancel()
        self.cancel_prefetch(uri)
        self.edits.pop(unquote(uri), None)
        self.service.index_document(self.name, uri, None)

    def supersede(self, uri: str, *, claim: bool = True) -> None:
        """Editors ask on every keystroke: a new request for a document -- or an edit of it
        (``claim`` False) -- ends the one before, at once: its job stops within a decode step
        (prefill included, once the engine checks there) and it is answered -32801."""
        previous = self.inline.get(uri)
        if previous is not None and not previous.done():
            self.superseded.add(previous)
            previous.cancel()
        current = asyncio.current_task()
        if claim and current is not None:
            self.inline[uri] = current

    def ghost_window(self, doc: TextDocument, source: str, cursor: int) -> Any:
        """The ghost-text window for ``cursor`` in ``source`` (``doc``'s text now, or just after an
        edit): the suggestion length adapted to the language's acceptance when ``adapt`` is on."""
        settings = self.settings
        language = doc.language_id or "plaintext"
        max_tokens = self.app.inline.max_tokens(language, settings.max_tokens) if settings.adapt else settings.max_tokens
        return self.service.ghost.window(doc.uri, source, cursor, settings, max_tokens)

    def superseded_error(self) -> RpcError | None:
        """The -32801 answer for this cancelled task when a newer request or an edit of its document
        ended it (``supersede``); None when it was cancelled otherwise (``$/cancelRequest``, close)."""
        task = asyncio.current_task()
        if task not in self.superseded:
            return None
        self.superseded.discard(task)
        return RpcError(ErrorCode.CONTENT_MODIFIED, "a newer inline completion request or an edit of "
                        "this document replaced this one")

    def cancel_prefetch(self, uri: str) -> None:
        if (pf := self.prefetches.pop(uri, None)) is not None:
            pf.task.cancel()

    def start_prefetch(self, uri: str, source: str, cursor: int) -> None:
        """Start the ghost text for ``cursor`` now, before the client asks (see ``Prefetch``)."""
        window = self.ghost_window(self.open_document(uri), source, cursor)
        if not window.prefix.strip() or self.service.ghost.cache.lookup(window) is not None:
            return
        pf = Prefetch(window)
        self.app.inline.counts.prefetched += 1
        pf.task = asyncio.ensure_future(self._prefetch(pf))
        self.prefetches[uri] = pf

    async def _prefetch(self, pf: "Prefetch") -> Finished | None:
        """The prefetched job: to its end (then its answer is cached), the next edit of the
        document (cancelled), or a request's deadline. None when the engine refused it."""
        ghost = self.service.ghost
        metrics = self.app.inline

        def on_end(fin: Finished) -> None:
            tokens = fin.stats.completion_tokens
            metrics.decoded(tokens, 0 if pf.attached else tokens)

        try:
            self.app.admit()
            job = await asyncio.to_thread(ghost.job, pf.window, label=f"{self.name} prefetch")
            fin = await self.run_job(job, pf.delta, on_end=on_end)
        except (Busy, EngineError, RpcError) as e:
            log.debug("%s: prefetch not run: %s", self.name, e)
            return None
        if fin.finish_reason != "cancelled":
            ghost.cache.store(pf.window, fin.text)
        return fin

    def remember(self, key: tuple[wire.RequestId, int], suggestion: Suggestion) -> None:
        """Keep a suggestion for the client's feedback on it (the newest MAX_SUGGESTIONS)."""
        self.suggestions[key] = suggestion
        while len(self.suggestions) > MAX_SUGGESTIONS:
            self.suggestions.popitem(last=False)


# -- handlers ----------------------------------------------------------------------------------------


@feature(lsp.INITIALIZE)
def initialize(ls: Connection, params: lsp.InitializeParams) -> None:
    try:
        opts = msgspec.convert(params.initialization_options or {}, wire.InitializationOptions)
    except msgspec.ValidationError as e:
        raise RpcError(ErrorCode.INVALID_PARAMS, f"invalid initializationOptions: {e}") from None
    if not ls.authorized:
        key = ls.app.api_key or ""
        if opts.api_key is None or not hmac.compare_digest(opts.api_key.encode(), key.encode()):
            ls.closing = True  # one guess per connection: the loop ends after this reply
            what = "needs" if opts.api_key is None else "has a different"
            raise RpcError(ErrorCode.UNAUTHORIZED, f"this daemon {what} initializationOptions.apiKey")
        ls.authorized = True
    ls.settings = opts.inline_completion or wire.InlineCompletionSettings()
    ls.initialized = True
    client = params.client_info.name if params.client_info else "a client"
    log.info("%s: initialized by %s", ls.name, client)
    if roots := editor_roots(params):
        ls.service.add_roots(ls, roots)


def editor_roots(params: lsp.InitializeParams) -> list[str]:
    """The project directories an editor names: ``workspaceFolders``, else ``rootUri``, else the
    older ``rootPath`` (LSP's order of precedence); ``file:`` URIs only."""
    if params.workspace_folders:
        uris = [f.uri for f in params.workspace_folders]
    elif params.root_uri:
        uris = [params.root_uri]
    else:
        return [params.root_path] if params.root_path else []
    return [path_from_uri(u) for u in uris if u.startswith("file:")]


@feature(lsp.SHUTDOWN)
def shutdown(ls: Connection, params: Any = None) -> None:
    ls.shut_down = True


@feature(lsp.TEXT_DOCUMENT_DID_OPEN)
def did_open(ls: Connection, params: lsp.DidOpenTextDocumentParams) -> None:
    doc = params.text_document
    ls.edits[unquote(doc.uri)] = nextedit.EditHistory(doc.text)
    ls.service.index_document(ls.name, doc.uri, doc.text)


@feature(lsp.TEXT_DOCUMENT_DID_CHANGE)
def did_change(ls: Connection, params: lsp.DidChangeTextDocumentParams) -> None:
    uri = params.text_document.uri
    text = ls.open_document(uri).source  # pygls applied the change
    history = ls.edits.get(unquote(uri))
    if history is not None and history.text == text:
        return  # nothing changed (a client resending the same text)
    ls.supersede(uri, claim=False)  # a suggestion for the text before is moot
    ls.cancel_prefetch(uri)
    before = history.text if history is not None else None
    if history is not None:
        history.update(text)
    ls.service.index_document(ls.name, uri, text)
    if (before is not None and ls.asks_ghost_text and ls.settings.prefetch
            and (cursor := typed_cursor(before, text)) is not None):
        ls.start_prefetch(uri, text, cursor)


@feature(lsp.TEXT_DOCUMENT_DID_CLOSE)
def did_close(ls: Connection, params: lsp.DidCloseTextDocumentParams) -> None:
    uri = params.text_document.uri
    ls.refused.pop(unquote(uri), None)
    ls.forget_document(uri)


@feature("warmspec/didRead")
async def did_read(ls: Connection, params: wire.DidReadParams) -> wire.DidReadResult:
    return await ls.service.did_read(params)


@feature("warmspec/status")
def status(ls: Connection, params: wire.NoParams) -> Any:
    return ls.app.status()


@feature("warmspec/models")
def models(ls: Connection, params: wire.NoParams) -> wire.ModelsResult:
    return wire.ModelsResult(models=[ls.app.model_info()], requested=ls.service.model_spec)


@feature("warmspec/chat")
async def chat(ls: Connection, params: wire.ChatParams) -> wire.GenerateResult:
    try:
        ls.app.admit()
        prompt, conversation = await asyncio.to_thread(ls.app.chat_request, params.messages,
                                                       conversation=params.conversation)
    except Busy as e:
        raise RpcError(ErrorCode.BUSY, str(e)) from None
    except EngineError as e:
        raise RpcError(ErrorCode.INVALID_PARAMS, str(e)) from None
    params = msgspec.structs.replace(params, conversation=conversation)
    return await ls.generate(prompt, params, "chat")


@feature("warmspec/complete")
async def complete(ls: Connection, params: wire.CompleteParams) -> wire.GenerateResult:
    try:
        ls.app.admit()  # the size and queue checks come before the tokenizer, which runs off the loop
        prompt = await asyncio.to_thread(ls.app.text_prompt, params.prompt)
    except Busy as e:
        raise RpcError(ErrorCode.BUSY, str(e)) from None
    except EngineError as e:
        raise RpcError(ErrorCode.INVALID_PARAMS, str(e)) from None
    return await ls.generate(prompt, params, "complete")


@feature(lsp.TEXT_DOCUMENT_INLINE_COMPLETION, lsp.InlineCompletionOptions())
async def inline_completion(ls: Connection, params: lsp.InlineCompletionParams) -> Any:
    """Ghost text at the cursor: the model continues the text before it (with the text after it
    when the model knows fill-in-the-middle); greedy, so answers can be cached. A streaming client
    (``inlineCompletion.stream``) sees it grow (``warmspec/inlineCompletionPartial``) and gets its
    timings in the result; the job stops at the request's deadline, answering with what it has."""
    msg_id = ls.protocol.msg_id
    received, extras = ls.inline_requests.pop(msg_id, (time.perf_counter(), None))
    uri = params.text_document.uri
    ls.asks_ghost_text = True
    ls.supersede(uri)
    try:
        return await suggest_inline(ls, msg_id, params, received, extras)
    finally:
        if ls.inline.get(uri) is asyncio.current_task():
            del ls.inline[uri]


async def suggest_inline(ls: Connection, msg_id: wire.RequestId, params: lsp.InlineCompletionParams,
                         received: float, extras: wire.InlineCompletionExtras | None) -> Any:
    settings = ls.settings
    metrics = ls.app.inline
    uri = params.text_document.uri
    doc = ls.open_document(uri)
    language = doc.language_id or "plaintext"
    metrics.requested()
    ghost = ls.service.ghost
    window = ls.ghost_window(doc, doc.source, doc.offset_at_position(params.position))
    first_visible: float | None = None
    tokens = 0
    if not window.prefix.strip():
        text, finish = "", "empty"  # nothing to continue yet
    elif (cached := ghost.cache.lookup(window)) is not None:
        text, finish = cached, "cache"
        first_visible = time.perf_counter() - received if text.strip() else None
    else:
        where = wire.Position(line=params.position.line, character=params.position.character)
        so_far = ""

        def show(text: str) -> None:
            nonlocal so_far, first_visible
            so_far = text
            if first_visible is None and so_far.strip():
                first_visible = time.perf_counter() - received
            if settings.stream:
                ls.protocol.notify(PARTIAL, wire.InlineCompletionPartialParams(id=msg_id, uri=uri, position=where,
                                                                               text=so_far))

        def on_delta(delta: Delta) -> None:
            if delta.text:
                show(so_far + delta.text)

        budget_ms = extras.deadline_ms if extras is not None and extras.deadline_ms else settings.deadline_ms
        deadline = received + budget_ms / 1000 - ANSWER_MARGIN_S if budget_ms else None
        pf = ls.prefetches.get(uri)
        if pf is not None and pf.window == window and not pf.task.done():
            answer = await attach(ls, pf, show, deadline)
            if answer is not None:
                text, finish, tokens = answer
                return inline_result(ls, msg_id, params, doc, language, window, received, first_visible,
                                     text, tokens, finish)

        answer_tokens: int | None = None  # set once answered: a job winding down after its deadline

        def on_end(fin: Finished) -> None:
            nonlocal tokens
            tokens = fin.stats.completion_tokens
            late = 0 if answer_tokens is None else max(0, tokens - answer_tokens)
            metrics.decoded(tokens, late)

        try:
            ls.app.admit()
            job = await asyncio.to_thread(ghost.job, window, label=f"{ls.name} #{msg_id} inline")  # tokenizes
            fin = await ls.run_job(job, on_delta, deadline=deadline, on_end=on_end)
        except Busy as e:
            raise RpcError(ErrorCode.BUSY, str(e)) from None
        except EngineError as e:
            raise RpcError(ErrorCode.INVALID_PARAMS, str(e)) from None
        except asyncio.CancelledError:
            metrics.cancelled(tokens)
            if (error := ls.superseded_error()) is not None:
                raise error from None
            raise
        text = fin.text
        tokens = answer_tokens = fin.stats.completion_tokens
        if fin.finish_reason == "cancelled":  # the deadline: what it has, not cached (it is cut short)
            finish = "deadline"
        else:
            finish = fin.finish_reason
            ghost.cache.store(window, text)
    return inline_result(ls, msg_id, params, doc, language, window, received, first_visible, text, tokens, finish)


async def attach(ls: Connection, pf: Prefetch, show: Callable[[str], None],
                 deadline: float | None) -> tuple[str, str, int] | None:
    """Serve a request from the prefetch running for its window: what it has now, the rest as it
    comes, until it ends or the request's deadline (then the prefetch stops, as a request's job
    would). ``(text, finish, tokens)``, or None when the prefetch ended without an answer (the
    engine refused it): then the request runs its own job."""
    pf.attached = True
    ls.app.inline.counts.prefetch_attached += 1
    if pf.text:
        show(pf.text)
    pf.listener = show
    try:
        timeout = None if deadline is None else max(0.0, deadline - time.perf_counter())
        fin = await asyncio.wait_for(asyncio.shield(pf.task), timeout)
    except asyncio.TimeoutError:
        pf.task.cancel()
        return pf.text, "deadline", pf.tokens
    except asyncio.CancelledError:
        ls.app.inline.cancelled(0)  # the prefetch's tokens are counted when it ends
        if (error := ls.superseded_error()) is not None:
            raise error from None
        raise
    finally:
        pf.listener = None
    if fin is None:
        return None
    finish = "deadline" if fin.finish_reason == "cancelled" else fin.finish_reason
    return fin.text, finish, fin.stats.completion_tokens


def inline_result(ls: Connection, msg_id: wire.RequestId, params: lsp.InlineCompletionParams, doc: TextDocument,
                  language: str, window: Any, received: float, first_visible: float | None, text: str,
                  tokens: int, finish: str) -> Any:
    """Count an answered ghost-text request and build its result (LSP's, with ``warmspec`` timings
    for a streaming client)."""
    settings = ls.settings
    metrics = ls.app.inline
    final = time.perf_counter() - received
    metrics.answered(first_visible_s=first_visible, final_s=final, text=text, tokens=tokens, finish=finish,
                     language=language)
    if text:
        ls.remember((msg_id, 0), Suggestion(doc.uri, language, text, tokens))
    log.debug("%s #%s inline: %s, %d characters, first visible %s, final %.0f ms", ls.name, msg_id, finish,
              len(text), "-" if first_visible is None else f"{first_visible * 1000:.0f} ms", final * 1000)
    if not settings.stream:
        here = lsp.Range(start=params.position, end=params.position)
        return lsp.InlineCompletionList(items=[lsp.InlineCompletionItem(insert_text=text, range=here)] if text else [])
    pos = wire.Position(line=params.position.line, character=params.position.character)
    debounce = metrics.debounce_ms(language, settings.debounce_ms) if settings.adapt else settings.debounce_ms
    info = wire.InlineCompletionInfo(
        first_visible_ms=None if first_visible is None else round(first_visible * 1000, 1),
        final_ms=round(final * 1000, 1), tokens=tokens, finish=finish, max_tokens=window.max_tokens,
        debounce_ms=debounce)
    items = [wire.InlineItem(insert_text=text, range=wire.Range(start=pos, end=pos))] if text else []
    return wire.InlineCompletionResult(items=items, warmspec=info)


@feature("warmspec/inlineCompletionFeedback")
def inline_feedback(ls: Connection, params: wire.InlineCompletionFeedbackParams) -> None:
    """Count what became of a suggestion; accepted text becomes a drafting source (``adapt``)."""
    s = ls.suggestions.get((params.id, params.index))
    if s is None:
        log.debug("%s: feedback on #%s/%d, which this connection does not remember", ls.name, params.id,
                  params.index)
        return
    accepted = ls.app.inline.feedback(s, params.event, params.accepted_chars)
    if accepted and ls.settings.adapt:
        ls.service.note_accepted(s.uri, s.language, accepted)


@feature("warmspec/alternatives")
async def alternatives(ls: Connection, params: wire.AlternativesParams) -> wire.AlternativesResult:
    """Different suggestions at a position: the greedy one (the ghost text's, from the cache when
    it is there), then samples at ``temperature`` with seeds ``seed``, ``seed + 1``, ... (so the
    same request gets the same answer), until ``count`` different ones or twice as many tries."""
    doc = ls.open_document(params.uri)
    pos = lsp.Position(line=params.position.line, character=params.position.character)
    here = wire.Range(start=params.position, end=params.position)
    ghost = ls.service.ghost
    window = ghost.window(doc.uri, doc.source, doc.offset_at_position(pos), ls.settings)
    items: list[wire.Alternative] = []
    if not window.prefix.strip():
        return wire.AlternativesResult(items=items, range=here)
    msg_id = ls.protocol.msg_id
    language = doc.language_id or "plaintext"
    seen: set[str] = set()
    tries: list[int | None] = [None, *range(params.seed, params.seed + 2 * params.count)]
    for seed in tries:
        if len(items) == params.count:
            break
        text = ghost.cache.lookup(window) if seed is None else None
        tokens = 0
        if text is None:
            try:
                ls.app.admit()
                job = await asyncio.to_thread(ghost.job, window, label=f"{ls.name} #{msg_id} alternative",
                                              temperature=0.0 if seed is None else params.temperature, seed=seed)
                fin = await ls.run_job(job)
            except Busy as e:
                raise RpcError(ErrorCode.BUSY, str(e)) from None
            except EngineError as e:
                raise RpcError(ErrorCode.INVALID_PARAMS, str(e)) from None
            text, tokens = fin.text, fin.stats.completion_tokens
            ls.app.inline.decoded(tokens)
            if seed is None:
                ghost.cache.store(window, text)
        if text.strip() and text.rstrip() not in seen:
            seen.add(text.rstrip())
            ls.remember((msg_id, len(items)), Suggestion(doc.uri, language, text, tokens))
            items.append(wire.Alternative(text=text, seed=seed))
    ls.app.inline.counts.alternatives += 1
    return wire.AlternativesResult(items=items, range=here)


@feature("warmspec/nextEdit")
async def next_edit(ls: Connection, params: wire.NextEditParams) -> wire.NextEditResult:
    """The next edit of a document, from its recent edits (see nextedit.py)."""
    doc = ls.open_document(params.uri)
    history = ls.edits.get(unquote(params.uri))
    text = doc.source
    if history is None or history.last is None:
        return wire.NextEditResult(edit=None)
    cursor = doc.offset_at_position(lsp.Position(line=params.position.line, character=params.position.character))
    found = await asyncio.to_thread(nextedit.suggest, history.last, text, cursor)  # a regex over the buffer
    if found is None or doc.source is not text:  # or the buffer changed meanwhile: ask again
        return wire.NextEditResult(edit=None)
    ls.app.inline.counts.next_edits += 1
    rng = wire.Range(start=position_at(doc, found.start), end=position_at(doc, found.end))
    return wire.NextEditResult(edit=wire.NextEdit(range=rng, text=found.text, kind=found.kind, old=found.old,
                                                  new=found.new, remaining=found.remaining))


def position_at(doc: TextDocument, offset: int) -> wire.Position:
    """The LSP position of a character offset of ``doc``, in the connection's position encoding."""
    text = doc.source
    start = text.rfind("\n", 0, offset) + 1
    return wire.Position(line=text.count("\n", 0, offset),
                         character=doc.position_codec.client_num_units(text[start:offset]))


# -- the service ------------------------------------------------------------------------------------


class RpcService:
    """What every connection shares, and the listeners that create them."""

    def __init__(self, app: App, *, model_spec: str | None = None):
        self.app = app
        self.model_spec = model_spec
        self.ghost = GhostText(app)
        self.connections: set[Connection] = set()
        self._servers: list[asyncio.AbstractServer] = []
        self._ids = itertools.count(1)
        self._open = 0  # socket and TCP connections being served, for Limits.max_connections
        # One thread, in order: tokenizing a large file must not stall the event loop, and a
        # document's changes must be indexed in the order they were made.
        self._indexer = ThreadPoolExecutor(1, thread_name_prefix="warmspec-index")
        self._pending: dict[tuple[str, str], str | None] = {}  # (connection, uri) -> newest text
        self._pending_lock = threading.Lock()
        self._accepted: dict[str, str] = {}  # language -> accepted ghost text (note_accepted)
        self._closing = False

    # -- listeners ------------------------------------------------------------------------------------

    async def serve_unix(self, path: Path) -> None:
        server = await asyncio.start_unix_server(self._accept("unix"), sock=bind_unix_socket(path),
                                                 limit=HEADER_LIMIT)
        self._servers.append(server)

    async def serve_tcp(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0: any free port); returns the port."""
        server = await asyncio.start_server(self._accept("tcp"), host, port, limit=HEADER_LIMIT)
        self._servers.append(server)
        return server.sockets[0].getsockname()[1]

    async def serve_stdio(self, stdin: BinaryIO, stdout: BinaryIO) -> int:
        """Serve the one editor on stdio until ``exit`` or the end of input; LSP's exit code."""
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=HEADER_LIMIT)
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), stdin)
        conn = Connection(self, "stdio", transport="stdio")
        self.connections.add(conn)
        await conn.serve(reader, StdoutWriter(stdout))
        return conn.exit_code

    def _accept(self, kind: Transport) -> Callable:
        async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            peer = writer.get_extra_info("peername")
            name = f"{kind}#{next(self._ids)}" + (f" {peer[0]}:{peer[1]}" if kind == "tcp" and peer else "")
            limit = self.app.limits.max_connections
            if self._open >= limit:
                log.warning("%s refused: %d connections are open (the limit)", name, self._open)
                writer.write(error_frame(None, ErrorCode.BUSY, f"too many connections: the daemon serves "
                                                               f"{limit} at once; try again later"))
                writer.close()
                return
            self._open += 1
            conn = Connection(self, name, transport=kind)
            self.connections.add(conn)
            try:
                await conn.serve(reader, writer)
            finally:
                self._open -= 1
                writer.close()

        return accept

    async def close(self) -> None:
        self._closing = True
        for server in self._servers:
            server.close()
        for conn in list(self.connections):
            conn.close()
        for server in self._servers:
            await server.wait_closed()
        self._indexer.shutdown(wait=False, cancel_futures=True)

    # -- workspace ------------------------------------------------------------------------------------

    def add_roots(self, conn: Connection, roots: list[str]) -> None:
        """Add a local client's project directories to the workspace roots; refuse a TCP
        client's. On the indexer thread, in order: the documents and reads the client sends next
        are indexed after their root is in place (and scheduling a watch walks the tree)."""
        if not conn.local:
            log.info("%s: workspace roots %s not added: only --workspace roots count over TCP",
                     conn.name, ", ".join(roots))
            return
        self._index_job(self._add_roots, conn.name, roots)

    def _index_job(self, fn: Callable, *args: Any) -> None:
        """Queue ``fn(*args)`` on the indexer thread. Nobody waits for these jobs, so a failure
        (anything but the WorkspaceError each job handles itself) is logged with its traceback
        here -- never dropped with an unread future. (didRead's job is awaited: its failure is
        the request's.)"""
        self._indexer.submit(fn, *args).add_done_callback(partial(_log_failure, f"{fn.__name__}{args!r}"))

    def _add_roots(self, name: str, roots: list[str]) -> None:
        for root in roots:
            try:
                if not self.app.workspace.add_root(root):
                    log.debug("%s: %s is already in the workspace", name, root)
            except WorkspaceError as e:
                log.info("%s: %s", name, e)

    def index_document(self, owner: str, uri: str, text: str | None) -> None:
        """Record an editor buffer of connection ``owner`` (None: closed) into the workspace,
        coalescing a burst of changes into one re-index of the newest text."""
        key = (owner, uri)
        with self._pending_lock:
            queued = key in self._pending
            self._pending[key] = text
        if not queued:
            self._index_job(self._index_pending, key)

    def _index_pending(self, key: tuple[str, str]) -> None:
        ws = self.app.workspace
        owner, uri = key
        with self._pending_lock:
            text = self._pending.pop(key)
        try:
            if text is None:
                ws.did_close(uri, owner)
            else:
                ws.did_open(uri, text, owner)
        except WorkspaceError as e:  # still served inline completions; just not a drafting source
            log.debug("not indexed: %s", e)

    def note_accepted(self, uri: str, language: str, text: str) -> None:
        """Ghost text a user accepted becomes a drafting source of its own, one per language,
        ranked as an open document: the newest ACCEPTED_CHARS characters accepted in that language,
        as a document no editor has (``.warmspec-accepted.LANGUAGE`` in the workspace root of the
        document it was accepted in, else the first root; never written to disk). Without roots
        there is nowhere to index it, and it is not."""
        kept = (self._accepted.pop(language, "") + text)[-ACCEPTED_CHARS:]
        self._accepted[language] = kept  # the most recent language last
        while len(self._accepted) > MAX_ACCEPTED_LANGUAGES:
            del self._accepted[next(iter(self._accepted))]
        ws = self.app.workspace
        path = Path(path_from_uri(uri)) if uri.startswith("file:") else None
        roots = [r for r in ws.roots if path is not None and (r == path or r in path.parents)] or ws.roots[:1]
        if roots:
            name = "".join(c if c.isalnum() or c in "-_" else "_" for c in language)[:32]
            self.index_document(ACCEPTED_OWNER, (roots[0] / f".warmspec-accepted.{name}").as_uri(), kept)

    def open_documents(self) -> int:
        """Documents open over all connections (each counts its own)."""
        return sum(len(c.documents) for c in self.connections)

    def release_documents(self, conn: Connection) -> None:
        """A connection ended: close what it left open, after its pending changes (same thread,
        in order), so the watcher follows those files on disk again. Not once the service is
        closing: the indexer is shut down, and so is the daemon."""
        if not self._closing:
            self._index_job(self._release, conn.name)

    def _release(self, owner: str) -> None:
        if released := self.app.workspace.release(owner):
            log.info("%s: closed %d documents it left open", owner, released)

    async def did_read(self, params: wire.DidReadParams) -> wire.DidReadResult:
        ws = self.app.workspace
        loop = asyncio.get_running_loop()
        try:
            path = await loop.run_in_executor(self._indexer, self._did_read, params)
        except WorkspaceError as e:
            raise RpcError(ErrorCode.PATH_REFUSED, str(e)) from None
        log.info("indexed %s (%d files in the workspace index)", path, len(ws.files))
        return wire.DidReadResult(path=str(path), workspace_files=len(ws.files))

    def _did_read(self, params: wire.DidReadParams) -> Path:
        """On the indexer thread, so after the roots a client named in ``initialize``."""
        ws = self.app.workspace
        if not ws.roots:
            raise WorkspaceError("this daemon has no workspace roots (start it with --workspace DIR, "
                                 "or name the project in initialize's workspaceFolders)")
        return ws.did_read(params.path, params.text, params.conversation)


def _log_failure(job: str, future: Future) -> None:
    """Log what a job on the indexer thread raised: nobody waits on its future."""
    if not future.cancelled() and (error := future.exception()) is not None:
        log.error("indexer job %s failed: %s", job, error, exc_info=error)


def bind_unix_socket(path: Path) -> socket.socket:
    """A listening Unix socket only its owner can connect to: created 0600 (the umask is set
    around ``bind`` so it is never briefly wider), in a directory the caller made 0700."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(str(path))
    except OSError:
        sock.close()
        raise
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    sock.listen(64)
    return sock
