"""What `run`, the REPL and task renderers (Sudoku) share: the run settings, where output goes, showing one streamed
answer (`stream_answer`), resolving a model (`ensure_model`) and the task-renderer hook.

It sits between the commands and the client: it talks to a server only through a `client.Client` it is given.
"""
from __future__ import annotations

import shutil
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TextIO

from dgemma_engine.arch import check_architecture
from dgemma_engine.gguf_keys import KEY_ARCHITECTURE

from dgemma_cli.errors import DgemmaError
from dgemma_cli.render import AnswerPrinter, timing_block
from dgemma_cli.ui import ProgressRenderer, Spinner, is_tty

if TYPE_CHECKING:  # httpx and pydantic are imported only when a request is made (keeps `dgemma --help` quick)
    from dgemma_cli import wire
    from dgemma_cli.client import Client


# ---- settings shared by one-shot mode and the REPL -------------------------------------------------------------------

@dataclass
class RunSettings:
    """Everything a `run` invocation (and later `/set` in the REPL) decides about requests and output."""

    model: str
    options: dict[str, Any] = field(default_factory=dict)
    think: bool | str | None = None
    hide_thinking: bool = False
    keep_alive: str | None = None
    verbose: bool = False
    visual: bool = False
    wordwrap: bool = True
    format: str | None = None
    insecure: bool = False
    system: str | None = None
    progress: bool = True  # spinner with canvas/step counters while no text has arrived

    def _common(self, progress: bool, preview: bool) -> dict[str, Any]:
        """The fields generate and chat requests share: the current options (with the progress and draft chunks
        when asked for), think, keep_alive, format."""
        options = dict(self.options)
        if progress:
            options["diffusion_progress"] = True
            if preview:
                options["diffusion_preview"] = True
        return {"model": self.model, "options": options or None, "think": self.think, "keep_alive": self.keep_alive,
                "format": self.format or None}

    def generate_request(self, prompt: str, *, system: str | None = None, progress: bool = False,
                         preview: bool = False, images: list[str] | None = None) -> wire.GenerateRequest:
        from dgemma_cli import wire

        return wire.GenerateRequest(prompt=prompt, system=system, images=images or None,
                                    **self._common(progress, preview))

    def chat_request(self, messages: list[dict[str, Any]], *, progress: bool = False,
                     preview: bool = False) -> wire.ChatRequest:
        from dgemma_cli import wire

        return wire.ChatRequest(messages=messages, **self._common(progress, preview))


# ---- task renderers (model-specific front ends) ----------------------------------------------------------------------

@dataclass
class TaskContext:
    """What a task renderer sees: the connected client, the model's `/api/show` answer, the one-shot prompt (None in
    interactive mode) and the run settings."""

    client: Client
    show: dict[str, Any]
    prompt: str | None
    settings: RunSettings


TaskRenderer = Callable[[TaskContext], bool]

TASK_RENDERERS: list[TaskRenderer] = []



def register_task_renderer(renderer: TaskRenderer) -> TaskRenderer:
    """Register a hook called before generic chat handling; it returns True when it handled the run itself."""
    TASK_RENDERERS.append(renderer)
    return renderer


# ---- one streamed answer ---------------------------------------------------------------------------------------------

def chunk_text(chunk: dict[str, Any]) -> tuple[str, str]:
    """(content, thinking) of a generate or chat chunk."""
    message = chunk.get("message")
    if isinstance(message, dict):
        return str(message.get("content") or ""), str(message.get("thinking") or "")
    return str(chunk.get("response") or ""), str(chunk.get("thinking") or "")


@dataclass
class Output:
    """Where and how a generation is shown: stdout/stderr, colours, wrapping, live view."""

    settings: RunSettings
    out: TextIO = sys.stdout
    err: TextIO = sys.stderr
    interactive_ui: bool = True  # spinner and live view allowed (a terminal on stdout)

    @property
    def visual(self) -> bool:
        return self.settings.visual and self.interactive_ui

    def wants_progress(self) -> bool:
        return self.visual or (self.settings.progress and self.interactive_ui and is_tty(self.err))


def stream_answer(chunks: Iterator[dict[str, Any]], output: Output) -> tuple[dict[str, Any] | None, str]:
    """Show one streamed answer; returns (final chunk, answer content). KeyboardInterrupt propagates after the output
    has been closed cleanly (the caller closes `chunks`, which aborts the HTTP request)."""
    from dgemma_cli import wire

    settings = output.settings
    tty = is_tty(output.out)
    width = shutil.get_terminal_size((80, 24)).columns
    printer = AnswerPrinter(out=output.out, color=tty, hide_thinking=settings.hide_thinking,
                            wrap_width=width - 1 if (tty and settings.wordwrap and output.interactive_ui) else None)
    spinner = Spinner(output.err, enabled=settings.progress and output.interactive_ui and is_tty(output.err)
                      and not output.visual)
    live = None
    if output.visual:
        from rich.console import Console

        from dgemma_cli.live_view import LiveView

        live = LiveView(Console(file=output.out), hide_thinking=settings.hide_thinking).__enter__()
    spinner.start("")
    final = None
    answer = ""
    try:
        for chunk in chunks:
            if chunk.get("done"):
                final = chunk
                continue
            progress = wire.progress_of(chunk)
            if progress is not None:
                if live is not None:
                    live.on_progress(progress)
                else:
                    spinner.set(f"denoising canvas {progress.canvas} · step {progress.completed}/{progress.total}")
                continue
            content, thinking = chunk_text(chunk)
            if not content and not thinking:
                continue
            answer += content
            if live is not None:
                live.on_text(content, thinking)
            else:
                spinner.stop()
                printer.thinking(thinking)
                printer.content(content)
    finally:
        spinner.stop()
        if live is not None:
            live.finish()
        else:
            printer.finish()
    if final is not None and settings.verbose:
        block = timing_block(final)
        if block:
            output.err.write(("\n" if tty else "") + block + "\n")
            output.err.flush()
    return final, answer


# ---- model resolution ------------------------------------------------------------------------------------------------

def ensure_model(client: Client, model: str, insecure: bool = False, pull: bool = True) -> dict[str, Any]:
    """`/api/show`, pulling the model first on a 404 (Ollama's run), then the architecture check."""
    from dgemma_cli.client import ApiError

    try:
        show = client.show(model)
    except ApiError as exc:
        if exc.status != 404 or not pull:
            raise
        try:
            ProgressRenderer().run(client.pull(model, insecure))  # as `dgemma pull`
        except DgemmaError as pull_error:  # say both: not in the store, and why the pull did not bring it
            raise DgemmaError(f"model '{model}' not found, and pulling it failed: {pull_error}") from None
        show = client.show(model)
    architecture = (show.get("model_info") or {}).get(KEY_ARCHITECTURE) or (show.get("details") or {}).get("family")
    if architecture:  # a server that names none has checked the model itself
        check_architecture(architecture, error=DgemmaError)
    return show
