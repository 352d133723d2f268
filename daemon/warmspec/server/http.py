"""HTTP transport: OpenAI- and Anthropic-compatible endpoints in front of the one scheduler.

Routes: ``GET /v1/models``, ``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/responses``
(OpenAI), ``POST /v1/messages`` and ``/v1/messages/count_tokens`` (Anthropic), ``GET /health`` and
``GET /metrics`` (Prometheus text), and the live status page ``GET /`` (``/status``, data in
``/status.json``; status_page.py).

Every generation endpoint turns its request into one ``Job`` and hands it to ``_serve``, the single
mechanism that waits on the ticket, streams or collects, sends keep-alives, parses tool calls and
cancels the job when the client goes away. What differs per API is only the formatting, in a
``Dialect`` (``dialects.py``): the events it streams and the body it returns; tool calls are
parsed by ``tools.py``. Sampling options and token limits are per job, so changing them between
requests never reloads anything.

Errors come back in the caller's API format (OpenAI's ``{"error": {...}}``, or Anthropic's
``{"type": "error", ...}`` under ``/v1/messages``): 400 for malformed or invalid requests, 401 without
the API key, 403 for requests from web pages (below), 404, 413 for bodies over the limit, 415 for a
body that is not ``application/json``, 503 when the queue is full, 500 (logged with its traceback)
for daemon faults.

Web pages. A page in the user's browser can reach a loopback port: it can POST ``text/plain`` with
no CORS preflight (and so start generations, or name files for the daemon to index), and through
DNS rebinding -- its own name made to resolve to 127.0.0.1 -- read the answers. So every request's
``Host`` must be a loopback name (``localhost``, a loopback address; any port) or the address the
server is bound to (any Host when bound to a wildcard address, which needs ``--api-key``); a
request carrying a browser ``Origin`` must come from the daemon's own origin (``http://`` + its
Host) or one given with ``--allow-origin``; and API posts must be ``application/json``, which a
page can only send after a CORS preflight that the daemon never grants.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import re
import time
from collections import Counter
from datetime import datetime, timezone
from typing import Any, AsyncIterator, Sequence

import msgspec
from aiohttp import web

from warmspec_protocol import FunctionCall, GenerationStats, Message, ToolCall
from warmspec_protocol import anthropic as ant
from warmspec_protocol import openai as oai
from warmspec_protocol.openai import SpeculationStats

from ..core import Delta, EngineError, Finished
from ..tokenizer import TokenizerError
from .app import App, to_wire
from .dialects import (ApiError, ChatDialect, CompletionDialect, Dialect, MessagesDialect, Outcome,
                       ResponsesDialect, anthropic_error, openai_error)
from . import status_page
from .keepalive import Progress
from .scheduler import Busy, Job, JobError, Ticket
from .tools import ToolCallSplitter, tool_format

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


class ClientGone(Exception):
    """The client closed its connection while its job was queued or running."""


# -- generation: one mechanism for every endpoint ---------------------------------------------------


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
                          stop_sequence=ev.stop, stats=to_wire(ev.stats, GenerationStats))
            return
        elif isinstance(ev, Progress):  # a reload after idle unload: HTTP clients just wait
            continue
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


# -- requests -> chat template messages -------------------------------------------------------------


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


async def _prompt(ctx: Context, messages: list[Message], tools: list[oai.Tool] | None,
                  *, note_reads: bool = True) -> ChatPrompt:
    """Token ids of the chat, built in a worker thread: encoding 1 MB of text takes 0.7 s here. (The
    loop runs meanwhile only if the tokenizer releases the GIL: ``encode_batch`` does, ``encode``
    does not -- measured 68 vs 1 ticks of a 10 ms timer during one 0.75 s encode.) Files the chat's
    tool calls read are indexed for drafting on the way."""
    tokens, conversation = await asyncio.to_thread(
        ctx.app.chat_request, messages, note_reads=note_reads,
        tools=[msgspec.to_builtins(t) for t in tools] if tools else None)
    return ChatPrompt(tokens, conversation)


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


def _chat_messages(messages: list[oai.ChatMessage]) -> list[Message]:
    out = []
    for i, m in enumerate(messages):
        calls = [ToolCall(id=c.id, function=FunctionCall(name=c.function.name,
                                                                     arguments=_arguments(c.function.arguments)))
                 for c in m.tool_calls] if m.tool_calls else None
        out.append(Message(role="system" if m.role == "developer" else m.role,
                                   content=_text(m.content, ("text",), f"messages[{i}].content"),
                                   tool_calls=calls, tool_call_id=m.tool_call_id, name=m.name))
    return out


def _responses_messages(req: oai.ResponsesRequest) -> list[Message]:
    out = [Message(role="system", content=req.instructions)] if req.instructions else []
    if isinstance(req.input, str):
        return out + [Message(role="user", content=req.input)]
    for i, item in enumerate(req.input):
        where = f"input[{i}]"
        if item.type == "message":
            if item.role is None:
                raise ApiError(400, "a message item needs a role", param=f"{where}.role")
            role = "system" if item.role == "developer" else item.role
            out.append(Message(role=role, content=_text(item.content, ("input_text", "output_text", "text"),
                                                                f"{where}.content")))
        elif item.type == "function_call":
            if item.call_id is None or item.name is None or item.arguments is None:
                raise ApiError(400, "a function_call item needs call_id, name and arguments", param=where)
            call = ToolCall(id=item.call_id, function=FunctionCall(name=item.name,
                                                                             arguments=_arguments(item.arguments)))
            if out and out[-1].role == "assistant" and out[-1].tool_calls is not None:
                out[-1].tool_calls.append(call)  # parallel calls: one assistant turn
            else:
                out.append(Message(role="assistant", content="", tool_calls=[call]))
        else:
            if item.call_id is None or item.output is None:
                raise ApiError(400, "a function_call_output item needs call_id and output", param=where)
            out.append(Message(role="tool", content=item.output, tool_call_id=item.call_id))
    return out


def _anthropic_messages(system: str | list[ant.ContentBlockParam] | None,
                        messages: list[ant.MessageParam]) -> list[Message]:
    out = []
    if system:
        out.append(Message(role="system", content=_text(system, ("text",), "system")))
    for i, m in enumerate(messages):
        where = f"messages[{i}].content"
        if isinstance(m.content, str):
            out.append(Message(role=m.role, content=m.content))
            continue
        texts, calls = [], []
        for j, block in enumerate(m.content):
            if block.type == "text":
                texts.append(block.text or "")
            elif block.type == "tool_use" and m.role == "assistant":
                if block.name is None:
                    raise ApiError(400, "a tool_use block needs a name", param=f"{where}[{j}].name")
                calls.append(ToolCall(id=block.id, function=FunctionCall(name=block.name,
                                                                                   arguments=block.input or {})))
            elif block.type == "tool_result" and m.role == "user":
                result = _text(block.content, ("text",), f"{where}[{j}].content")
                out.append(Message(role="tool", content=result, tool_call_id=block.tool_use_id))
            else:
                raise ApiError(400, f"content block of type {block.type!r} is not supported in {m.role} "
                                    "messages (warmspec serves text-only models)", param=f"{where}[{j}].type")
        if texts or calls:
            out.append(Message(role=m.role, content="\n".join(texts), tool_calls=calls or None))
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
    if request.headers.get("Content-Type") is None or request.content_type != "application/json":
        raise ApiError(415, f"the request body must be JSON sent as 'Content-Type: application/json' "
                            f"(got {request.headers.get('Content-Type', 'none')!r})")
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
         stop: str | list[str] | None, label: str, prediction: Sequence[int] = ()) -> Job:
    params = ctx.app.sampling(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                              min_p=req.min_p, seed=req.seed)
    if isinstance(prompt, ChatPrompt):
        return ctx.app.job(prompt.tokens, params, max_tokens=max_tokens, stop=stop, label=label,
                           conversation=prompt.conversation, prediction=prediction)
    return ctx.app.job(prompt, params, max_tokens=max_tokens, stop=stop, label=label)


def _single_choice(n: int | None) -> None:
    if n not in (None, 1):
        raise ApiError(400, "n must be 1: warmspec generates one choice per request", param="n")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    ctx = request.app[CTX]
    req = await _decode(request, oai.ChatCompletionRequest)
    ctx.app.admit()  # a full queue is refused before the prompt is tokenized
    _single_choice(req.n)
    if req.logprobs:
        raise ApiError(400, "logprobs are not supported", param="logprobs")
    tools = _tools(ctx, req.tools, _openai_choice(req.tool_choice))
    predicted = _text(req.prediction.content, ("text",), "prediction.content") if req.prediction else None
    prompt = await _prompt(ctx, _chat_messages(req.messages), tools)
    prediction = await asyncio.to_thread(ctx.app.prediction_tokens, predicted)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    job = _job(ctx, prompt, req, max_tokens=max_tokens, stop=req.stop, label="http chat", prediction=prediction)
    dialect = ChatDialect(ctx.app.lm.name, bool(req.stream_options and req.stream_options.include_usage))
    return await _serve(request, job, dialect, stream=req.stream, tools=tools is not None)


async def completions(request: web.Request) -> web.StreamResponse:
    ctx = request.app[CTX]
    req = await _decode(request, oai.CompletionRequest)
    ctx.app.admit()  # a full queue is refused before the prompt is tokenized
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
    ctx.app.admit()  # a full queue is refused before the prompt is tokenized
    if req.previous_response_id is not None:
        raise ApiError(400, "previous_response_id is not supported: warmspec stores no responses; send "
                            "the whole conversation in input", param="previous_response_id")
    as_openai = []
    for i, t in enumerate(req.tools or []):
        if t.type != "function":
            continue  # not a function the model can call (FunctionTool says which kinds)
        if not t.name:
            raise ApiError(400, "a function tool needs a name", param=f"tools[{i}].name")
        as_openai.append(oai.Tool(type="function", function=oai.FunctionDef(
            name=t.name, description=t.description, parameters=t.parameters)))
    tools = _tools(ctx, as_openai or None, _openai_choice(req.tool_choice))
    prompt = await _prompt(ctx, _responses_messages(req), tools)
    job = _job(ctx, prompt, req, max_tokens=req.max_output_tokens, stop=req.stop, label="http responses")
    return await _serve(request, job, ResponsesDialect(ctx.app.lm.name, req), stream=req.stream,
                        tools=tools is not None)


async def messages(request: web.Request) -> web.StreamResponse:
    ctx = request.app[CTX]
    req = await _decode(request, ant.MessagesRequest)
    ctx.app.admit()  # a full queue is refused before the prompt is tokenized
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
    n = ctx.app.lm.context_length or msgspec.UNSET
    return oai.Model(id=name, created=int(ctx.app.started), display_name=name, created_at=started,
                     max_model_len=n, max_context_length=n, context_length=n)


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
    """The HTTP server's state beside the ``App``: tool support of the template, request counters,
    and what a request's Host and Origin may be."""

    def __init__(self, app: App, keepalive_s: float, *, host: str = "127.0.0.1",
                 allow_origins: Sequence[str] = ()):
        self.app = app
        self.keepalive_s = keepalive_s
        self.bound = _host_name(host)
        self.allow_origins = {_origin(o) for o in allow_origins}
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
        metric("engine_resets_total", "counter", "Live caches dropped after an internal error.",
               [("", st.engine_resets)])
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
        metric("paused_steps_total", "counter", "Steps run without proposing: drafting had cost time.",
               [("", t.paused_steps)])
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
        metric("prefix_cache_disk_bytes", "gauge", "Prefix states saved on disk.", [("", pc.disk_bytes)])
        metric("prefix_cache_disk_hits_total", "counter", "Requests served a prefix from disk.",
               [("", pc.disk_hits)])
        metric("prefix_cache_disk_dropped_total", "counter", "Bad prefix files dropped.", [("", pc.disk_dropped)])
        metric("resident_memory_bytes", "gauge", "Resident set of the daemon.", [("", st.memory.rss_bytes)])
        metric("peak_resident_memory_bytes", "gauge", "Peak resident set.", [("", st.memory.peak_rss_bytes)])
        metric("model_loaded", "gauge", "1 while the weights are loaded (0: unloaded while idle).",
               [("", int(st.model_state == "loaded"))])
        il = st.inline
        metric("inline_requests_total", "counter", "Ghost-text requests, by how they ended.",
               [(f'{{outcome="{k}"}}', v) for k, v in (("cache", il.cache_hits), ("cancelled", il.cancelled),
                                                       ("deadline", il.deadline), ("all", il.requests))])
        metric("inline_prefetch_total", "counter", "Ghost text started at a keystroke, and requests it served.",
               [('{kind="started"}', il.prefetched), ('{kind="attached"}', il.prefetch_attached)])
        metric("inline_first_visible_seconds", "summary", "Ghost text: request to its first visible character.",
               [(f'{{quantile="{q}"}}', ms / 1000) for q, ms in (("0.5", il.first_visible.p50_ms),
                                                                 ("0.9", il.first_visible.p90_ms))])
        metric("inline_final_seconds", "summary", "Ghost text: request to its answer.",
               [(f'{{quantile="{q}"}}', ms / 1000) for q, ms in (("0.5", il.final.p50_ms), ("0.9", il.final.p90_ms))])
        metric("inline_tokens_total", "counter", "Ghost-text tokens decoded, and those thrown away.",
               [('{kind="generated"}', il.tokens_generated), ('{kind="thrown_away"}', il.tokens_thrown_away)])
        metric("inline_suggestions_total", "counter", "Editors' feedback on suggestions, by language.",
               [(f'{{language="{_label(lang)}",event="{e}"}}', getattr(a, e)) for lang, a in sorted(il.languages.items())
                for e in ("shown", "accepted", "partial", "dismissed")])
        metric("inline_accepted_chars_total", "counter", "Characters of suggestions accepted, by language.",
               [(f'{{language="{_label(lang)}"}}', a.chars_accepted) for lang, a in sorted(il.languages.items())])
        metric("workspace_files", "gauge", "Files indexed as n-gram sources.", [("", st.workspace_files)])
        metric("workspace_bytes", "gauge", "Memory of the workspace index.", [("", st.workspace_bytes)])
        metric("uptime_seconds", "gauge", "Seconds since the daemon started.", [("", st.uptime_s)])
        metric("model_info", "gauge", "The served model.",
               [(f'{{model="{_label(st.model.id)}",device="{_label(st.model.device)}"}}', 1)])
        return "\n".join(lines) + "\n"


CTX = web.AppKey("warmspec", Context)
STREAMING = web.RequestKey("warmspec.streaming", bool)  # set once a request's SSE headers are sent
_NO_KEY_NEEDED = {"/health", *status_page.PUBLIC_PATHS}  # the page is static; its data needs the key


def _host_name(host: str) -> str:
    """The name in a Host header (or a bind address), lower case, without its port; IPv6
    addresses without their brackets. Anything malformed comes back whole (and matches nothing)."""
    host = host.strip().lower()
    if host.startswith("["):  # [v6] or [v6]:port
        end = host.find("]")
        rest = host[end + 1:] if end > 0 else "?"
        return host[1:end] if rest == "" or (rest[:1] == ":" and rest[1:].isdigit()) else host
    if host.count(":") == 1:
        name, _, port = host.partition(":")
        return name if port.isdigit() else host
    return host  # a name, an IPv4 address, or a bare IPv6 address (a bind address)


def _origin(origin: str) -> str:
    return origin.strip().lower().rstrip("/")


def host_allowed(host: str, bound: str) -> bool:
    """Whether a request's Host header names this server and not a web page's domain: a loopback
    name, or the address the server is bound to (a wildcard bind allows any name: it needs an api
    key, which a web page does not have)."""
    name = _host_name(host)
    if name == "localhost" or name == bound or bound in ("0.0.0.0", "::", ""):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _refuse_web_pages(request: web.Request, ctx: Context) -> None:
    """Refuse what only a web page sends: a foreign Host (DNS rebinding) or a foreign Origin."""
    host = request.headers.get("Host")
    if host is not None and not host_allowed(host, ctx.bound):
        raise ApiError(403, f"Host {host!r} is not this server's: use localhost or 127.0.0.1 "
                            "(a request naming another host is what DNS rebinding from a web page looks like)")
    origin = request.headers.get("Origin")
    if origin is not None:
        origin = _origin(origin)
        if origin != f"http://{(host or '').strip().lower()}" and origin not in ctx.allow_origins:
            raise ApiError(403, f"requests from the web origin {origin!r} are refused (start the daemon "
                                "with --allow-origin ORIGIN to serve a page there)")


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
        _refuse_web_pages(request, ctx)
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
    body = anthropic_error(e) if request.path.startswith("/v1/messages") else openai_error(e)
    return _json(body, e.status)


def make_http_app(app: App, *, keepalive_s: float = KEEPALIVE_S, host: str = "127.0.0.1",
                  allow_origins: Sequence[str] = ()) -> web.Application:
    """The aiohttp application; it starts ``app``'s worker (idempotent) when the server starts.
    ``host``: the bound address; ``allow_origins``: web origins whose pages may use the API."""
    web_app = web.Application(middlewares=[_errors], client_max_size=app.limits.max_body_bytes)
    web_app[CTX] = Context(app, keepalive_s, host=host, allow_origins=allow_origins)

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
    status_page.add_routes(r, lambda request: request.app[CTX].app)
    return web_app


async def start_http(app: App, host: str, port: int, *, keepalive_s: float = KEEPALIVE_S,
                     allow_origins: Sequence[str] = ()) -> web.AppRunner:
    """Serve on ``host:port`` (0: any free port; ``runner.addresses[0][1]`` is the one bound).

    ``handler_cancellation`` makes aiohttp cancel a handler whose client disconnected, so its job
    is cancelled at once rather than at the next poll."""
    runner = web.AppRunner(make_http_app(app, keepalive_s=keepalive_s, host=host, allow_origins=allow_origins),
                           handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    log.info("HTTP on %s", ", ".join(f"http://{a[0]}:{a[1]}" for a in runner.addresses))
    return runner
