"""The engine's tiled F32 expert matmul (a ggml custom op) computes exactly what ggml_mul_mat_id computes.

The fixtures' logits tests cover it end to end; here edge shapes are checked directly: contraction lengths that are
not a multiple of the vector width, output rows not a multiple of the 4-row tile, token counts per expert that leave
every remainder of the token tile, broadcast (gate/up) and per-slot (down) inputs, one and two threads.
"""
from __future__ import annotations

import ctypes
import platform

import pytest

from dgemma_engine._lib import load_library


AVX2, AVX512 = 1, 2
UNSUPPORTED = -2


def check(kd: int, n: int, n_expert: int, n_used: int, t: int, x1: int, threads: int, isa: int = AVX512,
          seed: int = 1) -> float:
    fn = load_library("engine_tests").dg_check_expert_matmul
    fn.restype = ctypes.c_double
    fn.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int,
                   ctypes.c_int, ctypes.c_uint64, ctypes.c_int]
    return fn(kd, n, n_expert, n_used, t, x1, threads, seed, isa)

SHAPES = [  # kd, n, experts, used, tokens, x1
    (1024, 512, 32, 4, 256, 1),   # bench-mid gate_up
    (256, 1024, 32, 4, 256, 4),   # bench-mid down
    (64, 64, 4, 2, 37, 1),        # tiny-a widths, odd token count
    (33, 10, 6, 3, 23, 3),        # nothing a multiple of anything
    (7, 3, 3, 1, 5, 1),           # shorter than one vector, fewer rows than one tile
    (48, 129, 5, 5, 11, 5),       # every expert used by every token
]


@pytest.mark.parametrize("isa", [AVX2, AVX512], ids=["avx2", "avx512"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_tiled_expert_matmul_equals_mul_mat_id(shape, threads, isa):
    rel = check(*shape, threads=threads, isa=isa)
    if rel == UNSUPPORTED:  # reported as a skip with its reason, never passed silently
        pytest.skip(f"this CPU ({platform.machine()}) lacks the instruction set; ggml_mul_mat_id runs instead")
    assert rel >= 0
    # same products, other summation order: float32 rounding only (kd ≤ 1024 terms of size ≤ 0.25)
    assert rel < 1e-5, rel


def test_check_hook_rejects_bad_shapes():
    assert check(0, 4, 2, 1, 3, 1, 1) == -1
    assert check(8, 4, 2, 3, 3, 1, 1) == -1  # more experts used than exist
    assert check(8, 4, 2, 1, 3, 2, 1) == -1  # x1 must be 1 or n_used
    assert check(8, 4, 2, 1, 3, 1, 1, isa=3) == -1
