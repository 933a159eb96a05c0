"""Python GGUF validation: the gate every file passes before it enters the store or reaches a native loader.

docs/compat.md, security D. The file is memory-mapped and read with bounds checks at every step: each count, length
and offset read from the file is checked against the bytes that remain before it is used, so a hostile header cannot
make us allocate or loop beyond what the file size allows. Large arrays (the vocabulary, BPE merges) are skipped
over, not materialised: only their type and length are kept.
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

from dgemma_engine.arch import ARCH
from dgemma_engine.gguf_keys import (KEY_ALIGNMENT, KEY_ARCHITECTURE, KEY_BLOCK_COUNT, KEY_CANVAS_LENGTH,
                                     KEY_CONTEXT_LENGTH, KEY_EMBEDDING_LENGTH, KEY_FILE_TYPE, KEY_MERGES, KEY_SCORES,
                                     KEY_TOKEN_TYPE, KEY_TOKENIZER_MODEL, KEY_TOKENS, SPECIAL_TOKEN_KEYS, for_arch)

from dgemma_cli.errors import DgemmaError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_TENSOR_NAME = 63  # GGML_MAX_NAME (64) minus the terminating NUL
MAX_ARRAY_DEPTH = 2
KEEP_ARRAY_MAX = 1024  # arrays longer than this are summarised (type + length), never materialised
MAX_ELEMENTS = 1 << 62

# GGUF metadata value types -> struct format of a scalar.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<B", 10: "<Q", 11: "<q", 12: "<d"}
T_BOOL, T_STRING, T_ARRAY = 7, 8, 9
_INT_TYPES = {0, 1, 2, 3, 4, 5, 10, 11}

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
TOKENIZER_MODELS = ("gemma4", "llama")
_FLOAT_TYPES = {6, 12}


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
    """Bounds-checked little-endian reads from a buffer."""

    def __init__(self, buf: memoryview | bytes | mmap.mmap, size: int) -> None:
        self.buf, self.size, self.pos = buf, size, 0

    def remaining(self) -> int:
        return self.size - self.pos

    def need(self, n: int, what: str) -> None:
        if n < 0 or n > self.remaining():
            raise GGUFError(f"invalid GGUF: {what} extends beyond the end of the file")

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
    pos, size, buf, unpack = r.pos, r.size, r.buf, _U64.unpack_from
    first: bytes | None = None
    all_same = True
    for _ in range(count):
        if pos + 8 > size:
            raise GGUFError(f"invalid GGUF: array {key!r} extends beyond the end of the file")
        n = unpack(buf, pos)[0]
        start, pos = pos + 8, pos + 8 + n
        if pos > size:
            raise GGUFError(f"invalid GGUF: array {key!r} extends beyond the end of the file")
        if all_same:
            item = bytes(buf[start:pos])
            first = item if first is None else first
            all_same = item == first
    r.pos = pos
    return all_same


def _read_value(r: _Reader, vtype: int, key: str, depth: int = 0, keep: bool = False) -> Any:
    """One metadata value; arrays longer than KEEP_ARRAY_MAX are summarised unless `keep`."""
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
    if vtype == T_ARRAY:
        if depth >= MAX_ARRAY_DEPTH:
            raise GGUFError(f"invalid GGUF: arrays nested too deeply in {key!r}")
        item_type = r.unpack("<I", f"array type of {key!r}")
        length = r.unpack("<Q", f"array length of {key!r}")
        if item_type in _SCALARS:
            item_size = struct.calcsize(_SCALARS[item_type])
            r.need(length * item_size, f"array {key!r}")
            if length > KEEP_ARRAY_MAX and not keep:
                r.pos += length * item_size
                return ArraySummary(item_type, length)
            if keep and item_type in _INT_TYPES:  # all at once: a vocabulary's 262k token types
                values = list(struct.unpack_from(f"<{length}{_SCALARS[item_type][1]}", r.buf, r.pos))
                r.pos += length * item_size
                return values
            return [_read_value(r, item_type, key, depth + 1) for _ in range(length)]
        if item_type in (T_STRING, T_ARRAY):
            min_size = 8 if item_type == T_STRING else 12
            r.need(length * min_size, f"array {key!r}")  # each element needs at least its length prefix
            keep = keep or length <= KEEP_ARRAY_MAX
            if item_type == T_STRING and not keep:
                return ArraySummary(item_type, length, _skip_strings(r, length, key))
            items = [_read_value(r, item_type, key, depth + 1) for _ in range(length)] if keep else None
            if not keep:
                for _ in range(length):
                    _read_value(r, item_type, key, depth + 1)
            return items if keep else ArraySummary(item_type, length)
        raise GGUFError(f"invalid GGUF: unknown array element type {item_type} in {key!r}")
    raise GGUFError(f"invalid GGUF: unknown value type {vtype} for {key!r}")


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

    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = r.string("metadata key")
        if not key:
            raise GGUFError("invalid GGUF: empty metadata key")
        if key in metadata:
            raise GGUFError(f"invalid GGUF: duplicate key {key!r}")
        vtype = r.unpack("<I", f"type of {key!r}")
        metadata[key] = _read_value(r, vtype, key, keep=key in keep_arrays)
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


def check_diffusion_gguf(path: str | os.PathLike) -> GGUFInfo:
    """Validate a GGUF and require the diffusion-gemma architecture (store and server gate)."""
    info = read_gguf_info(path)
    if info.architecture != ARCH:
        raise GGUFError(f'model architecture "{info.architecture or "unknown"}" is not supported by dgemma')
    if KEY_CANVAS_LENGTH not in info.metadata:
        raise GGUFError(f"invalid GGUF: {KEY_CANVAS_LENGTH} is missing")
    return info


# ---- can a run use it? -----------------------------------------------------------------------------------------------

def _array_info(value: Any) -> tuple[int | None, int, bool] | None:
    """(element type or None if mixed/empty, length, all elements the same) of a metadata array, else None."""
    if isinstance(value, ArraySummary):
        return value.item_type, value.length, value.all_same
    if not isinstance(value, list):
        return None
    kinds = {_value_kind(item) for item in value}
    kind = kinds.pop() if len(kinds) == 1 else None
    return kind, len(value), len(set(map(repr, value))) <= 1


def _value_kind(value: Any) -> int:
    if isinstance(value, bool):
        return T_BOOL
    if isinstance(value, int):
        return 5
    if isinstance(value, float):
        return 6
    if isinstance(value, str):
        return T_STRING
    return T_ARRAY


def _check_array(metadata: dict[str, Any], key: str, kinds: set[int], what: str, length: int | None) -> None:
    value = metadata.get(key)
    if value is None:
        return
    info = _array_info(value)
    if info is None or (info[0] not in kinds and info[1] > 0):
        raise GGUFError(f"{key} must be an array of {what}")
    if length is not None and info[1] != length:
        raise GGUFError(f"{key} has {info[1]} entries, {KEY_TOKENS} has {length}")


def check_runnable(info: GGUFInfo) -> None:
    """The metadata checks the engine and its tokenizer apply at load, made at create time so that a model the store
    accepts can run (types of the tokenizer keys, special token ids in range, a context that fits a canvas)."""
    md, arch = info.metadata, info.architecture
    tokens = md.get(KEY_TOKENS)
    n_tokens = None
    if tokens is not None:
        array = _array_info(tokens)
        if array is None or array[0] != T_STRING or array[1] == 0:
            raise GGUFError(f"{KEY_TOKENS} must be a non-empty array of strings")
        n_tokens = array[1]
        if n_tokens > 1 and array[2]:
            raise GGUFError(f"{KEY_TOKENS} are all the same string")
    model = md.get(KEY_TOKENIZER_MODEL)
    if model is not None and model not in TOKENIZER_MODELS:
        raise GGUFError(f"unsupported {KEY_TOKENIZER_MODEL} {str(model)[:40]!r} "
                        f"(expected {' or '.join(map(repr, TOKENIZER_MODELS))})")
    if model is not None and tokens is None:
        raise GGUFError(f"{KEY_TOKENS} is missing")
    _check_array(md, KEY_TOKEN_TYPE, _INT_TYPES, "integers", n_tokens)
    _check_array(md, KEY_SCORES, _FLOAT_TYPES | _INT_TYPES, "numbers", n_tokens)
    _check_array(md, KEY_MERGES, {T_STRING}, "strings", None)
    if model == "llama" and KEY_SCORES not in md:
        raise GGUFError(f"{KEY_SCORES} is missing (needed by the 'llama' tokenizer)")
    for key in SPECIAL_TOKEN_KEYS.values():
        value = md.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int):
            raise GGUFError(f"{key} must be an integer")
        if n_tokens is not None and not 0 <= value < n_tokens:
            raise GGUFError(f"{key} {value} is outside the vocabulary (0..{n_tokens - 1})")
    context_key = for_arch(KEY_CONTEXT_LENGTH, arch)
    context = md.get(context_key)
    canvas = md.get(KEY_CANVAS_LENGTH)
    if not context:
        raise GGUFError(f"{context_key} is missing or zero")
    if isinstance(canvas, int) and context <= canvas:
        raise GGUFError(f"{context_key} {context} leaves no room for a prompt and "
                        f"a canvas of {canvas} tokens")
