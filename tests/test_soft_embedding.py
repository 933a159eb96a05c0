"""The soft-embedding op (ggml_ext/csrc/engine/soft_embedding.c): self-conditioning's P·E on the embedding as stored,
for every type a file may give it, against a double-precision product with ggml's own dequantization, on the AVX-512,
AVX2 and portable paths; the AVX-512 path bit for bit against the AVX2 one (each output is the same FMA chain over
the vocabulary on both); its row dequantizers bit for bit against ggml's; and DGEMMA_CPU_ISA choosing the path."""
import ctypes
import os
import platform

import numpy as np
import pytest

from dgemma_engine._lib import load_library

GGML = {"F32": 0, "F16": 1, "Q4_0": 2, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "IQ4_NL": 20, "IQ4_XS": 23,
        "BF16": 30}
ISAS = {"portable": 0, "avx2": 1, "avx512": 3}  # dg_isa levels (cpu.h); AVX-VNNI (2) runs the AVX2 path here
UNSUPPORTED = -2


def lib():
    engine = load_library("engine_tests")  # the test hooks (ggml_ext/csrc/engine_tests)
    engine.dg_check_soft_embedding.restype = ctypes.c_double
    engine.dg_check_soft_embedding.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                               ctypes.c_int, ctypes.c_int, ctypes.c_uint64, ctypes.c_int,
                                               ctypes.c_int, ctypes.POINTER(ctypes.c_double), ctypes.c_void_p]
    engine.dg_check_row_dequantizer.restype = ctypes.c_int64
    engine.dg_check_row_dequantizer.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int, ctypes.c_uint64]
    engine.dg_check_soft_embedding_isa.restype = ctypes.c_int
    return engine


def skip_reason(isa: str) -> str:
    cap = os.environ.get("DGEMMA_CPU_ISA")
    return (f"this CPU ({platform.machine()}) has no {isa}" + (f" or DGEMMA_CPU_ISA={cap} caps it" if cap else "")
            + "; that path cannot run here")


def require(isa: str) -> None:
    if lib().dg_check_soft_embedding_isa() < ISAS[isa]:
        pytest.skip(skip_reason(isa))


def run(type_name: str, vocab: int, width: int, tokens: int, slices: int, threads: int, seed: int, isa: str,
        out: np.ndarray | None = None) -> float:
    return lib().dg_check_soft_embedding(GGML[type_name], vocab, width, tokens, slices, threads, seed, ISAS[isa], 0,
                                         None, None if out is None else out.ctypes.data)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("type_name,width", [("F32", 72), ("F16", 40), ("BF16", 264), ("Q8_0", 96), ("Q4_0", 64),
                                             ("Q6_K", 512), ("Q4_K", 256), ("Q5_K", 768), ("IQ4_NL", 160),
                                             ("IQ4_XS", 256), ("Q8_0", 288)])  # 288: one whole panel and a part
@pytest.mark.parametrize("tokens", [1, 5, 6, 7, 17])
def test_matches_a_double_product(isa, type_name, width, tokens):
    require(isa)
    error = run(type_name, 300, width, tokens, 3, 2, 11, isa)
    assert 0 <= error < 2e-6, error


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("vocab,slices,threads", [(1, 1, 1), (129, 2, 2), (1000, 4, 3), (257, 7, 2)])
def test_any_vocabulary_slicing_and_thread_count(isa, vocab, slices, threads):
    """Slices that outnumber the threads, single-row slices and panels shorter than one block of rows."""
    require(isa)
    error = run("Q6_K", vocab, 256, 256, slices, threads, 5, isa)
    assert 0 <= error < 2e-6, error


# widths that leave a partial 16-column strip or a partial 64-column tile (F32, F16: any width; Q8_0 a multiple of 32,
# Q6_K of 256), or several 256-column panels and a part; the quantized ones take the strip dequantizers
WIDTHS = [("F32", 40), ("F32", 93), ("F16", 130), ("Q8_0", 96), ("Q8_0", 352), ("Q6_K", 256), ("Q6_K", 768)]


@pytest.mark.parametrize("tokens", list(range(1, 14)) + [81, 256])
@pytest.mark.parametrize("type_name,width", WIDTHS, ids=lambda v: str(v))
def test_avx512_path_gives_the_avx2_bits(type_name, width, tokens):
    """Same inputs (same seed) through both paths at 1 and 2 threads and 1 to 5 vocabulary slices: equal bits."""
    for isa in ("avx2", "avx512"):
        require(isa)
    for vocab, slices, threads in ((300, 1, 1), (300, 3, 2), (131, 5, 2)):
        outs = {}
        for isa in ("avx2", "avx512"):
            outs[isa] = np.zeros((tokens, width), dtype=np.float32)
            error = run(type_name, vocab, width, tokens, slices, threads, width + tokens, isa, outs[isa])
            assert 0 <= error < 2e-6, (isa, vocab, slices, threads, error)
        np.testing.assert_array_equal(outs["avx512"].view(np.uint32), outs["avx2"].view(np.uint32),
                                      err_msg=f"vocab {vocab}, {slices} slices, {threads} threads")
        assert np.abs(outs["avx2"]).max() > 0


@pytest.mark.parametrize("cap,level", [("none", 0), ("avx2", 1), ("avxvnni", 1), ("avx512", 3)])
def test_dgemma_cpu_isa_caps_the_path(monkeypatch, cap, level):
    """The op's best level follows DGEMMA_CPU_ISA (read when a graph is built); a level above it is refused, and a
    level the CPU lacks is a skip with its reason."""
    monkeypatch.setenv("DGEMMA_CPU_ISA", cap)
    engine = lib()
    best = engine.dg_check_soft_embedding_isa()
    if best < level:
        pytest.skip(skip_reason(cap))
    assert best == level
    for name, isa in ISAS.items():
        error = run("Q8_0", 200, 96, 7, 2, 2, 3, name)
        assert (error == UNSUPPORTED) if isa > level else (0 <= error < 2e-6), (name, error)


@pytest.mark.parametrize("isa", ["portable", "avx2"])  # the AVX-512 path dequantizes with the AVX2 loops
@pytest.mark.parametrize("type_name", ["Q8_0", "Q6_K"])
def test_row_dequantizers_are_bit_identical_to_ggml(isa, type_name):
    require(isa)
    assert lib().dg_check_row_dequantizer(GGML[type_name], 2000, ISAS[isa], 3) == 0


def test_invalid_arguments_are_refused():
    engine = lib()
    assert run("Q6_K", 10, 100, 1, 1, 1, 1, "portable") == -1  # width % 256
    assert engine.dg_check_soft_embedding(GGML["Q8_0"], 10, 64, 1, 1, 1, 1, 4, 0, None, None) == -1  # no level 4
    assert engine.dg_check_row_dequantizer(GGML["F16"], 1, 0, 1) == -1
