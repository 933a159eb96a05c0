"""LoRA adapters for `Model.load`: GGUF LoRA files as they are, PEFT adapter folders converted to one first.

An adapter is given as a path or as (path, scale). The path is a GGUF LoRA file (docs/gguf.md#lora-adapters) or a
PEFT adapter folder (`adapter_config.json` + `adapter_model.safetensors`), which `dgemma_convert.lora` turns into a
GGUF LoRA file in a temporary folder; the engine copies every adapter's factors at load, so the temporary files are
removed as soon as the model is loaded. The scale multiplies the adapter's alpha/r (1.0: as trained).
"""
from __future__ import annotations

import math
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

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


@contextmanager
def as_gguf(specs: Sequence) -> Iterator[list[tuple[Path, float, str]]]:
    """(GGUF path, scale, name for errors) per adapter; PEFT folders converted into a temporary folder that lives
    as long as the context."""
    with tempfile.TemporaryDirectory(prefix="dgemma-lora-") as tmp:
        files = []
        for i, spec in enumerate(specs):
            path, scale = adapter_spec(spec)
            if is_peft_folder(path):
                out = Path(tmp) / f"adapter-{i}.gguf"
                convert_peft(path, out)
                files.append((out, scale, path.name))
            elif path.is_file():
                files.append((path, scale, path.name))
            elif path.is_dir():
                raise EngineError(f"adapter folder {path.name} has no adapter_config.json (not a PEFT adapter)")
            else:
                raise EngineError(f"adapter not found: {path}")
        yield files


def convert_peft(folder: Path, out: Path) -> None:
    """The PEFT adapter folder as a GGUF LoRA file (dgemma_convert.lora)."""
    try:
        from dgemma_convert.lora import convert_lora
    except ImportError:
        raise EngineError("PEFT adapter folders need dgemma's converter (dgemma_convert.lora)") from None
    convert_lora(folder, out)
