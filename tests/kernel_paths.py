"""The engine's kernel paths that tests run on: what this CPU dispatches by itself, the portable one, and each lower
instruction set the CPU also has.

`native` leaves the engine to pick its kernels at run time (AVX-512, AVX-VNNI or AVX2, or ggml's ops where the CPU
lacks them); `portable` forces the plain-C quantized kernels and the standard-op graph that accelerators run (no
custom CPU ops); an instruction-set name (`avx2`, `avxvnni`, `avx512`) caps the engine's own kernels at that level
(DGEMMA_CPU_ISA), so an AVX-512 machine also checks the kernels an AVX2-only one runs. All are read by the engine when
it builds a graph, so a model used inside `kernel_path_env` keeps that path.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator

from dgemma_engine._lib import load_library

PORTABLE_ENV = {"DGEMMA_QKERNELS": "scalar", "DGEMMA_STANDARD_OPS": "1"}
KERNEL_PATHS = ("native", "portable")  # the surface golden's paths
ISA_LEVELS = ("none", "avx2", "avxvnni", "avx512")  # cpu.h's dg_isa, in order
ISA_PATHS = ISA_LEVELS[1:]
VARIABLES = (*PORTABLE_ENV, "DGEMMA_CPU_ISA")


def cpu_has_isa(name: str) -> bool:
    """Whether this CPU has the instruction-set level `name`."""
    return bool(load_library("engine_tests").dg_check_cpu_has_isa(ctypes.c_int(ISA_LEVELS.index(name))))


def native_isa() -> str:
    """The level the engine's kernels take on this CPU with no cap."""
    with kernel_path_env("native"):
        return ISA_LEVELS[load_library("engine_tests").dg_check_cpu_isa()]


def path_env(path: str) -> dict[str, str]:
    """The environment variables that select `path` (none for native)."""
    if path == "native":
        return {}
    if path == "portable":
        return dict(PORTABLE_ENV)
    if path in ISA_PATHS:
        return {"DGEMMA_CPU_ISA": path}
    raise ValueError(f"unknown kernel path {path!r}")


@contextlib.contextmanager
def kernel_path_env(path: str) -> Iterator[None]:
    """os.environ selects `path` inside the block (and for the processes started in it); restored after."""
    saved = {k: os.environ.get(k) for k in VARIABLES}
    for key in VARIABLES:
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
