"""HTTP transport: OpenAI- and Anthropic-compatible endpoints in front of the one scheduler.

Routes: ``GET /v1/models``, ``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/responses``
(OpenAI), ``POST /v1/messages`` and ``/v1/messages/count_tokens`` (Anthropic), ``GET /health`` and
``GET /metrics`` (Prometheus text).

Every generation endpoint turns its request into one ``Job`` and hands it to ``_serve``, the single
mechanism that waits on the ticket, streams or collects, sends keep-alives, parses tool calls and
cancels the job when the client goes away. What differs per API is only the formatting, in a
``Dialect``: the events it streams and the body it returns. Sampling options and token limits are
per job, so changing them between requests never reloads anything.

Errors come back in the caller's API format (OpenAI's ``{"error": {...}}``, or Anthropic's
``{"type": "error", ...}`` under ``/v1/messages``): 400 for malformed or invalid requests, 401 without
the API key, 404, 413 for bodies over the limit, 500 (logged with its traceback) for daemon faults.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import secrets
import time
from collections import Counter
from datetime import datetime, timezone
from typing import Any, AsyncIterator, Literal

import msgspec
from aiohttp import web

from warmspec_protocol import GenerationStats
from warmspec_protocol import anthropic as ant
from warmspec_protocol import openai as oai
from warmspec_protocol.openai import SpeculationStats

from ..engine import Delta, EngineError, Finished
from ..tokenizer import Tokenizer, TokenizerError
from .app import App
from .scheduler import Busy, Job, JobError, Ticket

log = logging.getLogger("warmspec.http")

# Agents and proxies commonly drop a silent connection after 10-60 s, and a long prompt behind a
# queue can take that long to reach its first token. A comment every 5 s keeps them waiting.
KEEPALIVE_S = 5.0
# How often a waiting request checks that its client is still there: a gone client's job stops
# within this plus one decode step, instead of decoding for nobody.
POLL_S = 0.5
KEEPALIVE = b": keep-alive\n\n"
SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}

_encode = msgspec.json.encode


class ApiError(Exception):
    """A request that ends in an error reply; ``str()`` is the message the client reads."""

    def __init__(self, status: int, message: str, *, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.param = param


class ClientGone(Exception):
    """The client closed its connection while its job was queued or running."""


# -- tool calls -------------------------------------------------------------------------------------

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
_TOOL_BLOCK = re.compile(r"\s*<tool_call>\s*(.*?)\s*</tool_call>\s*", re.S)
_PROBE_TOOL = "warmspec_probe_tool"


class HermesCall(msgspec.Struct):
    """The JSON a Hermes/Qwen-style model writes inside ``<tool_call>`` ... ``</tool_call>``."""

    name: str
    arguments: dict[str, Any] = {}


class ParsedCall(msgspec.Struct, kw_only=True):
    id: str
    name: str
    arguments: str  # JSON text


def tool_format(tokenizer: Tokenizer) -> Literal["hermes", "unparsed", "none"]:
    """What the model's chat template does with ``tools``, found by rendering a probe tool.

    "none": the template ignores tools (SmolLM2's), so the model never learns they exist.
    "unparsed": it renders them, but asks for a call format other than ``<tool_call>`` blocks.
    "hermes": it asks for ``<tool_call>{json}</tool_call>`` (Hermes, Qwen2.5, Qwen3), which
    ``ToolCallSplitter`` parses into tool calls.
    """
    probe = [{"type": "function", "function": {"name": _PROBE_TOOL, "description": "probe",
                                               "parameters": {"type": "object", "properties": {}}}}]
    try:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=probe)
    except TokenizerError:
        return "none"
    if _PROBE_TOOL not in rendered:
        return "none"
    return "hermes" if TOOL_OPEN in rendered else "unparsed"


def parse_tool_calls(text: str) -> list[ParsedCall] | None:
    """The calls in ``text`` if it is nothing but well-formed ``<tool_call>`` blocks, else None."""
    calls: list[ParsedCall] = []
    pos = 0
    while pos < len(text):
        m = _TOOL_BLOCK.match(text, pos)
        if m is None:
            return None
        try:
            call = msgspec.json.decode(m.group(1), type=HermesCall)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None
        calls.append(ParsedCall(id=f"call_{secrets.token_hex(12)}", name=call.name,
                                arguments=_encode(call.arguments).decode()))
        pos = m.end()
    return calls or None


class ToolCallSplitter:
    """Separates tool-call blocks from the text a model writes, as it streams.

    Text before the first ``<tool_call>`` streams as usual (a tail that could be the start of the
    tag is held back until it cannot be); from the tag on, everything is held and parsed when the
    generation ends. Held text that is not a clean sequence of calls is returned as text, so the
    model's output is never dropped.
    """

    def __init__(self) -> None:
        self._pending = ""
        self._held: str | None = None

    def feed(self, text: str) -> str:
        if self._held is not None:
            self._held += text
            return ""
        buf = self._pending + text
        i = buf.find(TOOL_OPEN)
        if i >= 0:
            self._held, self._pending = buf[i:], ""
            return buf[:i]
        keep = next((n for n in range(min(len(TOOL_OPEN) - 1, len(buf)), 0, -1)
                     if buf.endswith(TOOL_OPEN[:n])), 0)
        self._pending = buf[len(buf) - keep:]
        return buf[:len(buf) - keep]

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """The text still to emit and the parsed calls."""
        if self._held is None:
            tail, self._pending = self._pending, ""
            return tail, []
        calls = parse_tool_calls(self._held)
        return ("", calls) if calls else (self._held, [])


# -- generation: one mechanism for every endpoint ---------------------------------------------------


class Outcome(msgspec.Struct, kw_only=True):
    """A finished generation as every dialect reports it."""

    text: str
    tool_calls: list[ParsedCall]
    finish: Literal["stop", "length", "tool_calls"]
    stop_sequence: str | None  # the stop string that ended it (None: end of sequence or length)
    stats: GenerationStats


def _gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


async def _generate(request: web.Request, ctx: Context, ticket: Ticket,
                    split: ToolCallSplitter | None) -> AsyncIterator[str | Outcome | None]:
    """Text as it becomes final, then one ``Outcome``; ``None`` after every ``keepalive_s``
    without an event. Raises ``ApiError`` if the job fails and ``ClientGone`` if the client left."""
    parts: list[str] = []
    loop = asyncio.get_running_loop()
    last = loop.time()
    while True:
        try:
            ev = await ticket.next_event(POLL_S)
        except asyncio.TimeoutError:
            if _gone(request):
                raise ClientGone() from None
            if loop.time() - last >= ctx.keepalive_s:
                last = loop.time()
                yield None
            continue
        last = loop.time()
        if _gone(request):  # checked per event too: a busy decode never times out
            raise ClientGone()
        if isinstance(ev, Delta):
            text = split.feed(ev.text) if split else ev.text
            if text:
                parts.append(text)
                yield text
        elif isinstance(ev, Finished):
            if ev.finish_reason == "cancelled":
                raise ApiError(503, "the request was cancelled: the daemon is shutting down")
            if ev.finish_reason == "error":
                raise ApiError(500, "generation failed")
            tail, calls = split.finish() if split else ("", [])
            if tail:
                parts.append(tail)
                yield tail
            yield Outcome(text="".join(parts), tool_calls=calls,
                          finish="tool_calls" if calls else ev.finish_reason,
                          stop_sequence=ev.stop, stats=ev.stats)
            return
        else:
            assert isinstance(ev, JobError)  # a daemon fault's traceback is in the scheduler's log
            raise ApiError(400 if ev.client_error else 500, ev.message)


async def _serve(request: web.Request, job: Job, dialect: Dialect, *, stream: bool,
                 tools: bool) -> web.StreamResponse:
    """Run ``job`` and answer in ``dialect``, streamed (SSE) or whole."""
    ctx = request.app[CTX]
    ticket = ctx.app.scheduler.submit(job)
    pieces = _generate(request, ctx, ticket, ToolCallSplitter() if tools else None)
    try:
        if stream:
            return await _stream(request, ctx, dialect, pieces)
        return await _whole(dialect, pieces)
    except ClientGone:  # a whole reply's client left while it waited; nobody reads this
        ctx.client_left(request)
        return web.Response(status=499)
    except asyncio.CancelledError:  # aiohttp cancels the handler of a client that disconnected
        ctx.client_left(request)
        raise
    finally:
        ticket.cancel()  # a no-op once finished; stops the job if the client went away
        await pieces.aclose()


async def _stream(request: web.Request, ctx: Context, dialect: Dialect,
                  pieces: AsyncIterator[str | Outcome | None]) -> web.StreamResponse:
    resp = web.StreamResponse(headers=SSE_HEADERS)
    await resp.prepare(request)
    request[STREAMING] = True

    async def write(chunks: list[bytes]) -> None:
        if chunks:
            await resp.write(b"".join(chunks))

    try:
        try:
            await write(dialect.start())
            async for piece in pieces:
                if piece is None:
                    await resp.write(KEEPALIVE)
                elif isinstance(piece, str):
                    await write(dialect.text(piece))
                else:
                    await write(dialect.finish(piece))
        except ApiError as e:
            await write(dialect.failed(e))
        await resp.write_eof()
    except (ConnectionResetError, ClientGone):
        ctx.client_left(request)
    return resp


async def _whole(dialect: Dialect, pieces: AsyncIterator[str | Outcome | None]) -> web.Response:
    out = None
    async for piece in pieces:
        if isinstance(piece, Outcome):
            out = piece
    assert out is not None
    return web.Response(body=_encode(dialect.body(out)), content_type="application/json",
                        headers={"X-Warmspec-Stats": _encode(SpeculationStats.of(out.stats)).decode()})


# -- dialects ---------------------------------------------------------------------------------------


def _rid() -> str:
    return secrets.token_hex(12)


def _data(obj: msgspec.Struct) -> bytes:
    return b"data: " + _encode(obj) + b"\n\n"


def _event(obj: msgspec.Struct) -> bytes:
    """An SSE event named by the object's ``type`` tag, as the Responses and Anthropic APIs send."""
    return b"event: " + obj.__struct_config__.tag.encode() + b"\ndata: " + _encode(obj) + b"\n\n"


def _openai_error(e: ApiError) -> oai.ErrorResponse:
    kind = {401: "authentication_error", 404: "not_found_error"}.get(
        e.status, "invalid_request_error" if e.status < 500 else "server_error")
    code = {413: "request_too_large", 401: "invalid_api_key"}.get(e.status)
    return oai.ErrorResponse(error=oai.ErrorDetail(message=str(e), type=kind, param=e.param, code=code))


def _anthropic_error(e: ApiError) -> ant.ErrorResponse:
    kind = {401: "authentication_error", 404: "not_found_error", 413: "request_too_large",
            503: "overloaded_error"}.get(e.status, "invalid_request_error" if e.status < 500 else "api_error")
    return ant.ErrorResponse(error=ant.ErrorDetail(type=kind, message=str(e)))


def _function(call: ParsedCall) -> oai.FunctionCall:
    return oai.FunctionCall(name=call.name, arguments=call.arguments)


def _usage(s: GenerationStats) -> oai.Usage:
    return oai.Usage(prompt_tokens=s.prompt_tokens, completion_tokens=s.completion_tokens,
                     total_tokens=s.prompt_tokens + s.completion_tokens,
                     prompt_tokens_details=oai.PromptTokensDetails(cached_tokens=s.cached_tokens))


class Dialect:
    """What one API streams and returns for a generation; formatting only."""

    def __init__(self, model: str):
        self.model = model
        self.created = int(time.time())

    def start(self) -> list[bytes]:
        """Events sent as soon as the stream opens, before the first token."""
        return []

    def text(self, delta: str) -> list[bytes]:
        raise NotImplementedError

    def finish(self, out: Outcome) -> list[bytes]:
        raise NotImplementedError

    def failed(self, err: ApiError) -> list[bytes]:
        """A failure after the stream opened. OpenAI's SDK raises on a ``data`` with ``error``."""
        return [_data(_openai_error(err))]

    def body(self, out: Outcome) -> msgspec.Struct:
        raise NotImplementedError


class ChatDialect(Dialect):
    def __init__(self, model: str, include_usage: bool):
        super().__init__(model)
        self.id = f"chatcmpl-{_rid()}"
        self.include_usage = include_usage

    def _chunk(self, delta: oai.ChunkDelta, finish: oai.ChatFinish | None = None) -> bytes:
        return _data(oai.ChatCompletionChunk(id=self.id, created=self.created, model=self.model,
                                             choices=[oai.ChunkChoice(delta=delta, finish_reason=finish)]))

    def start(self) -> list[bytes]:
        return [self._chunk(oai.ChunkDelta(role="assistant", content=""))]

    def text(self, delta: str) -> list[bytes]:
        return [self._chunk(oai.ChunkDelta(content=delta))]

    def finish(self, out: Outcome) -> list[bytes]:
        chunks = []
        if out.tool_calls:
            calls = [oai.ChunkToolCall(index=i, id=c.id, function=_function(c)) for i, c in enumerate(out.tool_calls)]
            chunks.append(self._chunk(oai.ChunkDelta(tool_calls=calls)))
        stats = SpeculationStats.of(out.stats)
        last = oai.ChatCompletionChunk(id=self.id, created=self.created, model=self.model,
                                       choices=[oai.ChunkChoice(delta=oai.ChunkDelta(), finish_reason=out.finish)],
                                       warmspec=None if self.include_usage else stats)
        chunks.append(_data(last))
        if self.include_usage:
            chunks.append(_data(oai.ChatCompletionChunk(id=self.id, created=self.created, model=self.model,
                                                        choices=[], usage=_usage(out.stats), warmspec=stats)))
        return chunks + [b"data: [DONE]\n\n"]

    def body(self, out: Outcome) -> oai.ChatCompletion:
        calls = [oai.ToolCall(id=c.id, function=_function(c)) for c in out.tool_calls] or None
        message = oai.AssistantMessage(content=out.text if out.text or not calls else None, tool_calls=calls)
        return oai.ChatCompletion(id=self.id, created=self.created, model=self.model,
                                  choices=[oai.Choice(message=message, finish_reason=out.finish)],
                                  usage=_usage(out.stats), warmspec=SpeculationStats.of(out.stats))


class CompletionDialect(Dialect):
    def __init__(self, model: str, include_usage: bool):
        super().__init__(model)
        self.id = f"cmpl-{_rid()}"
        self.include_usage = include_usage

    def _completion(self, text: str, finish: Literal["stop", "length"] | None, **extra: Any) -> oai.Completion:
        return oai.Completion(id=self.id, created=self.created, model=self.model,
                              choices=[oai.CompletionChoice(text=text, finish_reason=finish)], **extra)

    def text(self, delta: str) -> list[bytes]:
        return [_data(self._completion(delta, None))]

    def finish(self, out: Outcome) -> list[bytes]:
        stats = SpeculationStats.of(out.stats)
        finish = "length" if out.finish == "length" else "stop"
        chunks = [_data(self._completion("", finish, warmspec=None if self.include_usage else stats))]
        if self.include_usage:
            chunks.append(_data(oai.Completion(id=self.id, created=self.created, model=self.model, choices=[],
                                               usage=_usage(out.stats), warmspec=stats)))
        return chunks + [b"data: [DONE]\n\n"]

    def body(self, out: Outcome) -> oai.Completion:
        return self._completion(out.text, "length" if out.finish == "length" else "stop",
                                usage=_usage(out.stats), warmspec=SpeculationStats.of(out.stats))


class ResponsesDialect(Dialect):
    """The Responses API: a message item with one output_text part, opened at the first text,
    then one function_call item per tool call; every event numbered by ``sequence_number``."""

    def __init__(self, model: str, req: oai.ResponsesRequest):
        super().__init__(model)
        rid = _rid()
        self.id, self.msg_id = f"resp_{rid}", f"msg_{rid}"
        self.req = req
        self.seq = 0
        self.opened = False

    def _ev(self, cls: type, **fields: Any) -> bytes:
        ev = cls(sequence_number=self.seq, **fields)
        self.seq += 1
        return _event(ev)

    def _response(self, status: str, output: list[oai.OutputItem], out: Outcome | None = None,
                  error: oai.ResponseError | None = None) -> oai.Response:
        r = self.req
        s = out.stats if out else None
        usage = oai.ResponseUsage(
            input_tokens=s.prompt_tokens, input_tokens_details=oai.InputTokensDetails(cached_tokens=s.cached_tokens),
            output_tokens=s.completion_tokens, output_tokens_details=oai.OutputTokensDetails(),
            total_tokens=s.prompt_tokens + s.completion_tokens) if s else None
        incomplete = oai.IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None
        return oai.Response(
            id=self.id, created_at=self.created, status=status, model=self.model, output=output, usage=usage,
            error=error, incomplete_details=incomplete, instructions=r.instructions,
            max_output_tokens=r.max_output_tokens, temperature=r.temperature, top_p=r.top_p, tools=r.tools or [],
            metadata=r.metadata or {}, warmspec=SpeculationStats.of(s) if s else None)

    def _message(self, status: oai.ItemStatus, text: str | None) -> oai.OutputMessage:
        content = [] if text is None else [oai.OutputText(text=text)]
        return oai.OutputMessage(id=self.msg_id, status=status, content=content)

    @staticmethod
    def _calls(out: Outcome) -> list[oai.FunctionCallItem]:
        return [oai.FunctionCallItem(id=f"fc_{c.id}", call_id=c.id, name=c.name, arguments=c.arguments,
                                     status="completed") for c in out.tool_calls]

    def _output(self, out: Outcome) -> list[oai.OutputItem]:
        status = "incomplete" if out.finish == "length" else "completed"
        message = [self._message(status, out.text)] if out.text or not out.tool_calls else []
        return message + self._calls(out)

    def _open(self) -> list[bytes]:
        if self.opened:
            return []
        self.opened = True
        return [self._ev(oai.OutputItemAdded, output_index=0, item=self._message("in_progress", None)),
                self._ev(oai.ContentPartAdded, item_id=self.msg_id, output_index=0, content_index=0,
                         part=oai.OutputText(text=""))]

    def start(self) -> list[bytes]:
        r = self._response("in_progress", [])
        return [self._ev(oai.ResponseCreated, response=r), self._ev(oai.ResponseInProgress, response=r)]

    def text(self, delta: str) -> list[bytes]:
        return self._open() + [self._ev(oai.OutputTextDelta, item_id=self.msg_id, output_index=0,
                                        content_index=0, delta=delta)]

    def finish(self, out: Outcome) -> list[bytes]:
        output = self._output(out)
        evs: list[bytes] = []
        for index, item in enumerate(output):
            where = dict(item_id=item.id, output_index=index)
            if isinstance(item, oai.OutputMessage):
                part = item.content[0]
                evs += self._open() + [self._ev(oai.OutputTextDone, **where, content_index=0, text=part.text),
                                       self._ev(oai.ContentPartDone, **where, content_index=0, part=part)]
            else:
                started = msgspec.structs.replace(item, arguments="", status="in_progress")
                evs += [self._ev(oai.OutputItemAdded, output_index=index, item=started),
                        self._ev(oai.FunctionCallArgumentsDelta, **where, delta=item.arguments),
                        self._ev(oai.FunctionCallArgumentsDone, **where, name=item.name, arguments=item.arguments)]
            evs.append(self._ev(oai.OutputItemDone, output_index=index, item=item))
        final = self.body(out)
        done = oai.ResponseIncomplete if final.status == "incomplete" else oai.ResponseCompleted
        return evs + [self._ev(done, response=final)]

    def failed(self, err: ApiError) -> list[bytes]:
        code = "invalid_request" if err.status < 500 else "server_error"
        return [self._ev(oai.ResponseFailed, response=self._response(
            "failed", [], error=oai.ResponseError(code=code, message=str(err))))]

    def body(self, out: Outcome) -> oai.Response:
        status = "incomplete" if out.finish == "length" else "completed"
        return self._response(status, self._output(out), out)


class MessagesDialect(Dialect):
    """Anthropic Messages: the text block (index 0) opens at the first text, then one tool_use
    block per tool call. Usage follows Anthropic's convention: ``input_tokens`` excludes the
    prompt tokens read from the cache (``cache_read_input_tokens``)."""

    def __init__(self, model: str, prompt_tokens: int):
        super().__init__(model)
        self.id = f"msg_{_rid()}"
        self.prompt_tokens = prompt_tokens
        self.opened = False

    @staticmethod
    def _stop_reason(out: Outcome) -> ant.StopReason:
        if out.finish == "tool_calls":
            return "tool_use"
        if out.finish == "length":
            return "max_tokens"
        return "stop_sequence" if out.stop_sequence is not None else "end_turn"

    def _open(self) -> list[bytes]:
        if self.opened:
            return []
        self.opened = True
        return [_event(ant.ContentBlockStart(index=0, content_block=ant.TextBlock(text="")))]

    def start(self) -> list[bytes]:
        message = ant.Message(id=self.id, model=self.model, content=[],
                              usage=ant.Usage(input_tokens=self.prompt_tokens, output_tokens=0))
        return [_event(ant.MessageStart(message=message)), _event(ant.Ping())]

    def text(self, delta: str) -> list[bytes]:
        return self._open() + [_event(ant.ContentBlockDelta(index=0, delta=ant.TextDelta(text=delta)))]

    def finish(self, out: Outcome) -> list[bytes]:
        evs: list[bytes] = []
        first = 0
        if self.opened or not out.tool_calls:
            evs += self._open() + [_event(ant.ContentBlockStop(index=0))]
            first = 1
        for i, c in enumerate(out.tool_calls, start=first):
            block = ant.ToolUseBlock(id=c.id, name=c.name, input={})  # the input follows as JSON text
            evs += [_event(ant.ContentBlockStart(index=i, content_block=block)),
                    _event(ant.ContentBlockDelta(index=i, delta=ant.InputJsonDelta(partial_json=c.arguments))),
                    _event(ant.ContentBlockStop(index=i))]
        s = out.stats
        usage = ant.DeltaUsage(output_tokens=s.completion_tokens, input_tokens=s.prompt_tokens - s.cached_tokens,
                               cache_read_input_tokens=s.cached_tokens)
        delta = ant.MessageDeltaBody(stop_reason=self._stop_reason(out), stop_sequence=out.stop_sequence)
        return evs + [_event(ant.MessageDelta(delta=delta, usage=usage, warmspec=SpeculationStats.of(s))),
                      _event(ant.MessageStop())]

    def failed(self, err: ApiError) -> list[bytes]:
        return [_event(_anthropic_error(err))]

    def body(self, out: Outcome) -> ant.Message:
        content: list[ant.ContentBlock] = [ant.TextBlock(text=out.text)] if out.text or not out.tool_calls else []
        content += [ant.ToolUseBlock(id=c.id, name=c.name, input=msgspec.json.decode(c.arguments))
                    for c in out.tool_calls]
        s = out.stats
        usage = ant.Usage(input_tokens=s.prompt_tokens - s.cached_tokens, output_tokens=s.completion_tokens,
                          cache_read_input_tokens=s.cached_tokens)
        return ant.Message(id=self.id, model=self.model, content=content, stop_reason=self._stop_reason(out),
                           stop_sequence=out.stop_sequence, usage=usage, warmspec=SpeculationStats.of(s))


# -- requests -> chat template messages -------------------------------------------------------------


class TemplateFunction(msgspec.Struct, kw_only=True):
    name: str
    arguments: Any  # a dict, as Hugging Face chat templates expect (they ``tojson`` it)


class TemplateToolCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    id: str | None = None
    type: str = "function"
    function: TemplateFunction


class TemplateMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A chat turn as chat templates read it (absent fields stay undefined in jinja)."""

    role: str
    content: str
    tool_calls: list[TemplateToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None


def _text(content: str | list[Any] | None, kinds: tuple[str, ...], where: str) -> str:
    """Plain text of a message's content; text parts are joined by newlines."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for i, part in enumerate(content):
        if part.type not in kinds:
            raise ApiError(400, f"content of type {part.type!r} is not supported: warmspec serves "
                                f"text-only models (use {' or '.join(map(repr, kinds))})", param=f"{where}[{i}].type")
        texts.append(part.text or "")
    return "\n".join(texts)


def _arguments(text: str) -> Any:
    """Arguments of an earlier call, as a dict for the template; kept as text if not JSON."""
    try:
        return msgspec.json.decode(text)
    except msgspec.DecodeError:
        return text


class ChatPrompt(msgspec.Struct):
    tokens: list[int]
    conversation: str


async def _prompt(ctx: Context, messages: list[TemplateMessage], tools: list[oai.Tool] | None,
                  *, note_reads: bool = True) -> ChatPrompt:
    """Token ids of the chat, built in a worker thread: encoding 1 MB of text takes 0.7 s here. (The
    loop runs meanwhile only if the tokenizer releases the GIL: ``encode_batch`` does, ``encode``
    does not -- measured 68 vs 1 ticks of a 10 ms timer during one 0.75 s encode.) Files the chat's
    tool calls read are indexed for drafting on the way."""
    dicts = [msgspec.to_builtins(m) for m in messages]

    def build() -> ChatPrompt:
        conversation = ctx.app.conversation_of(dicts)
        if note_reads:
            ctx.app.note_tool_reads(dicts, conversation)
        tokens = ctx.app.chat_prompt(dicts, tools=[msgspec.to_builtins(t) for t in tools] if tools else None)
        return ChatPrompt(tokens, conversation)

    return await asyncio.to_thread(build)


def _tools(ctx: Context, tools: list[oai.Tool] | None, choice: str | None) -> list[oai.Tool] | None:
    """The tools to render, after checking the model can use them and the choice can be kept.

    ``choice``: None, "auto" or "none", else a description of a forced call ("'required'",
    "naming a function"), which is refused: nothing constrains the model's output to a call."""
    if not tools or choice == "none":
        return None
    if choice not in (None, "auto"):
        raise ApiError(400, f"tool_choice {choice} is not supported: warmspec cannot force a tool call; "
                            "use 'auto' or 'none'", param="tool_choice")
    if ctx.tool_format == "none":
        raise ApiError(400, f"model {ctx.app.lm.name!r} has no tool support: its chat template ignores "
                            "tools (remove them, or serve a model whose template renders them, e.g. "
                            "Qwen2.5-Instruct)", param="tools")
    if ctx.tool_format == "unparsed":
        raise ApiError(400, f"model {ctx.app.lm.name!r} uses a tool-call format warmspec cannot parse "
                            "(it parses Hermes/Qwen <tool_call> blocks)", param="tools")
    return tools


def _openai_choice(choice: str | oai.NamedToolChoice | oai.FunctionToolChoice | None) -> str | None:
    if choice is None or choice in ("auto", "none"):
        return choice
    return "'required'" if choice == "required" else "naming a function"


def _chat_messages(messages: list[oai.ChatMessage]) -> list[TemplateMessage]:
    out = []
    for i, m in enumerate(messages):
        calls = [TemplateToolCall(id=c.id, function=TemplateFunction(name=c.function.name,
                                                                     arguments=_arguments(c.function.arguments)))
                 for c in m.tool_calls] if m.tool_calls else None
        out.append(TemplateMessage(role="system" if m.role == "developer" else m.role,
                                   content=_text(m.content, ("text",), f"messages[{i}].content"),
                                   tool_calls=calls, tool_call_id=m.tool_call_id, name=m.name))
    return out


def _responses_messages(req: oai.ResponsesRequest) -> list[TemplateMessage]:
    out = [TemplateMessage(role="system", content=req.instructions)] if req.instructions else []
    if isinstance(req.input, str):
        return out + [TemplateMessage(role="user", content=req.input)]
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        if item.type == "message":
            if item.role is None:
                raise ApiError(400, "a message item needs a role", param=f"{where}.role")
            role = "system" if item.role == "developer" else item.role
            out.append(TemplateMessage(role=role, content=_text(item.content, ("input_text", "output_text", "text"),
                                                                f"{where}.content")))
        elif item.type == "function_call":
            if item.call_id is None or item.name is None or item.arguments is None:
                raise ApiError(400, "a function_call item needs call_id, name and arguments", param=where)
            call = TemplateToolCall(id=item.call_id, function=TemplateFunction(name=item.name,
                                                                             arguments=_arguments(item.arguments)))
            if out and out[-1].role == "assistant" and out[-1].tool_calls is not None:
                out[-1].tool_calls.append(call)  # parallel calls: one assistant turn
            else:
                out.append(TemplateMessage(role="assistant", content="", tool_calls=[call]))
        else:
            if item.call_id is None or item.output is None:
                raise ApiError(400, "a function_call_output item needs call_id and output", param=where)
            out.append(TemplateMessage(role="tool", content=item.output, tool_call_id=item.call_id))
    return out


def _anthropic_messages(system: str | list[ant.ContentBlockParam] | None,
                        messages: list[ant.MessageParam]) -> list[TemplateMessage]:
    out = []
    if system:
        out.append(TemplateMessage(role="system", content=_text(system, ("text",), "system")))
    for i, m in enumerate(messages):
        where = f"messages[{i}].content"
        if isinstance(m.content, str):
            out.append(TemplateMessage(role=m.role, content=m.content))
            continue
        texts, calls = [], []
        for j, block in enumerate(m.content):
            if block.type == "text":
                texts.append(block.text or "")
            elif block.type == "tool_use" and m.role == "assistant":
                if block.name is None:
                    raise ApiError(400, "a tool_use block needs a name", param=f"{where}[{j}].name")
                calls.append(TemplateToolCall(id=block.id, function=TemplateFunction(name=block.name,
                                                                                   arguments=block.input or {})))
            elif block.type == "tool_result" and m.role == "user":
                result = _text(block.content, ("text",), f"{where}[{j}].content")
                out.append(TemplateMessage(role="tool", content=result, tool_call_id=block.tool_use_id))
            else:
                raise ApiError(400, f"content block of type {block.type!r} is not supported in {m.role} "
                                    "messages (warmspec serves text-only models)", param=f"{where}[{j}].type")
        if texts or calls:
            out.append(TemplateMessage(role=m.role, content="\n".join(texts), tool_calls=calls or None))
    return out


def _anthropic_tools(ctx: Context, tools: list[ant.ToolParam] | None,
                     choice: ant.ToolChoice | None) -> list[oai.Tool] | None:
    as_openai = [oai.Tool(type="function", function=oai.FunctionDef(name=t.name, description=t.description,
                                                                    parameters=t.input_schema))
                 for t in tools or []]
    forced = {"any": "'any'", "tool": "'tool'"}
    return _tools(ctx, as_openai, forced.get(choice.type, choice.type) if choice else None)


# -- handlers ---------------------------------------------------------------------------------------


def _param(e: msgspec.ValidationError) -> str | None:
    m = re.search(r"at `\$\.?(.*)`$", str(e))
    return m.group(1) or None if m else None


async def _decode(request: web.Request, kind: type[msgspec.Struct]) -> Any:
    limit = request.app[CTX].app.limits.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise ApiError(413, f"request body of {request.content_length} bytes is over the limit of {limit}")
    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(413, f"request body is over the limit of {limit} bytes") from None
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        raise ApiError(400, f"invalid request: {e}", param=_param(e)) from None
    except msgspec.DecodeError as e:
        raise ApiError(400, f"malformed JSON body: {e}") from None


SampledRequest = oai.ChatCompletionRequest | oai.CompletionRequest | oai.ResponsesRequest | ant.MessagesRequest


def _job(ctx: Context, prompt: list[int] | ChatPrompt, req: SampledRequest, *, max_tokens: int | None,
         stop: str | list[str] | None, label: str) -> Job:
    params = ctx.app.sampling(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                              min_p=req.min_p, seed=req.seed)
    if isinstance(prompt, ChatPrompt):
        return ctx.app.job(prompt.tokens, params, max_tokens=max_tokens, stop=stop, label=label,
                           conversation=prompt.conversation)
    return ctx.app.job(prompt, params, max_tokens=max_tokens, stop=stop, label=label)


def _single_choice(n: int | None) -> None:
    if n not in (None, 1):
        raise ApiError(400, "n must be 1: warmspec generates one choice per request", param="n")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    ctx = request.app[CTX]
    req = await _decode(request, oai.ChatCompletionRequest)
    _single_choice(req.n)
    if req.logprobs:
        raise ApiError(400, "logprobs are not supported", param="logprobs")
    tools = _tools(ctx, req.tools, _openai_choice(req.tool_choice))
    prompt = await _prompt(ctx, _chat_messages(req.messages), tools)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    job = _job(ctx, prompt, req, max_tokens=max_tokens, stop=req.stop, label="http chat")
    dialect = ChatDialect(ctx.app.lm.name, bool(req.stream_options and req.stream_options.include_usage))
    return await _serve(request, job, dialect, stream=req.stream, tools=tools is not None)


async def completions(request: web.Request) -> web.StreamResponse:
    ctx = request.app[CTX]
    req = await _decode(request, oai.CompletionRequest)
    _single_choice(req.n)
    for field, unsupported in (("echo", req.echo), ("suffix", req.suffix), ("logprobs", req.logprobs)):
        if unsupported:
            raise ApiError(400, f"{field} is not supported", param=field)
    if isinstance(req.prompt, list):
        if len(req.prompt) != 1:
            raise ApiError(400, "exactly one prompt per request", param="prompt")
        req.prompt = req.prompt[0]
    prompt = await asyncio.to_thread(ctx.app.text_prompt, req.prompt)
    job = _job(ctx, prompt, req, max_tokens=req.max_tokens, stop=req.stop, label="http completion")
    dialect = CompletionDialect(ctx.app.lm.name, bool(req.stream_options and req.stream_options.include_usage))
    return await _serve(request, job, dialect, stream=req.stream, tools=False)


async def responses(request: web.Request) -> web.StreamResponse:
    ctx = request.app[CTX]
    req = await _decode(request, oai.ResponsesRequest)
    if req.previous_response_id is not None:
        raise ApiError(400, "previous_response_id is not supported: warmspec stores no responses; send "
                            "the whole conversation in input", param="previous_response_id")
    as_openai = [oai.Tool(type="function", function=oai.FunctionDef(name=t.name, description=t.description,
                                                                    parameters=t.parameters))
                 for t in req.tools or []]
    tools = _tools(ctx, as_openai, _openai_choice(req.tool_choice))
    prompt = await _prompt(ctx, _responses_messages(req), tools)
    job = _job(ctx, prompt, req, max_tokens=req.max_output_tokens, stop=req.stop, label="http responses")
    return await _serve(request, job, ResponsesDialect(ctx.app.lm.name, req), stream=req.stream,
                        tools=tools is not None)


async def messages(request: web.Request) -> web.StreamResponse:
    ctx = request.app[CTX]
    req = await _decode(request, ant.MessagesRequest)
    tools = _anthropic_tools(ctx, req.tools, req.tool_choice)
    prompt = await _prompt(ctx, _anthropic_messages(req.system, req.messages), tools)
    job = _job(ctx, prompt, req, max_tokens=req.max_tokens, stop=req.stop_sequences, label="http messages")
    return await _serve(request, job, MessagesDialect(ctx.app.lm.name, len(prompt.tokens)), stream=req.stream,
                        tools=tools is not None)


async def count_tokens(request: web.Request) -> web.Response:
    ctx = request.app[CTX]
    req = await _decode(request, ant.CountTokensRequest)
    tools = _anthropic_tools(ctx, req.tools, req.tool_choice)
    prompt = await _prompt(ctx, _anthropic_messages(req.system, req.messages), tools, note_reads=False)
    return _json(ant.CountTokensResponse(input_tokens=len(prompt.tokens)))


def _model(ctx: Context) -> oai.Model:
    name = ctx.app.lm.name
    started = datetime.fromtimestamp(ctx.app.started, timezone.utc).isoformat().replace("+00:00", "Z")
    return oai.Model(id=name, created=int(ctx.app.started), display_name=name, created_at=started)


async def models(request: web.Request) -> web.Response:
    m = _model(request.app[CTX])
    return _json(oai.ModelList(data=[m], first_id=m.id, last_id=m.id))


async def model(request: web.Request) -> web.Response:
    m = _model(request.app[CTX])
    if request.match_info["model"] != m.id:
        raise ApiError(404, f"model {request.match_info['model']!r} is not served here (only {m.id!r})",
                       param="model")
    return _json(m)


async def health(request: web.Request) -> web.Response:
    app = request.app[CTX].app
    s = app.scheduler
    return _json(oai.Health(model=app.lm.name, uptime_s=round(time.time() - app.started, 3),
                            queue=s.queue_depth, active=s.active is not None))


async def metrics(request: web.Request) -> web.Response:
    return web.Response(text=request.app[CTX].prometheus(), content_type="text/plain",
                        headers={"X-Content-Type-Options": "nosniff"})


def _json(obj: msgspec.Struct, status: int = 200) -> web.Response:
    return web.Response(body=_encode(obj), status=status, content_type="application/json")


# -- application ------------------------------------------------------------------------------------


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Context:
    """The HTTP server's state beside the ``App``: tool support of the template, request counters."""

    def __init__(self, app: App, keepalive_s: float):
        self.app = app
        self.keepalive_s = keepalive_s
        self.tool_format = tool_format(app.lm.tokenizer)
        self.requests: Counter[tuple[str, int]] = Counter()
        self.disconnects = 0

    def client_left(self, request: web.Request) -> None:
        self.disconnects += 1
        log.info("%s %s: the client disconnected; its job is cancelled", request.method, request.path)

    def prometheus(self) -> str:
        """Prometheus text exposition: HTTP counters, and the daemon's cumulative statistics."""
        st = self.app.status()
        t = st.totals
        lines: list[str] = []

        def metric(name: str, kind: str, help: str, samples: list[tuple[str, float]]) -> None:
            lines.extend([f"# HELP warmspec_{name} {help}", f"# TYPE warmspec_{name} {kind}"])
            lines.extend(f"warmspec_{name}{labels} {value!r}" for labels, value in samples)

        metric("http_requests_total", "counter", "HTTP requests by route and status.",
               [(f'{{route="{_label(r)}",status="{s}"}}', n) for (r, s), n in sorted(self.requests.items())])
        metric("http_disconnects_total", "counter", "Clients that left before their answer; jobs cancelled.",
               [("", self.disconnects)])
        metric("requests_completed_total", "counter", "Jobs the engine finished.", [("", st.requests_completed)])
        metric("requests_failed_total", "counter", "Jobs that failed.", [("", st.requests_failed)])
        metric("queue_depth", "gauge", "Jobs waiting for the engine.", [("", st.queue)])
        metric("active_requests", "gauge", "Jobs being decoded (0 or 1).", [("", int(st.active))])
        metric("prompt_tokens_total", "counter", "Prompt tokens of finished jobs.", [("", t.prompt_tokens)])
        metric("cached_tokens_total", "counter", "Prompt tokens reused from the prefix cache.",
               [("", t.cached_tokens)])
        metric("completion_tokens_total", "counter", "Tokens generated.", [("", t.completion_tokens)])
        metric("passes_total", "counter", "Forward passes while decoding.", [("", t.passes)])
        metric("drafted_tokens_total", "counter", "Draft tokens verified.", [("", t.drafted)])
        metric("accepted_tokens_total", "counter", "Draft tokens accepted.", [("", t.accepted)])
        metric("gated_steps_total", "counter", "Steps where the gate chose a plain pass.", [("", t.gated_steps)])
        metric("acceptance_ratio", "gauge", "Accepted over drafted tokens, since start.", [("", t.acceptance)])
        metric("tokens_per_pass", "gauge", "Generated tokens per decoding pass, since start.",
               [("", t.tokens_per_pass)])
        metric("prefill_seconds_total", "counter", "Time spent in prefill.", [("", t.prefill_s)])
        metric("decode_seconds_total", "counter", "Time spent decoding.", [("", t.decode_s)])
        pc = st.prefix_cache
        metric("prefix_cache_hits_total", "counter", "Requests that reused a cached prefix.", [("", pc.hits)])
        metric("prefix_cache_misses_total", "counter", "Requests prefilled from scratch.", [("", pc.misses)])
        metric("prefix_cache_tokens_reused_total", "counter", "Prompt tokens not prefilled again.",
               [("", pc.tokens_reused)])
        metric("prefix_cache_bytes", "gauge", "Memory held by parked caches.", [("", pc.bytes)])
        metric("prefix_cache_entries", "gauge", "Parked caches.", [("", pc.entries)])
        metric("prefix_cache_evictions_total", "counter", "Parked caches dropped for the budget.",
               [("", pc.evictions)])
        metric("workspace_files", "gauge", "Files indexed as n-gram sources.", [("", st.workspace_files)])
        metric("workspace_bytes", "gauge", "Memory of the workspace index.", [("", st.workspace_bytes)])
        metric("uptime_seconds", "gauge", "Seconds since the daemon started.", [("", st.uptime_s)])
        metric("model_info", "gauge", "The served model.",
               [(f'{{model="{_label(st.model.id)}",device="{_label(st.model.device)}"}}', 1)])
        return "\n".join(lines) + "\n"


CTX = web.AppKey("warmspec", Context)
STREAMING = web.RequestKey("warmspec.streaming", bool)  # set once a request's SSE headers are sent
_NO_KEY_NEEDED = {"/health"}


def _authorized(request: web.Request, key: str) -> bool:
    given = request.headers.get("x-api-key")
    if given is None:
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        given = token.strip() if scheme.lower() == "bearer" else None
    return given is not None and hmac.compare_digest(given.encode(), key.encode())


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """API key check, and every failure turned into the caller's API error format."""
    ctx = request.app[CTX]
    try:
        if ctx.app.api_key and request.path not in _NO_KEY_NEEDED and not _authorized(request, ctx.app.api_key):
            raise ApiError(401, "invalid or missing API key (send 'Authorization: Bearer KEY' or 'x-api-key: KEY')")
        resp = await handler(request)
    except ApiError as e:
        resp = _error_response(request, e)
    except Busy as e:
        resp = _error_response(request, ApiError(503, str(e)))
    except (EngineError, TokenizerError) as e:
        resp = _error_response(request, ApiError(400, str(e)))
    except web.HTTPException as e:  # aiohttp's own: no such route, wrong method
        if e.status < 400:
            raise
        resp = _error_response(request, ApiError(e.status, f"{e.reason}: {request.method} {request.path}"))
    except Exception as e:
        log.exception("%s %s failed", request.method, request.path)
        if request.get(STREAMING):
            raise  # headers are gone; aiohttp drops the connection
        resp = _error_response(request, ApiError(500, f"internal error: {type(e).__name__}: {e}"))
    route = request.match_info.route.resource
    ctx.requests[(route.canonical if route is not None else "unmatched", resp.status)] += 1
    return resp


def _error_response(request: web.Request, e: ApiError) -> web.Response:
    body = _anthropic_error(e) if request.path.startswith("/v1/messages") else _openai_error(e)
    return _json(body, e.status)


def make_http_app(app: App, *, keepalive_s: float = KEEPALIVE_S) -> web.Application:
    """The aiohttp application; it starts ``app``'s worker (idempotent) when the server starts."""
    web_app = web.Application(middlewares=[_errors], client_max_size=app.limits.max_body_bytes)
    web_app[CTX] = Context(app, keepalive_s)

    async def start_worker(_: web.Application) -> None:
        app.start()

    web_app.on_startup.append(start_worker)
    r = web_app.router
    r.add_get("/health", health)
    r.add_get("/metrics", metrics)
    r.add_get("/v1/models", models)
    r.add_get("/v1/models/{model}", model)
    r.add_post("/v1/chat/completions", chat_completions)
    r.add_post("/v1/completions", completions)
    r.add_post("/v1/responses", responses)
    r.add_post("/v1/messages", messages)
    r.add_post("/v1/messages/count_tokens", count_tokens)
    return web_app


async def start_http(app: App, host: str, port: int, *, keepalive_s: float = KEEPALIVE_S) -> web.AppRunner:
    """Serve on ``host:port`` (0: any free port; ``runner.addresses[0][1]`` is the one bound).

    ``handler_cancellation`` makes aiohttp cancel a handler whose client disconnected, so its job
    is cancelled at once rather than at the next poll."""
    runner = web.AppRunner(make_http_app(app, keepalive_s=keepalive_s), handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    log.info("HTTP on %s", ", ".join(f"http://{a[0]}:{a[1]}" for a in runner.addresses))
    return runner
