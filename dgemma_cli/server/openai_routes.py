"""OpenAI-compatible layer (spec ollama-compat.md §2.7): chat completions, completions, models; SSE streaming.

Requests are translated into the same generation path as the native API. Only sampling fields the client actually
sent are forwarded (no implicit temperature, §3.5). Errors use OpenAI's error object (rendered by the app).
"""
import asyncio
import secrets
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from dgemma_cli.server import inference, schemas
from dgemma_cli.server.errors import NotFound, RequestError
from dgemma_cli.server.inference import Final, Text
from dgemma_cli.server.ollama_routes import (GenerationJob, admitted, common_checks, render_chat_prompt,
                                             with_model_messages)
from dgemma_cli.server.services import services
from dgemma_cli.server.streaming import (
    SSE,
    GuardedStreamingResponse,
    WorkerStream,
    collect,
    error_message,
    sse_event,
)

router = APIRouter(prefix="/v1")
ERRORS = {
    400: {"model": schemas.OpenAIError},
    404: {"model": schemas.OpenAIError},
    500: {"model": schemas.OpenAIError},
    503: {"model": schemas.OpenAIError},
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


def _finish_reason(final: Final | None) -> str:
    return "length" if final is not None and final.done_reason == "length" else "stop"


def _usage(final: Final | None) -> dict[str, int]:
    prompt = final.metrics.prompt_eval_count if final else 0
    completion = final.metrics.eval_count if final else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _message_text(model, message: schemas.OpenAIMessage) -> str:
    content = message.content
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        kind = part.get("type")
        if kind == "text":
            parts.append(str(part.get("text", "")))
        elif kind in ("image_url", "input_audio", "image", "file"):
            raise RequestError(f"{model.full} does not support vision")
        else:
            raise RequestError(f"unsupported content part type {kind!r}")
    return "".join(parts)


async def _prepare(request: Request, req: Any, build_prompt, max_tokens: int | None, think: Any):
    svc = services(request)
    if req.n is not None and req.n > 1:
        raise RequestError("n greater than 1 is not supported")
    model = await svc.resolve_runnable(req.model)
    options = svc.merged_options(model, _options(req, max_tokens))
    job = GenerationJob(svc, model, options, None)
    stream = await job.start(request, build_prompt, think)
    return model, stream


def _sse(stream: WorkerStream, events) -> GuardedStreamingResponse:
    async def body():
        try:
            async for chunk in events():
                yield sse_event(chunk)
            yield sse_event("[DONE]")
        except Exception as exc:  # noqa: BLE001  (mid-stream: an error event, then close)
            yield sse_event({"error": {"message": error_message(exc), "type": "api_error", "param": None, "code": None}})
        finally:
            stream.stop()

    return GuardedStreamingResponse(body(), cleanup=stream.stop, media_type=SSE)


@router.post("/chat/completions", response_model=schemas.ChatCompletion, responses=ERRORS)
@admitted
async def chat_completions(req: schemas.ChatCompletionRequest, request: Request):
    if not req.messages:
        raise RequestError("messages must not be empty")
    svc = services(request)
    model_probe = await svc.resolve_runnable(req.model)
    if req.tools:
        raise RequestError(f"{model_probe.full} does not support tools")
    fmt = None
    if req.response_format is not None and req.response_format.type != "text":
        fmt = "json"
    common_checks(model_probe, fmt, req.logprobs, req.top_logprobs)
    messages = []
    for message in req.messages:
        role = message.role.lower()
        if role == "developer":
            role = "system"
        messages.append({"role": role, "content": _message_text(model_probe, message)})
    messages = with_model_messages(model_probe, messages)
    think = req.reasoning_effort if req.reasoning_effort not in (None, "none") else None

    def build_prompt(runner, thinking):
        return inference.chat_prompt(runner, messages, thinking, True)

    model, stream = await _prepare(request, req, build_prompt, req.max_completion_tokens or req.max_tokens, think)
    completion_id = "chatcmpl-" + secrets.token_hex(12)
    created = int(time.time())

    def chunk(delta: dict[str, Any] | None, finish: str | None, **extra: Any) -> dict[str, Any]:
        choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
        return {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model.display,
            "system_fingerprint": FINGERPRINT,
            "choices": choices,
            **extra,
        }

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def events():
            yield chunk({"role": "assistant", "content": ""}, None)
            final = None
            async for item in stream:
                if isinstance(item, Text):
                    delta: dict[str, Any] = {}
                    if item.thinking:
                        delta["reasoning"] = item.thinking
                    if item.text:
                        delta["content"] = item.text
                    if delta:
                        yield chunk(delta, None)
                elif isinstance(item, Final):
                    final = item
            yield chunk({}, _finish_reason(final))
            if include_usage:
                yield chunk(None, None, usage=_usage(final))

        return _sse(stream, events)

    items = await collect(request, stream)
    final = next((i for i in reversed(items) if isinstance(i, Final)), None)
    message: dict[str, Any] = {"role": "assistant", "content": "".join(i.text for i in items if isinstance(i, Text))}
    reasoning = "".join(i.thinking for i in items if isinstance(i, Text))
    if reasoning:
        message["reasoning"] = reasoning
    return JSONResponse(
        {
            "id": completion_id,
            "object": "chat.completion",
            "created": created,
            "model": model.display,
            "system_fingerprint": FINGERPRINT,
            "choices": [{"index": 0, "message": message, "finish_reason": _finish_reason(final)}],
            "usage": _usage(final),
        }
    )


@router.post("/completions", response_model=schemas.Completion, responses=ERRORS)
@admitted
async def completions(req: schemas.CompletionRequest, request: Request):
    svc = services(request)
    model_probe = await svc.resolve_runnable(req.model)
    if req.suffix:
        raise RequestError(f"{model_probe.full} does not support insert")
    if req.logprobs:
        raise RequestError(f"{model_probe.quoted} does not support logprobs")
    prompt = req.prompt

    messages = with_model_messages(model_probe, [{"role": "user", "content": prompt}])

    def build_prompt(runner, thinking):
        return runner.tokenize(render_chat_prompt(runner, messages, thinking))

    model, stream = await _prepare(request, req, build_prompt, req.max_tokens, None)
    completion_id = "cmpl-" + secrets.token_hex(12)
    created = int(time.time())

    def chunk(text: str | None, finish: str | None, **extra: Any) -> dict[str, Any]:
        choices = [] if text is None else [{"index": 0, "text": text, "finish_reason": finish}]
        return {
            "id": completion_id,
            "object": "text_completion",
            "created": created,
            "model": model.display,
            "system_fingerprint": FINGERPRINT,
            "choices": choices,
            **extra,
        }

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def events():
            final = None
            async for item in stream:
                if isinstance(item, Text) and item.text:
                    yield chunk(item.text, None)
                elif isinstance(item, Final):
                    final = item
            yield chunk("", _finish_reason(final))
            if include_usage:
                yield chunk(None, None, usage=_usage(final))

        return _sse(stream, events)

    items = await collect(request, stream)
    final = next((i for i in reversed(items) if isinstance(i, Final)), None)
    text = "".join(i.text for i in items if isinstance(i, Text))
    return JSONResponse(
        {
            "id": completion_id,
            "object": "text_completion",
            "created": created,
            "model": model.display,
            "system_fingerprint": FINGERPRINT,
            "choices": [{"index": 0, "text": text, "finish_reason": _finish_reason(final)}],
            "usage": _usage(final),
        }
    )


def _model_card(entry) -> dict[str, Any]:
    return {
        "id": entry.name,
        "object": "model",
        "created": int(entry.modified),
        "owned_by": entry.model_name.namespace,
    }


@router.get("/models", response_model=schemas.OpenAIModelList, responses=ERRORS)
async def list_models(request: Request) -> JSONResponse:
    entries = await asyncio.to_thread(services(request).store.list_models)
    return JSONResponse({"object": "list", "data": [_model_card(e) for e in entries]})


@router.get("/models/{model:path}", response_model=schemas.OpenAIModel, responses=ERRORS)
async def retrieve_model(model: str, request: Request) -> JSONResponse:
    svc = services(request)
    name = svc.parse_name(model)
    for entry in await asyncio.to_thread(svc.store.list_models):
        if entry.model_name.key() == name.key():
            return JSONResponse(_model_card(entry))
    raise NotFound(f"model '{model}' not found")


@router.post("/embeddings", responses=ERRORS)
async def embeddings(request: Request) -> JSONResponse:
    raise RequestError("this model does not support embedding")
