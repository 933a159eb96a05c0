"""`dgemma run`, `ps` and `stop`: Ollama's client commands over the REST API (docs/compat.md#commands, #run).

`run` resolves the model with `/api/show` (pulling it on a 404), gives registered task renderers a chance to handle
the model (a bundled task model such as sudoku plugs in here), then runs one-shot over `/api/generate` when a prompt
is given or stdin is piped, or the interactive REPL (`repl.py`) over `/api/chat` otherwise. What one-shot mode and
the REPL share (settings, output, streaming, model resolution) is `session.py`; terminal helpers are `ui.py`.
"""
from __future__ import annotations

import sys
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any, Optional

import typer
from typer.core import TyperCommand

from dgemma_cli.errors import DgemmaError
from dgemma_cli.prompt_images import extract_images, has_vision
from dgemma_cli.session import TASK_RENDERERS, Output, RunSettings, TaskContext, ensure_model, stream_answer
from dgemma_cli.ui import human_bytes, human_duration, is_tty, table

if TYPE_CHECKING:  # httpx is imported only by the commands that talk to a server (keeps `dgemma --help` quick)
    from dgemma_cli.client import Client

THINK_VALUES = ("true", "false", "high", "medium", "low", "max")


# ---- flags -----------------------------------------------------------------------------------------------------------

def parse_think(value: str | None) -> bool | str | None:
    """`--think` (bare = true), `--think=false`, or a level; Ollama's error text otherwise."""
    if value is None:
        return None
    lowered = value.strip().lower()
    if lowered not in THINK_VALUES:
        raise DgemmaError(f'invalid value for --think: "{value}" (must be true, false, high, medium, low, or max)')
    return {"true": True, "false": False}.get(lowered, lowered)


# ---- one-shot mode ---------------------------------------------------------------------------------------------------

def read_piped_stdin() -> str:
    if is_tty(sys.stdin):
        return ""
    try:
        return sys.stdin.read()
    except (OSError, ValueError):
        return ""


def run_once(client: Client, settings: RunSettings, prompt: str, vision: bool = False) -> None:
    """Non-interactive `run`: one `/api/generate`; an empty prompt only loads the model (docs/compat.md#run). With
    `vision` (the model has a projector), image files named in the prompt are sent as its images."""
    images: list[str] = []
    if vision and prompt:
        found = extract_images(prompt)
        for path in found.added:
            print(f"Added image '{path}'", file=sys.stderr)
        prompt, images = found.text, found.images
    if not prompt and not images:
        client.generate(settings.generate_request(""))
        return
    output = Output(settings, interactive_ui=is_tty(sys.stdout))
    request = settings.generate_request(prompt, system=settings.system, progress=output.wants_progress(),
                                        preview=output.visual, images=images)
    stream_answer(client.generate_stream(request), output)


# ---- the commands ----------------------------------------------------------------------------------------------------

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
    num_canvases: Optional[int] = typer.Option(None, "--num-canvases", help="candidate canvases denoised together"),
    self_cond_top_k: Optional[int] = typer.Option(None, "--self-cond-top-k",
                                                  help="self-condition on the k most likely tokens (0: all)"),
    num_predict: Optional[int] = typer.Option(None, "--num-predict", help="token budget (whole canvases are denoised)"),
) -> None:
    """Run a model: one answer for a prompt (or piped stdin), else an interactive chat."""
    from dgemma_engine.settings import options_from_fields

    options = {key: value for key, value in (("seed", seed), ("num_predict", num_predict)) if value is not None}
    options |= options_from_fields({  # each sampler flag by its setting's field name
        "max_steps": steps, "t_max": t_max, "t_min": t_min, "entropy_bound": entropy_bound,
        "confidence_threshold": confidence_threshold, "stability_threshold": stability_threshold,
        "num_canvases": num_canvases, "self_cond_top_k": self_cond_top_k,
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
    from dgemma_cli.local_server import connect

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
                run_once(client, settings, text or "", has_vision(show))
            except KeyboardInterrupt:
                raise typer.Exit(130) from None


def _until(expires_at: str, now: datetime | None = None) -> str:
    """`4 minutes from now`, `Forever` (more than 20 years ahead), `Stopping...` (past)."""
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
    from dgemma_cli.client import client_base_url
    from dgemma_cli.local_server import connect

    with connect() as client:
        print(ps_table(client.ps().get("models") or [], prefix))
        if client.local is not None:  # models stay loaded only in a server that outlives the command
            print(f"no dgemma server at {client_base_url()}: nothing stays loaded without `dgemma serve`",
                  file=sys.stderr)


def stop(model: str = typer.Argument(..., help="model to unload")) -> None:
    """Stop (unload) a running model."""
    from dgemma_cli import wire
    from dgemma_cli.client import ApiError
    from dgemma_cli.local_server import connect

    with connect() as client:
        try:
            client.generate(wire.GenerateRequest(model=model, prompt="", keep_alive=0))
        except ApiError as exc:
            if exc.status == 404:
                raise DgemmaError(f'couldn\'t find model "{model}" to stop') from None
            raise


def register(app: typer.Typer) -> None:
    app.command("run", cls=ThinkFlagCommand)(run)
    app.command("ps")(ps)
    app.command("stop")(stop)

