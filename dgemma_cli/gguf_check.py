"""Python GGUF validation: the gate every file passes before it enters the store or reaches a native loader.

docs/compat.md, security D. The header is read by the engine's bounded reader (`dgemma_engine.gguf_reader`, which the
tokenizer shares): bounds-checked at every step, with fixed limits on the number of keys, the metadata's size and
the number of tensors, so a hostile header costs bounded time and memory. Here: the architecture gate, and what a
model needs to run (`check_runnable`, `check_loadable`), which create and pull both apply (`check_model_gguf`).
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from dgemma_engine import settings
from dgemma_engine.arch import check_architecture
from dgemma_engine.errors import DgemmaError
from dgemma_engine.gguf_keys import (KEY_CANVAS_LENGTH, KEY_CONTEXT_LENGTH, KEY_MERGES, KEY_SCORES, KEY_TOKEN_TYPE,
                                     KEY_TOKENIZER_MODEL, KEY_TOKENS, SPECIAL_TOKEN_KEYS, for_arch)
# The reader's names, re-exported: the store, the server and the tests read GGUF headers through this module.
from dgemma_engine.gguf_reader import (DEFAULT_ALIGNMENT, FILE_TYPES, FLOAT_TYPES, GGML_TYPES, GGUF_MAGIC, INT_TYPES,
                                       KEEP_ARRAY_MAX, MAX_CANVAS_LENGTH, MAX_METADATA_BYTES, MAX_METADATA_KEYS,
                                       MAX_TENSORS, T_ARRAY, T_BOOL, T_STRING, ArraySummary, GGUFError, GGUFInfo,
                                       TensorInfo, parse_gguf, read_gguf_info)

__all__ = ["DEFAULT_ALIGNMENT", "FILE_TYPES", "GGML_TYPES", "GGUF_MAGIC", "KEEP_ARRAY_MAX", "MAX_CANVAS_LENGTH",
           "MAX_METADATA_BYTES", "MAX_METADATA_KEYS", "MAX_TENSORS", "TOKENIZER_MODELS", "ArraySummary", "GGUFError",
           "GGUFInfo", "TensorInfo", "check_diffusion_gguf", "check_loadable", "check_model_gguf", "check_runnable",
           "parse_gguf", "read_gguf_info"]

TOKENIZER_MODELS = ("gemma4", "llama")


def check_diffusion_gguf(path: str | os.PathLike) -> GGUFInfo:
    """Validate a GGUF and require the diffusion-gemma architecture (store and server gate)."""
    info = read_gguf_info(path)
    check_architecture(info.architecture, error=GGUFError)
    if KEY_CANVAS_LENGTH not in info.metadata:
        raise GGUFError(f"invalid GGUF: {KEY_CANVAS_LENGTH} is missing")
    return info


# ---- can a run use it? -----------------------------------------------------------------------------------------------

def _array_info(value: Any) -> tuple[int | None, int, bool] | None:
    """(element type or None if mixed/empty, length, all elements the same) of a metadata array, else None."""
    if isinstance(value, ArraySummary):
        return value.item_type, value.length, value.all_same
    if not isinstance(value, list):
        return None
    kinds = {_value_kind(item) for item in value}
    kind = kinds.pop() if len(kinds) == 1 else None
    return kind, len(value), len(set(map(repr, value))) <= 1


def _value_kind(value: Any) -> int:
    if isinstance(value, bool):
        return T_BOOL
    if isinstance(value, int):
        return 5
    if isinstance(value, float):
        return 6
    if isinstance(value, str):
        return T_STRING
    return T_ARRAY


def _check_array(metadata: dict[str, Any], key: str, kinds: set[int], what: str, length: int | None) -> None:
    value = metadata.get(key)
    if value is None:
        return
    info = _array_info(value)
    if info is None or (info[0] not in kinds and info[1] > 0):
        raise GGUFError(f"{key} must be an array of {what}")
    if length is not None and info[1] != length:
        raise GGUFError(f"{key} has {info[1]} entries, {KEY_TOKENS} has {length}")


def check_runnable(info: GGUFInfo) -> None:
    """The metadata checks the engine and its tokenizer apply at load, made at create time so that a model the store
    accepts can run (the tokenizer keys present and of their types, special token ids in range, a context that fits
    a canvas, sampler defaults every request can start from)."""
    md, arch = info.metadata, info.architecture
    tokens = md.get(KEY_TOKENS)
    n_tokens = None
    if tokens is not None:
        array = _array_info(tokens)
        if array is None or array[0] != T_STRING or array[1] == 0:
            raise GGUFError(f"{KEY_TOKENS} must be a non-empty array of strings")
        n_tokens = array[1]
        if n_tokens > 1 and array[2]:
            raise GGUFError(f"{KEY_TOKENS} are all the same string")
    model = md.get(KEY_TOKENIZER_MODEL)
    if model is None:  # as llama.cpp: a file without it has no tokenizer a run could build
        raise GGUFError(f"{KEY_TOKENIZER_MODEL} is missing")
    if model not in TOKENIZER_MODELS:
        raise GGUFError(f"unsupported {KEY_TOKENIZER_MODEL} {str(model)[:40]!r} "
                        f"(expected {' or '.join(map(repr, TOKENIZER_MODELS))})")
    if tokens is None:
        raise GGUFError(f"{KEY_TOKENS} is missing")
    _check_array(md, KEY_TOKEN_TYPE, INT_TYPES, "integers", n_tokens)
    _check_array(md, KEY_SCORES, FLOAT_TYPES | INT_TYPES, "numbers", n_tokens)
    _check_array(md, KEY_MERGES, {T_STRING}, "strings", None)
    if model == "llama" and KEY_SCORES not in md:
        raise GGUFError(f"{KEY_SCORES} is missing (needed by the 'llama' tokenizer)")
    for key in SPECIAL_TOKEN_KEYS.values():
        value = md.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise GGUFError(f"{key} must be an integer")
        if n_tokens is not None and not 0 <= value < n_tokens:
            raise GGUFError(f"{key} {value} is outside the vocabulary (0..{n_tokens - 1})")
    context_key = for_arch(KEY_CONTEXT_LENGTH, arch)
    context = md.get(context_key)
    canvas = md.get(KEY_CANVAS_LENGTH)
    if not context:
        raise GGUFError(f"{context_key} is missing or zero")
    if isinstance(canvas, int) and context <= canvas:
        raise GGUFError(f"{context_key} {context} leaves no room for a prompt and "
                        f"a canvas of {canvas} tokens")
    _check_sampler_defaults(md)


def _check_sampler_defaults(metadata: dict[str, Any]) -> None:
    """The file's `diffusion.eb_*` values are what every request starts from (settings.defaults_from_metadata): each
    must be finite and, with the released values of the keys it lacks, in dgemma's ranges (settings.check_values) and
    the engine's sampler's (t_min < t_max strictly: the reference ranges)."""
    for setting in settings.FILE_SETTINGS:
        value = metadata.get(setting.gguf_key)
        if isinstance(value, float) and not math.isfinite(value):
            raise GGUFError(f"{setting.gguf_key} is {value}, not a finite number")
    defaults = settings.defaults_from_metadata(metadata)
    values = {s.field: defaults[s.field] for s in settings.FILE_SETTINGS}
    try:
        settings.check_values(values)
        settings.check_values(values, reference=True)
    except settings.SettingError as exc:
        key = next(s.gguf_key for s in settings.FILE_SETTINGS if str(exc).startswith(f"invalid value for {s.option}:"))
        raise GGUFError(f"{key} is out of range: {exc}") from None


def check_loadable(path: str | os.PathLike, info: GGUFInfo) -> None:
    """What loading the file for a run does, without allocating its weights: every tensor bound as the engine binds
    it (`Model.check`), the tokenizer built from the file as a run builds it and tried on a line of text, and the task
    the file names (`dgemma_engine.tasks`) known and found in its vocabulary. GGUFError names the problem, never the
    path. Run after `check_runnable`."""
    from dgemma_engine.model import Model
    from dgemma_engine.tasks import task_for
    from dgemma_engine.tokenizer import Tokenizer

    path = Path(path)
    try:
        Model.check(path)
        tokenizer = Tokenizer.from_gguf(path)
        ids = tokenizer.encode("Hello, world")
        task_for({**info.metadata, KEY_TOKENS: tokenizer.tokens})
    except DgemmaError as exc:
        raise GGUFError(str(exc).replace(str(path), path.name)) from None
    if not ids or any(not 0 <= i < tokenizer.n_vocab for i in ids):
        raise GGUFError("its tokenizer cannot encode text")


def check_model_gguf(path: str | os.PathLike) -> GGUFInfo:
    """Everything a model file must pass before the store keeps it, whether created or pulled: a diffusion-gemma GGUF
    (check_diffusion_gguf) whose metadata (check_runnable) and load (check_loadable) a run accepts."""
    info = check_diffusion_gguf(path)
    check_runnable(info)
    check_loadable(path, info)
    return info
