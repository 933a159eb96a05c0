"""The soft-embedding op (ggml_ext/csrc/engine/soft_embedding.c): self-conditioning's P·E on the embedding as stored,
for every type a file may give it, against a double-precision product with ggml's own dequantization, on the AVX2
and the portable paths; and its row dequantizers bit for bit against ggml's."""
import ctypes

import pytest

from dgemma_engine._lib import load_library

GGML = {"F32": 0, "F16": 1, "Q4_0": 2, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "IQ4_NL": 20, "IQ4_XS": 23,
        "BF16": 30}
ISAS = {"portable": 0, "avx2": 1}


def lib():
    engine = load_library("engine_tests")  # the test hooks (ggml_ext/csrc/engine_tests)
    engine.dg_check_soft_embedding.restype = ctypes.c_double
    engine.dg_check_soft_embedding.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                               ctypes.c_int, ctypes.c_int, ctypes.c_uint64, ctypes.c_int,
                                               ctypes.c_int, ctypes.POINTER(ctypes.c_double)]
    engine.dg_check_row_dequantizer.restype = ctypes.c_int64
    engine.dg_check_row_dequantizer.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int, ctypes.c_uint64]
    engine.dg_check_soft_embedding_isa.restype = ctypes.c_int
    return engine


def require(isa: str) -> None:
    if lib().dg_check_soft_embedding_isa() < ISAS[isa]:
        pytest.skip(f"this CPU has no {isa} (the portable path is tested instead)")


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("type_name,width", [("F32", 72), ("F16", 40), ("BF16", 264), ("Q8_0", 96), ("Q4_0", 64),
                                             ("Q6_K", 512), ("Q4_K", 256), ("Q5_K", 768), ("IQ4_NL", 160),
                                             ("IQ4_XS", 256), ("Q8_0", 288)])  # 288: one whole panel and a part
@pytest.mark.parametrize("tokens", [1, 5, 6, 7, 17])
def test_matches_a_double_product(isa, type_name, width, tokens):
    require(isa)
    error = lib().dg_check_soft_embedding(GGML[type_name], 300, width, tokens, 3, 2, 11, ISAS[isa], 0, None)
    assert 0 <= error < 2e-6, error


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("vocab,slices,threads", [(1, 1, 1), (129, 2, 2), (1000, 4, 3), (257, 7, 2)])
def test_any_vocabulary_slicing_and_thread_count(isa, vocab, slices, threads):
    """Slices that outnumber the threads, single-row slices and panels shorter than one block of rows."""
    require(isa)
    error = lib().dg_check_soft_embedding(GGML["Q6_K"], vocab, 256, 256, slices, threads, 5, ISAS[isa], 0, None)
    assert 0 <= error < 2e-6, error


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("type_name", ["Q8_0", "Q6_K"])
def test_row_dequantizers_are_bit_identical_to_ggml(isa, type_name):
    require(isa)
    assert lib().dg_check_row_dequantizer(GGML[type_name], 2000, ISAS[isa], 3) == 0


def test_invalid_arguments_are_refused():
    engine = lib()
    assert engine.dg_check_soft_embedding(GGML["Q6_K"], 10, 100, 1, 1, 1, 1, 0, 0, None) == -1  # width % 256
    assert engine.dg_check_row_dequantizer(GGML["F16"], 1, 0, 1) == -1
