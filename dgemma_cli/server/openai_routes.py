"""OpenAI-compatible layer (docs/compat.md#openai-layer): chat completions, completions, models; SSE streaming.

Requests are translated into the same generation path as the native API. Only sampling fields the client actually
sent are forwarded (no implicit temperature, docs/compat.md#standard-knobs). Errors use OpenAI's error object (rendered
by the app).
"""
import asyncio
import json
import secrets
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from dgemma_cli import wire
from dgemma_cli.server.errors import NotFound, RequestError
from dgemma_cli.server.answers import Final, Text
from dgemma_cli.server.generation import GenerationRequest, admitted, common_checks, start
from dgemma_cli.server.options import request_options
from dgemma_cli.server.prompts import ChatPrompt, chat_prompt
from dgemma_cli.server.request_images import from_data_url, read_message_images, url_of
from dgemma_cli.server.routing import CheckedRoute
from dgemma_cli.server.services import Services, services
from dgemma_cli.server.streaming import (
    SSE,
    GuardedStreamingResponse,
    WorkerStream,
    collect,
    error_message,
    guarded_stream,
    sse_event,
)
from dgemma_cli.server.output_format import OutputFormat, openai_format
from dgemma_cli.server.tool_choice import call_format, prompt_tools, read_tool_choice
from dgemma_cli.server.validation import chat_role, single_prompt

router = APIRouter(prefix="/v1", route_class=CheckedRoute)
ERRORS = {
    400: {"model": wire.OpenAIError},
    404: {"model": wire.OpenAIError},
    500: {"model": wire.OpenAIError},
    503: {"model": wire.OpenAIError},
}
FINGERPRINT = "fp_dgemma"


def _options(req: Any, max_tokens: int | None) -> dict[str, Any]:
    """Native options from the fields the client sent (exclude_unset), never from defaults."""
    sent = req.model_fields_set
    options: dict[str, Any] = {}
    if max_tokens is not None:
        options["num_predict"] = max_tokens
    for field in ("temperature", "top_p", "seed", "frequency_penalty", "presence_penalty"):
        if field in sent and getattr(req, field) is not None:
            options[field] = getattr(req, field)
    if req.stop is not None:
        options["stop"] = [req.stop] if isinstance(req.stop, str) else list(req.stop)
    return options


def _finish_reason(final: Final | None, called_tools: bool = False) -> str:
    if called_tools:
        return "tool_calls"
    return "length" if final is not None and final.done_reason == "length" else "stop"


def _tool_call(call) -> wire.OpenAIToolCall:
    """A parsed call as OpenAI sends it: a fresh `call_…` id, the arguments as a JSON string."""
    arguments = json.dumps(call.arguments, ensure_ascii=False)
    return wire.OpenAIToolCall(id="call_" + secrets.token_hex(12),
                               function=wire.OpenAIFunctionCall(name=call.name, arguments=arguments))


def _history_tool_calls(calls: list[dict]) -> list[dict]:
    """An assistant message's `tool_calls` for the template: arguments as an object (HF templates iterate them)."""
    out = []
    for call in calls:
        call = dict(call)
        function = dict(call.get("function") or {})
        if isinstance(function.get("arguments"), str):
            try:
                function["arguments"] = json.loads(function["arguments"])
            except ValueError:
                pass  # not JSON: the template gets the string as sent
        call["function"] = function
        out.append(call)
    return out


def _chat_messages(model, messages: list[wire.OpenAIMessage]) -> list[dict]:
    """OpenAI messages as template messages; a tool result also gets the `name` of the call it answers."""
    names: dict[str, str] = {}
    out = []
    for message in messages:
        role = chat_role(message.role)
        entry: dict[str, Any] = {"role": role, **_message_content(message)}
        if message.tool_calls:
            entry["tool_calls"] = _history_tool_calls(message.tool_calls)
            for call in entry["tool_calls"]:
                if isinstance(call.get("id"), str) and isinstance(call["function"].get("name"), str):
                    names[call["id"]] = call["function"]["name"]
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        name = message.name or (names.get(message.tool_call_id or "") if role == "tool" else None)
        if name:
            entry["name"] = name
        out.append(entry)
    return out


def _usage(final: Final | None) -> wire.Usage:
    prompt = final.metrics.prompt_eval_count if final else 0
    completion = final.metrics.eval_count if final else 0
    return wire.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _head(prefix: str, model) -> dict[str, Any]:
    """The fields every completion object and chunk of one answer share (one id, one creation time)."""
    return {"id": prefix + secrets.token_hex(12), "created": int(time.time()), "model": model.display,
            "system_fingerprint": FINGERPRINT}


def _message_content(message: wire.OpenAIMessage) -> dict[str, Any]:
    """`content` as text; `image_url` parts (base64 `data:` URLs) as `images`, each at its place in the text
    (`image_places`, prompts.with_image_markers)."""
    content = message.content
    if content is None or isinstance(content, str):
        return {"content": content or ""}
    text, images, places = "", [], []
    for part in content:
        kind = part.get("type")
        if kind == "text":
            text += str(part.get("text", ""))
        elif kind == "image_url":
            images.append(from_data_url(url_of(part)))
            places.append(len(text))
        elif kind in ("input_audio", "file"):
            raise RequestError(f"{kind} content parts are not supported")
        else:
            raise RequestError(f"unsupported content part type {kind!r}")
    return {"content": text, **({"images": images, "image_places": places} if images else {})}


async def _start(request: Request, svc: Services, model, req: Any, prompt: ChatPrompt, max_tokens: int | None, think: Any = None,
                 output_format: OutputFormat | None = None, tools: list[dict] | None = None) -> WorkerStream:
    """The request's options decoded once, then its generation started."""
    if req.n is not None and req.n > 1:
        raise RequestError("n greater than 1 is not supported")
    options = await request_options(svc.config, model.local, _options(req, max_tokens))
    return await start(request, svc, GenerationRequest(model, options, prompt, None, output_format, think, tools))


def _sse(stream: WorkerStream, events) -> GuardedStreamingResponse:
    """Server-sent events of the `events()` chunks, then `[DONE]`; mid-stream: an error event, then close."""

    async def frames():
        async for chunk in events():
            yield sse_event(chunk.wire())
        yield sse_event("[DONE]")

    def error_frame(exc: Exception) -> bytes:
        error = wire.OpenAIError(error=wire.OpenAIErrorBody(message=error_message(exc), type="api_error"))
        return sse_event(error.wire())

    return guarded_stream(stream, frames(), error_frame, SSE)


@router.post("/chat/completions", response_model=wire.ChatCompletion, responses=ERRORS)
@admitted
async def chat_completions(req: wire.ChatCompletionRequest, request: Request, svc: Services):
    if not req.messages:
        raise RequestError("messages must not be empty")
    model = await svc.resolve_runnable(req.model)
    choice = read_tool_choice(req.tool_choice)
    tools = prompt_tools(req.tools, choice)
    output_format = call_format(model, req.tools, choice)  # a call the answer must be; else response_format's
    if output_format is None and req.response_format is not None:
        schema = (req.response_format.json_schema or {}).get("schema")
        output_format = openai_format(req.response_format.type, schema)
    common_checks(model, req.logprobs, req.top_logprobs)
    messages = _chat_messages(model, req.messages)
    read_message_images(model, messages, svc.config.max_images)
    prompt = chat_prompt(model.local, messages, truncate=req.truncate is not False)
    think = req.reasoning_effort if req.reasoning_effort not in (None, "none") else None
    stream = await _start(request, svc, model, req, prompt, req.max_completion_tokens or req.max_tokens, think,
                          output_format, tools)
    head = _head("chatcmpl-", model)

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def chunk(delta: wire.ChatDelta, finish: str | None) -> wire.ChatCompletionChunk:
            return wire.ChatCompletionChunk(**head, choices=[wire.ChatChunkChoice(index=0, delta=delta,
                                                                                  finish_reason=finish)])

        async def events():
            yield chunk(wire.ChatDelta(role="assistant", content=""), None)
            final = None
            calls = 0
            async for item in stream:
                if isinstance(item, Text):
                    if item.thinking or item.text:
                        yield chunk(wire.ChatDelta(reasoning=item.thinking or None, content=item.text or None), None)
                    if item.tool_calls:
                        deltas = [wire.OpenAIToolCallDelta(index=calls + i, **_tool_call(c).model_dump())
                                  for i, c in enumerate(item.tool_calls)]
                        calls += len(deltas)
                        yield chunk(wire.ChatDelta(tool_calls=deltas), None)
                elif isinstance(item, Final):
                    final = item
            yield chunk(wire.ChatDelta(), _finish_reason(final, calls > 0))
            if include_usage:
                yield wire.ChatCompletionChunk(**head, choices=[], usage=_usage(final))

        return _sse(stream, events)

    items = await collect(request, stream)
    final = next((i for i in reversed(items) if isinstance(i, Final)), None)
    calls = [_tool_call(c) for i in items if isinstance(i, Text) for c in i.tool_calls]
    text = "".join(i.text for i in items if isinstance(i, Text))
    message = wire.ChatCompletionMessage(role="assistant", content=text if text.strip() or not calls else None,
                                         reasoning="".join(i.thinking for i in items if isinstance(i, Text)) or None,
                                         tool_calls=calls or None)
    choice = wire.ChatCompletionChoice(index=0, message=message, finish_reason=_finish_reason(final, bool(calls)))
    return JSONResponse(wire.ChatCompletion(**head, choices=[choice], usage=_usage(final)).wire())


@router.post("/completions", response_model=wire.Completion, responses=ERRORS)
@admitted
async def completions(req: wire.CompletionRequest, request: Request, svc: Services):
    model = await svc.resolve_runnable(req.model)
    if req.suffix:
        raise RequestError(f"{model.full} does not support insert")
    if req.logprobs:
        raise RequestError(f"{model.quoted} does not support logprobs")
    prompt = single_prompt(req.prompt)

    stream = await _start(request, svc, model, req, chat_prompt(model.local, [{"role": "user", "content": prompt}],
                                                                truncate=False), req.max_tokens)
    head = _head("cmpl-", model)

    def completion(text: str | None, finish: str | None, usage: wire.Usage | None = None) -> wire.Completion:
        choices = [] if text is None else [wire.CompletionChoice(index=0, text=text, finish_reason=finish)]
        return wire.Completion(**head, choices=choices, usage=usage)

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def events():
            final = None
            async for item in stream:
                if isinstance(item, Text) and item.text:
                    yield completion(item.text, None)
                elif isinstance(item, Final):
                    final = item
            yield completion("", _finish_reason(final))
            if include_usage:
                yield completion(None, None, _usage(final))

        return _sse(stream, events)

    items = await collect(request, stream)
    final = next((i for i in reversed(items) if isinstance(i, Final)), None)
    text = "".join(i.text for i in items if isinstance(i, Text))
    return JSONResponse(completion(text, _finish_reason(final), _usage(final)).wire())


def _model_card(entry) -> wire.OpenAIModel:
    return wire.OpenAIModel(id=entry.name, created=int(entry.modified), owned_by=entry.model_name.namespace)


@router.get("/models", response_model=wire.OpenAIModelList, responses=ERRORS)
async def list_models(request: Request) -> JSONResponse:
    entries = await asyncio.to_thread(services(request).store.list_models)
    return JSONResponse(wire.OpenAIModelList(data=[_model_card(e) for e in entries]).wire())


@router.get("/models/{model:path}", response_model=wire.OpenAIModel, responses=ERRORS)
async def retrieve_model(model: str, request: Request) -> JSONResponse:
    svc = services(request)
    name = svc.parse_name(model)
    for entry in await asyncio.to_thread(svc.store.list_models):
        if entry.model_name.key() == name.key():
            return JSONResponse(_model_card(entry).wire())
    raise NotFound(f"model '{model}' not found")


@router.post("/embeddings", responses=ERRORS)
async def embeddings(req: wire.OpenAIEmbeddingRequest, request: Request) -> JSONResponse:
    """As /api/embed: an unknown model is a 404 naming it; a stored one cannot embed (a 400 naming it)."""
    model = await services(request).resolve(req.model)
    raise RequestError(f"{model.full} does not support embedding")
