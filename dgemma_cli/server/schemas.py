"""Request models of the REST API, which also make the OpenAPI schema (the answers are in dgemma_cli/wire.py).

Requests tolerate unknown fields (`extra="ignore"`, invariant 6) and treat `null` as absent; known fields are strictly
typed, so a wrong JSON type is a 400 rather than a silent coercion.
"""
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

JsonValue = Any


class RequestModel(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)


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
    reasoning_effort: str | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    truncate: bool | None = Field(default=None, description="dgemma, as in /api/chat: false refuses a chat that does "
                                                            "not fit the context instead of dropping old messages")


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
    tool_choice: str | dict[str, JsonValue] | None = Field(default=None, description='"none" leaves the tools out; '
                                                           "other values are accepted and echoed (nothing can force "
                                                           "a call)")
    reasoning: dict[str, JsonValue] | None = None
    truncation: str | None = None
