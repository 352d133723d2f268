"""JSON-RPC 2.0 wire types: warmspec's own methods, the envelopes, the error codes.

Every message of a ``warmspec/*`` method is one of these Structs, in and out; the daemon decodes
params straight into them, so a wrong field is refused with a message naming it
(``Expected `int`, got `str` - at `$.max_tokens```). LSP methods (``initialize``, document sync,
``textDocument/inlineCompletion``) use lsprotocol's types on the server; the few pieces of them a
plain client needs (``InitializeParams``' warmspec options, ``$/cancelRequest``) are here too.

Naming: ``warmspec/*`` params and results are snake_case like the rest of warmspec's types (and the
OpenAI API); the parts that live inside LSP messages (``initializationOptions``) are camelCase like
LSP. ``METHODS`` lists every method with its types; ``schema.json`` and ``PROTOCOL.md`` follow it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from msgspec import UNSET, Meta, Struct, UnsetType

from .types import FinishReason, GenerationStats, Message, ModelInfo, Status

RequestId = int | str

Seed = Annotated[int, Meta(ge=0)]  # numpy's generator rejects negative seeds


class ErrorCode(enum.IntEnum):
    """Error codes: JSON-RPC 2.0's, LSP's, then warmspec's own (outside both reserved ranges)."""

    PARSE_ERROR = -32700  # the frame or its JSON could not be read
    INVALID_REQUEST = -32600  # JSON, but not a JSON-RPC 2.0 message (or over the size limit)
    METHOD_NOT_FOUND = -32601
    INVALID_PARAMS = -32602  # the message names the field
    INTERNAL_ERROR = -32603  # a daemon fault; logged with a traceback
    SERVER_NOT_INITIALIZED = -32002  # a request before ``initialize``
    REQUEST_CANCELLED = -32800  # the client sent ``$/cancelRequest``
    CONTENT_MODIFIED = -32801  # a newer inline completion for the same document made this one moot
    UNAUTHORIZED = -31001  # no or wrong ``initializationOptions.apiKey``
    PATH_REFUSED = -31002  # outside the workspace roots, .gitignored, binary, too large
    BUSY = -31003  # queue full, or the daemon is shutting down


# -- envelopes -------------------------------------------------------------------------------------


class ErrorObject(Struct, kw_only=True, omit_defaults=True):
    code: int
    message: str
    data: Any = None


class Envelope(Struct, kw_only=True):
    """Any one JSON-RPC message as received: a request (id and method), a notification (method,
    no id), or a response (id and result or error). Absent and null ``id`` are told apart."""

    jsonrpc: Literal["2.0"]
    id: RequestId | None | UnsetType = UNSET
    method: str | UnsetType = UNSET
    params: Any = UNSET
    result: Any = UNSET
    error: ErrorObject | UnsetType = UNSET


class Request(Struct, kw_only=True):
    jsonrpc: Literal["2.0"] = "2.0"
    id: RequestId
    method: str
    params: Any = UNSET  # left out, not null, when there are none (JSON-RPC 2.0 §4.2)


class Notification(Struct, kw_only=True):
    jsonrpc: Literal["2.0"] = "2.0"
    method: str
    params: Any = UNSET


class ErrorResponse(Struct, kw_only=True):
    """An error reply; ``id`` is null when the request's id could not be read (JSON-RPC 2.0 §5)."""

    jsonrpc: Literal["2.0"] = "2.0"
    id: RequestId | None
    error: ErrorObject


# -- lifecycle (the warmspec parts of LSP's initialize) ------------------------------------------------


class InlineCompletionSettings(Struct, kw_only=True, forbid_unknown_fields=True, rename="camel"):
    """How much of the document around the cursor goes into a ghost-text prompt, and how long a
    suggestion may get. Characters, not tokens: counting tokens would mean tokenizing the whole
    buffer on every keystroke."""

    prefix_chars: Annotated[int, Meta(ge=0, le=1 << 20)] = 4096
    suffix_chars: Annotated[int, Meta(ge=0, le=1 << 20)] = 1024
    max_tokens: Annotated[int, Meta(ge=1, le=512)] = 48
    # Streamed ghost text: ``warmspec/inlineCompletionPartial`` while the suggestion decodes, and
    # the ``warmspec`` field (InlineCompletionInfo) in the final result. Off for a client that
    # does not ask: it gets LSP's result and nothing else.
    stream: bool = False
    # Every request's time budget, from the moment the daemon reads it: the answer is the text
    # decoded by then (a request's own ``warmspec.deadlineMs`` wins). None: no budget.
    deadline_ms: Annotated[int, Meta(ge=1, le=60_000)] | None = None
    # The client's debounce; the debounce the daemon advises (InlineCompletionInfo) scales it.
    debounce_ms: Annotated[int, Meta(ge=0, le=5_000)] = 150
    # Suggestion length and advised debounce follow the feedback (per language); off: fixed.
    adapt: bool = True
    # Start the suggestion at a typing keystroke (didChange), while the client debounces: a request
    # for the same place then attaches to the job under way. It costs a job per keystroke (each
    # cancelled by the next), so a client opts in.
    prefetch: bool = False


class InitializationOptions(Struct, kw_only=True, forbid_unknown_fields=True, rename="camel",
                            omit_defaults=True):
    """``initialize``'s ``initializationOptions``. ``apiKey`` is required on the socket and TCP
    when the daemon was started with ``--api-key``; stdio needs none (the editor spawned it)."""

    api_key: str | None = None
    inline_completion: InlineCompletionSettings | None = None


class ClientInfo(Struct, kw_only=True, omit_defaults=True):
    name: str
    version: str | None = None


class ClientCapabilities(Struct, frozen=True):
    """A plain client declares none; editors send LSP's full ``ClientCapabilities``."""


class WorkspaceFolder(Struct, kw_only=True):
    """LSP's: a project directory, as a ``file://`` URI."""

    uri: str
    name: str


class InitializeParams(Struct, kw_only=True, rename="camel"):
    """The part of LSP's ``InitializeParams`` a warmspec client sends. ``workspaceFolders`` (else
    ``rootUri``) become workspace roots of the daemon when the connection is local -- stdio or the
    Unix socket, never TCP; see PROTOCOL.md."""

    process_id: int | None = None
    client_info: ClientInfo | None = None
    root_uri: str | None = None
    workspace_folders: list[WorkspaceFolder] | None = None
    capabilities: ClientCapabilities = ClientCapabilities()
    initialization_options: InitializationOptions | None = None


class ServerInfo(Struct, kw_only=True):
    name: str
    version: str | None = None


class InitializeResult(Struct, kw_only=True, rename="camel"):
    """The part of LSP's ``InitializeResult`` a plain client reads (capabilities are LSP's)."""

    server_info: ServerInfo | None = None


class CancelParams(Struct, kw_only=True):
    """``$/cancelRequest``: stop the request with this id (within one decode step)."""

    id: RequestId


# -- generation ------------------------------------------------------------------------------------


class GenerateOptions(Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """What ``warmspec/chat`` and ``warmspec/complete`` share. Sampling fields left out (or null)
    take the model's defaults; without ``max_tokens`` the answer runs until the model stops or the
    context ends, and no answer may exceed the daemon's limit (32768 tokens)."""

    max_tokens: Annotated[int, Meta(ge=1)] | None = None
    stop: str | list[str] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=10.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Meta(ge=0)] | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    seed: Seed | None = None
    speculate: bool = True
    conversation: str | None = None  # ranks files read in this conversation first for drafting
    # the expected answer (OpenAI's predicted outputs): drafted first, from the answer's first token;
    # it never changes the answer. The result's stats.sources.prediction counts its tokens.
    prediction: str | None = None


class ChatParams(GenerateOptions, kw_only=True, forbid_unknown_fields=True):
    """``warmspec/chat``: messages rendered by the model's chat template."""

    messages: Annotated[list[Message], Meta(min_length=1)]


class CompleteParams(GenerateOptions, kw_only=True, forbid_unknown_fields=True):
    """``warmspec/complete``: a raw prompt, continued as is."""

    prompt: Annotated[str, Meta(min_length=1)]


class DeltaParams(Struct, kw_only=True):
    """``warmspec/delta`` (server to client): text that became final, for the request ``id``."""

    id: RequestId
    text: str
    tokens: int  # how many tokens this step produced (several when drafts were accepted)


class ProgressParams(Struct, kw_only=True):
    """``warmspec/progress`` (server to client): what the daemon is doing for request ``id`` before
    its first delta -- reloading the model after an idle unload. ``fraction`` 1.0 marks the end;
    null when unknown."""

    id: RequestId
    message: str
    fraction: float | None = None


class GenerateResult(Struct, kw_only=True):
    """The whole answer and what it cost. ``tok_s`` is decode speed; ``ttft_s`` is the daemon's
    time from reading the request to the first delta (queueing and prefill included)."""

    text: str
    finish_reason: FinishReason
    stats: GenerationStats
    tok_s: float
    ttft_s: float


# -- ghost text: streaming, budget, feedback, alternatives, next edits ----------------------------


class Position(Struct, kw_only=True):
    """LSP's: a zero-based line and a character offset in the connection's position encoding
    (UTF-16 code units unless the client negotiated another)."""

    line: Annotated[int, Meta(ge=0)]
    character: Annotated[int, Meta(ge=0)]


class Range(Struct, kw_only=True):
    start: Position
    end: Position


class InlineCompletionExtras(Struct, kw_only=True, forbid_unknown_fields=True, rename="camel"):
    """The ``warmspec`` field a client may add to ``textDocument/inlineCompletion``'s params
    (camelCase: it lives inside an LSP message): this request's time budget, in milliseconds
    from the moment the daemon reads it."""

    deadline_ms: Annotated[int, Meta(ge=1, le=60_000)] | None = None


class InlineCompletionPartialParams(Struct, kw_only=True):
    """``warmspec/inlineCompletionPartial`` (server to client, to clients that set
    ``inlineCompletion.stream``): the suggestion so far for the inline completion request ``id``,
    at ``position`` of ``uri``. ``text`` is the whole suggestion so far, not a delta: each partial
    replaces the one before; the request's result is the final one."""

    id: RequestId
    uri: str
    position: Position
    text: str


FinishKind = Literal["stop", "length", "deadline", "cache", "empty"]


class InlineCompletionInfo(Struct, kw_only=True, rename="camel"):
    """The ``warmspec`` field of the result of ``textDocument/inlineCompletion`` (clients that set
    ``inlineCompletion.stream`` only): how the suggestion was made, and the debounce the daemon
    advises from the acceptance of this language's suggestions. ``firstVisibleMs``: from reading
    the request to the first partial with a non-blank character (null: none came); ``finalMs``:
    to this answer. ``finish``: ``stop``, ``length`` (``maxTokens``, adapted), ``deadline`` (cut at
    the budget), ``cache`` (no model run), ``empty`` (nothing to continue)."""

    first_visible_ms: float | None
    final_ms: float
    tokens: int
    finish: FinishKind
    max_tokens: int  # the suggestion length this request was given (adapted to the feedback)
    debounce_ms: int  # advised


class InlineItem(Struct, kw_only=True, rename="camel"):
    """LSP's InlineCompletionItem, as warmspec sends it: plain text, at an empty range."""

    insert_text: str
    range: Range


class InlineCompletionResult(Struct, kw_only=True):
    """LSP's InlineCompletionList with warmspec's ``warmspec`` field (streaming clients only; a
    client that ignores it has LSP's result)."""

    items: list[InlineItem]
    warmspec: InlineCompletionInfo


FeedbackEvent = Literal["shown", "accepted", "partial", "dismissed"]


class InlineCompletionFeedbackParams(Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """``warmspec/inlineCompletionFeedback`` (notification): what became of a suggestion. ``id`` is
    the request that produced it (``textDocument/inlineCompletion`` or ``warmspec/alternatives``,
    whose items are told apart by ``index``). ``accepted_chars``: for ``partial``, characters of
    the suggestion accepted so far (all of them for ``accepted``). Send ``shown`` when it is
    drawn, then ``accepted``, ``partial`` (as often as the user accepts more) or ``dismissed``."""

    id: RequestId
    event: FeedbackEvent
    accepted_chars: Annotated[int, Meta(ge=0)] | None = None
    index: Annotated[int, Meta(ge=0)] = 0


class AlternativesParams(Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """``warmspec/alternatives``: up to ``count`` different suggestions at ``position`` of an open
    document: the greedy one first, then seeded samples at ``temperature``, duplicates dropped."""

    uri: str
    position: Position
    count: Annotated[int, Meta(ge=1, le=8)] = 3
    temperature: Annotated[float, Meta(gt=0.0, le=2.0)] = 0.8
    seed: Annotated[int, Meta(ge=0, le=2**31)] = 0


class Alternative(Struct, kw_only=True):
    text: str
    seed: int | None  # None: the greedy suggestion


class AlternativesResult(Struct, kw_only=True):
    items: list[Alternative]
    range: Range  # where every item goes (empty, at the cursor)


class NextEditParams(Struct, kw_only=True, forbid_unknown_fields=True):
    """``warmspec/nextEdit``: the edit most likely to come next in an open document, from its recent
    changes and the cursor."""

    uri: str
    position: Position


class NextEdit(Struct, kw_only=True):
    """Replace ``range`` with ``text``. ``kind``: ``rename`` (an identifier the last edit renamed,
    at its nearest remaining occurrence) or ``repeat`` (the last edit's replacement, at the next
    place that still has the text it replaced). ``old`` / ``new``: the pattern; ``remaining``:
    occurrences left, this one included."""

    range: Range
    text: str
    kind: Literal["rename", "repeat"]
    old: str
    new: str
    remaining: int


class NextEditResult(Struct, kw_only=True):
    edit: NextEdit | None


# -- introspection ---------------------------------------------------------------------------------


class NoParams(Struct, forbid_unknown_fields=True):
    """Methods that take nothing accept an absent, null or empty ``params``."""


class ModelsResult(Struct, kw_only=True):
    """The loaded model, and the ``--model`` the daemon was started with (null: the embedded
    default; a local path is given absolute), so ``warmspec ask --model`` can tell a mismatch."""

    models: list[ModelInfo]
    requested: str | None


# -- workspace -------------------------------------------------------------------------------------


class DidReadParams(Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """``warmspec/didRead``: an agent read this file; index it for drafting. ``path`` is absolute,
    relative to the single workspace root, or a ``file://`` URI; ``text`` is what the agent saw
    (read from disk when left out)."""

    path: Annotated[str, Meta(min_length=1)]
    text: str | None = None
    conversation: str | None = None


class DidReadResult(Struct, kw_only=True):
    path: str  # the resolved real path
    workspace_files: int  # files now indexed


# -- the method table ------------------------------------------------------------------------------


@dataclass(frozen=True)
class MethodSpec:
    """One method: its types, and whether it is sent with an id (request), without (notification)
    or either. ``params`` None means LSP's type (lsprotocol) or no params."""

    name: str
    params: type | None
    result: type | None
    doc: str
    request: bool = True
    notification: bool = False
    to_client: bool = False


METHODS: dict[str, MethodSpec] = {
    m.name: m
    for m in (
        MethodSpec("warmspec/chat", ChatParams, GenerateResult,
                   "Chat completion, streamed as warmspec/delta notifications."),
        MethodSpec("warmspec/complete", CompleteParams, GenerateResult,
                   "Raw-prompt completion, streamed as warmspec/delta notifications."),
        MethodSpec("warmspec/delta", DeltaParams, None, "Streamed text of a running request.",
                   request=False, notification=True, to_client=True),
        MethodSpec("warmspec/progress", ProgressParams, None,
                   "What the daemon does for a request before its first delta (a model reload).",
                   request=False, notification=True, to_client=True),
        MethodSpec("warmspec/inlineCompletionPartial", InlineCompletionPartialParams, None,
                   "The suggestion so far of a running textDocument/inlineCompletion (clients that "
                   "set initializationOptions.inlineCompletion.stream).",
                   request=False, notification=True, to_client=True),
        MethodSpec("warmspec/inlineCompletionFeedback", InlineCompletionFeedbackParams, None,
                   "What became of a suggestion: shown, accepted, partially accepted, dismissed.",
                   request=False, notification=True),
        MethodSpec("warmspec/alternatives", AlternativesParams, AlternativesResult,
                   "Several different suggestions at a position: greedy, then seeded samples."),
        MethodSpec("warmspec/nextEdit", NextEditParams, NextEditResult,
                   "The next edit of a document, from its recent changes and the cursor."),
        MethodSpec("warmspec/status", NoParams, Status, "Model, queue, memory and cumulative statistics."),
        MethodSpec("warmspec/models", NoParams, ModelsResult, "The loaded model."),
        MethodSpec("warmspec/didRead", DidReadParams, DidReadResult,
                   "An agent read a file: index it for drafting (as a notification, refusals are "
                   "only logged).", notification=True),
    )
}

# The LSP methods the daemon serves (types: lsprotocol / the LSP 3.18 specification).
LSP_REQUESTS: frozenset[str] = frozenset({"initialize", "shutdown", "textDocument/inlineCompletion"})
LSP_NOTIFICATIONS: frozenset[str] = frozenset({
    "initialized", "exit", "$/cancelRequest",
    "textDocument/didOpen", "textDocument/didChange", "textDocument/didClose",
})

SCHEMA_TYPES: tuple[type, ...] = (
    Envelope, Request, Notification, ErrorResponse, ErrorObject, InitializeParams, InitializeResult,
    InitializationOptions, CancelParams, ChatParams, CompleteParams, DeltaParams, ProgressParams,
    GenerateResult, NoParams, ModelsResult, Status, DidReadParams, DidReadResult, InlineCompletionExtras,
    InlineCompletionPartialParams, InlineCompletionResult, InlineCompletionFeedbackParams,
    AlternativesParams, AlternativesResult, NextEditParams, NextEditResult,
)
