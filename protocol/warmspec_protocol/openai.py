"""OpenAI wire types: chat completions, completions, the Responses API, models and errors.

Field names and shapes follow OpenAI's API reference as the official ``openai`` SDK parses them.
Requests ignore fields warmspec has no use for (SDKs and agents send many: ``user``,
``presence_penalty``, ``store``...), so a client written for OpenAI works unchanged; the transport
rejects the few that would silently change the answer if ignored (``n`` > 1, ``logprobs``).
``top_k`` and ``min_p`` are warmspec extensions, as in vLLM and llama.cpp.

Every response also carries a ``warmspec`` object (``SpeculationStats``) that SDKs ignore but keep
(``completion.model_extra["warmspec"]``): what speculation did for this one request.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import UNSET, Meta, Struct, UnsetType

from .types import GenerationStats, SourceCount

Seed = Annotated[int, Meta(ge=0)]  # numpy's generator rejects negative seeds
ChatFinish = Literal["stop", "length", "tool_calls"]


# -- warmspec extensions (shared with the Anthropic types) ------------------------------------------


class SpeculationStats(Struct, kw_only=True):
    """Per-request statistics: ``GenerationStats`` plus the ratios a person reads first."""

    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    prefill_s: float
    decode_s: float
    passes: int
    drafted: int
    accepted: int
    gated_steps: int
    paused_steps: int = 0  # steps run without proposing because drafting had cost time
    tokens_per_pass: float
    acceptance: float
    decode_tok_s: float
    # per guess source: "request", "workspace", "recent", "prediction" (a predicted output)
    sources: dict[str, SourceCount] = {}

    @classmethod
    def of(cls, s: GenerationStats) -> "SpeculationStats":
        return cls(prompt_tokens=s.prompt_tokens, cached_tokens=s.cached_tokens,
                   completion_tokens=s.completion_tokens, prefill_s=round(s.prefill_s, 4),
                   decode_s=round(s.decode_s, 4), passes=s.passes, drafted=s.drafted,
                   accepted=s.accepted, gated_steps=s.gated_steps, paused_steps=s.paused_steps,
                   tokens_per_pass=round(s.tokens_per_pass, 3), acceptance=round(s.acceptance, 3),
                   decode_tok_s=round(s.decode_tok_s, 2), sources=s.sources)


class Health(Struct, kw_only=True):
    """``GET /health``: cheap enough for a load balancer to poll."""

    status: Literal["ok"] = "ok"
    model: str
    uptime_s: float
    queue: int
    active: bool


# -- shared pieces ----------------------------------------------------------------------------------


class StreamOptions(Struct, kw_only=True):
    include_usage: bool = False


class ContentPart(Struct, kw_only=True):
    """A part of a message's content; only text parts are served (``type`` "text", or
    "input_text"/"output_text" in the Responses API)."""

    type: str
    text: str | None = None


class FunctionCall(Struct, kw_only=True):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(Struct, kw_only=True):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDef(Struct, kw_only=True, omit_defaults=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema, passed to the chat template as is
    strict: bool | None = None


class Tool(Struct, kw_only=True):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Struct, kw_only=True):
    name: str


class NamedToolChoice(Struct, kw_only=True):
    type: Literal["function"]
    function: NamedFunction


class PromptTokensDetails(Struct, kw_only=True):
    cached_tokens: int


class CompletionTokensDetails(Struct, kw_only=True):
    """OpenAI's breakdown of the completion tokens; the prediction counts are those of Predicted
    Outputs (a request's ``prediction``), zero without one.

    OpenAI defines ``accepted_prediction_tokens`` as the prediction's tokens that appeared in the
    completion and ``rejected_prediction_tokens`` as those that did not, while still costing
    (counted like generated tokens). warmspec counts what its verifier did with them:

    - accepted: tokens drafted from the prediction that the model's own decoding agreed with --
      they are in the answer, each at the place the prediction put it (at most the answer's
      length: a pass may agree past the end of the sequence, where the answer is cut);
    - rejected: tokens drafted from the prediction that the model disagreed with, computed in a
      verify pass and thrown away -- the work a wrong prediction cost.

    Tokens of the prediction never drafted count in neither: past the end of the answer, or where
    the drafter did not follow the prediction (after a divergence it re-aligns only where the
    answer's last tokens occur in it again, and the gate drafts nothing where drafting would not
    pay). So accepted + rejected is the prediction's share of the verify work, which may be less or
    -- when parts of the prediction are drafted more than once -- more than its length.
    """

    reasoning_tokens: int = 0
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0

    @classmethod
    def of(cls, s: GenerationStats) -> "CompletionTokensDetails":
        c = s.sources.get("prediction")
        if c is None:
            return cls()
        return cls(accepted_prediction_tokens=min(c.accepted, s.completion_tokens),
                   rejected_prediction_tokens=c.drafted - c.accepted)


class Usage(Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    completion_tokens_details: CompletionTokensDetails


class ErrorDetail(Struct, kw_only=True):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(Struct, kw_only=True):
    error: ErrorDetail


# -- models -----------------------------------------------------------------------------------------


class Model(Struct, kw_only=True):
    """One model, with OpenAI's fields and Anthropic's (``type``, ``display_name``,
    ``created_at``), so ``/v1/models`` serves both SDKs; both keep the fields they do not know
    (``model.model_extra``).

    The context length in tokens, under the names agents already read from other local servers:
    vLLM's ``max_model_len``, LM Studio's ``max_context_length``, and ``context_length`` (OpenRouter,
    Ollama's ``/api/show``); absent when the model does not say."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "warmspec"
    type: Literal["model"] = "model"
    display_name: str
    created_at: str  # RFC 3339
    max_model_len: int | UnsetType = UNSET
    max_context_length: int | UnsetType = UNSET
    context_length: int | UnsetType = UNSET


class ModelList(Struct, kw_only=True):
    object: Literal["list"] = "list"
    data: list[Model]
    has_more: bool = False
    first_id: str | None = None
    last_id: str | None = None


# -- chat completions -------------------------------------------------------------------------------


class ChatMessage(Struct, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class Prediction(Struct, kw_only=True):
    """Predicted Outputs: text the answer is expected to repeat (the file being rewritten). It
    becomes the first guess source, drafted from the answer's first token and ranked above every
    other; it never changes the answer, only how fast it comes."""

    type: Literal["content"]
    content: str | list[ContentPart]


class ChatCompletionRequest(Struct, kw_only=True):
    model: str = ""
    messages: list[ChatMessage]
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: Seed | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    logprobs: bool | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    prediction: Prediction | None = None


class AssistantMessage(Struct, kw_only=True):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None
    refusal: None = None


class Choice(Struct, kw_only=True):
    index: int = 0
    message: AssistantMessage
    finish_reason: ChatFinish
    logprobs: None = None


class ChatCompletion(Struct, kw_only=True):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    warmspec: SpeculationStats


class ChunkToolCall(Struct, kw_only=True):
    index: int
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChunkDelta(Struct, kw_only=True, omit_defaults=True):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ChunkToolCall] | None = None


class ChunkChoice(Struct, kw_only=True):
    index: int = 0
    delta: ChunkDelta
    finish_reason: ChatFinish | None = None
    logprobs: None = None


class ChatCompletionChunk(Struct, kw_only=True):
    """One ``data:`` line of a chat stream. The last chunk before ``[DONE]`` carries
    ``warmspec`` (and ``usage`` when ``stream_options.include_usage``, in a chunk with no choices
    as OpenAI sends it)."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    warmspec: SpeculationStats | None = None


# -- completions (legacy) ---------------------------------------------------------------------------


class CompletionRequest(Struct, kw_only=True):
    model: str = ""
    prompt: str | list[str]
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: Seed | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


class CompletionChoice(Struct, kw_only=True):
    text: str
    index: int = 0
    logprobs: None = None
    finish_reason: Literal["stop", "length"] | None = None


class Completion(Struct, kw_only=True):
    """A whole completion, and also one chunk of a completion stream (same object type)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    warmspec: SpeculationStats | None = None


# -- Responses API: request -------------------------------------------------------------------------


class InputItem(Struct, kw_only=True):
    """One item of ``input``: a message (``type`` "message", or absent as in the easy form
    ``{"role", "content"}``), a ``function_call`` the model made earlier, or a
    ``function_call_output`` with its result."""

    type: Literal["message", "function_call", "function_call_output"] = "message"
    role: Literal["system", "developer", "user", "assistant"] | None = None
    content: str | list[ContentPart] | None = None
    id: str | None = None
    status: str | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | None = None


class FunctionTool(Struct, kw_only=True):
    """A Responses API tool. Only ``function`` tools reach the model; the other kinds (hosted
    tools, ``custom`` freeform tools, Codex CLI's ``namespace`` groups) are accepted and not
    offered to it, as a model served here can only call functions."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(Struct, kw_only=True):
    type: Literal["function"]
    name: str


class ResponsesRequest(Struct, kw_only=True):
    """A Responses API request. OpenAI defines no predicted outputs here (``prediction`` is a
    chat completions parameter only, as of the openai SDK 3.57), so neither does warmspec."""

    model: str = ""
    input: str | list[InputItem]
    instructions: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: Seed | None = None
    max_output_tokens: int | None = None
    stop: str | list[str] | None = None  # extension: the Responses API has no stop strings
    stream: bool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None


# -- Responses API: response ------------------------------------------------------------------------


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputText(Struct, kw_only=True, tag="output_text", tag_field="type"):
    text: str
    annotations: list[str] = []  # always empty: warmspec adds no citations
    logprobs: list[str] = []


class OutputMessage(Struct, kw_only=True, tag="message", tag_field="type"):
    id: str
    status: ItemStatus
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class FunctionCallItem(Struct, kw_only=True, tag="function_call", tag_field="type"):
    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


OutputItem = OutputMessage | FunctionCallItem


class InputTokensDetails(Struct, kw_only=True):
    cached_tokens: int


class OutputTokensDetails(Struct, kw_only=True):
    reasoning_tokens: int = 0


class ResponseUsage(Struct, kw_only=True):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(Struct, kw_only=True):
    reason: Literal["max_output_tokens"]


class ResponseError(Struct, kw_only=True):
    code: str
    message: str


class Response(Struct, kw_only=True):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    model: str
    output: list[OutputItem]
    usage: ResponseUsage | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    parallel_tool_calls: bool = False
    tool_choice: str = "auto"
    tools: list[FunctionTool] = []
    metadata: dict[str, str] = {}
    warmspec: SpeculationStats | None = None


# -- Responses API: stream events (each an SSE ``event:`` named by its ``type``) -------------------


class ResponseLifecycle(Struct, kw_only=True, tag_field="type"):
    """The events that carry the whole response; each subclass is one ``type``."""

    response: Response
    sequence_number: int


class ResponseCreated(ResponseLifecycle, tag="response.created"):
    pass


class ResponseInProgress(ResponseLifecycle, tag="response.in_progress"):
    pass


class ResponseCompleted(ResponseLifecycle, tag="response.completed"):
    pass


class ResponseIncomplete(ResponseLifecycle, tag="response.incomplete"):
    pass


class ResponseFailed(ResponseLifecycle, tag="response.failed"):
    pass


class OutputItemAdded(Struct, kw_only=True, tag="response.output_item.added", tag_field="type"):
    output_index: int
    item: OutputItem
    sequence_number: int


class OutputItemDone(Struct, kw_only=True, tag="response.output_item.done", tag_field="type"):
    output_index: int
    item: OutputItem
    sequence_number: int


class ContentPartAdded(Struct, kw_only=True, tag="response.content_part.added", tag_field="type"):
    item_id: str
    output_index: int
    content_index: int
    part: OutputText
    sequence_number: int


class ContentPartDone(Struct, kw_only=True, tag="response.content_part.done", tag_field="type"):
    item_id: str
    output_index: int
    content_index: int
    part: OutputText
    sequence_number: int


class OutputTextDelta(Struct, kw_only=True, tag="response.output_text.delta", tag_field="type"):
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[str] = []
    sequence_number: int


class OutputTextDone(Struct, kw_only=True, tag="response.output_text.done", tag_field="type"):
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[str] = []
    sequence_number: int


class FunctionCallArgumentsDelta(Struct, kw_only=True, tag="response.function_call_arguments.delta",
                                 tag_field="type"):
    item_id: str
    output_index: int
    delta: str
    sequence_number: int


class FunctionCallArgumentsDone(Struct, kw_only=True, tag="response.function_call_arguments.done",
                                tag_field="type"):
    item_id: str
    output_index: int
    name: str
    arguments: str
    sequence_number: int


ResponseEvent = (
    ResponseCreated | ResponseInProgress | ResponseCompleted | ResponseIncomplete | ResponseFailed
    | OutputItemAdded | OutputItemDone | ContentPartAdded | ContentPartDone | OutputTextDelta
    | OutputTextDone | FunctionCallArgumentsDelta | FunctionCallArgumentsDone
)
