"""What the native and the OpenAI routes share for one generation: admission, request checks, prompt rendering and
the `Job` that queues for the model and starts the worker (every 4xx happens before the first byte)."""
import asyncio
import functools
import logging
import threading
import time
from dataclasses import replace
from typing import Any

from dgemma_engine.chat.jinja import ChatTemplateBudgetError, ChatTemplateError
from dgemma_engine.chat.templates import ChatTemplate, render_prompt
from fastapi import Request

from dgemma_cli.server import inference
from dgemma_cli.server.errors import RequestError
from dgemma_cli.server.options import RequestOptions
from dgemma_cli.server.scheduler import placed_model
from dgemma_cli.server.services import ResolvedModel, Services, services
from dgemma_cli.server.structured import OutputFormat
from dgemma_cli.server.streaming import WorkerStream, until_disconnected
from dgemma_cli.server.tasks import TaskRequest, run_task

log = logging.getLogger("dgemma.server")


def admitted(handler):
    """Inference handlers count against DGEMMA_MAX_QUEUE from arrival until they hold a slot
    (docs/compat.md#concurrency-and-lifecycle)."""

    @functools.wraps(handler)
    async def wrapper(req, request: Request):
        with services(request).scheduler.admission():
            return await handler(req, request)

    return wrapper


def common_checks(model: ResolvedModel, logprobs: bool | None, top_logprobs: int | None) -> None:
    """A capability dgemma lacks, refused with Ollama's errors: logprobs."""
    if top_logprobs is not None and not 0 <= top_logprobs <= 20:
        raise RequestError("top_logprobs must be between 0 and 20")
    if logprobs or (top_logprobs or 0) > 0:
        raise RequestError(f"{model.quoted} does not support logprobs")


def think_flag(model: ResolvedModel, think: bool | str | None, has_thinking: bool) -> bool | None:
    if think is None or think is False:
        return None if think is None else False
    if isinstance(think, str) and think.lower() not in ("true", "low", "medium", "high", "max"):
        if think.lower() == "false":
            return False
        raise RequestError(f'invalid think value: "{think}" (must be true, false, high, medium, low, or max)')
    if not has_thinking:
        raise RequestError(f"{model.quoted} does not support thinking")
    return True


def with_model_messages(model: ResolvedModel, messages: list[dict]) -> list[dict]:
    """Modelfile MESSAGEs first; the model SYSTEM leads unless the request starts with its own system message."""
    preset = [dict(m) for m in model.local.messages or []]
    if model.local.system and not (messages and messages[0]["role"] == "system"):
        preset.insert(0, {"role": "system", "content": model.local.system})
    return preset + messages


def render_messages(runner, messages: list[dict], thinking: bool | None, override: ChatTemplate | None = None) -> str:
    """The prompt text of `messages` (with a per-request template `override`); template failures are a clean 500."""
    try:
        if override is not None:
            return render_prompt(override, messages, thinking, runner.special_tokens)
        return runner.render_chat(messages, thinking)
    except RequestError:
        raise
    except ChatTemplateError as exc:
        if override is not None and override.from_request and not isinstance(exc, ChatTemplateBudgetError):
            raise RequestError(f"template error: {exc.detail}"[:300]) from None  # the caller's own template
        raise inference.render_failed(exc) from None
    except Exception as exc:  # noqa: BLE001
        raise inference.render_failed(exc) from None


async def compiled_format(svc: Services, local_model: Any, output_format: OutputFormat) -> Any:
    """The compiled automaton of this format for the model's vocabulary (server/schema_compiler.py); a schema the
    vocabulary cannot write, or one too costly to compile, is the client's 400."""
    from dgemma_engine.constrained import ConstraintError

    try:
        return await svc.schemas.automaton(local_model.gguf_path, output_format.schema)
    except ConstraintError as exc:
        raise RequestError(str(exc).splitlines()[0]) from None


def format_fits_budget(plan: inference.Plan) -> None:
    """A token budget too small for the format's shortest value is the client's 400, before any canvas is denoised."""
    from dgemma_engine.constrained import ConstraintError, TokenAutomaton, check_room

    if not isinstance(plan.constraint, TokenAutomaton):  # a test runner's stand-in, which follows no automaton
        return
    try:
        check_room(plan.constraint, plan.max_new_tokens, plan.token_limit)
    except ConstraintError as exc:
        raise RequestError(str(exc)) from None


def offered_tools(model: ResolvedModel, runner, tools: list[dict] | None) -> tuple[list[dict] | None, object]:
    """The request's `tools` for the template and the call syntax to parse, when the template renders tools. A model
    whose template cannot is still answered, without them (docs/server.md, "Tools"): clients such as Open WebUI
    send their built-in tools with every chat."""
    if not tools:
        return None, None
    fmt = runner.tool_format
    if fmt is None:
        log.warning("%s: the chat template cannot render tools; ignoring the %d tool(s) of the request",
                    model.display, len(tools))
        return None, None
    return tools, fmt


class Job:
    """What a generate/chat request resolved to once its model is resident."""

    def __init__(self, svc: Services, model: ResolvedModel, options: RequestOptions, keep_alive: float | None,
                 output_format: OutputFormat | None = None):
        self.svc = svc
        self.output_format = output_format
        self.model = model
        self.sampler = options.sampler
        self.num_ctx = options.num_ctx
        self.keep_alive = keep_alive
        self.local = placed_model(model.local, options.placement)
        self.started = time.perf_counter()

    async def start(self, request: Request, build_prompt, think, tools: list[dict] | None = None) -> WorkerStream:
        """Compile the output format, queue for the model, render the prompt, plan the canvases: every 4xx happens
        before the first byte. `build_prompt(runner, thinking, tools)` gets the request's `tools` when the template
        can render them."""
        automaton = None
        if self.output_format is not None:  # compiled before queueing, so a costly schema never holds the model's slot
            automaton = await until_disconnected(request, compiled_format(self.svc, self.local, self.output_format))
        lease = await until_disconnected(
            request, self.svc.scheduler.acquire(self.model.display, self.local, self.num_ctx, self.keep_alive)
        )
        try:
            runner = lease.runner
            sampler = self.sampler
            thinking = think_flag(self.model, think, runner.has_thinking)
            template_tools, tool_format = offered_tools(self.model, runner, tools)
            prompt_ids = await asyncio.to_thread(build_prompt, runner, thinking, template_tools)
            task = TaskRequest.read(runner, prompt_ids)  # a task model's input (server/tasks.py); None: a text model
            plan = inference.plan_generation(runner, prompt_ids, sampler, self.svc.config.max_canvases,
                                             structured=self.output_format is not None)
            if self.output_format is not None:
                plan = replace(plan, constraint=automaton)
                await asyncio.to_thread(format_fits_budget, plan)  # a first check walks the automaton once
        except BaseException:
            lease.release()
            raise
        load_s = lease.load_seconds
        spare = await self.svc.scheduler.spare_leases(lease, sampler.task_tries - 1) if task is not None else []

        def produce(cancel: threading.Event):
            if task is not None:  # its tries side by side, one per slot held
                return run_task(runner, plan, sampler, cancel, task, 1 + len(spare), self.started, load_s)
            return inference.run_generation(runner, plan, sampler, cancel, bool(thinking), self.started, load_s,
                                            tool_format)

        def release(failed: bool) -> None:
            for held in (lease, *spare):
                held.release(failed)

        return WorkerStream(produce, release)
