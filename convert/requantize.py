"""GGUF -> GGUF: quantize an F32/F16/BF16 DiffusionGemma GGUF with the same per-tensor policy as `convert`.

Used by `dgemma create --quantize` on a GGUF that is already converted. Metadata is copied unchanged except
`general.file_type`; tensors keep their order (llama-quantize's attn_v counter depends on it). Tensor data is read
with pread in row chunks (not through a memory map), so memory stays bounded whatever the file size.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
from gguf import GGMLQuantizationType as T, GGUFValueType as V

from dgemma_convert.converter import (CHUNK_ELEMENTS, RAW_CHUNK_BYTES, ConversionResult, PlannedTensor, ProgressSink,
                                      encode_rows, make_quantizer, write_gguf)
from dgemma_convert.errors import ConvertError
from dgemma_convert.gguf_metadata import ARCH, KeyValue
from dgemma_convert.quantize import FLOAT_TYPES, choose_types, nbytes, parse_outtype
from dgemma_convert.safetensors_reader import to_float32
from dgemma_convert.tensor_map import TensorSpec
from dgemma_engine.gguf_keys import KEY_ARCHITECTURE, KEY_BLOCK_COUNT, KEY_FILE_TYPE


@dataclass(frozen=True)
class SourceTensor:
    spec: TensorSpec
    ggml_type: T
    offset: int  # absolute byte offset in the source file


def requantize(src: Path, dst: Path, outtype: str, *, threads: int | None = None,
               progress: ProgressSink | None = None) -> ConversionResult:
    started = time.monotonic()
    src, dst = Path(src), Path(dst)
    out = parse_outtype(outtype)
    metadata, sources = read_float_gguf(src)
    n_layer = next((kv.value for kv in metadata if kv.key == KEY_BLOCK_COUNT), None)
    if not isinstance(n_layer, int) or n_layer < 1:
        raise ConvertError(f"{src}: missing or invalid {KEY_BLOCK_COUNT}")
    types = choose_types([s.spec for s in sources], n_layer, out)
    planned = [PlannedTensor(s.spec, t, nbytes(t, s.spec.ne)) for s, t in zip(sources, types, strict=True)]
    file_type = KeyValue(KEY_FILE_TYPE, int(out.file_type), V.UINT32)
    if not any(kv.key == file_type.key for kv in metadata):
        metadata.append(file_type)
    metadata = [file_type if kv.key == file_type.key else kv for kv in metadata]
    quantizer = make_quantizer(planned, threads)
    by_name = {s.spec.name: s for s in sources}
    fd = os.open(src, os.O_RDONLY)
    try:
        write_gguf(dst, metadata, planned, lambda t: _tensor_bytes(fd, by_name[t.name], t, quantizer), progress)
    finally:
        os.close(fd)
    return ConversionResult(dst, len(planned), dst.stat().st_size, time.monotonic() - started)


def read_float_gguf(path: Path) -> tuple[list[KeyValue], list[SourceTensor]]:
    """Metadata and tensor table of a DiffusionGemma GGUF whose tensors are all F32, F16 or BF16."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except FileNotFoundError:
        raise ConvertError(f"GGUF file not found: {path}") from None
    except Exception as exc:  # gguf-py raises ValueError/IndexError/... on malformed files
        raise ConvertError(f"{path} is not a readable GGUF file: {exc}") from None
    metadata = []
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):  # header pseudo-fields (version, counts)
            continue
        vtype = V(field.types[0])
        if vtype == V.ARRAY and len(field.types) != 2:
            raise ConvertError(f"{path}: nested array in key {name} is not supported")
        metadata.append(KeyValue(name, field.contents(), vtype, V(field.types[-1]) if vtype == V.ARRAY else None))
    arch = next((kv.value for kv in metadata if kv.key == KEY_ARCHITECTURE), None)
    if arch != ARCH:
        raise ConvertError(f"{path}: architecture {arch!r} is not {ARCH!r}")
    size = path.stat().st_size
    sources = []
    for t in reader.tensors:
        ggml_type = T(t.tensor_type)
        if ggml_type not in FLOAT_TYPES:
            raise ConvertError(f"{path}: tensor {t.name} is {ggml_type.name}; only F32, F16 or BF16 files can be "
                               "quantized")
        ne = tuple(int(d) for d in t.shape)
        spec = TensorSpec(t.name, None, (), ne)
        if int(t.data_offset) + nbytes(ggml_type, ne) > size:
            raise ConvertError(f"{path} is truncated: tensor {t.name} lies past the end of the file")
        sources.append(SourceTensor(spec, ggml_type, int(t.data_offset)))
    return metadata, sources


def _tensor_bytes(fd: int, src: SourceTensor, t: PlannedTensor, quantizer) -> Iterator[bytes | np.ndarray]:
    row_bytes = nbytes(src.ggml_type, (src.spec.ne[0],))
    n_rows = int(np.prod(src.spec.ne[1:])) if len(src.spec.ne) > 1 else 1
    same = src.ggml_type == t.ggml_type
    rows_per_chunk = max(1, (RAW_CHUNK_BYTES if same else CHUNK_ELEMENTS * 2) // row_bytes)
    chunks = (_pread(fd, src.offset + row * row_bytes, min(rows_per_chunk, n_rows - row) * row_bytes)
              for row in range(0, n_rows, rows_per_chunk))
    if same:
        yield from chunks
        return
    dtype = src.ggml_type.name  # "F32" / "F16" / "BF16": the safetensors names of the same encodings
    yield from encode_rows((to_float32(raw, dtype).reshape(-1, src.spec.ne[0]) for raw in chunks), t.ggml_type,
                       quantizer)


def _pread(fd: int, offset: int, n: int) -> bytes:
    data = os.pread(fd, n, offset)
    if len(data) != n:
        raise ConvertError("source GGUF ended early (truncated file?)")
    return data
