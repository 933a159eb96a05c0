"""What a generation answers, independent of HTTP: the canvas plan, then the runner's events turned into text (stop
strings, `num_predict` cuts, thinking and tool calls split out), progress and metrics.

`run_generation` runs inside a worker thread and yields neutral outputs (`Text`, `Progress`, `Final`) that the Ollama
and OpenAI route modules turn into their own wire shapes. `Progress` and `Metrics` are the wire records themselves
(dgemma_cli/wire.py): a step event's fields get their wire names once, in `step_progress`. docs/compat.md
#canvas-budget (budget), #streaming-shape, #standard-knobs.
"""
import math
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from dgemma_cli.server.options import SamplerSettings
from dgemma_cli.server.runner import Runner
from dgemma_cli.server.prompts import image_room, no_room_error, prompt_budget
from dgemma_cli.wire import Metrics, Progress
from dgemma_engine.events import CanvasEvent, DoneEvent, StepEvent
from dgemma_engine.chat.tool_calls import ToolCall, ToolCallFormat, ToolCallStream

THOUGHT_OPEN = "<|channel>thought"
THOUGHT_CLOSE = "<channel|>"


@dataclass
class Text:
    text: str = ""
    thinking: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)  # calls that closed in this piece of text


@dataclass
class Final:
    done_reason: str  # "stop" | "length"
    metrics: Metrics
    context: list[int] = field(default_factory=list)  # prompt + answer ids (for /api/generate)


@dataclass(frozen=True)
class Plan:
    prompt_ids: list[int]
    max_new_tokens: int  # whole canvases
    token_limit: int | None  # exact num_predict cut, None = until EOS
    constraint: Any = None  # the runner's compiled output format (structured output), None = free text
    checker: Any = None  # a task model's rules for this prompt (dgemma_engine.tasks), None = a text model
    images: tuple = ()  # request_images.RequestImage per image marker in prompt_ids, in order


def _ns(seconds: float) -> int:
    return max(0, int(round(seconds * 1e9)))


def plan_generation(runner: Runner, prompt_ids: list[int], sampler: SamplerSettings, max_canvases: int,
                    structured: bool = False, images: list | tuple = ()) -> Plan:
    """Canvases = min(ceil(num_predict / C), DGEMMA_MAX_CANVASES, floor((num_ctx - prompt) / C))
    (docs/compat.md#canvas-budget). structured: the output format's stop id may sit right after the num_predict cut
    (it is never delivered), so the canvases hold one more position: ceil((num_predict + 1) / C). The prompt counts
    each image at its most positions (its marker expands to boi, the soft tokens, eoi)."""
    canvas = runner.canvas_length
    budget = prompt_budget(runner, len(images))
    if len(prompt_ids) > budget:
        raise no_room_error(len(prompt_ids) + image_room(runner, len(images)), canvas, runner.context_length,
                            len(images))
    room = 1 + (budget - len(prompt_ids)) // canvas
    limit = sampler.num_predict if sampler.num_predict >= 1 else None
    wanted = math.ceil((limit + int(structured)) / canvas) if limit else max_canvases
    canvases = min(wanted, max_canvases, room)
    return Plan(prompt_ids=list(prompt_ids), max_new_tokens=canvases * canvas, token_limit=limit, images=tuple(images))


class StopScanner:
    """Post-hoc stop strings over committed text; holds back `max(len(stop)) - 1` chars that could start a match."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """(text safe to emit now, whether a stop string matched: then the text ends before it)."""
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending = self.pending[: min(hits)], ""
            return out, True
        keep = min(self.hold, len(self.pending))
        out = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(out) :]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class ToolCallSplitter:
    """Moves complete tool calls out of the answer text (only when the request offered tools the template renders)."""

    def __init__(self, fmt: ToolCallFormat | None):
        self.stream = ToolCallStream(fmt) if fmt is not None else None

    def feed(self, part: Text) -> Text:
        if self.stream is None:
            return part
        text, calls = self.stream.feed(part.text)
        return Text(text=text, thinking=part.thinking, tool_calls=calls)

    def finish(self, part: Text) -> Text:
        """The last piece: an unclosed call stays text."""
        part = self.feed(part)
        if self.stream is not None:
            part.text += self.stream.finish()
        return part


class ThinkingSplitter:
    """Routes the model's `<|channel>thought … <channel|>` block to `thinking` (never inside `content`,
    docs/compat.md#standard-knobs)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.state = "start"  # start -> thinking -> answer
        self.buffer = ""

    def feed(self, text: str, final: bool = False) -> Text:
        if not self.enabled:
            return Text(text=text)
        self.buffer += text
        out = Text()
        while self.buffer:
            if self.state == "start":
                stripped = self.buffer.lstrip()
                if stripped.startswith(THOUGHT_OPEN):
                    self.buffer = stripped[len(THOUGHT_OPEN) :].lstrip("\n")
                    self.state = "thinking"
                elif THOUGHT_OPEN.startswith(stripped) and not final:
                    break  # could still become the marker
                else:
                    self.state = "answer"
            elif self.state == "thinking":
                end = self.buffer.find(THOUGHT_CLOSE)
                if end >= 0:
                    out.thinking += self.buffer[:end]
                    self.buffer = self.buffer[end + len(THOUGHT_CLOSE) :].lstrip("\n")
                    self.state = "answer"
                else:
                    keep = 0 if final else len(THOUGHT_CLOSE) - 1
                    cut = max(0, len(self.buffer) - keep)
                    out.thinking += self.buffer[:cut]
                    self.buffer = self.buffer[cut:]
                    break
            else:
                out.text += self.buffer
                self.buffer = ""
        return out


def step_progress(runner: Runner, event: StepEvent, preview: bool) -> Progress:
    """A step event as the wire's progress record (with the decoded draft when `preview`)."""
    progress = Progress(completed=int(event.step), total=int(event.max_steps), canvas=int(event.canvas_index) + 1)
    if preview:
        draft = list(event.argmax_ids)
        mask = event.accepted_mask
        progress.preview = runner.detokenize(draft)
        progress.entropy = float(event.mean_entropy)
        progress.accepted = int(event.accepted)
        progress.preview_tokens = [runner.detokenize([token]) for token in draft]
        progress.preview_accepted = [bool(a) for a in mask] if mask is not None else None
    return progress


def _tokens_covering(runner: Runner, ids: list[int], n_chars: int) -> int:
    """The fewest leading tokens of `ids` whose text has at least `n_chars` characters (for stop-string cuts)."""
    low, high = 0, len(ids)
    while low < high:
        mid = (low + high) // 2
        if len(runner.detokenize(ids[:mid])) >= n_chars:
            high = mid
        else:
            low = mid + 1
    return low


def run_generation(
    runner: Runner,
    plan: Plan,
    sampler: SamplerSettings,
    cancel: threading.Event,
    think: bool = False,
    started: float | None = None,
    load_seconds: float = 0.0,
    tool_format: ToolCallFormat | None = None,
) -> Iterator[Text | Progress | Final]:
    """Drive the runner and yield what clients see (tool calls in `tool_format` parsed out of the answer). Nothing
    final is yielded for a cancelled generation."""
    started = time.perf_counter() if started is None else started
    gen_start = time.perf_counter()
    stop = StopScanner(sampler.stop)
    thinking = ThinkingSplitter(think)
    calls = ToolCallSplitter(tool_format)
    answer_ids: list[int] = []
    streamed = ""  # concatenated canvas texts, for exact num_predict cuts
    delivered = 0  # characters that passed the stop-string scanner
    stop_matched = False
    steps = canvases = 0
    first_step_at = last_commit_at = None
    stats = None
    reason = None
    extra = {"constraint": plan.constraint} if plan.constraint is not None else {}
    if plan.checker is not None:
        extra["checker"] = plan.checker
    if plan.images:
        extra["images"] = list(plan.images)
    events = runner.generate(plan.prompt_ids, sampler, plan.max_new_tokens, cancel, **extra)
    try:
        for event in events:
            match event:
                case StepEvent():
                    steps += 1
                    first_step_at = first_step_at or time.perf_counter()
                    if sampler.progress:
                        yield step_progress(runner, event, sampler.preview)
                case CanvasEvent():
                    canvases += 1
                    last_commit_at = time.perf_counter()
                    ids = list(event.ids)  # committed tokens, already cut before the first EOS
                    text = event.text
                    limit, length = plan.token_limit, len(answer_ids) + len(ids)
                    # an EOS right at the limit ends the text on its own ("stop"): only more tokens are cut. With an
                    # output format, a value that fills the limit to a canvas edge has its stop id first in the next
                    # canvas (the plan holds one for it): that canvas decides.
                    at_edge = length == limit and event.eos_position is None and plan.constraint is None
                    cut = limit is not None and (length > limit or at_edge)
                    if cut:
                        ids = ids[: plan.token_limit - len(answer_ids)]
                        full = runner.detokenize(answer_ids + ids)
                        text = full[len(streamed) :] if full.startswith(streamed) else ""
                    answer_ids += ids
                    streamed += text
                    visible, stop_matched = stop.feed(text)
                    delivered += len(visible)
                    if visible:
                        part = calls.feed(thinking.feed(visible))
                        if calls.stream is None or part.text or part.thinking or part.tool_calls:
                            yield part  # (a piece held back whole as a possible call start is not sent)
                    if stop_matched:
                        reason = "stop"
                        break
                    if cut:
                        reason = "length"
                        break
                case DoneEvent():
                    stats = event.stats
                    reason = {"eos": "stop", "cancelled": "cancelled"}.get(event.reason, "length")
    finally:
        close = getattr(events, "close", None)
        if close is not None:
            close()
    if reason in (None, "cancelled") or cancel.is_set():
        return
    tail = calls.finish(thinking.feed(stop.flush(), final=True))
    if tail.text or tail.thinking or tail.tool_calls:
        yield tail
    if stop_matched:  # eval_count and context cover only what the client got
        answer_ids = answer_ids[: _tokens_covering(runner, answer_ids, delivered)]
    now = time.perf_counter()
    prompt_s = getattr(stats, "prompt_eval_s", None)
    if prompt_s is None:
        prompt_s = (first_step_at or now) - gen_start
    eval_s = max(0.0, (last_commit_at or now) - gen_start - prompt_s)
    metrics = Metrics(
        total_duration=_ns(now - started),
        load_duration=_ns(load_seconds),
        prompt_eval_count=int(getattr(stats, "prompt_tokens", len(plan.prompt_ids))),
        prompt_eval_duration=_ns(prompt_s),
        eval_count=len(answer_ids),
        eval_duration=_ns(eval_s),
        denoise_steps=steps,
        canvases=canvases,
        host_bytes_per_step=round(getattr(stats, "host_bytes_per_step", 0.0)) or None,
    )
    yield Final(done_reason=reason, metrics=metrics, context=plan.prompt_ids + answer_ids)
