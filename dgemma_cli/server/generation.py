"""One generation request, typed, from its route to the worker (docs/compat.md#concurrency-and-lifecycle).

Every route decodes its wire request into a `GenerationRequest`: the resolved model, the options decoded once
(options.py), the prompt (prompts.py), the output format, `think`, `tools` and `keep_alive`. `start` then does the rest
in one place: compile the format, check the prompt's size, queue for the model, build the prompt's ids, plan the
canvases and start the worker. Every 4xx happens before the first byte.
"""
import asyncio
import functools
import inspect
import logging
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

from fastapi import Request

from dgemma_cli.server import answers
from dgemma_cli.server.errors import RequestError
from dgemma_cli.server.options import RequestOptions
from dgemma_cli.server.prompts import Prompt, model_window, prompt_images
from dgemma_cli.server.request_images import check_decodable, check_vision
from dgemma_cli.server.services import ResolvedModel, Services, services
from dgemma_cli.server.output_format import OutputFormat
from dgemma_cli.server.output_format import compiled as output_format_compiled
from dgemma_cli.server.streaming import WorkerStream, until_disconnected
from dgemma_cli.server.tasks import TaskRequest, run_task

log = logging.getLogger("dgemma.server")


def admitted(handler):
    """Inference handlers count against DGEMMA_MAX_QUEUE from arrival until they hold a slot
    (docs/compat.md#concurrency-and-lifecycle). The handler gets the server's `Services` as its third argument."""

    @functools.wraps(handler)
    async def wrapper(req, request: Request):
        svc = services(request)
        with svc.scheduler.admission():
            return await handler(req, request, svc)

    signature = inspect.signature(handler)  # what FastAPI reads: the body and the request, not `svc`
    wrapper.__signature__ = signature.replace(parameters=list(signature.parameters.values())[:2])
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


async def compiled_format(svc: Services, local_model: Any, output_format: OutputFormat) -> Any:
    """The compiled automaton of this format for the model's vocabulary (server/schema_compiler.py, and
    output_format.compiled for a required tool call); a schema the vocabulary cannot write, or one too costly to
    compile, is the client's 400."""
    from dgemma_engine.constrained import ConstraintError

    try:
        return await output_format_compiled(svc.schemas, local_model, output_format)
    except ConstraintError as exc:
        raise RequestError(str(exc).splitlines()[0]) from None


def format_fits_budget(plan: answers.Plan) -> None:
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


@dataclass(frozen=True)
class GenerationRequest:
    """What a route decoded: everything a generation needs that does not depend on the loaded model."""

    model: ResolvedModel
    options: RequestOptions
    prompt: Prompt
    keep_alive: float | None = None
    output_format: OutputFormat | None = None
    think: bool | str | None = None
    tools: list[dict] | None = None
    started: float = field(default_factory=time.perf_counter)


async def start(request: Request, svc: Services, gen: GenerationRequest) -> WorkerStream:
    """Compile the output format, queue for the model, build the prompt, plan the canvases, start the worker."""
    # text and images that cannot fit the context the runner loads: a 400 before any decode, compile or load
    gen.prompt.check_size(await asyncio.to_thread(model_window, gen.model, gen.options.num_ctx))
    images = list(gen.prompt.images)  # counted and their headers read by the route (request_images.py)
    await check_decodable(images)  # then their pixels, once each: a corrupt image is a 400 before queueing
    automaton = None
    if gen.output_format is not None:  # compiled before queueing, so a costly schema never holds the model's slot
        automaton = await until_disconnected(request, compiled_format(svc, gen.model.local, gen.output_format))
    lease = await until_disconnected(request, svc.scheduler.acquire(
        gen.model.display, gen.model.local, gen.options.num_ctx, gen.keep_alive, gen.options.placement))
    try:
        runner, sampler = lease.runner, gen.options.sampler
        thinking = think_flag(gen.model, gen.think, runner.has_thinking)
        template_tools, tool_format = offered_tools(gen.model, runner, gen.tools)
        if images:  # again with the runner: a projector its vocabulary cannot address
            check_vision(gen.model, runner)
        prompt_ids = await asyncio.to_thread(gen.prompt.ids, runner, thinking, template_tools)
        task = TaskRequest.read(runner, prompt_ids)  # a task model's input (server/tasks.py); None: a text model
        plan = answers.plan_generation(runner, prompt_ids, sampler, svc.config.max_canvases,
                                         structured=gen.output_format is not None,
                                         images=prompt_images(prompt_ids, images, runner, gen.prompt.kept_images))
        if gen.output_format is not None:
            plan = replace(plan, constraint=automaton)
            await asyncio.to_thread(format_fits_budget, plan)  # a first check walks the automaton once
    except BaseException:
        lease.release()
        raise
    spare = await svc.scheduler.spare_leases(lease, sampler.task_tries - 1) if task is not None else []

    def produce(cancel: threading.Event):
        if task is not None:  # its tries side by side, one per slot held
            return run_task(runner, plan, sampler, cancel, task, 1 + len(spare), gen.started, lease.load_seconds)
        return answers.run_generation(runner, plan, sampler, cancel, bool(thinking), gen.started,
                                        lease.load_seconds, tool_format)

    def release(failed: bool) -> None:
        for held in (lease, *spare):
            held.release(failed)

    return WorkerStream(produce, release)


async def load_or_unload(request: Request, svc: Services, model: ResolvedModel, options: RequestOptions,
                         keep_alive: float | None) -> str:
    """An empty prompt or chat: load the model, or unload it with `keep_alive: 0`
    (docs/compat.md#load-unload-and-keep_alive). Returns the done reason."""
    if keep_alive == 0:
        await svc.scheduler.unload(model.display)
        return "unload"
    lease = await until_disconnected(request, svc.scheduler.acquire(model.display, model.local, options.num_ctx,
                                                                    keep_alive, options.placement))
    lease.release()
    return "load"
