"""Native Ollama API (docs/compat.md#rest-api): inference, info and store endpoints."""
import asyncio
import hashlib
import logging
import shutil
import threading
import time
from pathlib import PurePosixPath, PureWindowsPath
from typing import Any

from dgemma_engine.chat import gotemplate
from dgemma_engine.chat.budget import check_source
from dgemma_engine.chat.templates import ChatTemplate, template_format
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse

from dgemma_cli import wire
from dgemma_cli.bundled import bundled_modelfile, mark_deleted, pull_bundled
from dgemma_cli.errors import DgemmaError
from dgemma_cli.gotext import parse_keep_alive
from dgemma_cli.server import create_upload, model_info
from dgemma_cli.server.errors import NotFound, RequestError
from dgemma_cli.server.answers import Final, Progress, Text
from dgemma_cli.server.generation import GenerationRequest, admitted, common_checks, load_or_unload, start
from dgemma_cli.server.options import check_options, request_options
from dgemma_cli.server.routing import CheckedRoute
from dgemma_cli.server.services import ResolvedModel, Services, services
from dgemma_cli.server.streaming import (
    NDJSON,
    GuardedStreamingResponse,
    WorkerStream,
    collect,
    guarded_stream,
    json_line,
    stream_error_line,
    timestamp,
    timestamp_of,
    until_disconnected,
)
from dgemma_cli.server.output_format import ollama_format
from dgemma_cli.server.prompts import GeneratePrompt, chat_prompt
from dgemma_cli.server.request_images import (RequestImage, check_image_limits, from_base64, read_images,
                                                read_message_images)
from dgemma_cli.server.validation import chat_role, check_name_text
from dgemma_cli.store import ModelNotFoundError

log = logging.getLogger("dgemma.server")
router = APIRouter(route_class=CheckedRoute)

ERRORS = {
    400: {"model": wire.ErrorResponse, "description": "invalid request"},
    404: {"model": wire.ErrorResponse, "description": "model not found"},
}
INFERENCE_ERRORS = {
    **ERRORS,
    499: {"model": wire.ErrorResponse, "description": "client left while queued"},
    500: {"model": wire.ErrorResponse, "description": "internal error (load failure, template failure)"},
    503: {"model": wire.ErrorResponse, "description": "queue full"},
}


def _stream_flag(value: bool | None) -> bool:
    return True if value is None else value  # native endpoints stream unless told otherwise (invariant 2)


def _model_text(model: str | None, name: str | None) -> str:
    text = model or name
    if not text:
        raise RequestError("model is required")
    return text


# ---- meta ---------------------------------------------------------------------------------------------------------

@router.get("/", response_class=PlainTextResponse)
@router.head("/", response_class=PlainTextResponse, include_in_schema=False)
async def root() -> PlainTextResponse:
    return PlainTextResponse("Ollama is running")


@router.get("/api/version", response_model=wire.VersionResponse)
@router.head("/api/version", include_in_schema=False)
async def version(request: Request) -> JSONResponse:
    svc = services(request)
    return JSONResponse(wire.VersionResponse(version=svc.config.compat_version, dgemma_version=svc.dgemma_version).wire())


# ---- inference ----------------------------------------------------------------------------------------------------

def _answer_line(model: ResolvedModel, chat: bool, text: str, thinking: str, done: bool,
                 tool_calls: list | None = None, **fields: Any) -> dict[str, Any]:
    """One /api/generate or /api/chat object: the text in `response` (generate) or in `message` (chat), `thinking`
    and `tool_calls` only when there are some, then `fields` (the final chunk's reason and metrics, or a step's
    progress)."""
    head = {"model": model.display, "created_at": timestamp(), "done": done}
    if chat:
        calls = [wire.ToolCall(function=wire.ToolCallFunction(name=c.name, arguments=c.arguments))
                 for c in tool_calls or []]
        message = wire.ChatResponseMessage(role="assistant", content=text, thinking=thinking or None,
                                           tool_calls=calls or None)
        return wire.ChatResponse(**head, message=message, **fields).wire()
    return wire.GenerateResponse(**head, response=text, thinking=thinking or None, **fields).wire()


def _ndjson(stream: WorkerStream, render, source=None) -> GuardedStreamingResponse:
    """NDJSON of `render(item)` for each item (None: nothing sent); an error after the first byte is one more line
    (docs/compat.md#rest-conventions)."""

    async def lines():
        async for item in source if source is not None else stream:
            line = render(item)
            if line is not None:
                yield json_line(line)

    return guarded_stream(stream, lines(), lambda exc: json_line(stream_error_line(exc)), NDJSON)


@router.post("/api/generate", response_model=wire.GenerateResponse, responses=INFERENCE_ERRORS)
@admitted
async def generate(req: wire.GenerateRequest, request: Request, svc: Services):
    model = await svc.resolve_runnable(_model_text(req.model, req.name))
    if req.raw and (req.template or req.system or req.context):
        raise RequestError("raw mode does not support template, system, or context")
    if req.suffix:
        raise RequestError(f"{model.full} does not support insert")
    common_checks(model, req.logprobs, req.top_logprobs)
    output_format = ollama_format(req.format)
    steps = {} if req.steps is None else {"diffusion_steps": req.steps}
    options = await request_options(svc.config, model.local, {**(req.options or {}), **steps})
    keep_alive = _keep_alive(req.keep_alive)
    images = await _images(svc, model, req.images or [])
    if not req.prompt and not images:
        reason = await load_or_unload(request, svc, model, options, keep_alive)
        return JSONResponse(_answer_line(model, False, "", "", True, done_reason=reason))
    prompt = GeneratePrompt(req.prompt or "", req.system if req.system is not None else model.local.system,
                            bool(req.raw), tuple(req.context or ()),
                            req.truncate is not False,  # as Ollama: keep the prompt's end
                            _request_template(req.template) if req.template and not req.raw else None,
                            tuple(images))
    gen = GenerationRequest(model, options, prompt, keep_alive, output_format, req.think)
    stream = await start(request, svc, gen)
    return await _answer(request, stream, model, req.stream, chat=False, with_context=not req.raw)


def _request_template(text: str) -> ChatTemplate:
    """A per-request `template` (docs/compat.md#generate), classified like a Modelfile TEMPLATE and held to the same
    limits (budget.py; its size before any model loads, a Jinja one's nesting when the worker compiles it): Jinja is
    sandboxed, Go only in the safe subset (anything else is a 400, since the caller asked for this template
    explicitly)."""
    check_source(text)
    if template_format(text) == "jinja":
        return ChatTemplate("jinja", text)
    try:
        gotemplate.parse(text)
    except gotemplate.UnsupportedTemplate as exc:
        raise RequestError(f"template error: {exc}") from None
    return ChatTemplate("go", text)


@router.post("/api/chat", response_model=wire.ChatResponse, responses=INFERENCE_ERRORS)
@admitted
async def chat(req: wire.ChatRequest, request: Request, svc: Services):
    model = await svc.resolve_runnable(_model_text(req.model, req.name))
    messages = [m.model_dump(exclude_none=True) for m in (req.messages or [])]
    for message in messages:
        message["role"] = chat_role(message["role"])
        message.setdefault("content", "")
        if message["role"] == "tool" and message.get("tool_name"):
            message.setdefault("name", message["tool_name"])  # the name HF-style templates read
    common_checks(model, req.logprobs, req.top_logprobs)
    output_format = ollama_format(req.format)
    options = await request_options(svc.config, model.local, req.options)
    keep_alive = _keep_alive(req.keep_alive)
    for message in messages:  # each message keeps its own images (placed before its text, as Ollama does)
        if message.get("images"):
            message["images"] = [from_base64(text) for text in message["images"]]
        else:
            message.pop("images", None)
    read_message_images(model, messages, svc.config.max_images)
    if not messages:
        reason = await load_or_unload(request, svc, model, options, keep_alive)
        return JSONResponse(_answer_line(model, True, "", "", True, done_reason=reason))
    prompt = chat_prompt(model.local, messages, truncate=req.truncate is not False)
    gen = GenerationRequest(model, options, prompt, keep_alive, output_format, req.think, req.tools)
    stream = await start(request, svc, gen)
    return await _answer(request, stream, model, req.stream, chat=True, with_context=False)


async def _images(svc: Services, model: ResolvedModel, payloads: list[Any]) -> list[RequestImage]:
    """Ollama's base64 `images`: refused for a text-only model and checked against the count limit, then each one's
    header read; pixels are decoded later, once the request is known to fit (server/request_images.py)."""
    if not payloads:
        return []
    check_image_limits(model, len(payloads), svc.config.max_images)  # before any base64 is decoded
    return read_images(model, [from_base64(text) for text in payloads], svc.config.max_images)


def _keep_alive(value: Any) -> float | None:
    try:
        return parse_keep_alive(value)
    except DgemmaError as exc:
        raise RequestError(str(exc)) from None


async def _answer(request: Request, stream: WorkerStream, model: ResolvedModel, stream_flag, chat: bool, with_context: bool):
    def final(item: Final, text: str = "", thinking: str = "", tool_calls: list | None = None) -> dict[str, Any]:
        context = {"context": item.context} if with_context else {}
        return _answer_line(model, chat, text, thinking, True, tool_calls, done_reason=item.done_reason, **context,
                            **item.metrics.model_dump())

    if _stream_flag(stream_flag):
        def render(item):
            if isinstance(item, Text):
                return _answer_line(model, chat, item.text, item.thinking, False, item.tool_calls)
            if isinstance(item, Progress):
                return _answer_line(model, chat, "", "", False, **item.model_dump())
            if isinstance(item, Final):
                return final(item)
            return None

        return _ndjson(stream, render)

    items = await collect(request, stream)
    text = "".join(i.text for i in items if isinstance(i, Text))
    thinking = "".join(i.thinking for i in items if isinstance(i, Text))
    tool_calls = [call for i in items if isinstance(i, Text) for call in i.tool_calls]
    finals = [i for i in items if isinstance(i, Final)]
    if not finals:
        raise RequestError("generation ended without a result", 500)
    return JSONResponse(final(finals[-1], text, thinking, tool_calls))


# ---- info ---------------------------------------------------------------------------------------------------------

@router.get("/api/tags", response_model=wire.TagsResponse)
@router.head("/api/tags", include_in_schema=False)
async def tags(request: Request) -> JSONResponse:
    svc = services(request)
    entries = await asyncio.to_thread(svc.store.list_models)
    capabilities = await asyncio.to_thread(lambda: [model_info.listed_capabilities(svc.store, e) for e in entries])
    listed = [
        wire.ListedModel(
            name=e.name,
            model=e.name,
            modified_at=timestamp_of(e.modified),
            size=e.size,
            digest=e.digest,
            details=model_info.details(e.details),
            capabilities=caps,  # as /api/show lists them (model_info.capabilities)
        )
        for e, caps in zip(entries, capabilities)
    ]
    return JSONResponse(wire.TagsResponse(models=listed).wire())


@router.get("/api/ps", response_model=wire.PsResponse)
async def ps(request: Request) -> JSONResponse:
    svc = services(request)
    now = time.time()
    models = []
    for resident in svc.scheduler.running():
        runner = resident.runner
        local = resident.model
        models.append(
            wire.RunningModel(
                name=resident.name,
                model=resident.name,
                size=runner.size,
                digest=str(getattr(local, "manifest_digest", "")).removeprefix("sha256:"),
                details=model_info.details_of(local),
                expires_at=timestamp_of(resident.expiry_for_ps(now)),
                size_vram=runner.size_vram,
                context_length=runner.context_length,
            )
        )
    return JSONResponse(wire.PsResponse(models=models).wire())


@router.post("/api/show", response_model=wire.ShowResponse, responses=ERRORS)
async def show(req: wire.ShowRequest, request: Request) -> JSONResponse:
    svc = services(request)
    model = await svc.resolve(_model_text(req.model, req.name))
    answer = await asyncio.to_thread(model_info.show, model.local, bool(req.verbose), svc.config.host.is_loopback)
    return JSONResponse(answer.wire())


# ---- store --------------------------------------------------------------------------------------------------------

def _check_writable(svc: Services) -> None:
    if svc.config.readonly:
        raise RequestError("server is read-only", 403)


@router.post("/api/pull", response_model=wire.StatusResponse, responses={**ERRORS, 502: {"model": wire.ErrorResponse}})
async def pull(req: wire.PullRequest, request: Request):
    svc = services(request)
    _check_writable(svc)
    name = svc.parse_name(_model_text(req.model, req.name))
    from dgemma_cli.registry import pull as registry_pull

    def produce(cancel: threading.Event):
        if bundled_modelfile(name) is not None:  # shipped with dgemma: never fetched from a registry
            return pull_bundled(svc.store, name)
        return registry_pull(name, svc.store, insecure=bool(req.insecure), cancel=cancel)

    produce = svc.schemas.with_store_compile(produce, lambda: svc.store.resolve(name).gguf_path)
    return await _progress_answer(request, WorkerStream(produce, lambda failed: None), req.stream)


async def _progress_answer(request: Request, stream: WorkerStream, stream_flag: bool | None):
    """Pull/create status streams: NDJSON of status objects, or the last one (`success`) with `stream: false`."""
    if _stream_flag(stream_flag):
        # Wait for the first status so that validation failures still get their real status code (not 200 + line).
        items = stream.__aiter__()
        try:
            first = await until_disconnected(request, items.__anext__())
        except StopAsyncIteration:
            first = None
        except BaseException:
            stream.stop()
            raise

        async def statuses():
            if first is not None:
                yield first
            async for item in items:
                yield item

        return _ndjson(stream, lambda item: item, statuses())
    items = await collect(request, stream)
    return JSONResponse(items[-1] if items else wire.StatusResponse(status="success").wire())


def _clean_relative(name: str) -> bool:
    if not name or "\x00" in name or "\\" in name or PureWindowsPath(name).drive:
        return False
    path = PurePosixPath(name)
    return not path.is_absolute() and ".." not in path.parts and name not in (".",)


@router.post("/api/create", response_model=wire.StatusResponse, responses=ERRORS)
async def create(req: wire.CreateRequest, request: Request):
    svc = services(request)
    _check_writable(svc)
    if req.path is not None or req.modelfile is not None:
        raise RequestError("the server does not read Modelfiles or paths; send 'from', 'files' and the other fields")
    name = svc.parse_name(_model_text(req.model, req.name))
    check_name_text(req.from_)
    check_options(req.parameters)  # typed like request options, so that a created model's parameters can run
    if not req.from_ and not req.files:
        raise RequestError("neither 'from' or 'files' was specified")
    for key, digest in (*(req.files or {}).items(), *(req.adapters or {}).items()):
        if not _clean_relative(key):
            raise RequestError("file path must be relative")
        svc.blob_path(digest)  # the one validator: 400 invalid digest format
    gguf_paths = await asyncio.to_thread(create_upload.check_files, svc.store, req.files or {})
    if req.adapters:
        await asyncio.to_thread(create_upload.check_adapters, svc.store, req.adapters, gguf_paths, req.from_)

    def produce(cancel: threading.Event):
        return create_upload.create(svc.store, name, req, gguf_paths)

    produce = svc.schemas.with_store_compile(produce, lambda: svc.store.resolve(name).gguf_path)
    return await _progress_answer(request, WorkerStream(produce, lambda failed: None), req.stream)


@router.head("/api/blobs/{digest}", responses=ERRORS)
async def blob_exists(digest: str, request: Request) -> Response:
    svc = services(request)
    path = svc.blob_path(digest)
    if not await asyncio.to_thread(path.is_file):
        raise NotFound(f'blob "{digest}" not found')
    return Response(status_code=200)


@router.post("/api/blobs/{digest}", status_code=201, responses={**ERRORS, 413: {"model": wire.ErrorResponse}})
async def blob_upload(digest: str, request: Request) -> Response:
    svc = services(request)
    _check_writable(svc)
    path = svc.blob_path(digest)
    if await asyncio.to_thread(path.is_file):
        return Response(status_code=200)
    return await _receive_blob(svc, digest, request)


async def _receive_blob(svc: Services, digest: str, request: Request) -> Response:
    """Stream the body into a temp file inside `blobs/`, hashing as it goes; verify, then rename atomically
    (docs/compat.md, security G21)."""
    from dgemma_cli.store import normalize_digest

    expected = normalize_digest(digest)
    svc.store.ensure_dirs()
    tmp = svc.store.upload_path(expected)
    free = shutil.disk_usage(svc.store.blobs_dir).free
    cap = min(svc.config.max_upload, max(0, free - (1 << 30)))
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > cap:
        raise RequestError("upload too large", 413)
    hasher = hashlib.sha256()
    size = 0
    try:
        with open(tmp, "wb") as out:
            batch: list[bytes] = []
            batch_size = 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > cap:
                    raise RequestError("upload too large", 413)
                batch.append(chunk)
                batch_size += len(chunk)
                if batch_size >= 1 << 20:
                    await asyncio.to_thread(_write_batch, out, hasher, batch)
                    batch, batch_size = [], 0
            await asyncio.to_thread(_write_batch, out, hasher, batch)
        actual = "sha256:" + hasher.hexdigest()
        if actual != expected:
            raise RequestError(f'digest mismatch, expected "{expected}", got "{actual}"')
        await asyncio.to_thread(svc.store.commit_blob, tmp, expected)
    finally:
        tmp.unlink(missing_ok=True)
    return Response(status_code=201)


def _write_batch(out, hasher, batch: list[bytes]) -> None:
    for chunk in batch:
        hasher.update(chunk)
        out.write(chunk)


@router.post("/api/copy", responses=ERRORS)
async def copy(req: wire.CopyRequest, request: Request) -> Response:
    svc = services(request)
    _check_writable(svc)
    source = svc.parse_name(req.source or "", f'source "{req.source or ""}" is invalid')
    destination = svc.parse_name(req.destination or "", f'destination "{req.destination or ""}" is invalid')
    if not await asyncio.to_thread(svc.store.exists, source):
        raise ModelNotFoundError(req.source or "")
    await asyncio.to_thread(svc.store.copy, source, destination)
    return Response(status_code=200)


@router.delete("/api/delete", responses=ERRORS)
async def delete(req: wire.DeleteRequest, request: Request) -> Response:
    svc = services(request)
    _check_writable(svc)
    name = svc.parse_name(_model_text(req.model, req.name))
    if not await asyncio.to_thread(svc.store.exists, name):
        raise ModelNotFoundError(_model_text(req.model, req.name))
    await svc.scheduler.unload(name.display)
    await asyncio.to_thread(svc.store.delete, name)
    await asyncio.to_thread(mark_deleted, svc.store, name)  # a bundled model stays deleted until pulled
    return Response(status_code=200)


@router.post("/api/push", status_code=501, responses={501: {"model": wire.ErrorResponse}})
async def push() -> JSONResponse:
    return JSONResponse(wire.ErrorResponse(error="push is not supported").wire(), status_code=501)


@router.post("/api/embed", responses=ERRORS)
@router.post("/api/embeddings", responses=ERRORS, include_in_schema=False)
async def embed(req: wire.EmbedRequest, request: Request) -> JSONResponse:
    svc = services(request)
    model = await svc.resolve(_model_text(req.model, req.name))
    raise RequestError(f"{model.full} does not support embedding")
