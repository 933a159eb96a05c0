"""The records of the REST API, both ways, defined once (as Ollama's api/types.go): the routes validate requests into
them and build their answers from them, FastAPI derives the OpenAPI schema from them, and the CLI builds its requests
with them and reads the server's chunks with them (the live view, the `--verbose` timing block).

Pure data, so the client can import it without the server: this module imports pydantic and nothing of dgemma.
Key names and order are the API (Ollama's and OpenAI's, plus dgemma's additive diffusion keys): `wire()` is the JSON
object as sent. A field declared with `OMITTED` is left out while it is None; every other field is always sent (so
OpenAI's `finish_reason: null` and a `families: null` stay). Answers allow extra fields: diffusion extras only add keys.
See docs/server.md, "Wire types".
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model

JsonValue = Any


def _absent(value: Any) -> bool:
    return value is None


def omitted(description: str | None = None) -> Any:
    """A field that is sent only when it has a value."""
    return Field(default=None, exclude_if=_absent, description=description)


class WireModel(BaseModel):
    model_config = ConfigDict(extra="allow")

    def wire(self) -> dict[str, Any]:
        """The JSON object as it goes on the wire (absent optional keys left out)."""
        return self.model_dump()


# ---- errors -----------------------------------------------------------------------------------------------------------

class ErrorResponse(WireModel):
    error: str


class OpenAIErrorBody(WireModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class OpenAIError(WireModel):
    error: OpenAIErrorBody


def error_text(body: Any) -> str | None:
    """The message of an error answer or stream line in either shape (native `{"error": "..."}`, OpenAI's object)."""
    if not isinstance(body, dict) or "error" not in body:
        return None
    error = body["error"]
    if isinstance(error, dict):
        return str(error.get("message", ""))
    return error if isinstance(error, str) else None


# ---- native (Ollama) info ---------------------------------------------------------------------------------------------

class VersionResponse(WireModel):
    version: str
    dgemma_version: str


class ModelDetails(WireModel):
    parent_model: str = ""
    format: str = "gguf"
    family: str = ""
    families: list[str] | None = None
    parameter_size: str = ""
    quantization_level: str = ""


class ListedModel(WireModel):
    name: str
    model: str
    modified_at: str
    size: int
    digest: str
    details: ModelDetails
    capabilities: list[str] = []


class TagsResponse(WireModel):
    models: list[ListedModel]


class RunningModel(WireModel):
    name: str
    model: str
    size: int
    digest: str
    details: ModelDetails
    expires_at: str
    size_vram: int
    context_length: int


class PsResponse(WireModel):
    models: list[RunningModel]


class TensorInfo(WireModel):
    name: str
    type: str
    shape: list[int]


class AdapterInfo(WireModel):
    """A LoRA adapter layer of a model (dgemma's addition to `/api/show`; docs/gguf.md#lora-adapters)."""

    digest: str
    size: int
    ranks: list[int]
    alpha: float
    targets: int  # adapted weights (pairs of lora_a / lora_b)


class ShowResponse(WireModel):
    license: str = ""
    modelfile: str
    parameters: str = ""
    template: str = ""
    system: str = ""
    details: ModelDetails
    messages: list[dict[str, JsonValue]] = []
    model_info: dict[str, JsonValue]
    capabilities: list[str]
    modified_at: str
    tensors: list[TensorInfo] | None = omitted("with `verbose`: every tensor's name, type and shape")
    adapters: list[AdapterInfo] | None = omitted("the model's LoRA adapters, in the order they apply")
    projector_info: dict[str, JsonValue] | None = omitted("the vision projector's GGUF metadata (Ollama's field)")


class StatusResponse(WireModel):
    status: str
    digest: str | None = omitted()
    total: int | None = omitted()
    completed: int | None = omitted()


# ---- native generate / chat -------------------------------------------------------------------------------------------

class Metrics(WireModel):
    """The final chunk's statistics: durations in integer nanoseconds (invariant 4), counts in tokens."""

    total_duration: int = 0
    load_duration: int = 0
    prompt_eval_count: int = 0
    prompt_eval_duration: int = 0
    eval_count: int = 0
    eval_duration: int = 0
    denoise_steps: int = Field(default=0, description="diffusion: denoising steps run over all canvases")
    canvases: int = Field(default=0, description="diffusion: canvases committed")
    task_tries: int | None = omitted("task models: tries run up to the answer (the last one, or the first that passed)")
    host_bytes_per_step: int | None = omitted("diffusion: mean bytes a denoising step copied between the host and "
                                              "the devices (absent when every unit is on the CPU)")


class Progress(WireModel):
    """One denoising step (`diffusion_progress`; the draft with `diffusion_preview`): dgemma's additive keys.

    `preview_tokens`/`preview_accepted` hold the draft one string per canvas position and whether the sampler kept
    that position this step; without them a client compares `preview` with the previous step's."""

    completed: int = Field(description="diffusion progress: steps done in the current canvas")
    total: int = Field(description="diffusion progress: diffusion_steps")
    canvas: int = Field(description="diffusion progress: 1-based canvas index")
    task_try: int | None = omitted("task models: the 1-based try this step belongs to")
    preview: str | None = omitted("diffusion_preview: decoded draft of the current canvas")
    entropy: float | None = omitted("diffusion_preview: mean entropy of the step")
    accepted: int | None = omitted("diffusion_preview: positions kept by the sampler")
    preview_tokens: list[str] | None = omitted("diffusion_preview: the draft per position")
    preview_accepted: list[bool] | None = omitted("diffusion_preview: positions kept")


class GenerateHead(WireModel):
    model: str
    created_at: str
    response: str
    thinking: str | None = omitted()
    done: bool
    done_reason: str | None = omitted()
    context: list[int] | None = omitted("prompt + answer token ids (final chunk, not with `raw`)")


class ToolCallFunction(WireModel):
    name: str
    arguments: dict[str, JsonValue] = Field(description="the call's arguments as an object")


class ToolCall(WireModel):
    """A tool call the model made (parsed out of its answer text; docs/server.md, "Tools")."""

    function: ToolCallFunction


class ChatResponseMessage(WireModel):
    role: str
    content: str
    thinking: str | None = omitted()
    tool_calls: list[ToolCall] | None = omitted("the tool calls that completed in this chunk (all of them unstreamed)")


class ChatHead(WireModel):
    model: str
    created_at: str
    message: ChatResponseMessage
    done: bool
    done_reason: str | None = omitted()


def _answer_model(name: str, head: type[WireModel], doc: str) -> type[WireModel]:
    """`head`, then Metrics' keys (final chunk) and Progress' keys (progress chunks), each sent only when set: one
    model for every line of a stream, with the keys in the order they are sent."""
    extras: dict[str, Any] = {
        key: (field.annotation | None, omitted(field.description))
        for part in (Metrics, Progress)
        for key, field in part.model_fields.items()
    }
    return create_model(name, __base__=head, __doc__=doc, __module__=__name__, **extras)


def progress_of(line: dict[str, Any]) -> Progress | None:
    """The denoising step a generate or chat stream line reports, None for a text or final line (a progress line holds
    every required Progress key)."""
    if line.get("done") or not all(key in line for key, field in Progress.model_fields.items() if field.is_required()):
        return None
    return Progress.model_validate({key: line[key] for key in Progress.model_fields if key in line})


GenerateResponse = _answer_model("GenerateResponse", GenerateHead,
                                 "One /api/generate NDJSON line (or the whole answer with `stream: false`).")
ChatResponse = _answer_model("ChatResponse", ChatHead,
                             "One /api/chat NDJSON line (or the whole answer with `stream: false`).")


# ---- OpenAI-compatible layer ------------------------------------------------------------------------------------------

class OpenAIModel(WireModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class OpenAIModelList(WireModel):
    object: Literal["list"] = "list"
    data: list[OpenAIModel]


class Usage(WireModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionHead(WireModel):
    """What every OpenAI completion object and stream chunk starts with."""

    id: str
    object: str
    created: int
    model: str
    system_fingerprint: str


class OpenAIFunctionCall(WireModel):
    name: str
    arguments: str = Field(description="the call's arguments as a JSON string")


class OpenAIToolCall(WireModel):
    id: str
    type: Literal["function"] = "function"
    function: OpenAIFunctionCall


class OpenAIToolCallDelta(WireModel):
    """A tool call in a stream chunk: sent whole, once the model has finished writing it."""

    index: int
    id: str
    type: Literal["function"] = "function"
    function: OpenAIFunctionCall


class ChatCompletionMessage(WireModel):
    role: str
    content: str | None = Field(description="null for an answer that is only tool calls, as OpenAI sends it")
    reasoning: str | None = omitted()
    tool_calls: list[OpenAIToolCall] | None = omitted()


class ChatCompletionChoice(WireModel):
    index: int
    message: ChatCompletionMessage
    finish_reason: str | None


class ChatCompletion(CompletionHead):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatCompletionChoice]
    usage: Usage


class ChatDelta(WireModel):
    role: str | None = omitted()
    reasoning: str | None = omitted()
    content: str | None = omitted()
    tool_calls: list[OpenAIToolCallDelta] | None = omitted()


class ChatChunkChoice(WireModel):
    index: int
    delta: ChatDelta
    finish_reason: str | None


class ChatCompletionChunk(CompletionHead):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = omitted("the last chunk, with `stream_options.include_usage`")


class CompletionChoice(WireModel):
    index: int
    text: str
    finish_reason: str | None


class Completion(CompletionHead):
    """A text completion, and each of its stream chunks (`usage` there only with `stream_options.include_usage`)."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = omitted()


# ---- OpenAI Responses API (/v1/responses) -----------------------------------------------------------------------------

class ResponseOutputText(WireModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[JsonValue] = Field(default_factory=list)
    logprobs: list[JsonValue] = Field(default_factory=list)


class ResponseSummaryText(WireModel):
    type: Literal["summary_text"] = "summary_text"
    text: str


class ResponseOutputItem(WireModel):
    """A `message` (the answer), a `reasoning` item (the thinking, as its summary) or a `function_call` (one parsed
    tool call: `call_id`, `name`, `arguments` as a JSON string)."""

    id: str
    type: Literal["message", "reasoning", "function_call"]
    status: str | None = omitted()
    role: str | None = omitted()
    content: list[ResponseOutputText] | None = omitted()
    summary: list[ResponseSummaryText] | None = omitted()
    call_id: str | None = omitted()
    name: str | None = omitted()
    arguments: str | None = omitted()


class ResponseUsage(WireModel):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: dict[str, int] = Field(default_factory=lambda: {"cached_tokens": 0})
    output_tokens_details: dict[str, int] = Field(default_factory=lambda: {"reasoning_tokens": 0})


class ResponseIncomplete(WireModel):
    reason: str


class ResponseObject(WireModel):
    """The response object: the whole answer, and the `response` of the stream's created / completed events."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    completed_at: int | None = None
    status: Literal["in_progress", "completed", "incomplete"]
    incomplete_details: ResponseIncomplete | None = None
    model: str
    previous_response_id: str | None = None
    instructions: str | None = None
    output: list[ResponseOutputItem]
    error: JsonValue = None
    tools: list[JsonValue] = Field(default_factory=list)
    tool_choice: JsonValue = "auto"
    truncation: str = "disabled"
    parallel_tool_calls: bool = True
    text: dict[str, JsonValue] = Field(default_factory=lambda: {"format": {"type": "text"}})
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    usage: ResponseUsage | None = None
    store: bool = False
    metadata: dict[str, JsonValue] = Field(default_factory=dict)


class ResponseDeleted(WireModel):
    """DELETE /v1/responses/{id}."""

    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True


# ---- requests ---------------------------------------------------------------------------------------------------------
# What clients send, for the routes (FastAPI validates a body into them and derives the OpenAPI schema) and for the CLI
# (it builds its bodies with them). Requests tolerate unknown fields (`extra="ignore"`) and treat `null` as absent;
# known fields are strictly typed, so a wrong JSON type is a 400 rather than a silent coercion.

class RequestModel(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)


# ---- requests: native (Ollama) ----------------------------------------------------------------------------------------

KeepAlive = int | float | str | None
Options = dict[str, JsonValue] | None


class GenerateRequest(RequestModel):
    model: str | None = None
    name: str | None = Field(default=None, description="legacy alias of `model`")
    prompt: str | None = None
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    stream: bool | None = None
    raw: bool | None = None
    format: str | dict[str, JsonValue] | None = None
    keep_alive: KeepAlive = None
    images: list[str] | None = None
    options: Options = None
    think: bool | str | None = None
    truncate: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    steps: int | None = Field(default=None, description="alias of options.diffusion_steps")


class ChatMessage(RequestModel):
    role: str
    content: str | None = None
    images: list[str] | None = None
    thinking: str | None = None
    tool_calls: list[dict[str, JsonValue]] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None


class ChatRequest(RequestModel):
    model: str | None = None
    name: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[dict[str, JsonValue]] | None = None
    format: str | dict[str, JsonValue] | None = None
    options: Options = None
    stream: bool | None = None
    keep_alive: KeepAlive = None
    think: bool | str | None = None
    truncate: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


class ShowRequest(RequestModel):
    model: str | None = None
    name: str | None = None
    verbose: bool | None = None
    system: str | None = None
    options: Options = None


class PullRequest(RequestModel):
    model: str | None = None
    name: str | None = None
    insecure: bool | None = None
    stream: bool | None = None


class CreateRequest(RequestModel):
    model: str | None = None
    name: str | None = None
    from_: str | None = Field(default=None, alias="from")
    files: dict[str, str] | None = None
    adapters: dict[str, str] | None = None
    template: str | None = None
    system: str | None = None
    license: str | list[str] | None = None
    parameters: dict[str, JsonValue] | None = None
    messages: list[dict[str, JsonValue]] | None = None
    quantize: str | None = None
    requires: str | None = None
    stream: bool | None = None
    path: str | None = Field(default=None, description="server-side paths are refused (400)")
    modelfile: str | None = Field(default=None, description="server-side Modelfiles are refused (400)")
    renderer: str | None = Field(default=None, description="Ollama's RENDERER line; dgemma keeps no renderer")
    parser: str | None = Field(default=None, description="Ollama's PARSER line; dgemma keeps no parser")


class CopyRequest(RequestModel):
    source: str | None = None
    destination: str | None = None


class DeleteRequest(RequestModel):
    model: str | None = None
    name: str | None = None


class EmbedRequest(RequestModel):
    model: str | None = None
    name: str | None = None
    input: str | list[str] | None = None
    prompt: str | None = None


# ---- OpenAI-compatible layer ----------------------------------------------------------------------------------------

class StreamOptions(RequestModel):
    include_usage: bool | None = None


class ResponseFormat(RequestModel):
    type: str
    json_schema: dict[str, JsonValue] | None = None


class OpenAIMessage(RequestModel):
    role: str
    content: str | list[dict[str, JsonValue]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, JsonValue]] | None = None
    tool_call_id: str | None = None
    reasoning: str | None = None


class OpenAIRequest(RequestModel):
    """The fields both OpenAI generation requests share."""

    model: str
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    n: int | None = None


class ChatCompletionRequest(OpenAIRequest):
    messages: list[OpenAIMessage]
    max_completion_tokens: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict[str, JsonValue]] | None = None
    tool_choice: str | dict[str, JsonValue] | None = Field(default=None, description='"auto", "none" (the tools are '
                                                           'left out), "required" or {"type": "function", "function": '
                                                           '{"name": …}} (the answer is a call)')
    reasoning_effort: str | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    truncate: bool | None = Field(default=None, description="dgemma, as in /api/chat: false refuses a chat that does "
                                                            "not fit the context instead of dropping old messages")


class OpenAIEmbeddingRequest(RequestModel):
    model: str
    input: str | list[JsonValue] | None = None


class CompletionRequest(OpenAIRequest):
    prompt: str | list[str] = Field(description="a string, or a list of exactly one string")
    suffix: str | None = None
    logprobs: int | None = None


class ResponsesTextFormat(RequestModel):
    type: str
    name: str | None = None
    schema_: dict[str, JsonValue] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponsesText(RequestModel):
    format: ResponsesTextFormat | None = None


class ResponsesRequest(RequestModel):
    """POST /v1/responses (OpenAI's Responses API as Ollama implements it)."""

    model: str
    input: str | list[dict[str, JsonValue]] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None
    text: ResponsesText | None = None
    tools: list[dict[str, JsonValue]] | None = None
    tool_choice: str | dict[str, JsonValue] | None = Field(default=None, description='"auto", "none" (the tools are '
                                                           'left out), "required" or {"type": "function", "name": …} '
                                                           "(the answer is a call)")
    reasoning: dict[str, JsonValue] | None = None
    truncation: str | None = None
    previous_response_id: str | None = Field(default=None, description="continue a stored response: its input and "
                                                                       "output come before `input`")
    store: bool | None = Field(default=None, description="false: the response is not kept for later requests")
    seed: int | None = Field(default=None, description="dgemma, as in Chat Completions: a seeded answer repeats")


def request_body(request: RequestModel) -> dict[str, Any]:
    """A request as a client sends it: the fields it sets, under their wire names (`from`, `schema`)."""
    return request.model_dump(exclude_none=True, by_alias=True)
