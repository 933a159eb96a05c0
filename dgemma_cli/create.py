"""`create`: Modelfile -> layers -> manifest (docs/compat.md#modelfile-instructions, #create, #template-policy).

FROM may name a local GGUF file, a folder holding one GGUF, a Hugging Face checkpoint folder (converted on the fly
with dgemma_convert), or an existing model (pulled first if missing). A second FROM (or a second GGUF in the folder)
may be a vision projector GGUF (`general.architecture` "clip"): it becomes the `projector` layer (docs/store.md,
"Vision projectors"); a checkpoint with a vision tower gets its projector converted too. ADAPTER names a GGUF LoRA file or a PEFT adapter
folder (converted to a GGUF LoRA file here, so the store only holds GGUF); each adapter is checked against the base
before anything is written, and becomes an `adapter` layer after the inherited ones (docs/gguf.md#lora-adapters).
Every GGUF is validated by gguf_check before it enters the store. Layers use Ollama's media types; JSON blobs are
canonical so identical inputs give identical digests.
"""
from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from dgemma_engine.arch import ARCH, check_architecture
from dgemma_engine.chat.templates import template_format
from dgemma_engine.gguf_keys import KEY_CANVAS_LENGTH, KEY_CHAT_TEMPLATE, KEY_GENERAL_TYPE

from dgemma_cli.errors import DgemmaError
from dgemma_cli.gguf_check import GGUFError, GGUFInfo, check_loadable, check_runnable, read_gguf_info
from dgemma_cli.modelfile import (Modelfile, ModelfileError, check_jinja, check_messages, check_parameters,
                                  checked_modelfile)
from dgemma_cli.names import ModelName
from dgemma_cli.projector import ProjectorError, check_projector, is_projector
from dgemma_cli.store import (CONFIG_MEDIA_TYPE, MEDIA_ADAPTER, MEDIA_LICENSE, MEDIA_MESSAGES, MEDIA_MODEL,
                              MEDIA_PARAMS, MEDIA_PROJECTOR, MEDIA_SYSTEM, MEDIA_TEMPLATE, Layer, Store,
                              build_manifest, canonical_json)
from dgemma_convert.errors import ConvertError
from dgemma_engine.errors import EngineError

QUANTIZE_TYPES = {"q8_0": "Q8_0", "q6_k": "Q6_K", "q5_k_m": "Q5_K_M", "q4_k_m": "Q4_K_M", "q4_0": "Q4_0"}
FLOAT_FILE_TYPES = {"F32", "F16", "BF16"}


class CreateError(DgemmaError):
    status = 400


def human_number(n: int) -> str:
    """Parameter count in Ollama's style: `25.8B`, `270M`, `7B`, `136`."""
    for unit, scale in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= scale:
            value = n / scale
            return f"{value:.0f}{unit}" if value == int(value) else f"{value:.1f}{unit}"
    return str(n)


def check_jinja_template(text: str) -> None:
    """modelfile.check_jinja (the test render a TEMPLATE, a GGUF's own chat template and a pulled template layer all
    get) as a CreateError."""
    try:
        check_jinja(text)
    except ModelfileError as exc:
        raise CreateError(str(exc)) from None


# ---- FROM resolution -----------------------------------------------------------------------------------------------

def local_path(value: str, base_dir: Path, paths_within: Path | None) -> Path | None:
    """The existing local file or folder FROM names, else None (then it is a model name).

    With `paths_within` (the server, which must never open paths chosen by a client, docs/compat.md, security C) only
    files inside that folder count; anything else falls through to model-name validation."""
    if "\x00" in value:  # no file has such a name (and the OS calls would raise); the name check refuses it
        return None
    path = Path(value).expanduser()
    if not path.is_absolute():
        path = base_dir / path
    if paths_within is not None and path.resolve().parent != paths_within.resolve():
        return None
    return path if path.exists() else None


def is_hf_checkpoint(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def gguf_entries(folder: Path) -> list[Path]:
    """The folder's entries named `*.gguf` (any case), sorted."""
    return sorted(entry for entry in folder.iterdir() if entry.name.lower().endswith(".gguf"))


def gguf_in_folder(folder: Path) -> Path:
    """The one model GGUF file in a folder (a vision projector GGUF beside it is `projector_in_folder`'s); entries
    that resolve outside the folder are refused."""
    found = [entry for entry in _folder_ggufs(folder) if not is_projector_file(entry)]
    if not found:
        raise CreateError("no GGUF file or Hugging Face checkpoint found in the FROM folder")
    if len(found) > 1:
        raise CreateError("split GGUF models (more than one .gguf file) are not supported")
    return found[0]


def projector_in_folder(folder: Path) -> Path | None:
    """The vision projector GGUF in a FROM folder, if it holds one."""
    found = [entry for entry in _folder_ggufs(folder) if is_projector_file(entry)]
    if len(found) > 1:
        raise CreateError("more than one vision projector GGUF in the FROM folder")
    return found[0] if found else None


def _folder_ggufs(folder: Path) -> list[Path]:
    base = folder.resolve()
    found = []
    for entry in gguf_entries(folder):
        if entry.resolve().parent != base:
            raise CreateError(f"insecure path: {entry.name}")
        if entry.is_file():
            found.append(entry)
    return found


def is_projector_file(path: Path) -> bool:
    """A GGUF whose `general.architecture` is "clip" (a file that does not parse is not one: the model check names
    what is wrong with it)."""
    try:
        return is_projector(read_gguf_info(path))
    except GGUFError:
        return False


@dataclass(frozen=True)
class FromSources:
    """A Modelfile's FROM lines sorted out: the one model (a local path or a model name) and an optional vision
    projector GGUF file."""

    model: str  # as written: a model name when `model_path` is None
    model_path: Path | None
    projector: Path | None = None


def split_froms(froms: list[str], base_dir: Path, paths_within: Path | None) -> FromSources:
    """One model and at most one projector among the FROM lines (a folder may hold both GGUFs)."""
    models: list[tuple[str, Path | None]] = []
    projectors: list[Path] = []
    for value in froms:
        local = local_path(value, base_dir, paths_within)
        if local is not None and local.is_file() and is_projector_file(local):
            projectors.append(local)
            continue
        if local is not None and local.is_dir() and not is_hf_checkpoint(local):
            projector = projector_in_folder(local)
            if projector is not None:
                projectors.append(projector)
        models.append((value, local))
    if not models:
        raise CreateError("no model in FROM: a vision projector needs its model (add a FROM for the model's GGUF)")
    if len(models) > 1:
        raise CreateError("a Modelfile takes one model: a second FROM may only be a vision projector GGUF "
                          '(general.architecture "clip")')
    if len(projectors) > 1:
        raise CreateError("a Modelfile takes at most one vision projector")
    return FromSources(models[0][0], models[0][1], projectors[0] if projectors else None)


def validated_gguf(path: Path) -> GGUFInfo:
    try:
        info = read_gguf_info(path)
    except GGUFError as exc:
        raise CreateError(f"supplied file was not in GGUF format ({exc})") from None
    if info.metadata.get(KEY_GENERAL_TYPE) == "adapter":
        raise CreateError("the model file is a LoRA adapter: name it with ADAPTER and the base model with FROM")
    check_architecture(info.architecture, error=CreateError)
    if KEY_CANVAS_LENGTH not in info.metadata:
        raise CreateError(f"supplied file was not in GGUF format ({KEY_CANVAS_LENGTH} is missing)")
    try:  # the same checks as a pulled model file's (gguf_check.check_model_gguf)
        check_runnable(info)
        check_loadable(path, info)
    except GGUFError as exc:
        raise CreateError(f"model file cannot be run: {exc}") from None
    template = info.metadata.get(KEY_CHAT_TEMPLATE)
    if isinstance(template, str) and template:
        check_jinja_template(template)  # the file's own template is what chats render with
    return info


class ByteCounter:
    """A dgemma_convert ProgressSink that only counts bytes (read from the create generator's thread)."""

    def __init__(self) -> None:
        self.total = 0
        self.completed = 0

    def start(self, n_tensors: int, total_bytes: int) -> None:
        self.total = total_bytes

    def tensor(self, index: int, name: str) -> None:
        pass

    def advance(self, nbytes: int) -> None:
        self.completed += nbytes

    def stop(self) -> None:
        pass


PROGRESS_DIGEST = "0000000000000000000"  # what Ollama puts in `digest` for quantization progress


def converter_step(status: str, work: Callable[[ByteCounter], None],
                    hide: dict[str, str]) -> Iterator[dict[str, Any]]:
    """Run a converter call in a worker thread and yield progress objects until it ends.

    Converter errors become CreateError with local paths replaced by plain names (no path leaks,
    docs/compat.md, security C)."""
    counter, failure = ByteCounter(), []

    def run() -> None:
        try:
            work(counter)
        except BaseException as exc:  # noqa: BLE001 (re-raised in the caller's thread)
            failure.append(exc)

    thread = threading.Thread(target=run, name="dgemma-create-convert", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.1)
        if counter.total:
            yield {"status": status, "digest": PROGRESS_DIGEST, "total": counter.total, "completed": counter.completed}
    if failure:
        exc = failure[0]
        if isinstance(exc, DgemmaError) and not isinstance(exc, ConvertError | EngineError):
            raise exc
        message = str(exc)
        for path, name in hide.items():
            message = message.replace(path, name)
        raise CreateError(f"{status} failed: {message}") from None


# ---- ADAPTER ------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class AdapterSource:
    """One ADAPTER: a GGUF LoRA file or a PEFT adapter folder, and the name statuses and errors call it (never a
    server path)."""

    path: Path
    label: str


@dataclass(frozen=True)
class BaseShapes:
    """What an adapter is checked against: the base GGUF's architecture and tensor shapes (ggml ne)."""

    architecture: str
    tensors: dict[str, tuple[int, ...]]
    path: Path | None = None  # the base GGUF, for the engine's own adapter check

    @classmethod
    def of(cls, info: GGUFInfo, path: Path | None = None) -> "BaseShapes":
        return cls(info.architecture, {t.name: t.shape for t in info.tensors}, path)


def modelfile_adapters(mf: Modelfile, base_dir: Path, paths_within: Path | None) -> list[AdapterSource]:
    """The Modelfile's ADAPTERs as sources; a path that does not exist is an error (an adapter is never a name)."""
    sources = []
    for value in mf.adapters:
        path = local_path(value, base_dir, paths_within)
        if path is None:
            raise CreateError(f"adapter not found: {value}")
        sources.append(AdapterSource(path, path.name))
    return sources


def validated_adapter(path: Path, label: str, base: BaseShapes | None) -> GGUFInfo:
    """A GGUF LoRA file checked as the engine will use it: well-formed GGUF, LoRA header, and (with `base`) every
    target present in the base with matching shapes."""
    from dgemma_convert.lora import LoraError, check_against_base, lora_header_from

    try:
        info = read_gguf_info(path)
    except GGUFError as exc:
        raise CreateError(f"invalid adapter {label}: not a GGUF LoRA file ({exc})") from None
    try:
        header = lora_header_from(info.metadata, ((t.name, t.shape, t.type_name) for t in info.tensors))
        if base is not None:
            check_against_base(header, base.architecture, base.tensors)
    except LoraError as exc:
        raise CreateError(f"invalid adapter {label}: {exc}") from None
    if base is not None and base.path is not None:
        _check_adapter_loadable(base.path, path, label)
    return info


def _check_adapter_loadable(model: Path, adapter: Path, label: str) -> None:
    """The engine's own checks of loading this adapter onto this model (nothing allocated): what passes loads."""
    from dgemma_engine.model import Model

    try:
        Model.check_adapter(model, adapter)
    except EngineError as exc:
        raise CreateError(f"invalid adapter {label}: {exc}") from None


def check_adapter_folder(source: AdapterSource) -> None:
    from dgemma_engine.adapters import is_peft_folder

    if not is_peft_folder(source.path):
        raise CreateError(f"invalid adapter {source.label}: the folder is not a PEFT adapter "
                          "(adapter_config.json + adapter_model.safetensors)")


def check_adapter_plan(source: AdapterSource, base: BaseShapes | None) -> None:
    """A PEFT adapter folder checked without converting it: its config, its tensors, and their fit to `base`."""
    from dgemma_convert.lora import LoraError, check_against_base, plan_lora

    check_adapter_folder(source)
    try:
        plan, weights = plan_lora(source.path)
        weights.close()
        if base is not None:
            check_against_base(plan.header, base.architecture, base.tensors)
    except (LoraError, ConvertError) as exc:
        message = str(exc).replace(str(source.path), source.label)
        raise CreateError(f"invalid adapter {source.label}: {message}") from None


def converted_adapter(source: AdapterSource, out: Path, base: BaseShapes | None) -> Path:
    """A PEFT adapter folder -> a GGUF LoRA file at `out` (checked against `base` before it is written)."""
    from dgemma_convert.lora import LoraError, convert_lora

    tensors = (base.architecture, base.tensors) if base is not None else None
    try:
        convert_lora(source.path, out, base_tensors=tensors)
    except (LoraError, ConvertError) as exc:
        message = str(exc).replace(str(out), out.name).replace(str(source.path), source.label)
        raise CreateError(f"invalid adapter {source.label}: {message}") from None
    return out


def prepare_adapters(sources: list[AdapterSource], base: BaseShapes | None,
                     work: Path) -> Iterator[dict[str, Any]]:
    """Each ADAPTER as a checked GGUF LoRA file (PEFT folders converted into `work`); returns the files."""
    files = []
    for index, source in enumerate(sources):
        path = source.path
        if path.is_dir():
            check_adapter_folder(source)
            yield {"status": "converting adapter"}
            path = converted_adapter(source, work / f"adapter-{index}.gguf", base)
        validated_adapter(path, source.label, base)
        files.append(path)
    return files


def _import_adapters(store: Store, base: "_Base", files: list[Path]) -> Iterator[dict[str, Any]]:
    for path in files:
        layer, status = _import_layer(store, path, MEDIA_ADAPTER, None)
        base.layers.append(layer)
        base.sources[layer.digest] = path
        yield status


# ---- create --------------------------------------------------------------------------------------------------------

def _import_layer(store: Store, path: Path, media_type: str, from_: str | None) -> tuple[Layer, dict[str, Any]]:
    if path.resolve().parent == store.blobs_dir.resolve() and store.has_blob(path.name):
        # Already a verified blob (an upload, or `show --modelfile` output): reference it instead of copying it.
        digest = "sha256:" + path.name.removeprefix("sha256-")
        return Layer(media_type, digest, path.stat().st_size, from_), {"status": f"using existing layer {digest}"}
    digest, size, created = store.import_file(path)
    verb = "creating new layer" if created else "using existing layer"
    return Layer(media_type, digest, size, from_), {"status": f"{verb} {digest}"}


def _text_layer(store: Store, media_type: str, data: bytes) -> tuple[Layer, dict[str, Any]]:
    existed = store.has_blob(_digest_bytes(data))
    digest, size = store.write_blob(data)
    verb = "using existing layer" if existed else "creating new layer"
    return Layer(media_type, digest, size), {"status": f"{verb} {digest}"}


def _digest_bytes(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def create_model(name: ModelName | str, modelfile: Modelfile, store: Store, base_dir: Path | str,
                 quantize: str | None = None, paths_within: Path | None = None,
                 adapters: list[AdapterSource] | None = None) -> Iterator[dict[str, Any]]:
    """Create `name` from a parsed Modelfile, yielding Ollama's status objects; raises DgemmaError subclasses.

    `base_dir`: folder that relative FROM and ADAPTER paths start from (the Modelfile's folder). `paths_within`: if
    given, local paths are honoured only inside that folder; it defaults to `blobs/` when `base_dir` is the store's
    blobs folder (the server's call), so a client can never make the server open an arbitrary path. `adapters`: the
    ADAPTER sources when the caller resolved them itself (the server's uploaded blobs), in place of
    `modelfile.adapters`."""
    try:
        yield from _create_model(name, modelfile, store, base_dir, quantize, paths_within, adapters)
    except OSError as exc:  # unreadable source, full disk: one line, no paths
        raise CreateError(f"create failed: {exc.strerror or exc.__class__.__name__}") from None


@dataclass
class _Base:
    """What a FROM source contributes: layers, config, and (for a parent model) its inherited settings."""

    layers: list[Layer]
    config: dict[str, Any]
    params: dict[str, Any] = field(default_factory=dict)
    messages: list[dict[str, str]] = field(default_factory=list)
    licenses: list[str] = field(default_factory=list)
    template: str | None = None
    system: str | None = None
    sources: dict[str, Path] = field(default_factory=dict)  # digest -> file to import again if pruned meanwhile
    shapes: BaseShapes | None = None  # the weights' tensor shapes, what adapters are checked against


def _create_model(name: ModelName | str, modelfile: Modelfile, store: Store, base_dir: Path | str,
                  quantize: str | None, paths_within: Path | None,
                  adapters: list[AdapterSource] | None) -> Iterator[dict[str, Any]]:
    model_name = name if isinstance(name, ModelName) else ModelName.parse(name)
    base_dir = Path(base_dir)
    if paths_within is None and base_dir.resolve() == store.blobs_dir.resolve():
        paths_within = store.blobs_dir
    if adapters is None:
        adapters = modelfile_adapters(modelfile, base_dir, paths_within)
    if not modelfile.froms:
        raise CreateError("neither 'from' or 'files' was specified")
    modelfile = checked_modelfile(modelfile)  # the same checks for a Modelfile and a REST create (and pull's layers)
    quant = None
    if quantize:
        quant = QUANTIZE_TYPES.get(quantize.lower())
        if quant is None:
            raise CreateError(f"unsupported quantization type {quantize} (use one of q4_K_M, q5_K_M, q6_K, q8_0, q4_0)")

    store.ensure_dirs()
    sources = split_froms(modelfile.froms, base_dir, paths_within)
    local = sources.model_path
    with store.scratch("create") as work:  # conversions; never inside blobs/, never in $TMPDIR
        projector = sources.projector
        if local is not None:
            gguf, info = yield from _local_gguf(local, quant, work)
            if projector is None and local.is_dir() and is_hf_checkpoint(local):
                projector = yield from converted_projector(local, quant, work)
            checked_projector(projector, info)  # before anything enters the store
            # adapters are checked (and converted) before the weights enter the store: a bad one leaves nothing
            adapter_files = yield from prepare_adapters(adapters, BaseShapes.of(info, gguf), work)
            base = yield from _import_local(store, gguf, info, local.name)
        else:
            source = sources.model
            base = yield from _from_model(store, ModelName.parse(source), quant)  # not a path: a model name
            if adapters and base.shapes is None:
                raise CreateError(f"model '{source}' has no model layer to apply an adapter to")
            if projector is not None:
                checked_projector(projector, read_gguf_info(base.shapes.path) if base.shapes else None)
            adapter_files = yield from prepare_adapters(adapters, base.shapes, work)
        if projector is not None:
            yield from _import_projector(store, base, projector)
        yield from _import_adapters(store, base, adapter_files)
        yield from _write_model(store, model_name, modelfile, base)


def checked_projector(path: Path | None, model: GGUFInfo | None) -> None:
    """A vision projector GGUF checked as a pulled one is (projector.check_projector): its header, its fit to the
    model when known, and the vision engine's load checks."""
    if path is None:
        return
    try:
        check_projector(path, model, path.name)
    except ProjectorError as exc:
        raise CreateError(str(exc)) from None


def converted_projector(checkpoint: Path, quant: str | None, work: Path) -> Iterator[dict[str, Any]]:
    """The vision projector of a checkpoint folder, converted into `work` (None: the checkpoint has no vision tower).
    The converter's projector writer (`dgemma_convert.convert_mmproj`) is the one `dgemma convert
    --mmproj-outfile` uses."""
    from dgemma_convert.mmproj import MMPROJ_OUT_TYPES, convert_mmproj, plan_mmproj

    outtype = (quant or "f16").lower()
    outtype = outtype if outtype in MMPROJ_OUT_TYPES else "f16"  # K-quants are for the text weights
    if plan_mmproj(checkpoint, outtype) is None:
        return None
    out = work / "projector.gguf"
    yield {"status": "converting projector"}
    yield from converter_step("converting projector",
                               lambda sink: convert_mmproj(checkpoint, out, outtype, threads=2, progress=sink),
                               {str(out): out.name, str(checkpoint): checkpoint.name, str(work): "."})
    return out


def _import_projector(store: Store, base: "_Base", path: Path) -> Iterator[dict[str, Any]]:
    """The projector layer, right after the model layer; it replaces one the parent model had."""
    layer, status = _import_layer(store, path, MEDIA_PROJECTOR, None)
    kept = [existing for existing in base.layers if existing.media_type != MEDIA_PROJECTOR]
    at = next((i + 1 for i, existing in enumerate(kept) if existing.media_type == MEDIA_MODEL), len(kept))
    base.layers[:] = kept[:at] + [layer] + kept[at:]
    base.sources[layer.digest] = path
    yield status


def _local_gguf(local: Path, quant: str | None, work: Path) -> Iterator[dict[str, Any]]:
    """A GGUF file, a folder with one GGUF, or a checkpoint folder (converted) -> the validated GGUF to import."""
    gguf = local
    if local.is_dir():
        if is_hf_checkpoint(local):
            from dgemma_convert import convert

            yield {"status": "converting model"}
            gguf, outtype = work / "converted.gguf", (quant or "bf16").lower()
            yield from converter_step("converting model",
                                       lambda sink: convert(local, gguf, outtype, threads=2, progress=sink),
                                       {str(gguf): gguf.name, str(local): local.name, str(work): "."})
            quant = None  # already written in the requested type
        else:
            gguf = gguf_in_folder(local)
    yield {"status": "parsing GGUF"}
    info = validated_gguf(gguf)
    if quant is not None:
        if info.file_type not in FLOAT_FILE_TYPES:
            raise CreateError("quantization is only supported from F32, F16 or BF16 models")
        from dgemma_convert import requantize

        status = f"quantizing {info.file_type} model to {quant}"
        yield {"status": status}
        src, out = gguf, work / "quantized.gguf"
        yield from converter_step(status, lambda sink: requantize(src, out, quant.lower(), threads=2, progress=sink),
                                   {str(out): out.name, str(src): src.name, str(work): "."})
        gguf, info = out, validated_gguf(out)
    return gguf, info


def _import_local(store: Store, gguf: Path, info: GGUFInfo, from_: str) -> Iterator[dict[str, Any]]:
    """The model layer of a validated GGUF, and the config it implies."""
    layer, status = _import_layer(store, gguf, MEDIA_MODEL, from_)
    yield status
    config = {"model_format": "gguf", "model_family": ARCH, "model_families": [ARCH],
              "model_type": human_number(info.parameter_count), "file_type": info.file_type,
              "architecture": "amd64", "os": "linux"}
    return _Base([layer], config, sources={layer.digest: gguf}, shapes=BaseShapes.of(info, gguf))


def _from_model(store: Store, parent_name: ModelName, quant: str | None) -> Iterator[dict[str, Any]]:
    """An existing model (pulled first if missing): its weights and other layers are shared, settings inherited."""
    if not store.exists(parent_name):
        from dgemma_cli.registry import pull

        yield from pull(parent_name, store)
    parent = store.resolve(parent_name)
    if quant is not None:
        if parent.config.get("file_type") not in FLOAT_FILE_TYPES:
            raise CreateError("quantization is only supported from F32, F16 or BF16 models")
        raise CreateError("quantizing an existing model is not supported yet; create from its GGUF or checkpoint")
    assert parent.manifest is not None
    layers = []
    for layer in parent.manifest.layers:
        if layer.media_type == MEDIA_MODEL:
            layer = Layer(layer.media_type, layer.digest, layer.size, parent.name)
        elif layer.media_type in (MEDIA_TEMPLATE, MEDIA_SYSTEM, MEDIA_PARAMS, MEDIA_MESSAGES, MEDIA_LICENSE):
            continue  # rebuilt from the merged settings
        layers.append(layer)  # other media types (adapter, projector, ...) are preserved as they are
        yield {"status": f"using existing layer {layer.digest}"}
    config = {k: v for k, v in parent.config.items() if k != "template_format"}
    if not config.get("model_family"):
        config.update(model_format="gguf", model_family=ARCH, model_families=[ARCH])
    shapes = None
    if parent.gguf_path is not None and parent.gguf_path.is_file():
        try:
            shapes = BaseShapes.of(read_gguf_info(parent.gguf_path), parent.gguf_path)
        except GGUFError:
            shapes = None
    return _Base(layers, config, dict(parent.parameters), list(parent.messages), list(parent.license),
                 parent.template, parent.system, shapes=shapes)


def _write_model(store: Store, name: ModelName, mf: Modelfile, base: _Base) -> Iterator[dict[str, Any]]:
    """Merge the Modelfile over the base, write the small layers, the config and the manifest."""
    params = check_parameters({**base.params, **mf.parameters})  # new keys win; an inherited value is checked too
    messages = list(mf.messages) if mf.messages else check_messages(base.messages)  # replaced only if given
    template = mf.template if mf.template is not None else base.template
    system = mf.system if mf.system is not None else base.system
    licenses = base.licenses + [text for text in mf.licenses if text not in base.licenses]

    texts = [(media_type, data) for media_type, data in (
        (MEDIA_TEMPLATE, template.encode() if template is not None else None),
        (MEDIA_SYSTEM, system.encode() if system is not None else None),
        (MEDIA_PARAMS, canonical_json(params) if params else None),
        (MEDIA_MESSAGES, canonical_json(messages) if messages else None),
        *((MEDIA_LICENSE, text.encode()) for text in licenses),
    ) if data is not None]
    config = dict(base.config)
    if template is not None:
        config["template_format"] = template_format(template)
    if mf.requires:
        config["requires"] = mf.requires
    for key in ("renderer", "parser"):  # kept for Ollama Modelfiles; dgemma ignores them at inference
        if key in mf.extras:
            config[key] = mf.extras[key]

    # One critical section from the first small blob to the pruning of the replaced layers: a concurrent create,
    # delete or prune (another thread or process) can neither remove a blob this manifest is about to reference nor
    # miss this manifest when it decides what is unreferenced.
    statuses: list[dict[str, Any]] = []
    with store.write_lock():
        layers = list(base.layers)
        _restore_base_layers(store, base)
        for media_type, data in texts:
            layer, status = _text_layer(store, media_type, data)
            layers.append(layer)
            statuses.append(status)
        config_digest, config_size = store.write_blob(canonical_json(config))
        store.replace_manifest(name, build_manifest(Layer(CONFIG_MEDIA_TYPE, config_digest, config_size), layers))
    yield from statuses
    yield {"status": "writing manifest"}
    yield {"status": "success"}


def _restore_base_layers(store: Store, base: _Base) -> None:
    """Under the write lock: the base's layers must still exist (another writer may have pruned one since it was
    imported or found); a file we imported is imported again, an inherited layer that vanished is an error."""
    for layer in base.layers:
        if store.has_blob(layer.digest):
            continue
        source = base.sources.get(layer.digest)
        if source is None or not source.is_file():
            raise CreateError(f"layer {layer.digest[:19]} was removed while creating the model; try again")
        store.import_file(source)


def load_modelfile_for_create(path: str | Path | None, cwd: Path) -> tuple[Modelfile, Path]:
    """CLI helper: read `-f FILE` (default `Modelfile`; a missing default means `FROM .` when `cwd` holds a model)
    and its base folder. Errors name the file as the user wrote it."""
    from dgemma_cli.modelfile import parse_modelfile

    if path is None:
        default = cwd / "Modelfile"
        if not default.exists():
            try:
                holds_model = is_hf_checkpoint(cwd) or bool(gguf_entries(cwd))
            except OSError as exc:
                raise CreateError(f"cannot read this folder: {exc.strerror}") from None
            if not holds_model:
                raise CreateError("no Modelfile or model files found: this folder has no Modelfile, GGUF file or "
                                  "Hugging Face checkpoint (name a Modelfile with -f)")
            return parse_modelfile("FROM ."), cwd
        path = default
    file = Path(path)
    try:
        if not file.is_file():
            raise CreateError(f"Modelfile not found: {path}")
        with open(file, "rb") as f:
            data = f.read(16 << 20)
    except OSError as exc:
        raise CreateError(f"cannot read Modelfile {path}: {exc.strerror}") from None
    return parse_modelfile(data), file.resolve().parent
