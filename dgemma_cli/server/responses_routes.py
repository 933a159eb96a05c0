"""POST /v1/responses: OpenAI's Responses API as Ollama implements it (text in, text out, streaming events,
`text.format` structured output, function tools and `tool_choice`), translated into the same generation path as
/api/chat (docs/server.md, "Tools" and the Responses API); and its state: recent responses are kept
(server/response_store.py) for `previous_response_id`, `item_reference` input items and GET / DELETE
/v1/responses/{id}.

Only sampling fields the client sent are forwarded (no implicit temperature, as the other OpenAI routes).
"""
import json
import secrets
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from dgemma_cli import wire
from dgemma_cli.server.errors import RequestError
from dgemma_cli.server.answers import Final, Text
from dgemma_cli.server.generation import GenerationRequest, admitted, start
from dgemma_cli.server.services import Services, services
from dgemma_cli.server.streaming import SSE, GuardedStreamingResponse, WorkerStream, collect, error_message, guarded_stream
from dgemma_cli.server.options import request_options
from dgemma_cli.server.prompts import chat_prompt
from dgemma_cli.server.request_images import from_data_url, read_message_images, url_of
from dgemma_cli.server.routing import CheckedRoute
from dgemma_cli.server.output_format import openai_format
from dgemma_cli.server.response_store import ResponseStore
from dgemma_cli.server.tool_choice import call_format, function_tools, prompt_tools, read_tool_choice
from dgemma_cli.server.validation import chat_role
from dgemma_engine.chat.tool_calls import ToolCall

router = APIRouter(prefix="/v1", route_class=CheckedRoute)
ERRORS = {status: {"model": wire.OpenAIError} for status in (400, 404, 500, 503)}
INPUT_TEXT_PARTS = ("input_text", "output_text", "text")


def _content_text(model, content: Any) -> str:
    """Text-only content (a tool's output)."""
    entry = _content(content)
    if entry.get("images"):
        raise RequestError("images are only supported in message content")
    return entry["content"]


def _content(content: Any) -> dict[str, Any]:
    """A message's content: its text, and its `input_image` parts (base64 `data:` URLs in `image_url`) as `images`,
    each at its place in the text (`image_places`, prompts.with_image_markers)."""
    if content is None or isinstance(content, str):
        return {"content": content or ""}
    if not isinstance(content, list):
        raise RequestError("content must be a string or an array of content parts")
    text, images, places = "", [], []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in INPUT_TEXT_PARTS:
            text += str(part.get("text", ""))
        elif kind == "input_image":
            images.append(from_data_url(url_of(part)))
            places.append(len(text))
        elif kind == "input_file":
            raise RequestError("file inputs are not currently supported")
        else:
            raise RequestError(f"unknown content type: {kind}")
    return {"content": text, **({"images": images, "image_places": places} if images else {})}


def _arguments(text: Any) -> dict:
    """A `function_call` item's `arguments` (a JSON string) as the object the template renders."""
    if text in (None, ""):
        return {}
    try:
        value = json.loads(text) if isinstance(text, str) else text
    except ValueError as exc:
        raise RequestError(f"failed to parse function call arguments: {exc}") from None
    if not isinstance(value, dict):
        raise RequestError("function call arguments must be a JSON object")
    return value


class _History:
    """Input items as template messages: a `function_call` joins the assistant turn before it (or opens one), a
    `function_call_output` is a tool message named after the call it answers."""

    def __init__(self, model, messages: list[dict]):
        self.model = model
        self.messages = messages
        self.call_names: dict[str, str] = {}

    def message(self, item: dict) -> None:
        role = chat_role(str(item.get("role") or "user"))
        if role == "tool":  # tool results are `function_call_output` items here
            raise RequestError(f"invalid message role {role!r}")
        self.messages.append({"role": role, **_content(item.get("content"))})

    def function_call(self, item: dict) -> None:
        name, call_id = item.get("name"), item.get("call_id")
        if not isinstance(name, str) or not name:
            raise RequestError("function_call item missing required 'name' field")
        call = {"type": "function", "function": {"name": name, "arguments": _arguments(item.get("arguments"))}}
        if isinstance(call_id, str):
            call["id"] = call_id
            self.call_names[call_id] = name
        last = self.messages[-1] if self.messages else None
        if last is None or last["role"] != "assistant":
            last = {"role": "assistant", "content": ""}
            self.messages.append(last)
        last.setdefault("tool_calls", []).append(call)

    def function_call_output(self, item: dict) -> None:
        entry = {"role": "tool", "content": _content_text(self.model, item.get("output"))}
        call_id = item.get("call_id")
        if isinstance(call_id, str):
            entry["tool_call_id"] = call_id
            if call_id in self.call_names:
                entry["name"] = self.call_names[call_id]
        self.messages.append(entry)


def _input_items(req: wire.ResponsesRequest, store: ResponseStore) -> list[dict]:
    """The conversation as input items: the one `previous_response_id` continues (its input and output), then
    `input` (a string is one user message), each `item_reference` replaced by the stored item it names. An id the
    store does not hold is OpenAI's 404."""
    items = list(store.response(req.previous_response_id).conversation) if req.previous_response_id else []
    if isinstance(req.input, str):
        return items + ([{"type": "message", "role": "user", "content": req.input}] if req.input else [])
    for item in req.input or []:
        if item.get("type") == "item_reference":
            if not isinstance(item.get("id"), str):
                raise RequestError("item_reference input item missing required 'id' field")
            item = store.item(item["id"])
        items.append(item)
    return items


def _input_messages(model, instructions: str | None, items: list[dict]) -> list[dict]:
    """`instructions` as the system message, then the input items as template messages."""
    messages = [{"role": "system", "content": instructions}] if instructions else []
    history = _History(model, messages)
    for item in items:
        kind = item.get("type") or ("message" if item.get("role") else "")
        if kind == "message":
            history.message(item)
        elif kind == "function_call":
            history.function_call(item)
        elif kind == "function_call_output":
            history.function_call_output(item)
        elif kind == "reasoning":
            continue  # earlier thinking passed back: the chat template does not replay it
        elif not kind:
            raise RequestError("input item missing required 'type' field")
        else:
            raise RequestError(f"unsupported input item type: {kind!r}")
    return messages


def _options(req: wire.ResponsesRequest) -> dict[str, Any]:
    options: dict[str, Any] = {}
    if req.max_output_tokens is not None:
        options["num_predict"] = req.max_output_tokens
    for field in ("temperature", "top_p", "seed"):
        if getattr(req, field) is not None:
            options[field] = getattr(req, field)
    return options


class ResponseBuilder:
    """The response object of one request, and its stream events (numbered in order)."""

    def __init__(self, model_name: str, req: wire.ResponsesRequest):
        self.final: dict | None = None  # the response object once the answer is complete
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
        body = wire.ResponseObject(
            id=self.id, created_at=self.created_at, completed_at=int(time.time()) if final is not None else None,
            status=status, incomplete_details=incomplete, model=self.model_name,
            previous_response_id=req.previous_response_id, instructions=req.instructions,
            output=output, tools=list(req.tools or []), tool_choice=req.tool_choice or "auto",
            truncation=req.truncation or "disabled", text={"format": text_format},
            temperature=req.temperature, top_p=req.top_p, max_output_tokens=req.max_output_tokens, usage=usage,
            store=req.store is not False,
        ).wire()
        if final is not None:
            self.final = body
        return body

    @staticmethod
    def item_status(final: Final | None) -> str:
        """A finished item's status: "incomplete" when the answer was cut at max_output_tokens."""
        return "incomplete" if final is not None and final.done_reason == "length" else "completed"

    def message(self, text: str, status: str = "completed") -> wire.ResponseOutputItem:
        content = [wire.ResponseOutputText(text=text)] if status != "in_progress" else []
        return wire.ResponseOutputItem(id=self.message_id, type="message", status=status, role="assistant",
                                       content=content)

    def reasoning(self, thinking: str) -> wire.ResponseOutputItem:
        summary = [wire.ResponseSummaryText(text=thinking)] if thinking else []
        return wire.ResponseOutputItem(id=self.reasoning_id, type="reasoning", summary=summary)

    @staticmethod
    def function_call(call: ToolCall) -> wire.ResponseOutputItem:
        """A parsed call: a fresh item id and `call_id` (the id `function_call_output` answers), arguments as JSON."""
        return wire.ResponseOutputItem(id="fc_" + secrets.token_hex(12), type="function_call", status="completed",
                                       call_id="call_" + secrets.token_hex(12), name=call.name,
                                       arguments=json.dumps(call.arguments, ensure_ascii=False))

    def output(self, text: str, thinking: str, calls: list[ToolCall],
               final: Final | None) -> list[wire.ResponseOutputItem]:
        """Reasoning, the message (kept when it has text, so text around a call is not lost; always when there is
        no call), then one `function_call` item per call."""
        items = [self.reasoning(thinking)] if thinking else []
        if text.strip() or not calls:
            items.append(self.message(text, self.item_status(final)))
        return items + [self.function_call(call) for call in calls]

    def event(self, kind: str, **data: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **data}
        self.sequence += 1
        body = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
        return f"event: {kind}\ndata: {body}\n\n".encode()


class _StreamEvents:
    """The events of one streamed answer, in Ollama's order: created, in_progress; per output item `added`, its
    deltas, `done`; completed. Output indexes are given as items open: reasoning first, then the message (opened by
    its first non-blank text) and the function calls in the order the model wrote them."""

    def __init__(self, built: ResponseBuilder):
        self.built = built
        self.next_index = 0
        self.items: list[tuple[int, wire.ResponseOutputItem]] = []  # closed items, for the final output
        self.reasoning_index: int | None = None
        self.message_index: int | None = None
        self.thinking = self.text = self.blank = ""  # `blank`: whitespace not yet sent (it may open no message)
        self.calls = 0

    def _open(self) -> int:
        index, self.next_index = self.next_index, self.next_index + 1
        return index

    def think(self, piece: str) -> list[bytes]:
        b, out = self.built, []
        if self.reasoning_index is None:
            self.reasoning_index = self._open()
            out.append(b.event("response.output_item.added", output_index=self.reasoning_index,
                               item=b.reasoning("").wire()))
        self.thinking += piece
        out.append(b.event("response.reasoning_summary_text.delta", item_id=b.reasoning_id,
                           output_index=self.reasoning_index, summary_index=0, delta=piece))
        return out

    def close_reasoning(self) -> list[bytes]:
        b, index = self.built, self.reasoning_index
        if index is None or any(i == index for i, _ in self.items):
            return []
        item = b.reasoning(self.thinking)
        self.items.append((index, item))
        return [b.event("response.reasoning_summary_text.done", item_id=b.reasoning_id, output_index=index,
                        summary_index=0, text=self.thinking),
                b.event("response.output_item.done", output_index=index, item=item.wire())]

    def say(self, piece: str, force: bool = False) -> list[bytes]:
        b = self.built
        if self.message_index is None and not force and not (self.blank + piece).strip():
            self.blank += piece
            return []
        out = self.close_reasoning()
        if self.message_index is None:
            self.message_index = self._open()
            out.append(b.event("response.output_item.added", output_index=self.message_index,
                               item=b.message("", "in_progress").wire()))
            out.append(b.event("response.content_part.added", item_id=b.message_id, output_index=self.message_index,
                               content_index=0, part=wire.ResponseOutputText(text="").wire()))
        piece, self.blank = self.blank + piece, ""
        if piece:
            self.text += piece
            out.append(b.event("response.output_text.delta", item_id=b.message_id, output_index=self.message_index,
                               content_index=0, delta=piece, logprobs=[]))
        return out

    def call(self, call: ToolCall) -> list[bytes]:
        """A complete call at once: added (empty arguments), the arguments as one delta, done."""
        b, out = self.built, self.close_reasoning()
        item, index = b.function_call(call), self._open()
        self.calls += 1
        self.items.append((index, item))
        opening = item.model_copy(update={"status": "in_progress", "arguments": ""})
        out.append(b.event("response.output_item.added", output_index=index, item=opening.wire()))
        out.append(b.event("response.function_call_arguments.delta", item_id=item.id, output_index=index,
                           delta=item.arguments))
        out.append(b.event("response.function_call_arguments.done", item_id=item.id, output_index=index,
                           arguments=item.arguments))
        out.append(b.event("response.output_item.done", output_index=index, item=item.wire()))
        return out

    def finish(self, final: Final | None) -> list[bytes]:
        """Close what is open; with no call, there is always one (maybe empty) message, as the non-streaming answer
        has."""
        b, out = self.built, self.close_reasoning()
        if self.message_index is None and not self.calls:
            out += self.say("", force=True)
        if self.message_index is not None:
            index, text = self.message_index, self.text
            out.append(b.event("response.output_text.done", item_id=b.message_id, output_index=index,
                               content_index=0, text=text, logprobs=[]))
            out.append(b.event("response.content_part.done", item_id=b.message_id, output_index=index,
                               content_index=0, part=wire.ResponseOutputText(text=text).wire()))
            message = b.message(text, b.item_status(final))
            self.items.append((index, message))
            out.append(b.event("response.output_item.done", output_index=index, item=message.wire()))
        output = [item for _, item in sorted(self.items, key=lambda pair: pair[0])]
        kind = "response.incomplete" if final is not None and final.done_reason == "length" else "response.completed"
        out.append(b.event(kind, response=b.response("completed", output, final)))
        return out


def _stream(stream: WorkerStream, built: ResponseBuilder, keep) -> GuardedStreamingResponse:
    async def frames():
        yield built.event("response.created", response=built.response("in_progress", []))
        yield built.event("response.in_progress", response=built.response("in_progress", []))
        events = _StreamEvents(built)
        final = None
        async for item in stream:
            if isinstance(item, Final):
                final = item
                continue
            if not isinstance(item, Text):
                continue
            frames_now = events.think(item.thinking) if item.thinking else []
            if item.text:
                frames_now += events.say(item.text)
            for call in item.tool_calls:
                frames_now += events.call(call)
            for frame in frames_now:
                yield frame
        for frame in events.finish(final):
            yield frame
        keep(built.final)

    def error_frame(exc: Exception) -> bytes:
        error = wire.OpenAIError(error=wire.OpenAIErrorBody(message=error_message(exc), type="api_error"))
        return f"event: error\ndata: {error.model_dump_json()}\n\n".encode()

    return guarded_stream(stream, frames(), error_frame, SSE)


@router.post("/responses", response_model=wire.ResponseObject, responses=ERRORS)
@admitted
async def create_response(req: wire.ResponsesRequest, request: Request, svc: Services):
    model = await svc.resolve_runnable(req.model)
    choice = read_tool_choice(req.tool_choice)
    offered = function_tools(req.tools)
    tools = prompt_tools(offered, choice)
    output_format = call_format(model, offered, choice)  # a call the answer must be; else text.format's
    if output_format is None and req.text is not None and req.text.format is not None:
        output_format = openai_format(req.text.format.type, req.text.format.schema_)
    items = _input_items(req, svc.responses)
    messages = _input_messages(model, req.instructions, items)
    read_message_images(model, messages, svc.config.max_images)
    if not messages:
        raise RequestError("input must not be empty")
    effort = (req.reasoning or {}).get("effort")
    think = effort if effort not in (None, "none") else None
    options = await request_options(svc.config, model.local, _options(req))
    gen = GenerationRequest(model, options, chat_prompt(model.local, messages), None, output_format, think, tools)
    stream = await start(request, svc, gen)
    built = ResponseBuilder(model.display, req)

    def keep(response: dict | None) -> None:
        if response is not None and req.store is not False:
            svc.responses.put(response, items)

    if req.stream:
        return _stream(stream, built, keep)
    answer = await collect(request, stream)
    final = next((i for i in reversed(answer) if isinstance(i, Final)), None)
    texts = [i for i in answer if isinstance(i, Text)]
    text, thinking = "".join(i.text for i in texts), "".join(i.thinking for i in texts)
    calls = [call for i in texts for call in i.tool_calls]
    response = built.response("completed", built.output(text, thinking, calls, final), final)
    keep(response)
    return JSONResponse(response)


@router.get("/responses/{response_id}", response_model=wire.ResponseObject, responses=ERRORS)
async def retrieve_response(response_id: str, request: Request) -> JSONResponse:
    return JSONResponse(services(request).responses.response(response_id).response)


@router.delete("/responses/{response_id}", response_model=wire.ResponseDeleted, responses=ERRORS)
async def delete_response(response_id: str, request: Request) -> JSONResponse:
    store = services(request).responses
    store.response(response_id)  # an unknown id: the 404
    store.delete(response_id)
    return JSONResponse(wire.ResponseDeleted(id=response_id).wire())
