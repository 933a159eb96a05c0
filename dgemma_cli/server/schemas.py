"""Request and response models of the REST API, which also make the OpenAPI schema.

Requests tolerate unknown fields (`extra="ignore"`, invariant 6) and treat `null` as absent; known fields are strictly
typed, so a wrong JSON type is a 400 rather than a silent coercion. Responses allow extra fields: diffusion extras only
add keys (invariant 10).
"""
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

JsonValue = Any


class RequestModel(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)


class ResponseModel(BaseModel):
    model_config = ConfigDict(extra="allow")


# ---- native (Ollama) requests ----------------------------------------------------------------------------------------

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


# ---- native responses (documentation; streaming objects share these shapes) -------------------------------------------

class ErrorResponse(ResponseModel):
    error: str


class VersionResponse(ResponseModel):
    version: str
    dgemma_version: str


class ModelDetails(ResponseModel):
    parent_model: str = ""
    format: str = "gguf"
    family: str = ""
    families: list[str] | None = None
    parameter_size: str = ""
    quantization_level: str = ""


class ListedModel(ResponseModel):
    name: str
    model: str
    modified_at: str
    size: int
    digest: str
    details: ModelDetails
    capabilities: list[str] = []


class TagsResponse(ResponseModel):
    models: list[ListedModel]


class RunningModel(ResponseModel):
    name: str
    model: str
    size: int
    digest: str
    details: ModelDetails
    expires_at: str
    size_vram: int
    context_length: int


class PsResponse(ResponseModel):
    models: list[RunningModel]


class ShowResponse(ResponseModel):
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


class GenerateResponse(ResponseModel):
    """One NDJSON line (or the whole answer with `stream: false`)."""

    model: str
    created_at: str
    response: str
    done: bool
    done_reason: str | None = None
    completed: int | None = Field(default=None, description="diffusion progress: steps done in the current canvas")
    total: int | None = Field(default=None, description="diffusion progress: diffusion_steps")
    canvas: int | None = Field(default=None, description="diffusion progress: 1-based canvas index")
    preview: str | None = Field(default=None, description="diffusion_preview: decoded draft of the current canvas")
    preview_tokens: list[str] | None = Field(default=None, description="diffusion_preview: the draft per position")
    preview_accepted: list[bool] | None = Field(default=None, description="diffusion_preview: positions kept")
    entropy: float | None = Field(default=None, description="diffusion_preview: mean entropy of the step")
    accepted: int | None = Field(default=None, description="diffusion_preview: positions kept by the sampler")


class ChatResponseMessage(ResponseModel):
    role: str
    content: str
    thinking: str | None = None


class ChatResponse(ResponseModel):
    model: str
    created_at: str
    message: ChatResponseMessage
    done: bool
    done_reason: str | None = None


class StatusResponse(ResponseModel):
    status: str
    digest: str | None = None
    total: int | None = None
    completed: int | None = None


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


class ChatCompletionRequest(RequestModel):
    model: str
    messages: list[OpenAIMessage]
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict[str, JsonValue]] | None = None
    reasoning_effort: str | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    n: int | None = None


class CompletionRequest(RequestModel):
    model: str
    prompt: str
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    suffix: str | None = None
    logprobs: int | None = None
    n: int | None = None


class OpenAIErrorBody(ResponseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class OpenAIError(ResponseModel):
    error: OpenAIErrorBody


class OpenAIModel(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class OpenAIModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[OpenAIModel]


class Usage(ResponseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChatCompletionChoice(ResponseModel):
    index: int
    message: dict[str, JsonValue]
    finish_reason: str | None


class ChatCompletion(ResponseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChatCompletionChoice]
    usage: Usage


class CompletionChoice(ResponseModel):
    index: int
    text: str
    finish_reason: str | None


class Completion(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[CompletionChoice]
    usage: Usage
