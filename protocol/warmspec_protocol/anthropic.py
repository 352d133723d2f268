"""Anthropic Messages API wire types: the request, the message, stream events and errors.

Shapes follow Anthropic's API reference as the official ``anthropic`` SDK parses them. Requests
ignore fields warmspec has no use for (``metadata``, ``service_tier``...). ``min_p`` and ``seed``
are warmspec extensions. Messages and the final ``message_delta`` event carry a ``warmspec``
object (``SpeculationStats``), which the SDK keeps as an extra field.
"""

from __future__ import annotations

from typing import Any, Literal

from msgspec import Struct

from .openai import Seed, SpeculationStats

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


# -- request ----------------------------------------------------------------------------------------


class ContentBlockParam(Struct, kw_only=True):
    """One block of a message or of ``system``: ``text``; ``tool_use`` (a call the assistant made,
    in history); ``tool_result`` (its result, in a user turn). Other types (images, documents) are
    refused by the transport with a clear message rather than by a schema error."""

    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[ContentBlockParam] | None = None
    is_error: bool | None = None


class MessageParam(Struct, kw_only=True):
    # "system": Claude Code (2.1) sends system turns inside ``messages`` as well as in ``system``
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlockParam]


class ToolParam(Struct, kw_only=True):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]  # a JSON Schema, passed to the chat template as is


class ToolChoice(Struct, kw_only=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class MessagesRequest(Struct, kw_only=True):
    model: str = ""
    messages: list[MessageParam]
    max_tokens: int
    system: str | list[ContentBlockParam] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: Seed | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoice | None = None


class CountTokensRequest(Struct, kw_only=True):
    model: str = ""
    messages: list[MessageParam]
    system: str | list[ContentBlockParam] | None = None
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoice | None = None


class CountTokensResponse(Struct, kw_only=True):
    input_tokens: int


# -- response ---------------------------------------------------------------------------------------


class TextBlock(Struct, kw_only=True, tag="text", tag_field="type"):
    text: str


class ToolUseBlock(Struct, kw_only=True, tag="tool_use", tag_field="type"):
    id: str
    name: str
    input: dict[str, Any]


ContentBlock = TextBlock | ToolUseBlock


class Usage(Struct, kw_only=True):
    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0


class Message(Struct, kw_only=True, tag="message", tag_field="type"):
    id: str
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentBlock]
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: Usage
    warmspec: SpeculationStats | None = None


class ErrorDetail(Struct, kw_only=True):
    type: str
    message: str


class ErrorResponse(Struct, kw_only=True, tag="error", tag_field="type"):
    error: ErrorDetail


# -- stream events (each an SSE ``event:`` named by its ``type``) -----------------------------------


class MessageStart(Struct, kw_only=True, tag="message_start", tag_field="type"):
    message: Message


class ContentBlockStart(Struct, kw_only=True, tag="content_block_start", tag_field="type"):
    index: int
    content_block: ContentBlock


class TextDelta(Struct, kw_only=True, tag="text_delta", tag_field="type"):
    text: str


class InputJsonDelta(Struct, kw_only=True, tag="input_json_delta", tag_field="type"):
    partial_json: str


class ContentBlockDelta(Struct, kw_only=True, tag="content_block_delta", tag_field="type"):
    index: int
    delta: TextDelta | InputJsonDelta


class ContentBlockStop(Struct, kw_only=True, tag="content_block_stop", tag_field="type"):
    index: int


class MessageDeltaBody(Struct, kw_only=True):
    stop_reason: StopReason
    stop_sequence: str | None = None


class DeltaUsage(Struct, kw_only=True):
    """Cumulative usage at the end of the stream; the input counts are known only after the
    prefill (how much of the prompt came from the cache), so they are repeated here."""

    output_tokens: int
    input_tokens: int | None = None
    cache_read_input_tokens: int | None = None


class MessageDelta(Struct, kw_only=True, tag="message_delta", tag_field="type"):
    delta: MessageDeltaBody
    usage: DeltaUsage
    warmspec: SpeculationStats | None = None


class MessageStop(Struct, kw_only=True, tag="message_stop", tag_field="type"):
    pass


class Ping(Struct, kw_only=True, tag="ping", tag_field="type"):
    pass


StreamEvent = (
    MessageStart | ContentBlockStart | ContentBlockDelta | ContentBlockStop | MessageDelta
    | MessageStop | Ping | ErrorResponse
)
