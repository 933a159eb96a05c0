"""POST /v1/responses: OpenAI's Responses API as Ollama implements it (text in, text out, streaming events,
`text.format` structured output), translated into the same generation path as /api/chat (docs/server.md).

Only sampling fields the client sent are forwarded (no implicit temperature, as the other OpenAI routes).
"""
import json
import secrets
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from dgemma_cli import wire
from dgemma_cli.server import inference, schemas
from dgemma_cli.server.errors import RequestError
from dgemma_cli.server.inference import Final, Text
from dgemma_cli.server.jobs import Job, admitted, with_model_messages
from dgemma_cli.server.services import services
from dgemma_cli.server.streaming import SSE, GuardedStreamingResponse, WorkerStream, collect, error_message, guarded_stream
from dgemma_cli.server.routing import CheckedRoute
from dgemma_cli.server.structured import openai_format
from dgemma_cli.server.validation import chat_role

router = APIRouter(prefix="/v1", route_class=CheckedRoute)
ERRORS = {status: {"model": wire.OpenAIError} for status in (400, 404, 500, 503)}
INPUT_TEXT_PARTS = ("input_text", "output_text", "text")


def _content_text(model, content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise RequestError("content must be a string or an array of content parts")
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in INPUT_TEXT_PARTS:
            parts.append(str(part.get("text", "")))
        elif kind == "input_image":
            raise RequestError(f"{model.full} does not support vision")
        elif kind == "input_file":
            raise RequestError("file inputs are not currently supported")
        else:
            raise RequestError(f"unknown content type: {kind}")
    return "".join(parts)


def _input_messages(model, req: schemas.ResponsesRequest) -> list[dict]:
    """`instructions` as the system message, then `input`: a string (one user message) or a list of items."""
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    if isinstance(req.input, str):
        return messages + ([{"role": "user", "content": req.input}] if req.input else [])
    for item in req.input or []:
        kind = item.get("type") or ("message" if item.get("role") else "")
        if kind == "message":
            role = chat_role(str(item.get("role") or "user"))
            if role == "tool":  # tool results are `function_call_output` items here
                raise RequestError(f"invalid message role {role!r}")
            messages.append({"role": role, "content": _content_text(model, item.get("content"))})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "content": _content_text(model, output)})
        elif kind == "reasoning":
            continue  # earlier thinking passed back: the chat template does not replay it
        elif not kind:
            raise RequestError("input item missing required 'type' field")
        else:
            raise RequestError(f"unsupported input item type: {kind!r}")
    return messages


def _options(req: schemas.ResponsesRequest) -> dict[str, Any]:
    options: dict[str, Any] = {}
    if req.max_output_tokens is not None:
        options["num_predict"] = req.max_output_tokens
    for field in ("temperature", "top_p"):
        if getattr(req, field) is not None:
            options[field] = getattr(req, field)
    return options


class ResponseBuilder:
    """The response object of one request, and its stream events (numbered in order)."""

    def __init__(self, model_name: str, req: schemas.ResponsesRequest):
        self.id = "resp_" + secrets.token_hex(12)
        self.message_id = "msg_" + secrets.token_hex(12)
        self.reasoning_id = "rs_" + secrets.token_hex(12)
        self.created_at = int(time.time())
        self.model_name = model_name
        self.req = req
        self.sequence = 0

    def response(self, status: str, output: list[wire.ResponseOutputItem], final: Final | None = None) -> dict:
        req = self.req
        text_format = {"type": "text"}
        if req.text is not None and req.text.format is not None:
            text_format = req.text.format.model_dump(by_alias=True, exclude_none=True)
        incomplete = None
        if final is not None and final.done_reason == "length":
            status, incomplete = "incomplete", wire.ResponseIncomplete(reason="max_output_tokens")
        usage = None
        if final is not None:
            prompt, completion = final.metrics.prompt_eval_count, final.metrics.eval_count
            usage = wire.ResponseUsage(input_tokens=prompt, output_tokens=completion, total_tokens=prompt + completion)
        return wire.ResponseObject(
            id=self.id, created_at=self.created_at, completed_at=int(time.time()) if final is not None else None,
            status=status, incomplete_details=incomplete, model=self.model_name, instructions=req.instructions,
            output=output, truncation=req.truncation or "disabled", text={"format": text_format},
            temperature=req.temperature, top_p=req.top_p, max_output_tokens=req.max_output_tokens, usage=usage,
        ).wire()

    def message(self, text: str, status: str = "completed") -> wire.ResponseOutputItem:
        content = [wire.ResponseOutputText(text=text)] if status == "completed" else []
        return wire.ResponseOutputItem(id=self.message_id, type="message", status=status, role="assistant",
                                       content=content)

    def reasoning(self, thinking: str) -> wire.ResponseOutputItem:
        summary = [wire.ResponseSummaryText(text=thinking)] if thinking else []
        return wire.ResponseOutputItem(id=self.reasoning_id, type="reasoning", summary=summary)

    def output(self, text: str, thinking: str) -> list[wire.ResponseOutputItem]:
        return ([self.reasoning(thinking)] if thinking else []) + [self.message(text)]

    def event(self, kind: str, **data: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **data}
        self.sequence += 1
        body = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
        return f"event: {kind}\ndata: {body}\n\n".encode()


def _stream(stream: WorkerStream, built: ResponseBuilder) -> GuardedStreamingResponse:
    """Ollama's event order: created, in_progress; per item added, deltas, done; completed."""

    async def frames():
        yield built.event("response.created", response=built.response("in_progress", []))
        yield built.event("response.in_progress", response=built.response("in_progress", []))
        text = thinking = ""
        index = 0
        message_open = reasoning_open = False
        final = None
        async for item in stream:
            if isinstance(item, Final):
                final = item
                continue
            if not isinstance(item, Text):
                continue
            if item.thinking:
                if not reasoning_open:
                    reasoning_open = True
                    yield built.event("response.output_item.added", output_index=index,
                                      item=built.reasoning("").wire())
                thinking += item.thinking
                yield built.event("response.reasoning_summary_text.delta", item_id=built.reasoning_id,
                                  output_index=index, summary_index=0, delta=item.thinking)
            if item.text:
                if reasoning_open and not message_open:
                    yield built.event("response.reasoning_summary_text.done", item_id=built.reasoning_id,
                                      output_index=index, summary_index=0, text=thinking)
                    yield built.event("response.output_item.done", output_index=index,
                                      item=built.reasoning(thinking).wire())
                    index += 1
                if not message_open:
                    message_open = True
                    yield built.event("response.output_item.added", output_index=index,
                                      item=built.message("", "in_progress").wire())
                    yield built.event("response.content_part.added", item_id=built.message_id, output_index=index,
                                      content_index=0, part=wire.ResponseOutputText(text="").wire())
                text += item.text
                yield built.event("response.output_text.delta", item_id=built.message_id, output_index=index,
                                  content_index=0, delta=item.text, logprobs=[])
        if not message_open:  # no text at all: still one (empty) message, as the non-streaming answer has
            yield built.event("response.output_item.added", output_index=index,
                              item=built.message("", "in_progress").wire())
            yield built.event("response.content_part.added", item_id=built.message_id, output_index=index,
                              content_index=0, part=wire.ResponseOutputText(text="").wire())
        yield built.event("response.output_text.done", item_id=built.message_id, output_index=index,
                          content_index=0, text=text, logprobs=[])
        yield built.event("response.content_part.done", item_id=built.message_id, output_index=index,
                          content_index=0, part=wire.ResponseOutputText(text=text).wire())
        yield built.event("response.output_item.done", output_index=index, item=built.message(text).wire())
        kind = "response.incomplete" if final is not None and final.done_reason == "length" else "response.completed"
        yield built.event(kind, response=built.response("completed", built.output(text, thinking), final))

    def error_frame(exc: Exception) -> bytes:
        error = wire.OpenAIError(error=wire.OpenAIErrorBody(message=error_message(exc), type="api_error"))
        return f"event: error\ndata: {error.model_dump_json()}\n\n".encode()

    return guarded_stream(stream, frames(), error_frame, SSE)


@router.post("/responses", response_model=wire.ResponseObject, responses=ERRORS)
@admitted
async def create_response(req: schemas.ResponsesRequest, request: Request):
    svc = services(request)
    model = await svc.resolve_runnable(req.model)
    if req.tools:
        raise RequestError(f"{model.full} does not support tools")
    output_format = None
    if req.text is not None and req.text.format is not None:
        output_format = openai_format(req.text.format.type, req.text.format.schema_)
    messages = _input_messages(model, req)
    if not messages:
        raise RequestError("input must not be empty")
    messages = with_model_messages(model, messages)
    effort = (req.reasoning or {}).get("effort")
    think = effort if effort not in (None, "none") else None

    def build_prompt(runner, thinking, _tools):
        return inference.chat_prompt(runner, messages, thinking, True)

    job = Job(svc, model, svc.merged_options(model, _options(req)), None, output_format)
    stream = await job.start(request, build_prompt, think)
    built = ResponseBuilder(model.display, req)
    if req.stream:
        return _stream(stream, built)
    items = await collect(request, stream)
    final = next((i for i in reversed(items) if isinstance(i, Final)), None)
    text = "".join(i.text for i in items if isinstance(i, Text))
    thinking = "".join(i.thinking for i in items if isinstance(i, Text))
    return JSONResponse(built.response("completed", built.output(text, thinking), final))
