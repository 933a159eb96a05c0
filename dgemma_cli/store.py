"""The model store: Ollama's on-disk layout, manifests and blobs (docs/compat.md#names-and-store, security A–B).

    <root>/manifests/<host>/<namespace>/<model>/<tag>    manifest JSON
    <root>/blobs/sha256-<64 lowercase hex>                 content-addressed blobs

`Store.blob_path` is the ONE function that turns a digest into a path: every reader and writer (pull, create,
/api/blobs, copy, delete, prune, resume sidecars) goes through it, so a traversal digest can never name a file
outside `blobs/`. Manifest paths come only from validated `ModelName`s and are checked to stay inside `manifests/`.

Writers that change which blobs are referenced (a manifest write, a delete, a prune) hold `Store.write_lock()`: an
exclusive `flock` on `<root>/.dgemma-store.lock`, so a server and a CLI sharing the store never prune a blob that
another writer is about to reference. Scratch space for conversions lives in `<root>/tmp/`, never in $TMPDIR, and
folders whose owner died (a killed `create`) are removed by the next `Store.scratch()`.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import secrets
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

from dgemma_cli import env
from dgemma_cli.errors import DgemmaError
from dgemma_cli.names import InvalidNameError, ModelName

MANIFEST_MEDIA_TYPE = "application/vnd.docker.distribution.manifest.v2+json"
CONFIG_MEDIA_TYPE = "application/vnd.docker.container.image.v1+json"
MEDIA_MODEL = "application/vnd.ollama.image.model"
MEDIA_TEMPLATE = "application/vnd.ollama.image.template"
MEDIA_SYSTEM = "application/vnd.ollama.image.system"
MEDIA_LICENSE = "application/vnd.ollama.image.license"
MEDIA_PARAMS = "application/vnd.ollama.image.params"
MEDIA_MESSAGES = "application/vnd.ollama.image.messages"
MEDIA_ADAPTER = "application/vnd.ollama.image.adapter"  # a GGUF LoRA file (docs/gguf.md#lora-adapters)
MEDIA_PROJECTOR = "application/vnd.ollama.image.projector"  # a vision projector GGUF (docs/store.md)

MAX_LAYERS = 64
MAX_LAYER_SIZE = 10**12  # 1 TB
MAX_MANIFEST_BYTES = 4 << 20
MAX_TEXT_LAYER_BYTES = 16 << 20  # template/system/license/params/messages layers are read into memory
LOCK_FILE = ".dgemma-store.lock"
SCRATCH_DIR = "tmp"
SCRATCH_OWNER = ".owner"  # flocked by the folder's owner for as long as it lives

_DIGEST_RE = re.compile(r"sha256[:-]([0-9a-fA-F]{64})", re.ASCII)
_BLOB_NAME_RE = re.compile(r"sha256-[0-9a-f]{64}", re.ASCII)


class InvalidDigestError(DgemmaError):
    status = 400

    def __init__(self) -> None:
        super().__init__("invalid digest format")


class ModelNotFoundError(DgemmaError):
    status = 404

    def __init__(self, name: str) -> None:
        super().__init__(f"model '{name}' not found")
        self.name = name


class InvalidManifestError(DgemmaError):
    status = 400


def normalize_digest(digest: str) -> str:
    """`sha256:<64 lowercase hex>` for any accepted spelling (`sha256-`, uppercase hex); else InvalidDigestError."""
    if not isinstance(digest, str):
        raise InvalidDigestError()
    m = _DIGEST_RE.fullmatch(digest)
    if m is None:
        raise InvalidDigestError()
    return "sha256:" + m.group(1).lower()


def canonical_json(obj: Any) -> bytes:
    """Canonical JSON (sorted keys, compact, trailing newline): identical inputs give identical digests."""
    return (json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False) + "\n").encode()


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return "sha256:" + h.hexdigest()


@dataclass(frozen=True)
class Layer:
    media_type: str
    digest: str  # normalised `sha256:<hex>`
    size: int
    from_: str | None = None


@dataclass(frozen=True)
class Manifest:
    raw: bytes  # exact bytes on disk (pulled manifests are stored as received)
    config: Layer
    layers: tuple[Layer, ...]

    @property
    def digest(self) -> str:
        """SHA-256 of the manifest bytes: `list` shows its first 12 hex, `/api/tags` the whole."""
        return hashlib.sha256(self.raw).hexdigest()

    @property
    def total_size(self) -> int:
        return self.config.size + sum(layer.size for layer in self.layers)

    def all_digests(self) -> list[str]:
        return [self.config.digest] + [layer.digest for layer in self.layers]

    def layer(self, media_type: str) -> Layer | None:
        return next((layer for layer in self.layers if layer.media_type == media_type), None)


def _parse_layer(obj: Any, what: str) -> Layer:
    if not isinstance(obj, dict):
        raise InvalidManifestError(f"invalid manifest: {what} is not an object")
    media_type, digest, size = obj.get("mediaType"), obj.get("digest"), obj.get("size")
    if not isinstance(media_type, str) or not media_type:
        raise InvalidManifestError(f"invalid manifest: {what} has no media type")
    try:
        digest = normalize_digest(digest)
    except InvalidDigestError:
        raise InvalidManifestError(f"invalid manifest: {what} has an invalid digest") from None
    if isinstance(size, bool) or not isinstance(size, int) or size < 0 or size > MAX_LAYER_SIZE:
        raise InvalidManifestError(f"invalid manifest: {what} has an invalid size")
    from_ = obj.get("from")
    return Layer(media_type, digest, size, from_ if isinstance(from_, str) else None)


def parse_manifest(raw: bytes) -> Manifest:
    """Validate a manifest's shape, digests and sizes (docs/compat.md#pull-protocol step 3), without touching the
    filesystem."""
    if len(raw) > MAX_MANIFEST_BYTES:
        raise InvalidManifestError("invalid manifest: larger than 4 MiB")
    try:
        obj = json.loads(raw)
    except (UnicodeDecodeError, ValueError):
        raise InvalidManifestError("invalid manifest: not valid JSON") from None
    if not isinstance(obj, dict) or obj.get("schemaVersion") != 2:
        raise InvalidManifestError("invalid manifest: schemaVersion must be 2")
    layers = obj.get("layers")
    if not isinstance(layers, list):
        raise InvalidManifestError("invalid manifest: missing layers")
    if len(layers) > MAX_LAYERS:
        raise InvalidManifestError(f"invalid manifest: more than {MAX_LAYERS} layers")
    config = _parse_layer(obj.get("config"), "config")
    parsed = tuple(_parse_layer(layer, f"layer {i}") for i, layer in enumerate(layers))
    if any(layer.digest == config.digest for layer in parsed):
        raise InvalidManifestError("invalid manifest: config digest repeats a layer digest")
    return Manifest(raw, config, parsed)


def build_manifest(config: Layer, layers: Iterable[Layer]) -> bytes:
    def entry(layer: Layer) -> dict[str, Any]:
        d: dict[str, Any] = {"mediaType": layer.media_type, "digest": layer.digest, "size": layer.size}
        if layer.from_:
            d["from"] = layer.from_
        return d

    return canonical_json(
        {
            "schemaVersion": 2,
            "mediaType": MANIFEST_MEDIA_TYPE,
            "config": entry(config),
            "layers": [entry(layer) for layer in layers],
        }
    )


@dataclass(frozen=True)
class ModelEntry:
    """One row of `list` / `/api/tags`."""

    name: str  # display form
    model_name: ModelName
    digest: str  # SHA-256 of the manifest bytes (64 hex, no prefix)
    size: int
    modified: float  # manifest mtime, seconds since the epoch
    details: dict[str, Any] = field(default_factory=dict)
    vision: bool = False  # a projector layer (the `vision` capability)


@dataclass
class LocalModel:
    """Everything a runner or `show` needs about a stored model."""

    name: str  # display form
    gguf_path: Path | None
    parameters: dict[str, Any]
    template: str | None
    system: str | None
    license: list[str]
    messages: list[dict[str, str]]
    config: dict[str, Any]
    manifest_digest: str
    model_name: ModelName | None = None
    manifest: Manifest | None = None
    modified: float = 0.0
    adapters: list[Path] = field(default_factory=list)  # GGUF LoRA blobs, applied in manifest order
    projector: Path | None = None  # the vision projector GGUF blob; None: a text-only model

    @property
    def template_format(self) -> str | None:
        return self.config.get("template_format")


class _RootLock:
    """One store's write lock: reentrant within a thread, exclusive across threads (an RLock) and processes (flock)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.thread_lock = threading.RLock()
        self.depth = 0
        self.fd: int | None = None

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        with self.thread_lock:
            if self.depth == 0:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX)
                except BaseException:
                    os.close(fd)
                    raise
                self.fd = fd
            self.depth += 1
            try:
                yield
            finally:
                self.depth -= 1
                if self.depth == 0 and self.fd is not None:
                    os.close(self.fd)  # releases the flock
                    self.fd = None


_ROOT_LOCKS: dict[str, _RootLock] = {}
_ROOT_LOCKS_GUARD = threading.Lock()


def _root_lock(root: Path) -> _RootLock:
    path = root.resolve() / LOCK_FILE
    with _ROOT_LOCKS_GUARD:
        return _ROOT_LOCKS.setdefault(str(path), _RootLock(path))


def _sweep_scratch(folder: Path) -> None:
    """Remove scratch folders whose owner no longer holds its lock (it was killed, or crashed)."""
    for entry in folder.iterdir():
        if not entry.is_dir() or entry.is_symlink():
            continue
        try:
            fd = os.open(entry / SCRATCH_OWNER, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            fd = None  # killed between mkdir and creating its owner file
        except OSError:
            continue
        try:
            if fd is not None:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            elif time.time() - entry.stat().st_mtime < 60:
                continue  # a brand-new folder whose owner file is not there yet
        except (BlockingIOError, OSError):
            continue  # still owned
        finally:
            if fd is not None:
                os.close(fd)
        shutil.rmtree(entry, ignore_errors=True)


def default_root() -> Path:
    value = env.MODELS.get()
    return Path(value) if value else Path.home() / ".dgemma" / "models"


class Store:
    def __init__(self, root: str | os.PathLike | None = None) -> None:
        self.root = Path(root).expanduser() if root is not None else default_root()
        self.blobs_dir = self.root / "blobs"
        self.manifests_dir = self.root / "manifests"

    def ensure_dirs(self) -> None:
        self.blobs_dir.mkdir(parents=True, exist_ok=True)
        self.manifests_dir.mkdir(parents=True, exist_ok=True)

    def write_lock(self) -> contextlib.AbstractContextManager[None]:
        """Held around every change of which blobs are referenced: a manifest write together with the check that its
        blobs exist and the pruning of the layers it replaced, a delete, a prune (across threads and processes)."""
        return _root_lock(self.root).hold()

    @contextlib.contextmanager
    def scratch(self, prefix: str) -> Iterator[Path]:
        """A private folder under `<root>/tmp/` for the duration of the block, removed afterwards; folders left by a
        killed owner are removed by the next call (each folder's owner holds a flock on its `.owner` file)."""
        folder = self.root / SCRATCH_DIR
        folder.mkdir(parents=True, exist_ok=True)
        _sweep_scratch(folder)
        work = folder / f"{prefix}-{os.getpid()}-{secrets.token_hex(6)}"
        work.mkdir()
        fd = os.open(work / SCRATCH_OWNER, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield work
        finally:
            shutil.rmtree(work, ignore_errors=True)
            os.close(fd)

    # ---- blobs -------------------------------------------------------------------------------------------------

    def blob_path(self, digest: str) -> Path:
        """THE validated digest -> path function: `blobs/sha256-<64 lowercase hex>`, never anything else."""
        hexdigest = normalize_digest(digest).split(":", 1)[1]
        return self._inside_blobs(self.blobs_dir / f"sha256-{hexdigest}")

    def _inside_blobs(self, path: Path) -> Path:
        if path.resolve().parent != self.blobs_dir.resolve():  # e.g. a symlinked file pointing elsewhere
            raise InvalidDigestError()
        return path

    def partial_path(self, digest: str) -> Path:
        """In-flight download data: `blobs/sha256-<hex>-partial` (derived from blob_path only)."""
        blob = self.blob_path(digest)
        return self._inside_blobs(blob.with_name(blob.name + "-partial"))

    def sidecar_path(self, digest: str, part: int) -> Path:
        """Resume state of one part: `blobs/sha256-<hex>-partial-<N>`."""
        if isinstance(part, bool) or not isinstance(part, int) or not 0 <= part < 100_000:
            raise DgemmaError("invalid part number")
        blob = self.blob_path(digest)
        return self._inside_blobs(blob.with_name(blob.name + f"-partial-{part}"))

    def upload_path(self, digest: str) -> Path:
        """A fresh temp name for a blob being written (`…-upload-<random>`), inside `blobs/`."""
        blob = self.blob_path(digest)
        return self._inside_blobs(blob.with_name(blob.name + f"-upload-{secrets.token_hex(8)}"))

    def has_blob(self, digest: str) -> bool:
        return self.blob_path(digest).is_file()

    def commit_blob(self, tmp: Path, digest: str) -> Path:
        """Atomically move a fully written and verified temp file into place (mode 0644)."""
        dest = self.blob_path(digest)
        if tmp.resolve().parent != self.blobs_dir.resolve():
            raise DgemmaError("temporary blob outside the store")
        os.chmod(tmp, 0o644)
        os.replace(tmp, dest)
        return dest

    def write_blob(self, data: bytes) -> tuple[str, int]:
        """Store bytes as a blob; returns (digest, size). Existing blobs are left untouched."""
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        if not self.has_blob(digest):
            self.ensure_dirs()
            tmp = self.upload_path(digest)
            try:
                tmp.write_bytes(data)
                self.commit_blob(tmp, digest)
            finally:
                tmp.unlink(missing_ok=True)
        return digest, len(data)

    def import_file(self, src: Path, chunk: int = 1 << 22) -> tuple[str, int, bool]:
        """Copy a local file into the store, hashing as it goes; returns (digest, size, created)."""
        self.ensure_dirs()
        tmp = self.blobs_dir / f"sha256-import-upload-{secrets.token_hex(8)}"
        h, size = hashlib.sha256(), 0
        try:
            with open(src, "rb") as fin, open(tmp, "wb") as fout:
                while block := fin.read(chunk):
                    h.update(block)
                    fout.write(block)
                    size += len(block)
            digest = "sha256:" + h.hexdigest()
            if self.has_blob(digest):
                return digest, size, False
            self.commit_blob(tmp, digest)
            return digest, size, True
        finally:
            tmp.unlink(missing_ok=True)

    def read_blob_text(self, digest: str, limit: int = MAX_TEXT_LAYER_BYTES) -> str:
        path = self.blob_path(digest)
        with open(path, "rb") as f:
            data = f.read(limit + 1)
        if len(data) > limit:
            raise DgemmaError(f"layer {digest[:19]} is too large")
        return data.decode("utf-8", errors="replace")

    # ---- manifests ---------------------------------------------------------------------------------------------

    def _as_name(self, name: ModelName | str) -> ModelName:
        return name if isinstance(name, ModelName) else ModelName.parse(name)

    def _find_on_disk(self, name: ModelName) -> Path | None:
        """The existing manifest file matching `name` case-insensitively (the on-disk spelling is reused)."""
        try:
            return self._walk_to_manifest(name)
        except OSError as exc:
            if exc.errno == errno.ENAMETOOLONG:  # a store root so deep that the name's path cannot exist
                return None
            raise

    def _walk_to_manifest(self, name: ModelName) -> Path | None:
        current = self.manifests_dir
        for part in name.parts:
            if not current.is_dir():
                return None
            exact = current / part
            if exact.exists():
                current = exact
                continue
            match = next((p for p in current.iterdir() if p.name.lower() == part.lower()), None)
            if match is None:
                return None
            current = match
        return current if current.is_file() else None

    def _inside_manifests(self, path: Path) -> Path:
        base = self.manifests_dir.resolve()
        resolved = path.resolve()
        if base not in resolved.parents:
            raise DgemmaError("invalid model name")
        return path

    def manifest_path(self, name: ModelName | str) -> Path:
        """Path of the manifest for `name`: the existing file (any case) or where a new one would go."""
        name = self._as_name(name)
        found = self._find_on_disk(name)
        return self._inside_manifests(found if found is not None else self.manifests_dir.joinpath(*name.parts))

    def exists(self, name: ModelName | str) -> bool:
        return self._find_on_disk(self._as_name(name)) is not None

    def read_manifest(self, name: ModelName | str) -> Manifest:
        name = self._as_name(name)
        path = self._find_on_disk(name)
        if path is None:
            raise ModelNotFoundError(name.display)
        self._inside_manifests(path)
        with open(path, "rb") as f:
            raw = f.read(MAX_MANIFEST_BYTES + 1)
        return parse_manifest(raw)

    def write_manifest(self, name: ModelName | str, raw: bytes) -> Path:
        """Atomically write manifest bytes (validated first) for `name`."""
        path = self.manifest_path(name)  # the name is validated before the content
        parse_manifest(raw)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._inside_manifests(path)
            tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(6)}")
            try:
                tmp.write_bytes(raw)
                os.chmod(tmp, 0o644)
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)
        except OSError as exc:
            if exc.errno == errno.ENAMETOOLONG:  # valid, but too long for this store's folder (PATH_MAX)
                raise InvalidNameError() from None
            raise
        return path

    def replace_manifest(self, name: ModelName | str, raw: bytes) -> set[str]:
        """Write `name`'s manifest, then delete the blobs only the manifest it replaced used (a pull or create over
        an existing model). Returns the digests the old manifest had and the new one lacks."""
        try:
            previous = self.read_manifest(name) if self.exists(name) else None
        except DgemmaError:  # an unreadable old manifest leaves nothing to compare
            previous = None
        self.write_manifest(name, raw)
        if previous is None:
            return set()
        orphans = set(previous.all_digests()) - set(parse_manifest(raw).all_digests())
        if orphans:
            self.remove_unreferenced(orphans)
        return orphans

    def iter_manifests(self) -> Iterable[tuple[ModelName, Path]]:
        """Every well-formed manifest path with a valid name (anything else in `manifests/` is ignored)."""
        if not self.manifests_dir.is_dir():
            return
        for path in sorted(self.manifests_dir.glob("*/*/*/*")):
            if not path.is_file() or path.name.startswith("."):
                continue
            host, ns, model, tag = path.relative_to(self.manifests_dir).parts
            try:
                yield ModelName.parse(f"{host}/{ns}/{model}:{tag}"), path
            except DgemmaError:
                continue

    def _manifest_at(self, path: Path) -> Manifest | None:
        try:
            with open(path, "rb") as f:
                return parse_manifest(f.read(MAX_MANIFEST_BYTES + 1))
        except (OSError, DgemmaError):
            return None

    def referenced_digests(self) -> set[str]:
        refs: set[str] = set()
        for _, path in self.iter_manifests():
            manifest = self._manifest_at(path)
            if manifest is not None:
                refs.update(manifest.all_digests())
        return refs

    # ---- models ------------------------------------------------------------------------------------------------

    def read_config(self, manifest: Manifest) -> dict[str, Any]:
        try:
            config = json.loads(self.read_blob_text(manifest.config.digest, limit=1 << 20))
        except (OSError, ValueError, DgemmaError):
            return {}
        return config if isinstance(config, dict) else {}

    def list_models(self) -> list[ModelEntry]:
        """All models, newest first."""
        entries = []
        for name, path in self.iter_manifests():
            manifest = self._manifest_at(path)
            if manifest is None:
                continue
            config = self.read_config(manifest)
            details = {
                "parent_model": "",
                "format": config.get("model_format", "gguf"),
                "family": config.get("model_family", ""),
                "families": config.get("model_families")
                or ([config["model_family"]] if config.get("model_family") else None),
                "parameter_size": config.get("model_type", ""),
                "quantization_level": config.get("file_type", ""),
            }
            entries.append(ModelEntry(name.display, name, manifest.digest, manifest.total_size,
                                      path.stat().st_mtime, details, manifest.layer(MEDIA_PROJECTOR) is not None))
        entries.sort(key=lambda e: e.modified, reverse=True)
        return entries

    def resolve(self, name: ModelName | str) -> LocalModel:
        """Read a model's manifest and its small layers; the weights stay on disk (gguf_path)."""
        name = self._as_name(name)
        path = self._find_on_disk(name)
        manifest = self.read_manifest(name)
        config = self.read_config(manifest)
        gguf_path, template, system, licenses, messages, params = None, None, None, [], [], {}
        adapters, projector = [], None
        for layer in manifest.layers:
            if layer.media_type == MEDIA_MODEL and gguf_path is None:
                gguf_path = self.blob_path(layer.digest)
            elif layer.media_type == MEDIA_ADAPTER:
                adapters.append(self.blob_path(layer.digest))
            elif layer.media_type == MEDIA_PROJECTOR and projector is None:
                projector = self.blob_path(layer.digest)
            elif layer.media_type == MEDIA_TEMPLATE:
                template = self.read_blob_text(layer.digest)
            elif layer.media_type == MEDIA_SYSTEM:
                system = self.read_blob_text(layer.digest)
            elif layer.media_type == MEDIA_LICENSE:
                licenses.append(self.read_blob_text(layer.digest))
            elif layer.media_type == MEDIA_PARAMS:
                params = _json_layer(self.read_blob_text(layer.digest), dict, "params")
            elif layer.media_type == MEDIA_MESSAGES:
                messages = _stored_messages(_json_layer(self.read_blob_text(layer.digest), list, "messages"))
        return LocalModel(
            name=name.display if path is None else _on_disk_name(self, path).display,
            gguf_path=gguf_path,
            parameters=params,
            template=template,
            system=system,
            license=licenses,
            messages=messages,
            config=config,
            manifest_digest=manifest.digest,
            model_name=name,
            manifest=manifest,
            modified=path.stat().st_mtime if path is not None else 0.0,
            adapters=adapters,
            projector=projector,
        )

    def copy(self, src: ModelName | str, dst: ModelName | str) -> set[str]:
        """Copy the manifest bytes under a new name; blobs are shared. A model the copy replaces loses the blobs only
        it used, as a create over it would (replace_manifest); returns their digests."""
        src_name, dst_name = self._as_name(src), self._as_name(dst)
        with self.write_lock():
            manifest = self.read_manifest(src_name)
            for digest in manifest.all_digests():
                if not self.has_blob(digest):
                    raise DgemmaError(f"model '{src_name.display}' is incomplete: missing blob {digest}")
            return self.replace_manifest(dst_name, manifest.raw)

    def delete(self, name: ModelName | str) -> list[str]:
        """Remove a model; prune the blobs only it referenced and empty manifest folders. Returns removed digests."""
        name = self._as_name(name)
        with self.write_lock():
            path = self._find_on_disk(name)
            if path is None:
                raise ModelNotFoundError(name.display)
            self._inside_manifests(path)
            old = self._manifest_at(path)
            path.unlink()
            self._remove_empty_manifest_dirs()
            return self.remove_unreferenced(old.all_digests() if old else [])

    def remove_unreferenced(self, candidates: Iterable[str]) -> list[str]:
        """Delete those of `candidates` (digests) that no manifest references any more (references are read under
        the write lock, so a manifest written concurrently is always seen)."""
        with self.write_lock():
            refs = self.referenced_digests()
            removed = []
            for digest in dict.fromkeys(candidates):
                if digest not in refs:
                    path = self.blob_path(digest)
                    if path.is_file():
                        path.unlink()
                        removed.append(digest)
            return removed

    def missing_blobs(self, manifest: Manifest) -> list[str]:
        return [digest for digest in manifest.all_digests() if not self.has_blob(digest)]

    def prune(self, min_age_s: float = 3600) -> list[str]:
        """Startup pruning: remove unreferenced or misnamed files in `blobs/` older than `min_age_s`."""
        if not self.blobs_dir.is_dir():
            return []
        with self.write_lock():
            return self._prune(min_age_s)

    def _prune(self, min_age_s: float) -> list[str]:
        removed: list[str] = []
        self.migrate_legacy_blobs()
        refs = {d.replace(":", "-") for d in self.referenced_digests()}
        now = time.time()
        for entry in self.blobs_dir.iterdir():
            if entry.name in refs and _BLOB_NAME_RE.fullmatch(entry.name):
                continue
            try:
                st = entry.lstat()
            except OSError:
                continue
            if now - st.st_mtime < min_age_s:
                continue  # a concurrent pull or upload may still own it
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            removed.append(entry.name)
        self._remove_empty_manifest_dirs()
        return removed

    def migrate_legacy_blobs(self) -> None:
        """Rename blobs stored under the legacy `sha256:<hex>` name to `sha256-<hex>` (run at startup)."""
        for entry in self.blobs_dir.glob("sha256:*"):
            try:
                target = self.blob_path(entry.name)
            except InvalidDigestError:
                continue
            if not target.exists():
                os.replace(entry, target)

    def _remove_empty_manifest_dirs(self) -> None:
        if not self.manifests_dir.is_dir():
            return
        for dirpath, _dirnames, _files in sorted(os.walk(self.manifests_dir), key=lambda t: -len(t[0])):
            if Path(dirpath) != self.manifests_dir:
                try:
                    os.rmdir(dirpath)
                except OSError:
                    pass


def _on_disk_name(store: Store, path: Path) -> ModelName:
    host, ns, model, tag = path.relative_to(store.manifests_dir).parts
    return ModelName.parse(f"{host}/{ns}/{model}:{tag}")


def _stored_messages(messages: list) -> list[dict[str, str]]:
    """A stored messages layer under the create and pull check: a model stored before that check (or by hand) with
    messages no template can render is refused in one line rather than failing inside the renderer."""
    from dgemma_cli.modelfile import ModelfileError, check_messages

    try:
        return check_messages(messages)
    except ModelfileError as exc:
        raise DgemmaError(f"the model's messages layer is invalid: {exc}") from None


def _json_layer(text: str, kind: type, what: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        raise DgemmaError(f"invalid {what} layer: not valid JSON") from None
    if not isinstance(value, kind):
        raise DgemmaError(f"invalid {what} layer")
    return value
