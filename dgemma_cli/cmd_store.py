"""`dgemma pull|create|list|ls|show|rm|cp`: Ollama's store commands as clients of the REST API (spec ollama-compat.md
§1.1, §1.4).

Like `run`, `ps` and `stop`, every command talks to the server at DGEMMA_HOST through `client.connect()`, which serves
the same app in-process for the command's duration when nothing answers there: one code path, no daemon left behind.
This module renders the answers (tables, `show` blocks, progress bars); `store_client.py` holds the calls that
`client.Client` lacks and the local half of `create` (FROM resolution, checkpoint conversion, blob upload).
"""
from __future__ import annotations

import json
import sys
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Optional

import typer
from rich.console import Console
from rich.live import Live
from rich.text import Text

from dgemma_cli.errors import DgemmaError
from dgemma_cli.names import ModelName

if TYPE_CHECKING:
    from dgemma_cli.client import Client

SELECTORS = ("license", "modelfile", "parameters", "system", "template")


# ---- formatting helpers (Ollama's wording) -----------------------------------------------------------------------

def human_bytes(n: int) -> str:
    """Decimal units: `16 GB`, `986 MB`, `4.7 GB`, `1 GB`, `512 B`."""
    if n < 1000:
        return f"{n} B"
    value, unit = float(n), "B"
    for unit in ("KB", "MB", "GB", "TB", "PB"):
        value /= 1000
        if value < 1000:
            break
    if value >= 10:
        return f"{int(value)} {unit}"
    return f"{int(value)} {unit}" if value == int(value) else f"{value:.1f} {unit}"


def human_duration(seconds: float) -> str:
    """Go's units.HumanDuration, as Ollama's `list` uses it."""
    s = int(seconds)
    if s < 1:
        return "Less than a second"
    if s == 1:
        return "1 second"
    if s < 60:
        return f"{s} seconds"
    minutes = int(seconds // 60)
    if minutes == 1:
        return "About a minute"
    if minutes < 60:
        return f"{minutes} minutes"
    hours = round(seconds / 3600)
    if hours == 1:
        return "About an hour"
    if hours < 48:
        return f"{hours} hours"
    if hours < 24 * 7 * 2:
        return f"{hours // 24} days"
    if hours < 24 * 30 * 2:
        return f"{hours // 24 // 7} weeks"
    if hours < 24 * 365 * 2:
        return f"{hours // 24 // 30} months"
    return f"{int(seconds // 3600) // 24 // 365} years"


def human_time_ago(timestamp: float, now: float | None = None) -> str:
    return human_duration((now if now is not None else time.time()) - timestamp) + " ago"


def table(rows: list[list[str]]) -> str:
    """Left-aligned columns, 4 spaces apart, no borders (list, ps)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("    ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def go_value(value: Any) -> str:
    """A value in Go's `%#v` style: strings double-quoted, numbers bare."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    return str(value)


# ---- progress ----------------------------------------------------------------------------------------------------

def remaining_text(seconds: float) -> str:
    """Time left as Ollama prints it: `45s`, `2m3s`, `1h5m`, `99h+`."""
    s = int(round(seconds))
    if s >= 100 * 3600:
        return "99h+"
    h, m, sec = s // 3600, s % 3600 // 60, s % 60
    if h:
        return f"{h}h{m}m"
    return f"{m}m{sec}s" if m else f"{sec}s"


@dataclass
class _Bar:
    label: str
    total: int
    completed: int = 0
    samples: deque = field(default_factory=lambda: deque(maxlen=50))  # (time, completed) for the rate

    def rate(self) -> float:
        if len(self.samples) < 2:
            return 0.0
        (t0, c0), (t1, c1) = self.samples[0], self.samples[-1]
        return (c1 - c0) / (t1 - t0) if t1 > t0 else 0.0


def bar_line(label: str, completed: int, total: int, rate: float, width: int) -> str:
    """`pulling 8eeb52dfb3bb:  45% ▕███████         ▏ 2.1 GB/4.7 GB   12 MB/s   2m3s`, fitted to `width`."""
    pct = min(100, int(100 * completed / total)) if total else 100
    if completed >= total:
        stats = human_bytes(total)
    else:
        stats = f"{human_bytes(completed)}/{human_bytes(total)}"
        if rate > 0:
            stats += f"  {human_bytes(int(rate))}/s  {remaining_text((total - completed) / rate)}"
    left = f"{label}: {pct:3d}% "
    bar_width = max(10, width - len(left) - len(stats) - 3)
    filled = bar_width * pct // 100
    return f"{left}▕{'█' * filled}{' ' * (bar_width - filled)}▏ {stats}"


class ProgressRenderer:
    """Ollama-like progress on stderr: one bar per digest and plain status lines, redrawn in place on a terminal.
    Elsewhere (logs, pipes) each status line, and each bar once complete, is printed once, whole."""

    SPINNER = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"

    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True, highlight=False)
        self.lines: list[str | _Bar] = []
        self.bars: dict[str, _Bar] = {}
        self.frame = 0
        self.live = Live(console=self.console, refresh_per_second=8, transient=False, get_renderable=self.render)

    def render(self) -> Text:
        self.frame += 1
        width = self.console.width
        out = []
        for i, line in enumerate(self.lines):
            if isinstance(line, _Bar):
                out.append(bar_line(line.label, line.completed, line.total, line.rate(), width))
            elif i == len(self.lines) - 1 and line != "success" and self.live.is_started and self.console.is_terminal:
                out.append(f"{line} {self.SPINNER[self.frame % len(self.SPINNER)]}")
            else:
                out.append(line)
        return Text("\n".join(out), overflow="fold")

    def __enter__(self) -> "ProgressRenderer":
        if self.console.is_terminal:
            self.live.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live.is_started:
            self.live.stop()

    def _log(self, line: str) -> None:
        if not self.console.is_terminal:
            print(line, file=self.console.file, flush=True)

    def update(self, event: dict[str, Any]) -> None:
        digest, status = event.get("digest"), event.get("status", "")
        if digest and event.get("total") is not None:
            completed = event.get("completed", 0)
            bar = self.bars.get(digest)
            if bar is None:
                if not completed:
                    return  # Ollama does not draw a layer's first `completed: 0` update
                bar = self.bars[digest] = _Bar(status, event["total"])
                self.lines.append(bar)
            if completed >= bar.total > bar.completed or completed == bar.total == 0:
                self._log(bar_line(bar.label, completed, bar.total, 0.0, 80))
            bar.completed = completed
            bar.samples.append((time.monotonic(), completed))
        elif status and (not self.lines or self.lines[-1] != status):
            self.lines.append(status)
            self._log(status)

    def run(self, events: Iterable[dict[str, Any]]) -> None:
        with self:
            for event in events:
                self.update(event)


# ---- `show` from an /api/show answer ------------------------------------------------------------------------------

PARAMETER_KEY_COLUMNS = 30  # `/api/show` pads each `parameters` key to 30 columns (Ollama adds one space after it)


def parameter_rows(text: str | None) -> list[tuple[str, str]]:
    """`/api/show` `parameters` text as (key, value text) rows, in the server's order (keys sorted, lists repeated)."""
    rows = []
    for line in (text or "").splitlines():
        key, _, value = line.partition(" ")
        if len(key) > PARAMETER_KEY_COLUMNS:  # a key of exactly 30 characters with no separator after it
            key, value = line[:PARAMETER_KEY_COLUMNS], line[PARAMETER_KEY_COLUMNS:]
        if key:
            rows.append((key, value.strip()))
    return rows


def _typed(value_text: str) -> Any:
    """A Go `%#v` value back as a Python value: numbers and booleans bare, strings double-quoted."""
    try:
        return json.loads(value_text)
    except ValueError:
        return value_text


def sampler_defaults(model_info: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """Effective sampler defaults by field name: Modelfile PARAMETER > GGUF diffusion.eb_* > released default."""
    from dgemma_engine import settings

    return {s.field: params.get(s.option, model_info.get(s.gguf_key, s.default)) for s in settings.SAMPLER_SETTINGS}


def diffusion_rows(model_info: dict[str, Any], params: dict[str, Any]) -> list[tuple[str, str]]:
    """`show`'s Diffusion block: the canvas length, then one row per sampler setting label (settings sharing a
    label, the temperature schedule, share a row: `0.8 → 0.4`)."""
    from dgemma_engine import settings

    values = sampler_defaults(model_info, params)
    shown: dict[str, list[str]] = {}
    for s in settings.SAMPLER_SETTINGS:
        shown.setdefault(s.label, []).append(go_value(values[s.field]))
    canvas = ("canvas length", _info_text(model_info.get("diffusion.canvas_length")))
    return [canvas] + [(label, " → ".join(texts)) for label, texts in shown.items()]


def _block(title: str, rows: list[tuple[str, str]]) -> list[str]:
    if not rows:
        return []
    width = max(len(k) for k, _ in rows)
    return [f"  {title}"] + [f"    {k.ljust(width)}    {v}".rstrip() for k, v in rows] + [""]


def _text_rows(text: str | None) -> list[tuple[str, str]]:
    lines = [line for line in (text or "").splitlines() if line.strip()]
    if len(lines) > 2:
        lines = lines[:2] + ["..."]
    return [(line, "") for line in lines]


def _meta_value(value: Any) -> str:
    """One metadata value for `show -v`: scalars in Go style, short arrays whole, long ones as a count."""
    if isinstance(value, list):
        return json.dumps(value, ensure_ascii=False) if len(value) <= 5 else f"[... {len(value)} items]"
    return go_value(value)


def _info_text(value: Any) -> str:
    return "" if value is None else go_value(value)


def show_info_text(show: dict[str, Any], verbose: bool = False) -> str:
    """The `show MODEL` blocks of spec §1.4 from an `/api/show` answer (`verbose` adds Metadata and Tensors)."""
    info = show.get("model_info") or {}
    details = show.get("details") or {}
    arch = info.get("general.architecture") or details.get("family") or ""
    lines = _block("Model", [
        ("architecture", arch),
        ("parameters", details.get("parameter_size") or ""),
        ("context length", _info_text(info.get(f"{arch}.context_length"))),
        ("embedding length", _info_text(info.get(f"{arch}.embedding_length"))),
        ("quantization", details.get("quantization_level") or ""),
    ])
    lines += _block("Capabilities", [(c, "") for c in show.get("capabilities") or []])
    param_rows = parameter_rows(show.get("parameters"))
    lines += _block("Diffusion", diffusion_rows(info, {key: _typed(text) for key, text in param_rows}))
    lines += _block("Parameters", param_rows)
    lines += _block("System", _text_rows(show.get("system")))
    lines += _block("License", _text_rows(show.get("license")))
    if verbose:
        lines += _block("Metadata", [(k, _meta_value(v)) for k, v in sorted(info.items())])
        lines += _block("Tensors", [(str(t.get("name", "")), f"{t.get('type', '')}    {list(t.get('shape') or [])}")
                                    for t in show.get("tensors") or []])
    return "\n".join(lines).rstrip("\n") + "\n"


# ---- commands ----------------------------------------------------------------------------------------------------

@contextmanager
def _connect() -> Iterator[Client]:
    """`client.connect()`, with transport failures (server gone mid-command) as one `Error:` line."""
    import httpx  # httpx and the server app load only for the commands that need them

    from dgemma_cli.client import connect

    try:
        with connect() as client:
            yield client
    except httpx.HTTPError as exc:
        raise DgemmaError(f"lost the connection to the dgemma server ({exc or type(exc).__name__})") from None


def pull(
    model: str = typer.Argument(..., help="model name, e.g. hf.co/unsloth/diffusiongemma-26B-A4B-it-GGUF:Q4_K_M"),
    insecure: bool = typer.Option(False, "--insecure", help="allow plain http to a loopback or http:// registry"),
) -> None:
    """Pull a model from a registry (Ollama protocol; Hugging Face hf.co names work too)."""
    with _connect() as client:
        ProgressRenderer().run(client.pull(model, insecure))


def create(
    model: str = typer.Argument(..., help="name of the new model"),
    file: Optional[Path] = typer.Option(None, "--file", "-f", help="Modelfile (default: ./Modelfile)"),
    quantize: Optional[str] = typer.Option(None, "--quantize", "-q", help="q4_K_M | q5_K_M | q6_K | q8_0"),
) -> None:
    """Create a model from a Modelfile."""
    from dgemma_cli.create import load_modelfile_for_create
    from dgemma_cli.store_client import create_request

    try:
        ModelName.parse(model)
    except DgemmaError:
        raise DgemmaError(f"invalid model name: {model}") from None
    modelfile, base_dir = load_modelfile_for_create(file, Path.cwd())
    for warning in modelfile.warnings:
        print(warning, file=sys.stderr)
    with _connect() as client, ProgressRenderer() as progress:
        progress.update({"status": "gathering model components"})
        body = create_request(client, model, modelfile, base_dir, quantize, progress.update)
        for event in client.create(body):
            progress.update(event)


def list_models(prefix: Optional[str] = typer.Argument(None, help="only names starting with this (any case)")) -> None:
    """List models in the store."""
    from dgemma_cli.store_client import list_tags

    with _connect() as client:
        models = list_tags(client)
    rows = [["NAME", "ID", "SIZE", "MODIFIED"]]
    now = time.time()
    for entry in models:
        name = str(entry.get("name") or entry.get("model") or "")
        if prefix and not name.lower().startswith(prefix.lower()):
            continue
        rows.append([name, str(entry.get("digest") or "")[:12], human_bytes(int(entry.get("size") or 0)),
                     _modified_text(entry.get("modified_at"), now)])
    print(table(rows))


def _modified_text(modified_at: Any, now: float) -> str:
    try:
        return human_time_ago(datetime.fromisoformat(str(modified_at)).timestamp(), now)
    except ValueError:
        return "Unknown"


def show(
    model: str = typer.Argument(...),
    license: bool = typer.Option(False, "--license", help="show the license"),
    modelfile: bool = typer.Option(False, "--modelfile", help="show the Modelfile"),
    parameters: bool = typer.Option(False, "--parameters", help="show the parameters"),
    system: bool = typer.Option(False, "--system", help="show the system message"),
    template: bool = typer.Option(False, "--template", help="show the template"),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="also show metadata and tensors"),
) -> None:
    """Show information about a model."""
    chosen = [name for name, flag in zip(SELECTORS, (license, modelfile, parameters, system, template)) if flag]
    if len(chosen) > 1:
        raise DgemmaError("only one of '--license', '--modelfile', '--parameters', '--system', or '--template' "
                          "can be specified")
    with _connect() as client:
        answer = client.show(model, verbose=verbose and not chosen)
    if not chosen:
        sys.stdout.write(show_info_text(answer, verbose))
    elif chosen[0] == "modelfile":
        sys.stdout.write(answer.get("modelfile") or "")
    else:  # license, parameters, system, template: the field as the server formats it
        print(answer.get(chosen[0]) or "")


def rm(models: list[str] = typer.Argument(..., help="models to delete")) -> None:
    """Delete models (and the blobs no other model uses)."""
    from dgemma_cli.client import ApiError
    from dgemma_cli.store_client import delete_model, unload_model

    with _connect() as client:
        for model in models:
            try:
                unload_model(client, model)
            except ApiError as exc:
                if "not found" not in str(exc).lower():
                    print(f"Warning: unable to stop model '{model}'", file=sys.stderr)
            delete_model(client, model)
            print(f"deleted '{model}'")


def cp(source: str = typer.Argument(...), destination: str = typer.Argument(...)) -> None:
    """Copy a model under a new name (blobs are shared)."""
    from dgemma_cli.store_client import copy_model

    with _connect() as client:
        copy_model(client, source, destination)
    print(f"copied '{source}' to '{destination}'")


def register(app: typer.Typer) -> None:
    app.command("pull")(pull)
    app.command("create")(create)
    app.command("list")(list_models)
    app.command("ls", hidden=True)(list_models)
    app.command("show")(show)
    app.command("rm")(rm)
    app.command("cp")(cp)
