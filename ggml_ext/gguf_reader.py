"""The bounded GGUF reader: what the store's checks (`dgemma_cli.gguf_check`) and the tokenizer read a file's header
with, never gguf-py's reader (which materialises every key and array: 160 times the file's size for a file of a million
one-byte keys).

The file is memory-mapped and read with bounds checks at every step: each count, length and offset read from the file
is checked against the bytes that remain before it is used, so a hostile header cannot make us allocate or loop beyond
what the file size allows. The metadata has fixed limits besides (MAX_METADATA_KEYS keys, MAX_METADATA_BYTES bytes,
MAX_TENSORS tensors; docs/compat.md, security D8), so reading a header costs at most a fixed time and memory whatever
the file's size. Large arrays (the vocabulary, BPE merges) are skipped over, not materialised: only their type and
length are kept, unless the caller names them in `keep_arrays`.
"""
from __future__ import annotations

import mmap
import os
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from dgemma_engine.errors import DgemmaError
from dgemma_engine.gguf_keys import (KEY_ALIGNMENT, KEY_ARCHITECTURE, KEY_BLOCK_COUNT, KEY_CANVAS_LENGTH,
                                     KEY_CONTEXT_LENGTH, KEY_EMBEDDING_LENGTH, KEY_FILE_TYPE, for_arch)

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_TENSOR_NAME = 63  # GGML_MAX_NAME (64) minus the terminating NUL
KEEP_ARRAY_MAX = 1024  # arrays longer than this are summarised (type + length), never materialised
MAX_ELEMENTS = 1 << 62
# A DiffusionGemma GGUF has about 50 keys and 16 MB of metadata (a 262,144-token vocabulary, 514,906 merges), and at
# most a thousand tensors; these leave room for other writers' extra keys while keeping a header's cost bounded.
MAX_METADATA_KEYS = 4096
MAX_METADATA_BYTES = 64 << 20
MAX_TENSORS = 1 << 16
MAX_ARRAY_ITEMS = 1 << 22  # elements of the arrays read one by one or kept (a long numeric array skipped is free)
MAX_SHOWN_ITEMS = 1 << 16  # elements of short arrays read for show; beyond, they are summarised like long ones

# GGUF metadata value types -> struct format of a scalar.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<B", 10: "<Q", 11: "<q", 12: "<d"}
T_BOOL, T_STRING, T_ARRAY = 7, 8, 9
INT_TYPES = {0, 1, 2, 3, 4, 5, 10, 11}

# ggml tensor types: name, block elements, block bytes (gguf-py's table; its Q8_1 says 40 bytes, ggml's block_q8_1 has
# 36).
_BLOCK_SIZES = {**GGML_QUANT_SIZES, GGMLQuantizationType.Q8_1: (32, 36)}
GGML_TYPES: dict[int, tuple[str, int, int]] = {int(t): (t.name, *size) for t, size in _BLOCK_SIZES.items()}

# general.file_type (llama_ftype) -> the name Ollama shows as quantization level.
FILE_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
    12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
    19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL",
    26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16", 36: "TQ1_0", 37: "TQ2_0",
}

# Keys whose type is fixed by the layout (docs/gguf.md#metadata-keys); a wrong type is as bad as a missing tensor.
_INTEGER_KEYS = (KEY_BLOCK_COUNT, KEY_CONTEXT_LENGTH, KEY_EMBEDDING_LENGTH)  # under the file's own architecture
MAX_CANVAS_LENGTH = 4096  # DG_MAX_CANVAS in ggml_ext/csrc/engine/engine.h: the engine refuses longer canvases
FLOAT_TYPES = {6, 12}


class GGUFError(DgemmaError):
    """The file is not a well-formed GGUF (message says where)."""

    status = 400


@dataclass(frozen=True)
class ArraySummary:
    """A long metadata array, kept as its element type and length only (plus, for strings, whether every element
    is one and the same string: a vocabulary no tokenizer can use)."""

    item_type: int
    length: int
    all_same: bool = False


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml `ne` order
    type_name: str
    offset: int  # absolute offset in the file
    nbytes: int

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass
class GGUFInfo:
    version: int
    metadata: dict[str, Any]
    tensors: list[TensorInfo] = field(default_factory=list)
    alignment: int = DEFAULT_ALIGNMENT
    data_offset: int = 0
    file_size: int = 0

    @property
    def architecture(self) -> str:
        return str(self.metadata.get(KEY_ARCHITECTURE, ""))

    @property
    def parameter_count(self) -> int:
        return sum(t.n_elements for t in self.tensors)

    @property
    def file_type(self) -> str:
        ft = self.metadata.get(KEY_FILE_TYPE)
        if isinstance(ft, int) and ft in FILE_TYPES:
            return FILE_TYPES[ft]
        # No file_type key: name the file by its most common weight type, as Ollama does for unknown files.
        counts: dict[str, int] = {}
        for t in self.tensors:
            if len(t.shape) >= 2:
                counts[t.type_name] = counts.get(t.type_name, 0) + 1
        return max(counts, key=counts.get) if counts else "unknown"


class _Reader:
    """Bounds-checked little-endian reads from a buffer, up to `end`: the end of the file, or of the metadata budget
    while the key/values are read."""

    def __init__(self, buf: memoryview | bytes | mmap.mmap, size: int) -> None:
        self.buf, self.size, self.pos, self.end = buf, size, 0, size
        self.items = self.shown = 0  # array elements read so far (MAX_ARRAY_ITEMS, MAX_SHOWN_ITEMS)

    def remaining(self) -> int:
        return self.end - self.pos

    def past(self, what: str, at: int) -> GGUFError:
        """The error for a read of `what` up to offset `at`, beyond `end`."""
        if at <= self.size:
            return GGUFError(f"invalid GGUF: the metadata is larger than {MAX_METADATA_BYTES >> 20} MiB (at {what})")
        return GGUFError(f"invalid GGUF: {what} extends beyond the end of the file")

    def need(self, n: int, what: str) -> None:
        if n < 0 or n > self.remaining():
            raise self.past(what, self.pos + n if n >= 0 else self.size + 1)

    def unpack(self, fmt: str, what: str) -> Any:
        n = struct.calcsize(fmt)
        self.need(n, what)
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += n
        return value

    def skip(self, n: int, what: str) -> None:
        self.need(n, what)
        self.pos += n

    def string(self, what: str) -> str:
        n = self.unpack("<Q", f"{what} length")
        self.need(n, what)
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise GGUFError(f"invalid GGUF: {what} is not valid UTF-8") from None


def _shortest_f32(value: float) -> float:
    """The shortest decimal that rounds to the same float32 (0.8, not 0.800000011920929)."""
    if value != value or value in (float("inf"), float("-inf")):
        return value
    packed = struct.pack("<f", value)
    for digits in range(1, 10):
        candidate = float(f"{value:.{digits}g}")
        if struct.pack("<f", candidate) == packed:
            return candidate
    return value


_U64 = struct.Struct("<Q")


def _skip_strings(r: _Reader, count: int, key: str) -> bool:
    """Step over `count` length-prefixed strings (a 262k-token vocabulary) without decoding them; True if they
    are all the same string."""
    pos, end, buf, unpack = r.pos, r.end, r.buf, _U64.unpack_from
    first: bytes | None = None
    all_same = True
    for _ in range(count):
        if pos + 8 > end:
            raise r.past(f"array {key!r}", pos + 8)
        n = unpack(buf, pos)[0]
        start, pos = pos + 8, pos + 8 + n
        if pos > end:
            raise r.past(f"array {key!r}", pos)
        if all_same:
            item = bytes(buf[start:pos])
            first = item if first is None else first
            all_same = item == first
    r.pos = pos
    return all_same


def _read_strings(r: _Reader, count: int, key: str) -> list[str]:
    """`count` length-prefixed strings, decoded (the vocabulary and merges a tokenizer is built from)."""
    pos, end, buf, unpack = r.pos, r.end, r.buf, _U64.unpack_from
    items = []
    append = items.append
    try:
        for _ in range(count):
            if pos + 8 > end:
                raise r.past(f"array {key!r}", pos + 8)
            n = unpack(buf, pos)[0]
            start, pos = pos + 8, pos + 8 + n
            if pos > end:
                raise r.past(f"array {key!r}", pos)
            append(str(buf[start:pos], "utf-8"))
    except UnicodeDecodeError:
        raise GGUFError(f"invalid GGUF: an element of array {key!r} is not valid UTF-8") from None
    r.pos = pos
    return items


def _count_items(r: _Reader, n: int, key: str) -> None:
    r.items += n
    if r.items > MAX_ARRAY_ITEMS:
        raise GGUFError(f"invalid GGUF: the metadata arrays hold more than {MAX_ARRAY_ITEMS} elements (at {key!r})")


def _read_value(r: _Reader, vtype: int, key: str, keep: bool = False) -> Any:
    """One metadata value; arrays longer than KEEP_ARRAY_MAX are summarised unless `keep`, and so are short ones once
    MAX_SHOWN_ITEMS elements have been read for show."""
    if vtype in _SCALARS:
        value = r.unpack(_SCALARS[vtype], f"value of {key!r}")
        if vtype == T_BOOL:
            if value > 1:
                raise GGUFError(f"invalid GGUF: boolean value of {key!r} is {value}")
            return bool(value)
        if vtype == 6:
            return _shortest_f32(value)
        return value
    if vtype == T_STRING:
        return r.string(f"string value of {key!r}")
    if vtype != T_ARRAY:
        raise GGUFError(f"invalid GGUF: unknown value type {vtype} for {key!r}")
    item_type = r.unpack("<I", f"array type of {key!r}")
    length = r.unpack("<Q", f"array length of {key!r}")
    if item_type == T_ARRAY:  # as ggml's and the engine's parsers: no key of any GGUF layout holds them
        raise GGUFError(f"invalid GGUF: array {key!r} holds arrays (not supported)")
    if item_type not in _SCALARS and item_type != T_STRING:
        raise GGUFError(f"invalid GGUF: unknown array element type {item_type} in {key!r}")
    shown = not keep and length <= KEEP_ARRAY_MAX and r.shown + length <= MAX_SHOWN_ITEMS
    if shown:
        r.shown += length
    if item_type == T_STRING:
        r.need(length * 8, f"array {key!r}")  # each element needs at least its length prefix
        _count_items(r, length, key)
        if keep or shown:
            return _read_strings(r, length, key)
        return ArraySummary(item_type, length, _skip_strings(r, length, key))
    item_size = struct.calcsize(_SCALARS[item_type])
    r.need(length * item_size, f"array {key!r}")
    if not keep and not shown:
        r.pos += length * item_size
        return ArraySummary(item_type, length)
    _count_items(r, length, key)
    if keep and item_type in INT_TYPES | FLOAT_TYPES:  # all at once: a vocabulary's 262k token types, scores
        values = list(struct.unpack_from(f"<{length}{_SCALARS[item_type][1]}", r.buf, r.pos))
        r.pos += length * item_size
        return values
    return [_read_value(r, item_type, key) for _ in range(length)]


def _check_typed_keys(metadata: dict[str, Any]) -> None:
    arch = metadata.get(KEY_ARCHITECTURE)
    if arch is not None and not isinstance(arch, str):
        raise GGUFError(f"invalid GGUF: {KEY_ARCHITECTURE} must be a string")
    if isinstance(arch, str):
        for key in (for_arch(k, arch) for k in _INTEGER_KEYS):
            value = metadata.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise GGUFError(f"invalid GGUF: {key} must be a non-negative integer")
    canvas = metadata.get(KEY_CANVAS_LENGTH)
    if canvas is not None and (isinstance(canvas, bool) or not isinstance(canvas, int) or canvas <= 0):
        raise GGUFError(f"invalid GGUF: {KEY_CANVAS_LENGTH} must be a positive integer")
    if canvas is not None and canvas > MAX_CANVAS_LENGTH:
        raise GGUFError(f"invalid GGUF: {KEY_CANVAS_LENGTH} {canvas} is larger than {MAX_CANVAS_LENGTH}")


def parse_gguf(buf: bytes | memoryview | mmap.mmap, size: int | None = None,
               keep_arrays: frozenset[str] = frozenset()) -> GGUFInfo:
    """Validate and describe a GGUF held in `buf` (bytes or an mmap). Raises GGUFError on any inconsistency. The
    arrays named in `keep_arrays` are read whole, however long (a vocabulary for the schema compiler)."""
    size = len(buf) if size is None else size
    r = _Reader(buf, size)
    if size < 4 or bytes(buf[:4]) != GGUF_MAGIC:
        raise GGUFError("invalid GGUF: bad magic (not a GGUF file)")
    r.pos = 4
    version = r.unpack("<I", "version")
    if version not in (2, 3):
        raise GGUFError(f"invalid GGUF: unsupported version {version}")
    n_tensors = r.unpack("<Q", "tensor count")
    n_kv = r.unpack("<Q", "key/value count")
    # Each key/value needs >= 8 (key length) + 4 (type) + 1 bytes, each tensor >= 8 + 4 + 8 + 4 + 8 bytes.
    if n_kv * 13 > r.remaining():
        raise GGUFError(f"invalid GGUF: key/value count {n_kv} exceeds the file size")
    if n_tensors * 32 > r.remaining():
        raise GGUFError(f"invalid GGUF: tensor count {n_tensors} exceeds the file size")
    if n_kv > MAX_METADATA_KEYS:
        raise GGUFError(f"invalid GGUF: {n_kv} metadata keys (at most {MAX_METADATA_KEYS})")
    if n_tensors > MAX_TENSORS:
        raise GGUFError(f"invalid GGUF: {n_tensors} tensors (at most {MAX_TENSORS})")

    metadata: dict[str, Any] = {}
    r.end = min(size, r.pos + MAX_METADATA_BYTES)
    for _ in range(n_kv):
        key = r.string("metadata key")
        if not key:
            raise GGUFError("invalid GGUF: empty metadata key")
        if key in metadata:
            raise GGUFError(f"invalid GGUF: duplicate key {key!r}")
        vtype = r.unpack("<I", f"type of {key!r}")
        metadata[key] = _read_value(r, vtype, key, keep=key in keep_arrays)
    r.end = size
    _check_typed_keys(metadata)

    alignment = metadata.get(KEY_ALIGNMENT, DEFAULT_ALIGNMENT)
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise GGUFError(f"invalid GGUF: alignment {alignment!r} is not a power of two")

    raw_tensors: list[tuple[str, tuple[int, ...], int, int]] = []
    names: set[str] = set()
    for _ in range(n_tensors):
        name = r.string("tensor name")
        if not name or len(name.encode()) > MAX_TENSOR_NAME:
            raise GGUFError(f"invalid GGUF: tensor name {name[:80]!r} is empty or too long")
        if name in names:
            raise GGUFError(f"invalid GGUF: duplicate tensor {name!r}")
        names.add(name)
        n_dims = r.unpack("<I", f"dimensions of {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise GGUFError(f"invalid GGUF: tensor {name!r} has {n_dims} dimensions")
        shape = tuple(r.unpack("<Q", f"shape of {name!r}") for _ in range(n_dims))
        n_elements = 1
        for d in shape:
            if d == 0 or d > MAX_ELEMENTS:
                raise GGUFError(f"invalid GGUF: tensor {name!r} has dimension {d}")
            n_elements *= d
            if n_elements > MAX_ELEMENTS:
                raise GGUFError(f"invalid GGUF: tensor {name!r} has too many elements")
        ggml_type = r.unpack("<I", f"type of {name!r}")
        offset = r.unpack("<Q", f"offset of {name!r}")
        raw_tensors.append((name, shape, ggml_type, offset))

    data_offset = -(-r.pos // alignment) * alignment
    if data_offset > size and raw_tensors:
        raise GGUFError("invalid GGUF: tensor data starts beyond the end of the file")
    tensors: list[TensorInfo] = []
    for name, shape, ggml_type, offset in raw_tensors:
        if ggml_type not in GGML_TYPES:
            raise GGUFError(f"invalid GGUF: tensor {name!r} has unknown type {ggml_type}")
        type_name, block, block_bytes = GGML_TYPES[ggml_type]
        if shape[0] % block:
            raise GGUFError(f"invalid GGUF: tensor {name!r} row of {shape[0]} is not a multiple of {block}")
        nrows = 1
        for d in shape[1:]:
            nrows *= d
        nbytes = nrows * (shape[0] // block) * block_bytes
        if offset % alignment:
            raise GGUFError(f"invalid GGUF: tensor {name!r} offset is not aligned")
        start = data_offset + offset
        if start + nbytes > size:
            raise GGUFError(f"invalid GGUF: tensor {name!r} data extends beyond the end of the file")
        tensors.append(TensorInfo(name, shape, type_name, start, nbytes))

    ordered = sorted(tensors, key=lambda t: t.offset)
    for a, b in zip(ordered, ordered[1:]):
        if a.offset + a.nbytes > b.offset:
            raise GGUFError(f"invalid GGUF: tensors {a.name!r} and {b.name!r} overlap")
    return GGUFInfo(version, metadata, tensors, alignment, data_offset, size)


def read_gguf_info(path: str | os.PathLike, keep_arrays: frozenset[str] = frozenset()) -> GGUFInfo:
    """Validate the GGUF at `path` without reading its tensor data (memory bounded by the mapping); `keep_arrays` as
    parse_gguf."""
    path = Path(path)
    try:
        # Check the type before opening: opening a FIFO or device would block or read forever.
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise GGUFError("invalid GGUF: not a regular file")
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 4:
                raise GGUFError("invalid GGUF: file too short")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                return parse_gguf(mm, size, keep_arrays)
    except OSError as exc:
        raise GGUFError(f"cannot read GGUF file: {exc.strerror or exc}") from None


