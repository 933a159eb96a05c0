"""The engine's panel-packed F32 weight product (a ggml custom op) computes what ggml_mul_mat computes.

The fixtures' logits and generation goldens cover it end to end (every F32 weight product of a step on the CPU goes
through it). Here edge shapes are checked directly, on each path this CPU has (AVX2: 16-row panels × 6-row tiles;
AVX-512: 32-row panels × 12-row tiles): contraction lengths that are not a multiple of the 8-wide transpose, output
counts that leave a partial panel, row counts that leave every remainder of the row tile, activation rows with a
stride (a view), one to three threads; the result does not depend on the threads, and the two paths give the same
bits (each output is one FMA chain over k in order on both).
"""
from __future__ import annotations

import ctypes
import os
import platform

import numpy as np
import pytest

from dgemma_engine._lib import load_library

UNSUPPORTED = -2
DISPATCHED, AVX2, AVXVNNI, AVX512 = -1, 1, 2, 3  # dg_isa levels (cpu.h); -1: what the engine picks (dg_cpu_isa)
ISAS = {"avx2": AVX2, "avx512": AVX512}


def check(kd: int, n: int, t: int, threads: int, x_stride: int | None = None, seed: int = 1,
          out: np.ndarray | None = None, isa: int = DISPATCHED) -> float:
    fn = load_library("engine_tests").dg_check_f32_matmul
    fn.restype = ctypes.c_double
    fn.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_uint64,
                   ctypes.c_int, ctypes.c_void_p]
    return fn(kd, n, t, kd if x_stride is None else x_stride, threads, seed, isa,
              None if out is None else out.ctypes.data)


def isa_skip(isa: int) -> None:
    name = {DISPATCHED: "AVX2 + FMA", AVX2: "AVX2 + FMA", AVX512: "AVX-512 F/BW/VL/VNNI"}[isa]
    cap = os.environ.get("DGEMMA_CPU_ISA")
    pytest.skip(f"this CPU ({platform.machine()}) lacks {name}" + (f" or DGEMMA_CPU_ISA={cap} caps it" if cap else "")
                + "; that path cannot run here")


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


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_f32_matmul_equals_ggml_mul_mat(shape, threads, isa):
    rel = check(*shape, threads=threads, isa=ISAS[isa])
    if rel == UNSUPPORTED:
        isa_skip(ISAS[isa])
    assert rel >= 0
    # same products, other summation order: float32 rounding only (kd ≤ 256 terms of size ≤ 1)
    assert rel < 1e-5, rel


@pytest.mark.parametrize("isa", ISAS)
def test_strided_rows_and_thread_count_leave_the_result_unchanged(isa):
    kd, n, t = 96, 40, 19
    one = np.zeros((t, n), dtype=np.float32)
    if check(kd, n, t, threads=1, out=one, isa=ISAS[isa]) == UNSUPPORTED:
        isa_skip(ISAS[isa])
    for threads, stride in ((2, kd), (3, kd + 5), (1, kd + 8)):
        other = np.zeros_like(one)
        assert 0 <= check(kd, n, t, threads=threads, x_stride=stride, out=other, isa=ISAS[isa]) < 1e-5
        if stride == kd:
            np.testing.assert_array_equal(other, one)  # each output is one FMA chain, whatever the split
    assert np.abs(one).max() > 0


# output counts around the 16- and 32-row panels, row counts around the 6- and 12-row tiles
ODD_SHAPES = [(7, 3, 5), (33, 10, 23), (9, 31, 13), (100, 33, 11), (64, 47, 25), (17, 65, 1), (128, 828, 81),
              (2816, 50, 14), (40, 96, 256)]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", ODD_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_avx512_path_gives_the_avx2_bits(shape, threads):
    kd, n, t = shape
    outs = {}
    for name, isa in ISAS.items():
        outs[name] = np.zeros((t, n), dtype=np.float32)
        rel = check(kd, n, t, threads=threads, x_stride=kd + 3, seed=kd + n + t, out=outs[name], isa=isa)
        if rel == UNSUPPORTED:
            isa_skip(isa)
        assert 0 <= rel < 1e-5, (name, rel)
    np.testing.assert_array_equal(outs["avx512"].view(np.uint32), outs["avx2"].view(np.uint32))
    assert np.abs(outs["avx2"]).max() > 0


@pytest.mark.parametrize("cap", ["avx2", "avxvnni", "avx512"])
def test_dgemma_cpu_isa_selects_the_path(monkeypatch, cap):
    """DGEMMA_CPU_ISA caps the level the op is built with (read at graph build): the engine's own dispatch runs under
    each cap, a level above the cap is refused, and every path gives the same bits."""
    monkeypatch.setenv("DGEMMA_CPU_ISA", cap)
    shape = (130, 70, 29)  # a partial panel and a partial row tile on both paths
    dispatched = np.zeros(shape[1:][::-1], dtype=np.float32)
    rel = check(*shape, threads=2, out=dispatched)
    if rel == UNSUPPORTED:
        isa_skip(DISPATCHED)
    assert 0 <= rel < 1e-5
    if cap != "avx512":
        assert check(*shape, threads=2, isa=AVX512) == UNSUPPORTED  # capped below AVX-512
    elif check(*shape, threads=2, isa=AVX512) == UNSUPPORTED:
        isa_skip(AVX512)
    for isa in (AVX2, AVXVNNI):  # AVX-VNNI runs the AVX2 path
        other = np.zeros_like(dispatched)
        if check(*shape, threads=2, out=other, isa=isa) != UNSUPPORTED:
            np.testing.assert_array_equal(other.view(np.uint32), dispatched.view(np.uint32))
    monkeypatch.setenv("DGEMMA_CPU_ISA", "none")
    assert check(*shape, threads=2) == UNSUPPORTED  # no level: ggml's own matmul


def test_check_hook_rejects_bad_shapes():
    assert check(0, 4, 3, 1) == -1
    assert check(8, 4, 3, 0) == -1
    assert check(8, 4, 3, 1, x_stride=7) == -1
    assert check(8, 4, 3, 1, isa=4) == -1
