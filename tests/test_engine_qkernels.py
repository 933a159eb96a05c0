"""The engine's quantized products (integer dot products, ggml custom ops) compute what ggml's own ops compute.

Every covered weight type on every kernel path (AVX-512 VNNI, AVX-VNNI, AVX2 and the portable fallback; a path this CPU
lacks is skipped with its reason) against ggml_mul_mat_id / ggml_mul_mat
on the same ggml-quantized weights and the same activation quantization (ggml's own quantizer), so the integer sums
are equal and only the order of the float sums differs. Edge shapes: 1, 15, 16, 17 and 256 rows per expert with
unused experts, uneven routing, output rows that leave every remainder of the tiles, broadcast (gate/up) and
per-slot (down) inputs, one and two threads, dense products.
"""
from __future__ import annotations

import ctypes
import platform
from pathlib import Path

import numpy as np
import pytest

from dgemma_engine._lib import load_library
from dgemma_engine.model import Context, Model

SCALAR, AVX2, AVXVNNI, AVX512 = 1, 2, 3, 4
PATH_NAMES = {SCALAR: "scalar", AVX2: "avx2", AVXVNNI: "avxvnni", AVX512: "avx512"}
UNSUPPORTED_CPU, NO_KERNEL = -2, -3
TYPES = {"q8_0": 8, "q5_0": 6, "q4_K": 12, "q6_K": 14, "iq4_nl": 20, "iq4_xs": 23}
BLOCK = {"q8_0": 32, "q5_0": 32, "q4_K": 256, "q6_K": 256, "iq4_nl": 32, "iq4_xs": 256}


def check(type_name: str, kd: int, n: int, n_expert: int, n_used: int, t: int, x1: int = 1, rows_per_expert: int = 0,
          threads: int = 2, path: int = AVX2, seed: int = 1, type_id: int | None = None) -> float:
    fn = load_library("engine_tests").dg_check_qmatmul
    fn.restype = ctypes.c_double
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int64,
                   ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_uint64, ctypes.c_int]
    type_id = TYPES[type_name] if type_id is None else type_id
    return fn(type_id, kd, n, n_expert, n_used, t, x1, rows_per_expert, threads, seed, path)




def assert_matches_ggml(rel: float, path: int = AVX2) -> None:
    if rel == UNSUPPORTED_CPU:  # reported as a skip with its reason, never passed silently
        pytest.skip(f"this CPU ({platform.machine()}) lacks {PATH_NAMES[path]}; its kernels cannot run here")
    assert rel >= 0, rel
    # same integers, other float summation order: float32 rounding only
    assert rel < 1e-5, rel


PATHS = pytest.mark.parametrize("path", list(PATH_NAMES), ids=list(PATH_NAMES.values()))
TYPE_NAMES = pytest.mark.parametrize("type_name", list(TYPES))

# rows per expert: 8 experts, top-2, tokens in groups that share their experts; the experts no group reaches stay unused
ROWS_PER_EXPERT = [1, 15, 16, 17, 256]


@PATHS
@TYPE_NAMES
@pytest.mark.parametrize("rows", ROWS_PER_EXPERT)
def test_rows_per_expert(type_name, rows, path):
    kd = 2 * BLOCK[type_name]
    tokens = rows if rows == 256 else 2 * rows  # 256: experts 0 and 1 only; else 4 of the 8 experts
    assert_matches_ggml(check(type_name, kd, 37, 8, 2, tokens, x1=2, rows_per_expert=rows, path=path), path)


SHAPES = [  # kd blocks, n, experts, used, tokens, x1, threads
    (1, 1, 1, 1, 1, 1, 1),      # one of everything
    (1, 9, 3, 1, 5, 1, 2),      # fewer output rows than threads' 8-row groups
    (3, 70, 16, 4, 23, 4, 2),   # uneven routing, per-slot inputs, output rows not a multiple of 8
    (4, 64, 6, 6, 11, 1, 1),    # every expert used by every token
]


@PATHS
@TYPE_NAMES
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_expert_shapes(type_name, shape, path):
    blocks, n, experts, used, tokens, x1, threads = shape
    assert_matches_ggml(check(type_name, blocks * BLOCK[type_name], n, experts, used, tokens, x1=x1,
                              threads=threads, path=path), path)


@PATHS
@TYPE_NAMES
@pytest.mark.parametrize("tokens", [1, 17, 256])
def test_dense(type_name, tokens, path):
    assert_matches_ggml(check(type_name, 2 * BLOCK[type_name], 45, 0, 0, tokens, path=path), path)


@PATHS
def test_real_expert_geometry(path):
    """The released model's expert widths (H 2816, FFe 704) at 16 rows per expert, the types its mixes use there."""
    for type_name, kd, n in (("q4_K", 2816, 64), ("q6_K", 2816, 64), ("q8_0", 2816, 64), ("iq4_xs", 2816, 64),
                             ("q5_0", 704, 96), ("q8_0", 704, 96), ("iq4_nl", 704, 96)):
        assert_matches_ggml(check(type_name, kd, n, 16, 2, 128, x1=2, rows_per_expert=16, path=path), path)


@PATHS
@TYPE_NAMES
def test_bit_identical_across_thread_counts(type_name, path):
    """Threads split the output rows, never a sum: 1, 2, 3 and 5 threads give the same bits (experts and dense)."""
    fn = load_library("engine_tests").dg_check_qmatmul_threads
    fn.restype = ctypes.c_double
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int64,
                   ctypes.c_int, ctypes.c_int, ctypes.c_uint64, ctypes.c_int]
    kd = 3 * BLOCK[type_name]
    for experts, used in ((6, 2), (0, 0)):
        for other in (2, 3, 5):
            differ = fn(TYPES[type_name], kd, 83, experts, used, 40, 1, other, 7, path)
            if differ == UNSUPPORTED_CPU:
                pytest.skip(f"this CPU ({platform.machine()}) lacks {PATH_NAMES[path]}; its kernels cannot run here")
            assert differ == 0, (experts, other, differ)


def test_uncovered_types_and_shapes_are_refused():
    assert check("q8_0", 48, 4, 2, 1, 3) == NO_KERNEL        # row not a whole number of blocks
    assert check("q4_K", 32 * 9, 4, 2, 1, 3) == NO_KERNEL    # K-quants need whole 256-element super-blocks
    assert check("q8_0", 64, 4, 2, 1, 3, type_id=0) == NO_KERNEL   # F32: the tiled F32 op's business
    assert check("q8_0", 64, 4, 2, 1, 3, type_id=7) == NO_KERNEL   # Q5_1: not covered yet
    assert check("q8_0", 0, 4, 2, 1, 3) == -1
    assert check("q8_0", 64, 4, 2, 3, 3) == -1               # more experts used than exist
    assert check("q8_0", 64, 4, 2, 1, 3, x1=2) == -1         # x1 must be 1 or n_used
    assert check("q8_0", 64, 4, 2, 1, 3, path=0) == -1       # "off" is not a kernel path



FIXTURES = Path(__file__).parent / "fixtures"


def first_steps(path: Path, run: dict[str, np.ndarray], calls: int = 3) -> np.ndarray:
    """Logits of the first recorded decoder calls of a golden run (self-conditioning where recorded)."""
    with Model.load(path, threads=2) as m, Context(m, n_ctx=len(run["seq"]) + m.hparams.canvas_length,
                                                    threads=2) as ctx:
        ctx.encode(run["prompt"])
        out = []
        for i in range(min(calls, len(run["pos"]))):
            start = int(run["pos"][i][0])
            if start != ctx.n_past:
                ctx.encode(run["seq"][ctx.n_past:start])
            if run["has_sc"][i]:
                ctx.set_self_cond_logits(run["raw"][i - 1])
                out.append(ctx.step(run["canvas"][i], sc_temperature=float(run["T"][i - 1])).copy())
            else:
                out.append(ctx.step(run["canvas"][i]).copy())
        return np.array(out)


@pytest.mark.parametrize("kernels", [AVX2, AVXVNNI, AVX512], ids=["avx2", "avxvnni", "avx512"])
@pytest.mark.parametrize("name", ["tiny-a", "tiny-b"])
@pytest.mark.parametrize("outtype", ["q8_0", "q4_k_m"])
def test_model_logits_match_ggml_ops(gguf_path, monkeypatch, name, outtype, kernels):
    """Whole decoder steps of the quantized fixtures (Q8_0 and Q5_0 experts: their widths are below 256) with the
    engine's kernels and with ggml's ops. The Q8_0 and Q5_0 kernels sum each block's integers exactly before its
    one float scaling, where ggml scales eight partial sums, so the logits are not bit-identical: a last-bit difference can
    flip a rounding of the next product's activation quantization. Asserted: the kernels differ from ggml's ops by a
    tenth of the quantization's own error at most, and are no further than ggml's ops from the unquantized model."""
    if check("q8_0", 32, 1, 1, 1, 1, path=kernels) == UNSUPPORTED_CPU:
        pytest.skip(f"this CPU ({platform.machine()}) lacks {PATH_NAMES[kernels]}; ggml's ops would run in both")
    with np.load(FIXTURES / name / "golden" / "g1_seed0.npz") as z:
        run = {k: z[k] for k in z.files}
    path = gguf_path(name, outtype)
    monkeypatch.setenv("DGEMMA_QKERNELS", "off")
    ggml = first_steps(path, run)
    f32 = first_steps(gguf_path(name), run)
    monkeypatch.setenv("DGEMMA_QKERNELS", PATH_NAMES[kernels])
    ours = first_steps(path, run)
    quantization_error = np.abs(ggml - f32)
    assert np.abs(ours - ggml).max() <= 0.1 * quantization_error.max()
    assert np.abs(ours - f32).mean() <= 1.02 * quantization_error.mean()


def test_profiled_step_splits_its_time_by_class(gguf_path):
    """Context.step_profiled (bench/real_shapes.py's split): every class of the Q8_0 fixture's self-conditioned step
    gets its time, the weight products included, and the logits are the plain step's."""
    from dgemma_engine.model import PROFILE_CLASSES

    with Model.load(gguf_path("tiny-a", "q8_0"), threads=2) as m, Context(m, n_ctx=64, threads=2) as ctx:
        ctx.encode([5, 6, 7, 8])
        canvas = np.arange(m.hparams.canvas_length) % 50 + 3
        first = ctx.step(canvas).copy()
        split = ctx.step_profiled(canvas, 1.0)
        profiled = ctx.logits().copy()
        ctx.set_self_cond_logits(first)
        plain = ctx.step(canvas, 1.0).copy()  # the same inputs: the same logits
    assert tuple(split) == PROFILE_CLASSES
    assert all(v >= 0 for v in split.values())
    for cls in ("experts", "dense", "attention", "lm_head", "self_cond"):
        assert split[cls] > 0, (cls, split)
    np.testing.assert_array_equal(profiled, plain)
