"""`dgemma pull|create|list|ls|show|rm|cp`: Ollama's store commands as clients of the REST API
(docs/compat.md#commands, #output-formats).

Like `run`, `ps` and `stop`, every command talks to the server at DGEMMA_HOST through `local_server.connect()`, which
serves the same app in-process for the command's duration when nothing answers there: one code path, no daemon left
behind. This module renders the answers (`show` blocks; tables and progress bars are `ui.py`'s); `store_client.py`
holds the calls that `client.Client` lacks and the local half of `create` (FROM resolution, checkpoint conversion,
blob upload).
"""
from __future__ import annotations

import json
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Optional

import typer

from dgemma_engine.gguf_keys import (KEY_ARCHITECTURE, KEY_CANVAS_LENGTH, KEY_CONTEXT_LENGTH, KEY_EMBEDDING_LENGTH,
                                     KEY_PARAMETER_COUNT, KEY_VISION_EMBEDDING_LENGTH, KEY_VISION_PROJECTION_DIM,
                                     for_arch)

from dgemma_cli.errors import DgemmaError
from dgemma_cli.gotext import go_value
from dgemma_cli.names import ModelName
from dgemma_cli.ui import ProgressRenderer, human_bytes, human_time_ago, table

SELECTORS = ("license", "modelfile", "parameters", "system", "template")


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
    canvas = ("canvas length", _info_text(model_info.get(KEY_CANVAS_LENGTH)))
    return [canvas] + [(label, " → ".join(texts)) for label, texts in shown.items()]


def _block(title: str, rows: list[tuple[str, str]]) -> list[str]:
    if not rows:
        return []
    width = max(len(k) for k, _ in rows)
    return [f"  {title}"] + [f"    {k.ljust(width)}    {v}".rstrip() for k, v in rows] + [""]


def _adapter_row(adapter: dict[str, Any]) -> tuple[str, str]:
    """`LoRA <digest 12>    rank 8, alpha 16, 26 weights`."""
    digest = str(adapter.get("digest", "")).removeprefix("sha256:")[:12]
    ranks = "/".join(str(r) for r in adapter.get("ranks") or [])
    alpha = adapter.get("alpha")
    alpha_text = f"{alpha:g}" if isinstance(alpha, int | float) else "?"
    return f"LoRA {digest}", f"rank {ranks}, alpha {alpha_text}, {adapter.get('targets', 0)} weights"


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


def projector_rows(info: dict[str, Any] | None) -> list[tuple[str, str]]:
    """Ollama's Projector block: architecture, parameters, embedding length, dimensions (what the header has)."""
    if not info:
        return []
    from dgemma_cli.create import human_number

    count = info.get(KEY_PARAMETER_COUNT)
    rows = [("architecture", str(info.get(KEY_ARCHITECTURE) or "")),
            ("parameters", human_number(count) if isinstance(count, int) else ""),
            ("embedding length", _info_text(info.get(KEY_VISION_EMBEDDING_LENGTH))),
            ("dimensions", _info_text(info.get(KEY_VISION_PROJECTION_DIM)))]
    return [(name, value) for name, value in rows if value]


def show_info_text(show: dict[str, Any], verbose: bool = False) -> str:
    """The `show MODEL` blocks of docs/compat.md#output-formats from an `/api/show` answer (`verbose` adds Metadata and
    Tensors)."""
    info = show.get("model_info") or {}
    details = show.get("details") or {}
    arch = info.get(KEY_ARCHITECTURE) or details.get("family") or ""
    lines = _block("Model", [
        ("architecture", arch),
        ("parameters", details.get("parameter_size") or ""),
        ("context length", _info_text(info.get(for_arch(KEY_CONTEXT_LENGTH, arch)))),
        ("embedding length", _info_text(info.get(for_arch(KEY_EMBEDDING_LENGTH, arch)))),
        ("quantization", details.get("quantization_level") or ""),
    ])
    lines += _block("Projector", projector_rows(show.get("projector_info")))
    lines += _block("Capabilities", [(c, "") for c in show.get("capabilities") or []])
    lines += _block("Adapters", [_adapter_row(a) for a in show.get("adapters") or []])
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

def _connect() -> Any:
    """`local_server.connect()`, imported when a command runs: httpx and the server app load only for the commands
    that need them. Transport failures are one `Error:` line (the client's `transport_errors`)."""
    from dgemma_cli.local_server import connect

    return connect()


def pull(
    model: str = typer.Argument(..., help="model name, e.g. hf.co/unsloth/diffusiongemma-26B-A4B-it-GGUF:Q4_K_M"),
    insecure: bool = typer.Option(False, "--insecure", help="allow plain http to a loopback or http:// registry"),
) -> None:
    """Pull a model from a registry (Ollama protocol; Hugging Face hf.co names work too)."""
    with _connect() as client:
        ProgressRenderer().run(client.pull(model, insecure))


def create(
    model: str = typer.Argument(..., help="name of the new model"),
    # a str, not a Path: errors name the file exactly as typed (Path("./x") prints as "x")
    file: Optional[str] = typer.Option(None, "--file", "-f", metavar="PATH", help="Modelfile (default: ./Modelfile)"),
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
    elif answer.get(chosen[0]):  # license, parameters, system, template: the field as the server formats it
        print(answer[chosen[0]])
    else:  # stdout stays empty (a redirect makes an empty file); stderr says why
        what = "system message" if chosen[0] == "system" else chosen[0]
        print(f"model '{model}' has no {what}", file=sys.stderr)


def rm(models: list[str] = typer.Argument(..., help="models to delete")) -> None:
    """Delete models (and the blobs no other model uses)."""
    from dgemma_cli.client import ApiError
    from dgemma_cli.store_client import delete_model, unload_model

    with _connect() as client:
        for model in models:
            ModelName.parse(model)  # an invalid name is its one error line, with no unload attempt before it
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
