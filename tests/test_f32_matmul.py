"""The engine's panel-packed F32 weight product (a ggml custom op) computes what ggml_mul_mat computes.

The fixtures' logits and generation goldens cover it end to end (every F32 weight product of a step on the CPU goes
through it). Here edge shapes are checked directly: contraction lengths that are not a multiple of the 8-wide
transpose, output counts that leave a partial 16-wide panel, row counts that leave every remainder of the 6-row
tile, activation rows with a stride (a view), one to three threads; and the result does not depend on the threads.
"""
from __future__ import annotations

import ctypes
import platform

import numpy as np
import pytest

from dgemma_engine._lib import load_library

UNSUPPORTED = -2


def check(kd: int, n: int, t: int, threads: int, x_stride: int | None = None, seed: int = 1,
          out: np.ndarray | None = None) -> float:
    fn = load_library("engine_tests").dg_check_f32_matmul
    fn.restype = ctypes.c_double
    fn.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_uint64,
                   ctypes.c_void_p]
    return fn(kd, n, t, kd if x_stride is None else x_stride, threads, seed,
              None if out is None else out.ctypes.data)


SHAPES = [  # kd, n, t
    (128, 256, 81),   # the Sudoku model's MLP gate / up
    (256, 128, 81),   # its down projection
    (128, 828, 81),   # its LM head (828 = 51 panels + 12)
    (33, 10, 23),     # nothing a multiple of anything
    (7, 3, 5),        # shorter than one transpose, fewer outputs than a panel, fewer rows than a tile
    (64, 17, 1),      # one row, one output past a panel
]


def unsupported_skip() -> None:
    pytest.skip(f"this CPU ({platform.machine()}) lacks AVX2 + FMA; ggml's matmul runs instead")


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_f32_matmul_equals_ggml_mul_mat(shape, threads):
    rel = check(*shape, threads=threads)
    if rel == UNSUPPORTED:
        unsupported_skip()
    assert rel >= 0
    # same products, other summation order: float32 rounding only (kd ≤ 256 terms of size ≤ 1)
    assert rel < 1e-5, rel


def test_strided_rows_and_thread_count_leave_the_result_unchanged():
    kd, n, t = 96, 40, 19
    one = np.zeros((t, n), dtype=np.float32)
    if check(kd, n, t, threads=1, out=one) == UNSUPPORTED:
        unsupported_skip()
    for threads, stride in ((2, kd), (3, kd + 5), (1, kd + 8)):
        other = np.zeros_like(one)
        assert 0 <= check(kd, n, t, threads=threads, x_stride=stride, out=other) < 1e-5
        if stride == kd:
            np.testing.assert_array_equal(other, one)  # each output is one FMA chain, whatever the split
    assert np.abs(one).max() > 0


def test_check_hook_rejects_bad_shapes():
    assert check(0, 4, 3, 1) == -1
    assert check(8, 4, 3, 0) == -1
    assert check(8, 4, 3, 1, x_stride=7) == -1
