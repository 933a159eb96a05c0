"""Models that ship inside the package (`dgemma_modelfiles` package data) and register themselves on first use.

`sudoku` is the bundled default: a fresh install runs `dgemma run sudoku PUZZLE` with no network and no pull. When a
name the store does not have is one of BUNDLED (in its default form, `registry.ollama.ai/library/<name>:latest`), the
server creates it from the shipped Modelfile, exactly as `dgemma create <name> -f <Modelfile>` would; the GGUF is
validated and copied into the store like any other. As with Ollama, a model the user deleted stays deleted: `rm`
leaves a marker in the store, and only a pull (`dgemma pull sudoku`, or `run`'s pull on a 404) registers it again.

A read-only server (DGEMMA_READONLY) writes nothing in the store, yet a bundled model is part of the installation, not
something a client adds, so `dgemma run sudoku` still works there: the model is created the same way in a private
store outside the models folder (a temporary folder, removed when the process exits) and served from it; `list` does
not show it, as it does not show a bundled model before its first use. A model the user deleted stays deleted there
too.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dgemma_cli.errors import DgemmaError
from dgemma_cli.names import DEFAULT_HOST, DEFAULT_NAMESPACE, DEFAULT_TAG, ModelName
from dgemma_cli.store import Store

# model name -> Modelfile in the dgemma_modelfiles package (its FROM names the GGUF next to it)
BUNDLED = {"sudoku": "sudoku.Modelfile"}
DELETED_DIR = ".dgemma-bundled-deleted"  # in the store root: one empty file per bundled model the user deleted
_lock = threading.Lock()  # two first requests at once register once
_private: dict[str, Store] = {}  # a read-only server's bundled models: name -> the private store that holds it
_private_dirs: list[tempfile.TemporaryDirectory] = []  # their folders, removed at exit
# A private folder's name carries its process id, so a folder a killed server left behind (no exit handler ran) is
# removed by the next read-only server that makes one: at most one stale copy per dead process, never an unbounded
# pile in the temporary folder.
PRIVATE_PREFIX = "dgemma-bundled-"


def presets_dir() -> Path:
    from dgemma_modelfiles import PRESETS_DIR

    return Path(PRESETS_DIR)


def bundled_modelfile(name: ModelName) -> Path | None:
    """The shipped Modelfile for `name`, or None when `name` is not a bundled model."""
    if (name.host, name.namespace, name.tag) != (DEFAULT_HOST, DEFAULT_NAMESPACE, DEFAULT_TAG):
        return None
    filename = BUNDLED.get(name.model.lower())
    return presets_dir() / filename if filename else None


def _deleted_marker(store: Store, name: ModelName) -> Path:
    return store.root / DELETED_DIR / name.model.lower()  # a BUNDLED key: bundled_modelfile(name) was checked


def mark_deleted(store: Store, name: ModelName) -> None:
    """Remember that the user deleted `name` when it is a bundled model, so that first use does not bring it back."""
    if bundled_modelfile(name) is None:
        return
    marker = _deleted_marker(store, name)
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()


def register_bundled(store: Store, name: ModelName, undelete: bool = False) -> bool:
    """Create `name` in `store` from its shipped Modelfile when it is a bundled model the store lacks and the user
    has not deleted (`undelete`, a pull's: also after a delete). Returns True when the model exists afterwards
    because it is bundled; False for any other name, and for a deleted one."""
    modelfile = bundled_modelfile(name)
    if modelfile is None:
        return False
    marker = _deleted_marker(store, name)
    with _lock:
        if store.exists(name):
            return True
        if marker.exists() and not undelete:
            return False
        _create(store, name, modelfile)
        try:
            marker.unlink(missing_ok=True)
        except OSError as exc:
            raise DgemmaError(f"cannot register the bundled model '{name.model}': {exc.strerror}") from None
    return True


def bundled_source(store: Store, name: ModelName, read_only: bool) -> Store | None:
    """The store to resolve `name` from when `store` lacks it: `store` itself once the bundled model is registered
    there (register_bundled); on a read-only server a private store outside it, made once per process; None for a
    name that is not bundled and for a bundled model the user deleted."""
    if not read_only:
        return store if register_bundled(store, name) else None
    modelfile = bundled_modelfile(name)
    if modelfile is None or _deleted_marker(store, name).exists():
        return None
    key = name.model.lower()
    with _lock:
        if key not in _private:
            _remove_stale_private_dirs()
            folder = tempfile.TemporaryDirectory(prefix=f"{PRIVATE_PREFIX}{os.getpid()}-", ignore_cleanup_errors=True)
            try:
                private = Store(folder.name)
                _create(private, name, modelfile)
            except BaseException:
                folder.cleanup()
                raise
            _private_dirs.append(folder)
            _private[key] = private
        return _private[key]


def _remove_stale_private_dirs() -> None:
    """This user's private folders whose process is gone (killed before its exit handler ran)."""
    for folder in Path(tempfile.gettempdir()).glob(f"{PRIVATE_PREFIX}*-*"):
        pid = folder.name[len(PRIVATE_PREFIX):].split("-", 1)[0]
        try:
            mine = folder.is_dir() and not folder.is_symlink() and folder.stat().st_uid == os.getuid()
        except OSError:
            continue
        if mine and pid.isdigit() and not _process_alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _create(store: Store, name: ModelName, modelfile: Path) -> None:
    """`dgemma create <name> -f <shipped Modelfile>` into `store`."""
    from dgemma_cli.create import create_model, load_modelfile_for_create

    try:
        parsed, base_dir = load_modelfile_for_create(modelfile, modelfile.parent)
        weights = base_dir / str(parsed.from_)
        if not weights.is_file():
            raise DgemmaError(f"the bundled model '{name.model}' is missing from this installation "
                              f"({weights.name} not found in the dgemma_modelfiles package)")
        for _status in create_model(name, parsed, store, base_dir):
            pass
    except OSError as exc:
        raise DgemmaError(f"cannot register the bundled model '{name.model}': {exc.strerror}") from None


def pull_bundled(store: Store, name: ModelName) -> Iterator[dict[str, Any]]:
    """`pull` of a bundled model: registered from the package, also after a delete, with no network; pull statuses."""
    yield {"status": "copying the bundled model from the dgemma package"}
    register_bundled(store, name, undelete=True)
    yield {"status": "success"}
