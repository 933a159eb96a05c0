"""LoRA adapters for `Model.load`: GGUF LoRA files (docs/gguf.md#lora-adapters).

An adapter is given as a path or as (path, scale); the scale multiplies the adapter's alpha/r (1.0: as trained). A
PEFT adapter folder (`adapter_config.json` + `adapter_model.safetensors`) is the converter's to turn into a GGUF LoRA
file first (`dgemma create` converts an ADAPTER folder; `dgemma debug --lora` uses `dgemma_convert.lora.peft_as_gguf`).
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Sequence

from dgemma_engine.errors import EngineError


def adapter_spec(spec) -> tuple[Path, float]:
    """A path, or (path, scale), as (Path, float)."""
    if isinstance(spec, (str, os.PathLike)):
        return Path(spec), 1.0
    try:
        path, scale = spec
        scale = float(scale)
    except (TypeError, ValueError):
        raise EngineError(f"an adapter is a path or (path, scale), got {spec!r}") from None
    if not math.isfinite(scale):
        raise EngineError(f"adapter scale must be finite, got {scale}")
    return Path(path), scale


def parse_adapter_arg(text: str) -> tuple[str, float]:
    """`--lora PATH` or `--lora PATH:SCALE`: a trailing `:number` is the scale unless the whole text names a file
    or folder that exists."""
    head, sep, tail = text.rpartition(":")
    if not sep or not head or os.path.exists(text):
        return text, 1.0
    try:
        scale = float(tail)
    except ValueError:
        return text, 1.0
    if not math.isfinite(scale):
        raise EngineError(f"--lora scale must be finite, got {tail!r}")
    return head, scale


def is_peft_folder(path: Path) -> bool:
    return path.is_dir() and (path / "adapter_config.json").is_file()


def gguf_adapters(specs: Sequence) -> list[tuple[Path, float, str]]:
    """(GGUF path, scale, name for errors) per adapter."""
    files = []
    for spec in specs:
        path, scale = adapter_spec(spec)
        if is_peft_folder(path):
            raise EngineError(f"adapter {path.name} is a PEFT adapter folder: convert it to a GGUF LoRA file first "
                              "(dgemma_convert.lora)")
        if path.is_dir():
            raise EngineError(f"adapter folder {path.name} has no adapter_config.json (not a PEFT adapter)")
        if not path.is_file():
            raise EngineError(f"adapter not found: {path}")
        files.append((path, scale, path.name))
    return files
