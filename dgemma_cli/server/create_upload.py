"""A create request's uploads (`/api/create`): its GGUF blobs and adapters checked before anything is written or
streamed (docs/compat.md#create), then the model built from the request's fields."""
from pathlib import Path, PurePosixPath
from typing import Any

from dgemma_engine.arch import check_architecture

from dgemma_cli.errors import DgemmaError
from dgemma_cli.names import ModelName
from dgemma_cli.projector import is_projector
from dgemma_cli.server.errors import RequestError
from dgemma_cli.store import Store


def check_files(store: Store, files: dict[str, str]) -> list[Path]:
    """The uploaded GGUF blobs of a create request, validated before anything is written (docs/compat.md#create,
    security D)."""
    from dgemma_cli.gguf_check import GGUFError, read_gguf_info

    paths, projectors = [], []
    for digest in files.values():
        path = store.blob_path(digest)
        if not path.is_file():
            raise RequestError(f'blob "{digest}" not found', 404)
        try:
            info = read_gguf_info(path)
        except GGUFError as exc:  # Ollama's words, then which rule the header broke (as the CLI's create says)
            raise RequestError(f"supplied file was not in GGUF format ({exc})") from None
        if is_projector(info):  # a vision projector (Ollama's `projector` layer), checked by create
            projectors.append(path)
            continue
        check_architecture(info.architecture, error=RequestError)
        paths.append(path)
    if len(paths) > 1:
        raise RequestError("split GGUF models (more than one file) are not supported")
    if len(projectors) > 1:
        raise RequestError("a model takes at most one vision projector")
    return paths + projectors


def check_adapters(store: Store, adapters: dict[str, str], gguf_paths: list[Path], from_: str | None) -> None:
    """The uploaded adapters of a create request, checked (against the base when it is already here) before the
    answer starts streaming, so that a bad adapter is a 400 (docs/gguf.md#lora-adapters)."""
    from dgemma_cli.create import CreateError, check_adapter_plan, validated_adapter

    base = _adapter_base(store, gguf_paths, from_)
    with store.scratch("adapter-check") as work:
        for source in adapter_sources(store, adapters, work):
            try:
                if source.path.is_dir():
                    check_adapter_plan(source, base)
                else:
                    validated_adapter(source.path, source.label, base)
            except CreateError as exc:
                raise RequestError(str(exc)) from None


def _adapter_base(store: Store, gguf_paths: list[Path], from_: str | None) -> Any:
    from dgemma_cli.create import BaseShapes, is_projector_file
    from dgemma_cli.gguf_check import read_gguf_info

    path = next((p for p in gguf_paths if not is_projector_file(p)), None)
    if path is None and from_:
        try:
            path = store.resolve(ModelName.parse(from_)).gguf_path
        except DgemmaError:
            return None  # not here yet (pulled by create): checked there
    return BaseShapes.of(read_gguf_info(path), path) if path is not None and path.is_file() else None


def adapter_sources(store: Store, adapters: dict[str, str], work: Path) -> list[Any]:
    """`adapters` ({file name: digest}) as ADAPTER sources: each GGUF LoRA blob, or one PEFT folder made in `work`
    from the `adapter_config.json` and `adapter_model.safetensors` blobs (links; the server never opens a path a
    client chose)."""
    from dgemma_cli.create import AdapterSource
    from dgemma_convert.lora import CONFIG_FILE, WEIGHTS_FILE

    blobs = {}
    for key, digest in adapters.items():
        path = store.blob_path(digest)
        if not path.is_file():
            raise RequestError(f'blob "{digest}" not found', 404)
        blobs[key] = path
    peft = {CONFIG_FILE, WEIGHTS_FILE}
    names = {PurePosixPath(key).name: path for key, path in blobs.items()}
    if not peft & set(names):
        return [AdapterSource(path, key) for key, path in blobs.items()]
    if len(blobs) != 2 or set(names) != peft:
        raise RequestError(f"a PEFT adapter is exactly {CONFIG_FILE} and {WEIGHTS_FILE}, got "
                           f"{', '.join(sorted(blobs))}")
    folder = work / "peft-adapter"
    folder.mkdir()
    for name, path in names.items():
        (folder / name).symlink_to(path)
    return [AdapterSource(folder, "PEFT adapter")]


def create(store: Store, name: ModelName, req: Any, gguf_paths: list[Path]):
    """The create request's progress: its Modelfile, built from the request's fields, through `create_model`."""
    from dgemma_cli.create import create_model
    from dgemma_cli.modelfile import Modelfile

    licenses = [req.license] if isinstance(req.license, str) else list(req.license or [])
    from dgemma_cli.create import is_projector_file

    only_projectors = all(is_projector_file(path) for path in gguf_paths)  # then `from` names the model
    modelfile = Modelfile(
        froms=([req.from_] if req.from_ and only_projectors else []) + [str(p) for p in gguf_paths],
        template=req.template,
        system=req.system,
        licenses=licenses,
        messages=[dict(m) for m in req.messages or []],
        parameters=dict(req.parameters or {}),
        requires=req.requires,
    )
    with store.scratch("adapters") as work:
        adapters = adapter_sources(store, req.adapters or {}, work)
        yield from create_model(name, modelfile, store, store.blobs_dir, quantize=req.quantize,
                                adapters=adapters)
