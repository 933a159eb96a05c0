"""A memory-mapped reader for single-file and sharded safetensors checkpoints (no torch).

Every number in a header is untrusted: the header length, each tensor's dtype, shape and byte range are checked
against each other and against the real file size before anything is mapped, so a truncated shard or a header whose
offsets lie is a ConvertError, never a crash or a read past the end of the file.

Tensors are read in row chunks (a row is the last dimension, ggml's ne[0]) and the pages of each chunk are released
from this process after use, so resident memory stays bounded by the chunk size whatever the tensor size.
"""
from __future__ import annotations

import json
import mmap
import os
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Iterator

import numpy as np

from dgemma_convert.errors import ConvertError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors format's own limit

# safetensors dtype -> bytes per element. Only the float types can be converted; the others are accepted in headers
# so that a checkpoint carrying integer buffers still opens.
DTYPE_SIZES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2,
    "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1,
}
FLOAT_DTYPES = ("F32", "F16", "BF16")
_PAGE = mmap.PAGESIZE


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path
    offset: int  # absolute byte offset in `file`
    nbytes: int

    @property
    def row_length(self) -> int:
        """Elements per row (the last dimension; 1 for a scalar)."""
        return self.shape[-1] if self.shape else 1

    @property
    def n_rows(self) -> int:
        return prod(self.shape[:-1]) if self.shape else 1


class SafetensorsFile:
    """One `.safetensors` file: its validated header and a lazily opened read-only memory map."""

    def __init__(self, path: Path):
        self.path = path
        self._fd: int | None = None
        self._map: mmap.mmap | None = None
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                self.entries = _parse_header(path, f, size)
        except FileNotFoundError:
            raise ConvertError(f"missing safetensors file: {path}") from None
        except OSError as exc:
            raise ConvertError(f"cannot read {path}: {exc}") from None
        self.size = size

    def _mapped(self) -> mmap.mmap:
        if self._map is None:
            try:
                with open(self.path, "rb") as f:
                    if os.fstat(f.fileno()).st_size != self.size:
                        raise ConvertError(f"{self.path} changed size while converting")
                    self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except OSError as exc:
                raise ConvertError(f"cannot map {self.path}: {exc}") from None
        return self._map

    def read(self, offset: int, nbytes: int) -> bytes:
        """Copy `nbytes` at `offset`, then drop those pages from this process (they stay in the page cache)."""
        m = self._mapped()
        data = m[offset:offset + nbytes]
        if nbytes > 0 and hasattr(mmap, "MADV_DONTNEED"):
            start = offset - offset % _PAGE
            m.madvise(mmap.MADV_DONTNEED, start, offset + nbytes - start)
        return data

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None


def _parse_header(path: Path, f, size: int) -> dict[str, TensorEntry]:
    if size < 8:
        raise ConvertError(f"{path.name} is truncated: {size} bytes, too short for a safetensors header")
    header_len = int.from_bytes(f.read(8), "little")
    if header_len > MAX_HEADER_BYTES:
        raise ConvertError(f"{path.name}: safetensors header length {header_len} is implausible (corrupt file?)")
    if 8 + header_len > size:
        raise ConvertError(f"{path.name} is truncated: header of {header_len} bytes but the file has {size} bytes")
    try:
        header = json.loads(f.read(header_len).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConvertError(f"{path.name}: safetensors header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ConvertError(f"{path.name}: safetensors header must be a JSON object")

    data_start = 8 + header_len
    data_size = size - data_start
    entries: dict[str, TensorEntry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        entries[name] = _parse_entry(path, name, info, data_start, data_size)

    # Byte ranges must not overlap: a header that points two tensors at the same bytes is lying.
    previous: TensorEntry | None = None
    for entry in sorted(entries.values(), key=lambda e: (e.offset, e.nbytes)):
        if previous is not None and entry.offset < previous.offset + previous.nbytes and entry.nbytes > 0:
            raise ConvertError(f"{path.name}: tensors '{previous.name}' and '{entry.name}' overlap (bad offsets)")
        if entry.nbytes > 0:
            previous = entry
    return entries


def _parse_entry(path: Path, name: str, info: object, data_start: int, data_size: int) -> TensorEntry:
    where = f"{path.name}: tensor '{name}'"
    if not isinstance(info, dict):
        raise ConvertError(f"{where}: header entry must be an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in DTYPE_SIZES:
        raise ConvertError(f"{where}: unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise ConvertError(f"{where}: shape must be a list of non-negative integers, got {shape!r}")
    if (not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
        raise ConvertError(f"{where}: data_offsets must be two integers, got {offsets!r}")
    begin, end = offsets
    if not 0 <= begin <= end:
        raise ConvertError(f"{where}: invalid data_offsets {offsets}")
    nbytes = prod(shape) * DTYPE_SIZES[dtype]
    if end - begin != nbytes:
        raise ConvertError(f"{where}: data_offsets {offsets} span {end - begin} bytes but shape {shape} x {dtype} "
                           f"needs {nbytes}")
    if end > data_size:
        raise ConvertError(f"{path.name} is truncated or its offsets lie: tensor '{name}' ends at byte "
                           f"{data_start + end} but the file has {data_start + data_size} bytes")
    return TensorEntry(name, dtype, tuple(shape), path, data_start + begin, nbytes)


class Checkpoint:
    """All tensors of a Hugging Face checkpoint folder: `model.safetensors` or shards listed in the index."""

    def __init__(self, files: list[SafetensorsFile], entries: dict[str, TensorEntry]):
        self._files = {f.path: f for f in files}
        self.entries = entries

    @classmethod
    def open(cls, hf_dir: Path) -> "Checkpoint":
        single, index = hf_dir / SINGLE_FILE, hf_dir / INDEX_FILE
        if single.is_file():
            f = SafetensorsFile(single)
            return cls([f], dict(f.entries))
        if index.is_file():
            return cls._open_sharded(hf_dir, index)
        raise ConvertError(f"no {SINGLE_FILE} or {INDEX_FILE} in {hf_dir}")

    @classmethod
    def _open_sharded(cls, hf_dir: Path, index: Path) -> "Checkpoint":
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as exc:
            raise ConvertError(f"{INDEX_FILE} is not a valid index: {exc}") from None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ConvertError(f"{INDEX_FILE} has no 'weight_map'")
        shards: dict[str, SafetensorsFile] = {}
        entries: dict[str, TensorEntry] = {}
        for name, shard in weight_map.items():
            # shard names come from an untrusted file: plain file names inside the folder only
            if not isinstance(shard, str) or not shard or shard != os.path.basename(shard) or shard in (".", ".."):
                raise ConvertError(f"{INDEX_FILE}: invalid shard name {shard!r} for tensor '{name}'")
            if shard not in shards:
                if not (hf_dir / shard).is_file():
                    raise ConvertError(f"missing shard {shard} (listed in {INDEX_FILE})")
                shards[shard] = SafetensorsFile(hf_dir / shard)
            entry = shards[shard].entries.get(name)
            if entry is None:
                raise ConvertError(f"tensor '{name}' is listed in {INDEX_FILE} but not stored in shard {shard}")
            entries[name] = entry
        return cls(list(shards.values()), entries)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def iter_raw(self, entry: TensorEntry, max_bytes: int, n_rows: int | None = None) -> Iterator[bytes]:
        """The first `n_rows` rows (default all) of a tensor as raw little-endian bytes, in chunks of whole rows."""
        row_bytes = entry.row_length * DTYPE_SIZES[entry.dtype]
        total_rows = entry.n_rows if n_rows is None else n_rows
        rows_per_chunk = max(1, max_bytes // max(row_bytes, 1))
        f = self._files[entry.file]
        for row in range(0, total_rows, rows_per_chunk):
            rows = min(rows_per_chunk, total_rows - row)
            yield f.read(entry.offset + row * row_bytes, rows * row_bytes)

    def iter_rows_f32(self, entry: TensorEntry, max_elements: int, n_rows: int | None = None) -> Iterator[np.ndarray]:
        """The first `n_rows` rows as float32 arrays of shape [rows, row_length], chunk by chunk."""
        if entry.dtype not in FLOAT_DTYPES:
            raise ConvertError(f"tensor '{entry.name}' has dtype {entry.dtype}; only {', '.join(FLOAT_DTYPES)} "
                               "can be converted")
        max_bytes = max_elements * DTYPE_SIZES[entry.dtype]
        for raw in self.iter_raw(entry, max_bytes, n_rows):
            yield to_float32(raw, entry.dtype).reshape(-1, entry.row_length)

    def close(self) -> None:
        for f in self._files.values():
            f.close()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def to_float32(raw: bytes, dtype: str) -> np.ndarray:
    """Decode little-endian F32 / F16 / BF16 bytes to float32 (BF16 is the top half of an F32: exact)."""
    if dtype == "F32":
        return np.frombuffer(raw, dtype="<f4").astype(np.float32, copy=True)
    if dtype == "F16":
        return np.frombuffer(raw, dtype="<f2").astype(np.float32)
    if dtype == "BF16":  # place each bf16 in the high half of a zeroed little-endian uint32: one strided copy
        bits = np.zeros(len(raw) // 2, dtype="<u4")
        bits.view("<u2")[1::2] = np.frombuffer(raw, dtype="<u2")
        return bits.view("<f4")
    raise ConvertError(f"cannot convert dtype {dtype} to float32")
