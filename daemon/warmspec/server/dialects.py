"""Dialects: how each HTTP API formats one generation -- the events it streams, the body it
returns, its error JSON. Formatting only: waiting, streaming, keep-alives and cancellation live
in ``http.py``, once for every API."""

from __future__ import annotations

import secrets
import time
from typing import Any, Literal

import msgspec

from warmspec_protocol import GenerationStats
from warmspec_protocol import anthropic as ant
from warmspec_protocol import openai as oai
from warmspec_protocol.openai import SpeculationStats

from .tools import ParsedCall

_encode = msgspec.json.encode


class ApiError(Exception):
    """A request that ends in an error reply; ``str()`` is the message the client reads."""

    def __init__(self, status: int, message: str, *, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.param = param


class Outcome(msgspec.Struct, kw_only=True):
    """A finished generation as every dialect reports it."""

    text: str
    tool_calls: list[ParsedCall]
    finish: Literal["stop", "length", "tool_calls"]
    stop_sequence: str | None  # the stop string that ended it (None: end of sequence or length)
    stats: GenerationStats


def _rid() -> str:
    return secrets.token_hex(12)


def _data(obj: msgspec.Struct) -> bytes:
    return b"data: " + _encode(obj) + b"\n\n"


def _event(obj: msgspec.Struct) -> bytes:
    """An SSE event named by the object's ``type`` tag, as the Responses and Anthropic APIs send."""
    return b"event: " + obj.__struct_config__.tag.encode() + b"\ndata: " + _encode(obj) + b"\n\n"


def openai_error(e: ApiError) -> oai.ErrorResponse:
    kind = {401: "authentication_error", 404: "not_found_error"}.get(
        e.status, "invalid_request_error" if e.status < 500 else "server_error")
    code = {413: "request_too_large", 401: "invalid_api_key"}.get(e.status)
    return oai.ErrorResponse(error=oai.ErrorDetail(message=str(e), type=kind, param=e.param, code=code))


def anthropic_error(e: ApiError) -> ant.ErrorResponse:
    kind = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
            413: "request_too_large", 503: "overloaded_error"}.get(e.status, "invalid_request_error" if e.status < 500 else "api_error")
    return ant.ErrorResponse(error=ant.ErrorDetail(type=kind, message=str(e)))


def _function(call: ParsedCall) -> oai.FunctionCall:
    return oai.FunctionCall(name=call.name, arguments=call.arguments)


def _usage(s: GenerationStats) -> oai.Usage:
    return oai.Usage(prompt_tokens=s.prompt_tokens, completion_tokens=s.completion_tokens,
                     total_tokens=s.prompt_tokens + s.completion_tokens,
                     prompt_tokens_details=oai.PromptTokensDetails(cached_tokens=s.cached_tokens),
                     completion_tokens_details=oai.CompletionTokensDetails.of(s))


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
        return [_data(openai_error(err))]

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
        return [_event(anthropic_error(err))]

    def body(self, out: Outcome) -> ant.Message:
        content: list[ant.ContentBlock] = [ant.TextBlock(text=out.text)] if out.text or not out.tool_calls else []
        content += [ant.ToolUseBlock(id=c.id, name=c.name, input=msgspec.json.decode(c.arguments))
                    for c in out.tool_calls]
        s = out.stats
        usage = ant.Usage(input_tokens=s.prompt_tokens - s.cached_tokens, output_tokens=s.completion_tokens,
                          cache_read_input_tokens=s.cached_tokens)
        return ant.Message(id=self.id, model=self.model, content=content, stop_reason=self._stop_reason(out),
                           stop_sequence=out.stop_sequence, usage=usage, warmspec=SpeculationStats.of(s))
