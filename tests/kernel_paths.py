"""The engine's kernel paths that tests run on: what this CPU dispatches by itself, and the portable one.

`native` leaves the engine to pick its kernels at run time (AVX2, or ggml's ops where the CPU lacks it); `portable`
forces the plain-C quantized kernels and the standard-op graph that accelerators run (no custom CPU ops). Both are
read by the engine when it loads a model, so a model loaded inside `kernel_path_env` keeps that path.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

PORTABLE_ENV = {"DGEMMA_QKERNELS": "scalar", "DGEMMA_STANDARD_OPS": "1"}
KERNEL_PATHS = ("native", "portable")


def path_env(path: str) -> dict[str, str]:
    """The environment variables that select `path` (none for native)."""
    if path not in KERNEL_PATHS:
        raise ValueError(f"unknown kernel path {path!r}")
    return dict(PORTABLE_ENV) if path == "portable" else {}


@contextlib.contextmanager
def kernel_path_env(path: str) -> Iterator[None]:
    """os.environ selects `path` inside the block (and for the processes started in it); restored after."""
    saved = {k: os.environ.get(k) for k in PORTABLE_ENV}
    for key in PORTABLE_ENV:
        os.environ.pop(key, None)
    os.environ.update(path_env(path))
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
