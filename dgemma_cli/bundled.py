"""Models that ship inside the package (`dgemma_modelfiles` package data) and register themselves on first use.

`sudoku` is the bundled default: a fresh install runs `dgemma run sudoku PUZZLE` with no network and no pull. When a
name the store does not have is one of BUNDLED (in its default form, `registry.ollama.ai/library/<name>:latest`), the
server creates it from the shipped Modelfile, exactly as `dgemma create <name> -f <Modelfile>` would; the GGUF is
validated and copied into the store like any other. Deleting it just means the next use registers it again.
"""
from __future__ import annotations

import threading
from pathlib import Path

from dgemma_cli.errors import DgemmaError
from dgemma_cli.names import DEFAULT_HOST, DEFAULT_NAMESPACE, DEFAULT_TAG, ModelName
from dgemma_cli.store import Store

# model name -> Modelfile in the dgemma_modelfiles package (its FROM names the GGUF next to it)
BUNDLED = {"sudoku": "sudoku.Modelfile"}
_lock = threading.Lock()  # two first requests at once register once


def presets_dir() -> Path:
    from dgemma_modelfiles import PRESETS_DIR

    return Path(PRESETS_DIR)


def bundled_modelfile(name: ModelName) -> Path | None:
    """The shipped Modelfile for `name`, or None when `name` is not a bundled model."""
    if (name.host, name.namespace, name.tag) != (DEFAULT_HOST, DEFAULT_NAMESPACE, DEFAULT_TAG):
        return None
    filename = BUNDLED.get(name.model.lower())
    return presets_dir() / filename if filename else None


def register_bundled(store: Store, name: ModelName) -> bool:
    """Create `name` in `store` from its shipped Modelfile when it is a bundled model the store lacks.
    Returns True when the model exists afterwards because it is bundled; False for any other name."""
    modelfile = bundled_modelfile(name)
    if modelfile is None:
        return False
    from dgemma_cli.create import create_model, load_modelfile_for_create

    with _lock:
        if store.exists(name):
            return True
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
    return True
