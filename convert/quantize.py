"""Output types, llama.cpp's per-tensor type policy, and ggml's own quantizers through ctypes.

The policy reproduces what `llama-quantize` (src/llama-quant.cpp, `llama_tensor_get_type`) decides for this model
(docs/gguf.md#type-policy, #quant-mixes), so a `q4_k_m` file from dgemma has the same type mix as Unsloth's Q4_K_M. The
bytes come from `ggml_quantize_chunk` of the ggml that llama-cpp-python ships (K-quants are real K-quants), loaded after
`llama_cpp` so the process holds exactly one ggml, or from dgemma's byte-identical fast K-quants
(docs/convert.md#fast-k-quants).
"""
from __future__ import annotations

import ctypes
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
from gguf import GGML_QUANT_SIZES, LlamaFileType as FT, GGMLQuantizationType as T

from dgemma_convert.errors import ConvertError
from dgemma_convert.fast_quant import FastQuantizer, load_fast_quantizer, probe_rows
from dgemma_convert.tensor_map import TensorSpec, float_type, is_quantizable


@dataclass(frozen=True)
class OutType:
    name: str
    file_type: FT  # general.file_type (llama_ftype)
    base: T  # the type most tensors get


OUT_TYPES = {
    "f32": OutType("f32", FT.ALL_F32, T.F32),
    "f16": OutType("f16", FT.MOSTLY_F16, T.F16),
    "bf16": OutType("bf16", FT.MOSTLY_BF16, T.BF16),
    "q8_0": OutType("q8_0", FT.MOSTLY_Q8_0, T.Q8_0),
    "q4_0": OutType("q4_0", FT.MOSTLY_Q4_0, T.Q4_0),
    "q4_k_m": OutType("q4_k_m", FT.MOSTLY_Q4_K_M, T.Q4_K),
    "q5_k_m": OutType("q5_k_m", FT.MOSTLY_Q5_K_M, T.Q5_K),
    "q6_k": OutType("q6_k", FT.MOSTLY_Q6_K, T.Q6_K),
}
FLOAT_TYPES = (T.F32, T.F16, T.BF16)

# llama-quantize's fallback when a row length is not a multiple of the K-quant block (256): same family, 32-wide
# (IQ4_XS: no `--outtype` writes it; bench/real_shapes.py's IQ4_XS-experts mix does).
K_QUANT_FALLBACK = {T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0, T.IQ4_XS: T.IQ4_NL}


def parse_outtype(name: str) -> OutType:
    try:
        return OUT_TYPES[name.lower()]
    except KeyError:
        raise ConvertError(f"unknown --outtype {name!r}; choose one of {', '.join(OUT_TYPES)}") from None


def block_size(t: T) -> int:
    return GGML_QUANT_SIZES[t][0]


def nbytes(t: T, ne: Sequence[int]) -> int:
    """Bytes of a tensor of type t and ggml shape ne (rows of ne[0] elements)."""
    blck, type_size = GGML_QUANT_SIZES[t]
    n_rows = int(np.prod(ne[1:])) if len(ne) > 1 else 1
    return n_rows * (ne[0] // blck) * type_size


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's choice of the layers that get more bits: the first and last eighth, and every third between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _fit_row_length(t: T, row_length: int) -> T:
    """A type whose blocks divide the row: the K-quant fallback first, F16 as the last resort (as llama.cpp)."""
    if row_length % block_size(t) == 0:
        return t
    fallback = K_QUANT_FALLBACK.get(t, T.F16)
    return fallback if row_length % block_size(fallback) == 0 else T.F16


def choose_types(specs: Sequence[TensorSpec], n_layer: int, out: OutType) -> list[T]:
    """The GGML type of every tensor, in file order (order matters: the attn_v counter of llama-quantize)."""
    if out.base in FLOAT_TYPES:
        return [float_type(spec, out.base) for spec in specs]

    mixed = out.file_type in (FT.MOSTLY_Q4_K_M, FT.MOSTLY_Q5_K_M)
    has_output = any(spec.name == "output.weight" for spec in specs)
    n_attn_v = sum("attn_v.weight" in spec.name for spec in specs)
    i_attn_v = 0
    types = []
    for spec in specs:
        if not is_quantizable(spec):
            types.append(T.F32)
            continue
        name, t = spec.name, out.base
        if name == "output.weight" or (not has_output and name == "token_embd.weight"):
            # the (tied) output projection: Q6_K unless the file is Q8_0 anyway
            if spec.ne[0] % block_size(out.base) != 0:
                t = T.Q8_0
            elif out.base != T.Q8_0:
                t = T.Q6_K
        elif "attn_v.weight" in name:
            if mixed and use_more_bits(i_attn_v, n_attn_v):
                t = T.Q6_K
            i_attn_v += 1
        elif "ffn_down" in name:  # ffn_down and ffn_down_exps; MoE model, so the layer comes from the name
            layer = int(re.match(r"blk\.(\d+)\.", name).group(1))
            if mixed and use_more_bits(layer, n_layer):
                t = T.Q6_K
        types.append(_fit_row_length(t, spec.ne[0]))
    return types


# ----------------------------------------------------------------------------------------------------------------
# ggml through ctypes


class GGMLQuantizer:
    """`ggml_quantize_chunk` of llama-cpp-python's ggml, run over row ranges on a few threads.

    Q4_K, Q5_K and Q6_K go to dgemma's faster quantizers where the CPU has them (dgemma_convert.fast_quant), for
    each type only after they matched ggml's bytes on probe rows in this process.
    """

    def __init__(self, threads: int = 2, fast: bool = True):
        self.threads = max(1, threads)
        self._lib = _load_ggml_base()
        self._initialized: set[T] = set()
        self._fast: FastQuantizer | None = load_fast_quantizer() if fast else None
        self.fast_types: frozenset[T] = frozenset()
        if self._fast is not None:
            probe = probe_rows()
            self.fast_types = frozenset(t for t in self._fast.types
                                        if np.array_equal(self.quantize(t, probe), self._fast_bytes(t, probe)))

    def _fast_bytes(self, t: T, rows: np.ndarray) -> np.ndarray:
        out = np.zeros(rows.shape[0] * self.row_size(t, rows.shape[1]), dtype=np.uint8)
        written = self._fast.quantize(t, rows.ctypes.data, out.ctypes.data, rows.shape[0], rows.shape[1])
        return out if written == out.nbytes else out[:0]

    def row_size(self, t: T, row_length: int) -> int:
        return self._lib.ggml_row_size(int(t), row_length)

    def quantize(self, t: T, rows: np.ndarray) -> np.ndarray:
        """float32 [n_rows, row_length] -> the type's bytes (uint8), row after row."""
        rows = np.ascontiguousarray(rows, dtype=np.float32)
        n_rows, row_length = rows.shape
        if row_length % block_size(t) != 0:  # ggml would abort the process; never let it
            raise ConvertError(f"row length {row_length} is not a multiple of the {t.name} block size")
        if t not in self._initialized:
            self._lib.ggml_quantize_init(int(t))
            self._initialized.add(t)
        row_bytes = self.row_size(t, row_length)
        out = np.empty(n_rows * row_bytes, dtype=np.uint8)
        fast = self._fast if t in self.fast_types else None

        def run(part: tuple[int, int]) -> int:
            first, count = part
            src = rows.ctypes.data + first * row_length * 4
            dst = out.ctypes.data + first * row_bytes
            written = fast.quantize(t, src, dst, count, row_length) if fast is not None else 0
            return written or self._lib.ggml_quantize_chunk(int(t), src, dst, 0, count, row_length, None)

        step = max(1, -(-n_rows // self.threads))
        parts = [(first, min(step, n_rows - first)) for first in range(0, n_rows, step)]
        if len(parts) == 1:
            written = [run(parts[0])]
        else:  # ctypes releases the GIL during the call, so the threads quantize in parallel
            with ThreadPoolExecutor(len(parts)) as pool:
                written = list(pool.map(run, parts))
        if sum(written) != out.nbytes:
            raise ConvertError(f"ggml wrote {sum(written)} bytes for {t.name}, expected {out.nbytes}")
        return out


def _load_ggml_base() -> ctypes.CDLL:
    try:
        import llama_cpp  # noqa: F401  (loads llama_cpp/lib/libggml*.so first: one ggml per process)
    except Exception as exc:  # ImportError, or an OSError from a broken install
        raise ConvertError(f"quantized output needs llama-cpp-python's ggml, which failed to load: {exc}") from None
    path = Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise ConvertError(f"cannot load ggml from {path}: {exc}") from None
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_init.argtypes = [ctypes.c_int]
    lib.ggml_quantize_init.restype = None
    lib.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
    lib.ggml_row_size.restype = ctypes.c_size_t
    return lib
