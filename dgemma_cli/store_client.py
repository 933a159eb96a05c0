"""Client side of the store endpoints (docs/compat.md#commands, #info-and-store-endpoints, #create), on top of
`client.Client`.

Plain calls (`/api/tags`, `/api/copy`, `/api/delete`, unload, `/api/blobs`) and the part of `create` that Ollama's
CLI does locally: resolve a Modelfile's FROM on this machine, convert a Hugging Face checkpoint folder to a temporary
GGUF, upload the GGUF as a blob (HEAD first, POST only if the server lacks it) and build the `/api/create` body. The
server never sees a local path (docs/compat.md, security C): it gets `files: {name: digest}` or `from: <model name>`.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from dgemma_cli import wire
from dgemma_cli.client import CALL_TIMEOUT, ApiError, Client
from dgemma_cli.modelfile import Modelfile
from dgemma_cli.store import Store
from dgemma_cli.store import sha256_file as _sha256_file  # a module-level name, so tests can see every rehash

UPLOAD_CHUNK = 1 << 20
Progress = Callable[[dict[str, Any]], None]  # receives Ollama-style status objects (the progress renderer's input)


# ---- plain calls ---------------------------------------------------------------------------------------------------

def list_tags(client: Client) -> list[dict[str, Any]]:
    return client.request("GET", "/api/tags").json().get("models") or []


def copy_model(client: Client, source: str, destination: str) -> None:
    client.request("POST", "/api/copy", json={"source": source, "destination": destination})


def delete_model(client: Client, model: str) -> None:
    client.request("DELETE", "/api/delete", json={"model": model})


def unload_model(client: Client, model: str) -> None:
    """Ollama's unload: an empty generate with `keep_alive: 0` (also fine when the model is not loaded)."""
    client.generate(wire.GenerateRequest(model=model, prompt="", keep_alive=0))


def blob_exists(client: Client, digest: str) -> bool:
    try:
        client.request("HEAD", f"/api/blobs/{digest}")
    except ApiError as exc:
        if exc.status == 404:
            return False
        raise
    return True


def upload_blob(client: Client, digest: str, path: Path, progress: Progress) -> None:
    """POST the file to `/api/blobs/<digest>`, reporting bytes sent as a progress bar keyed by the digest."""
    size = path.stat().st_size
    label = f"copying file {digest.removeprefix('sha256:')[:12]}"

    def body() -> Iterator[bytes]:
        sent = 0
        with open(path, "rb") as f:
            while chunk := f.read(UPLOAD_CHUNK):
                yield chunk
                sent += len(chunk)
                progress({"status": label, "digest": digest, "total": size, "completed": sent})

    client.request("POST", f"/api/blobs/{digest}", content=body(), headers={"Content-Length": str(size)},
                   timeout=CALL_TIMEOUT)


def ensure_blob(client: Client, path: Path, progress: Progress) -> str:
    """The file's digest, uploaded first unless the server already has that blob."""
    named = _blob_name_digest(path)
    if named is not None and blob_exists(client, named):
        return named  # the server has this blob already; hashing many GB again would tell us nothing new
    digest = _sha256_file(path)
    if not blob_exists(client, digest):
        upload_blob(client, digest, path, progress)
    return digest


def _blob_name_digest(path: Path) -> str | None:
    """`sha256:<hex>` for a file in a store's `blobs/` folder (what `show --modelfile` prints as FROM), else None."""
    match = re.fullmatch(r"sha256-([0-9a-f]{64})", path.name)
    return f"sha256:{match.group(1)}" if match and path.parent.name == "blobs" else None


# ---- create: the local half ----------------------------------------------------------------------------------------

def create_request(client: Client, model: str, modelfile: Modelfile, base_dir: Path, quantize: str | None,
                   progress: Progress) -> wire.CreateRequest:
    """The `/api/create` body for a parsed Modelfile, after uploading whatever its FROM names on this machine.

    A local GGUF (or a folder holding one) is uploaded as is and the server quantizes it if asked; a checkpoint
    folder is converted here, straight to the requested type, so the server only ever receives GGUF blobs."""
    # create.py owns the FROM rules (path vs name, folder scan, checkpoint detection); reuse them, do not fork them.
    from dgemma_cli.create import (CreateError, checked_projector, gguf_in_folder, is_hf_checkpoint,
                                   modelfile_adapters, split_froms, validated_gguf)

    adapters = modelfile_adapters(modelfile, base_dir, None)
    for source in adapters:  # a bad adapter fails before anything is converted or uploaded
        _precheck_adapter(source)
    if not modelfile.froms:
        raise CreateError("neither 'from' or 'files' was specified")
    body: dict[str, Any] = {"model": model}
    sources = split_froms(modelfile.froms, base_dir, None)
    local, projector = sources.model_path, sources.projector
    files: dict[str, str] = {}
    if local is None:
        body["from"] = sources.model  # a model name: the server resolves (or pulls) it
        if quantize:
            body["quantize"] = quantize
    elif local.is_dir() and is_hf_checkpoint(local):
        with _converted(local, quantize, progress) as (gguf, converted):
            files[f"{local.name}.gguf"] = ensure_blob(client, gguf, progress)
            if converted is not None and projector is None:
                files[f"{local.name}-mmproj.gguf"] = ensure_blob(client, converted, progress)
    else:
        gguf = gguf_in_folder(local) if local.is_dir() else local
        info = validated_gguf(gguf)  # the server checks again; this only spares uploading a file it would refuse
        checked_projector(projector, info)
        files[gguf.name] = ensure_blob(client, gguf, progress)
        if quantize:
            body["quantize"] = quantize
    if projector is not None:  # Ollama's form: the projector is one more GGUF in `files`
        checked_projector(projector, None)
        files[projector.name if projector.name not in files else f"mmproj-{projector.name}"] = \
            ensure_blob(client, projector, progress)
    if files:
        body["files"] = files
    if adapters:
        body["adapters"] = {}
        for index, source in enumerate(adapters):
            name, digest = _uploaded_adapter(client, source, progress)
            # a map: two adapters with one file name (from two folders) need two keys
            body["adapters"][name if name not in body["adapters"] else f"{index}-{name}"] = digest
    for key, text in (("template", modelfile.template), ("system", modelfile.system), ("requires", modelfile.requires)):
        if text is not None:  # `SYSTEM ""` is a value too (it clears an inherited system message)
            body[key] = text
    for key, items in (("license", modelfile.licenses), ("parameters", modelfile.parameters),
                       ("messages", modelfile.messages)):
        if items:
            body[key] = items
    for key in ("renderer", "parser"):  # Ollama's request fields for these lines; a server may ignore them
        if key in modelfile.extras:
            body[key] = modelfile.extras[key]
    return wire.CreateRequest.model_validate(body)


def _precheck_adapter(source: Any) -> None:
    """What can be checked without the base (the server checks the rest): spares uploading what it would refuse."""
    from dgemma_cli.create import check_adapter_plan, validated_adapter

    if source.path.is_dir():
        check_adapter_plan(source, None)
    else:
        validated_adapter(source.path, source.label, None)


def _uploaded_adapter(client: Client, source: Any, progress: Progress) -> tuple[str, str]:
    """(file name, digest) of one ADAPTER on the server: a GGUF LoRA file is uploaded as is, a PEFT folder is
    converted here first."""
    from dgemma_cli.create import converted_adapter

    if not source.path.is_dir():
        return source.path.name, ensure_blob(client, source.path, progress)
    with Store().scratch("create") as work:
        progress({"status": "converting adapter"})
        gguf = converted_adapter(source, work / f"{source.path.name}.gguf", None)
        return source.path.name, ensure_blob(client, gguf, progress)  # the server's errors name the folder


def yield_progress(steps: Any, progress: Progress) -> Any:
    """Pass a create step's status objects to `progress`; the step's return value."""
    while True:
        try:
            progress(next(steps))
        except StopIteration as done:
            return done.value


@contextmanager
def _converted(checkpoint: Path, quantize: str | None, progress: Progress) -> Iterator[tuple[Path, Path | None]]:
    """Convert a checkpoint folder to a GGUF in a scratch folder of the local store (removed afterwards), with
    converter progress; and its vision projector, when it has a vision tower."""
    from dgemma_convert import convert

    from dgemma_cli.create import QUANTIZE_TYPES, CreateError, converted_projector, converter_step

    outtype = "bf16"
    if quantize:
        if quantize.lower() not in QUANTIZE_TYPES:
            raise CreateError(f"unsupported quantization type {quantize} (use one of q4_K_M, q5_K_M, q6_K, q8_0, q4_0)")
        outtype = quantize.lower()
    # Scratch inside the local store, not $TMPDIR: a killed create leaves nothing behind that the next one keeps.
    with Store().scratch("create") as work:
        gguf = work / f"{checkpoint.name}.gguf"
        progress({"status": "converting model"})
        steps = converter_step("converting model",
                                lambda sink: convert(checkpoint, gguf, outtype, threads=2, progress=sink),
                                {str(gguf): gguf.name, str(checkpoint): checkpoint.name, str(work): "."})
        for event in steps:
            progress(event)
        projector = yield_progress(converted_projector(checkpoint, quantize, work), progress)
        yield gguf, projector

