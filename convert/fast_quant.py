"""dgemma's own Q4_K/Q5_K/Q6_K quantizers (convert/csrc/kquant_fast.c): ggml's bytes, several times faster.

They run ggml's reference arithmetic with the 8 sub-blocks of a super-block side by side in AVX2 lanes
(docs/convert.md#fast-k-quants). Loaded with ctypes after ggml; `load_fast_quantizer()` is None where the library is
not built, or when the environment variable DGEMMA_FAST_QUANT is "0" (then ggml quantizes everything).
"""
from __future__ import annotations

import ctypes
import glob
import os
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T

DISABLE_ENV = "DGEMMA_FAST_QUANT"


class FastQuantizer:
    """The C library: which types this CPU accelerates, and one quantization call (the GIL is released)."""

    def __init__(self, lib: ctypes.CDLL):
        lib.dgq_supported.argtypes = [ctypes.c_int]
        lib.dgq_supported.restype = ctypes.c_int
        lib.dgq_quantize.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
        lib.dgq_quantize.restype = ctypes.c_size_t
        self._lib = lib
        self.types = frozenset(t for t in (T.Q4_K, T.Q5_K, T.Q6_K) if lib.dgq_supported(int(t)))

    def quantize(self, t: T, src: int, dst: int, n_rows: int, row_length: int) -> int:
        """float32 rows at address src -> t's bytes at dst; returns the bytes written (0: not handled, none written)."""
        return self._lib.dgq_quantize(int(t), src, dst, n_rows, row_length)


def load_fast_quantizer() -> FastQuantizer | None:
    """The fast quantizers, or None; call after ggml is loaded (the library links to libggml-base by its SONAME)."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None
    matches = sorted(glob.glob(str(Path(__file__).parent / "_quant*.so")))
    if not matches:
        return None
    try:
        quantizer = FastQuantizer(ctypes.CDLL(matches[0]))
    except (OSError, AttributeError):
        return None
    return quantizer if quantizer.types else None


def probe_rows() -> np.ndarray:
    """A few rows that reach every branch of the K-quant searches: random, flat, one-signed, sparse and tiny values.

    The converter quantizes them with both quantizers once and uses the fast one only for the types that agree, so
    a different ggml (another llama-cpp-python) can never change the output bytes.
    """
    rng = np.random.default_rng(20260)
    rows = rng.standard_normal((8, 512)) * np.array([[1e-3], [1.0], [40.0], [1e-6], [1.0], [1.0], [1.0], [1.0]])
    rows[4] = np.abs(rows[4]) + 0.5  # positive only
    rows[5] = -np.abs(rows[5])  # negative only
    rows[6, ::3] = 0.0  # sparse
    rows[7, :64] = 0.25  # flat sub-blocks
    rows[7, 64:96] = 0.0
    return rows.astype(np.float32)
