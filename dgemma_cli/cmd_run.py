"""`dgemma run`, `ps` and `stop`: Ollama's client commands over the REST API (spec ollama-compat.md §1.1-§1.2).

`run` resolves the model with `/api/show` (pulling it on a 404), gives registered task renderers a chance to handle
the model (a bundled task model such as sudoku plugs in here), then runs one-shot over `/api/generate` when a prompt
is given or stdin is piped, or the interactive REPL (`repl.py`) over `/api/chat` otherwise.
"""
from __future__ import annotations

import shutil
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Optional, TextIO

import typer
from typer.core import TyperCommand

from dgemma_cli.errors import DgemmaError
from dgemma_cli.render import AnswerPrinter, timing_block

if TYPE_CHECKING:  # httpx is imported only by the commands that talk to a server (keeps `dgemma --help` quick)
    from dgemma_cli.client import Client

ARCHITECTURE = "diffusion-gemma"
THINK_VALUES = ("true", "false", "high", "medium", "low", "max")
SPINNER_FRAMES = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"


# ---- settings shared by one-shot mode and the REPL ------------------------------------------------------------------

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

    def request(self, **body: Any) -> dict[str, Any]:
        """A generate/chat request body with the current options (progress chunks requested when `progress`)."""
        out: dict[str, Any] = {"model": self.model, **body}
        if self.options:
            out["options"] = dict(self.options)
        if self.think is not None:
            out["think"] = self.think
        if self.keep_alive is not None:
            out["keep_alive"] = self.keep_alive
        if self.format:
            out["format"] = self.format
        return out


def parse_think(value: str | None) -> bool | str | None:
    """`--think` (bare = true), `--think=false`, or a level; Ollama's error text otherwise."""
    if value is None:
        return None
    lowered = value.strip().lower()
    if lowered not in THINK_VALUES:
        raise DgemmaError(f'invalid value for --think: "{value}" (must be true, false, high, medium, low, or max)')
    return {"true": True, "false": False}.get(lowered, lowered)


# ---- task renderers (model-specific front ends) ---------------------------------------------------------------------

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


# ---- terminal helpers -----------------------------------------------------------------------------------------------

def is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class Spinner:
    """`⠋ denoising canvas 2 · step 17/48` on stderr, animated by a thread; a no-op when stderr is not a terminal."""

    def __init__(self, stream: TextIO = sys.stderr, enabled: bool | None = None):
        self.stream = stream
        self.enabled = is_tty(stream) if enabled is None else enabled
        self.message = ""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._shown = False

    def start(self, message: str = "") -> "Spinner":
        self.message = message
        if self.enabled and self._thread is None:
            self._thread = threading.Thread(target=self._spin, daemon=True)
            self._thread.start()
        return self

    def set(self, message: str) -> None:
        self.message = message

    def _spin(self) -> None:
        frame = 0
        while not self._stop.wait(0.1):
            with self._lock:
                if self._stop.is_set():
                    return
                self.stream.write(f"\r\x1b[K{SPINNER_FRAMES[frame % len(SPINNER_FRAMES)]} {self.message}")
                self.stream.flush()
                self._shown = True
            frame += 1

    def stop(self) -> None:
        if self._thread is None:
            return
        with self._lock:
            self._stop.set()
            if self._shown:
                self.stream.write("\r\x1b[K")
                self.stream.flush()
        self._thread.join()
        self._thread = None


def chunk_text(chunk: dict[str, Any]) -> tuple[str, str]:
    """(content, thinking) of a generate or chat chunk."""
    message = chunk.get("message")
    if isinstance(message, dict):
        return str(message.get("content") or ""), str(message.get("thinking") or "")
    return str(chunk.get("response") or ""), str(chunk.get("thinking") or "")


def is_progress(chunk: dict[str, Any]) -> bool:
    return not chunk.get("done") and "completed" in chunk and "canvas" in chunk


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
            if is_progress(chunk):
                if live is not None:
                    live.on_progress(chunk)
                else:
                    spinner.set(f"denoising canvas {chunk['canvas']} · step {chunk['completed']}/{chunk['total']}")
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


# ---- model resolution -----------------------------------------------------------------------------------------------

def ensure_model(client: Client, model: str, insecure: bool = False, pull: bool = True) -> dict[str, Any]:
    """`/api/show`, pulling the model first on a 404 (Ollama's run), then the architecture check."""
    from dgemma_cli.client import ApiError

    try:
        show = client.show(model)
    except ApiError as exc:
        if exc.status != 404 or not pull:
            raise
        from dgemma_cli.cmd_store import ProgressRenderer

        ProgressRenderer().run(client.pull(model, insecure))  # as `dgemma pull`
        show = client.show(model)
    architecture = (show.get("model_info") or {}).get("general.architecture") or (show.get("details") or {}).get("family")
    if architecture and architecture != ARCHITECTURE:
        raise DgemmaError(f'model architecture "{architecture}" is not supported by dgemma')
    return show


def read_piped_stdin() -> str:
    if is_tty(sys.stdin):
        return ""
    try:
        return sys.stdin.read()
    except (OSError, ValueError):
        return ""


def run_once(client: Client, settings: RunSettings, prompt: str) -> None:
    """Non-interactive `run`: one `/api/generate`; an empty prompt only loads the model (§1.2)."""
    if not prompt:
        client.generate(settings.request(prompt=""))
        return
    output = Output(settings, interactive_ui=is_tty(sys.stdout))
    body = settings.request(prompt=prompt)
    if settings.system is not None:
        body["system"] = settings.system
    if output.wants_progress():
        body.setdefault("options", {})["diffusion_progress"] = True
        if output.visual:
            body["options"]["diffusion_preview"] = True
    stream_answer(client.generate_stream(body), output)


# ---- the commands ---------------------------------------------------------------------------------------------------

class ThinkFlagCommand(TyperCommand):
    """A bare `--think` means `--think=true` (Go's NoOptDefVal): the next word stays a prompt word."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        args = ["--think=true" if a == "--think" else a for a in args]
        return super().parse_args(ctx, args)


def run(
    model: str = typer.Argument(..., help="model name"),
    prompt: Optional[list[str]] = typer.Argument(None, help="prompt (omit for an interactive chat)"),
    verbose: bool = typer.Option(False, "--verbose", help="show timings after each answer"),
    visual: bool = typer.Option(False, "--visual", "--preview", help="show the canvas denoising live"),
    no_progress: bool = typer.Option(False, "--no-progress", help="no spinner while a canvas is denoised"),
    think: Optional[str] = typer.Option(None, "--think", help="enable thinking: true, false, low, medium, high, max"),
    hidethinking: bool = typer.Option(False, "--hidethinking", help="do not print the thinking block"),
    keepalive: Optional[str] = typer.Option(None, "--keepalive", help="how long the model stays loaded (e.g. 5m)"),
    nowordwrap: bool = typer.Option(False, "--nowordwrap", help="do not wrap words at the terminal edge"),
    format: Optional[str] = typer.Option(None, "--format", help="response format (json)"),
    insecure: bool = typer.Option(False, "--insecure", help="allow an insecure registry for the auto-pull"),
    seed: Optional[int] = typer.Option(None, "--seed", help="sampler seed (same seed, same answer)"),
    steps: Optional[int] = typer.Option(None, "--steps", help="max denoising steps per canvas (diffusion_steps)"),
    t_max: Optional[float] = typer.Option(None, "--t-max", help="temperature at the first step"),
    t_min: Optional[float] = typer.Option(None, "--t-min", help="temperature at the last step"),
    entropy_bound: Optional[float] = typer.Option(None, "--entropy-bound", help="entropy bound of the sampler"),
    confidence_threshold: Optional[float] = typer.Option(None, "--confidence-threshold", help="early-stop mean entropy"),
    stability_threshold: Optional[int] = typer.Option(None, "--stability-threshold", help="unchanged steps to stop"),
    num_predict: Optional[int] = typer.Option(None, "--num-predict", help="token budget (whole canvases are denoised)"),
) -> None:
    """Run a model: one answer for a prompt (or piped stdin), else an interactive chat."""
    from dgemma_engine.settings import options_from_fields

    options = {key: value for key, value in (("seed", seed), ("num_predict", num_predict)) if value is not None}
    options |= options_from_fields({  # each sampler flag by its setting's field name
        "max_steps": steps, "t_max": t_max, "t_min": t_min, "entropy_bound": entropy_bound,
        "confidence_threshold": confidence_threshold, "stability_threshold": stability_threshold,
    })
    settings = RunSettings(model=model, options=options, think=parse_think(think), hide_thinking=hidethinking,
                           keep_alive=keepalive, verbose=verbose, visual=visual, wordwrap=not nowordwrap,
                           format=format, insecure=insecure, progress=not no_progress)
    words = list(prompt or [])
    interactive = not words and is_tty(sys.stdin) and is_tty(sys.stdout)
    text = None
    if not interactive:
        piped = read_piped_stdin().strip()
        text = " ".join(part for part in (piped, " ".join(words)) if part)
        if not is_tty(sys.stdin):  # as Ollama: input from a pipe means output for a script (no spinner, no wrapping)
            settings.wordwrap = settings.progress = False
    from dgemma_cli.client import connect

    say = (lambda message: print(message, file=sys.stderr)) if verbose else None
    with connect(say) as client:
        show = ensure_model(client, model, insecure)
        context = TaskContext(client, show, text, settings)
        for renderer in TASK_RENDERERS:
            if renderer(context):
                return
        if interactive:
            from dgemma_cli.repl import Repl

            Repl(client, settings, show).run()
        else:
            try:
                run_once(client, settings, text or "")
            except KeyboardInterrupt:
                raise typer.Exit(130) from None


def _until(expires_at: str, now: datetime | None = None) -> str:
    """`4 minutes from now`, `Forever` (more than 20 years ahead), `Stopping...` (past)."""
    from dgemma_cli.cmd_store import human_duration

    try:
        when = datetime.fromisoformat(expires_at)
    except (TypeError, ValueError):
        return "Unknown"
    now = now or datetime.now(timezone.utc)
    seconds = (when - now).total_seconds()
    if seconds <= 0:
        return "Stopping..."
    if seconds > 20 * 365 * 24 * 3600:
        return "Forever"
    return human_duration(seconds) + " from now"


def _processor(size: int, size_vram: int) -> str:
    if size <= 0:
        return "Unknown"
    if size_vram >= size:
        return "100% GPU"
    if size_vram <= 0:
        return "100% CPU"
    gpu = round(100 * size_vram / size)
    return f"{100 - gpu}%/{gpu}% CPU/GPU"


def ps_table(models: list[dict[str, Any]], prefix: str | None = None) -> str:
    from dgemma_cli.cmd_store import human_bytes, table

    rows = [["NAME", "ID", "SIZE", "PROCESSOR", "CONTEXT", "UNTIL"]]
    for m in models:
        name = str(m.get("name") or m.get("model") or "")
        if prefix and not name.lower().startswith(prefix.lower()):
            continue
        size = int(m.get("size") or 0)
        rows.append([name, str(m.get("digest") or "")[:12], human_bytes(size),
                     _processor(size, int(m.get("size_vram") or 0)), str(m.get("context_length") or ""),
                     _until(str(m.get("expires_at") or ""))])
    return table(rows)


def ps(prefix: Optional[str] = typer.Argument(None, help="only names starting with this (any case)")) -> None:
    """List running models."""
    from dgemma_cli.client import connect

    with connect() as client:
        print(ps_table(client.ps().get("models") or [], prefix))


def stop(model: str = typer.Argument(..., help="model to unload")) -> None:
    """Stop (unload) a running model."""
    from dgemma_cli.client import ApiError, connect

    with connect() as client:
        try:
            client.generate({"model": model, "prompt": "", "keep_alive": 0})
        except ApiError as exc:
            if exc.status == 404:
                raise DgemmaError(f'couldn\'t find model "{model}" to stop') from None
            raise


def register(app: typer.Typer) -> None:
    app.command("run", cls=ThinkFlagCommand)(run)
    app.command("ps")(ps)
    app.command("stop")(stop)

