"""Build malformed variants of a valid fixture GGUF (issue 14): wrong metadata types, missing or absurd sizes,
duplicate and empty keys. Each mutant is the fixture's tensors (bytes copied as they are) with its metadata
changed by one function of `MUTANTS`; the file is written by a small GGUF v3 writer of our own, because gguf-py
refuses to write some of these on purpose.

    from gguf_mutator import MUTANTS, mutate
    mutate(fixture_path, out_path, "tokens as i32")
"""
from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

# GGUF value types
U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
_SCALAR_FORMATS = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<?",
                   U64: "<Q", I64: "<q", F64: "<d"}
ALIGNMENT = 32


@dataclass(frozen=True)
class KV:
    key: str
    vtype: int
    value: Any
    item_type: int | None = None  # arrays only


@dataclass(frozen=True)
class Tensor:
    name: str
    ne: tuple[int, ...]
    ggml_type: int
    data: bytes


def read(path: Path) -> tuple[list[KV], list[Tensor]]:
    """The fixture's metadata (minus the reader's own GGUF.* header fields) and tensors."""
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(str(path), "r")
    kvs = []
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        vtype = int(field.types[0])
        item_type = int(field.types[1]) if vtype == GGUFValueType.ARRAY else None
        kvs.append(KV(key, vtype, field.contents(), item_type))
    tensors = [Tensor(t.name, tuple(int(d) for d in t.shape), int(t.tensor_type), bytes(t.data.tobytes()))
               for t in reader.tensors]
    return kvs, tensors


def _string(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def _value(vtype: int, value: Any, item_type: int | None) -> bytes:
    if vtype == STRING:
        return _string(value)
    if vtype == ARRAY:
        assert item_type is not None
        items = list(value)
        return struct.pack("<IQ", item_type, len(items)) + b"".join(_value(item_type, v, None) for v in items)
    return struct.pack(_SCALAR_FORMATS[vtype], value)


def write(path: Path, kvs: list[KV], tensors: list[Tensor]) -> Path:
    out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kvs)))
    for kv in kvs:
        out += _string(kv.key) + struct.pack("<I", kv.vtype) + _value(kv.vtype, kv.value, kv.item_type)
    offset = 0
    for t in tensors:
        out += _string(t.name) + struct.pack("<I", len(t.ne)) + b"".join(struct.pack("<Q", d) for d in t.ne)
        out += struct.pack("<IQ", t.ggml_type, offset)
        offset += -(-len(t.data) // ALIGNMENT) * ALIGNMENT
    out += bytes(-len(out) % ALIGNMENT)
    for t in tensors:
        out += t.data + bytes(-len(t.data) % ALIGNMENT)
    path.write_bytes(bytes(out))
    return path


# ---- the mutations ---------------------------------------------------------------------------------------------------

Mutation = Callable[[list[KV]], list[KV]]
ARCH = "diffusion-gemma"


def _get(kvs: list[KV], key: str) -> KV:
    return next(kv for kv in kvs if kv.key == key)


def _set(key: str, vtype: int, value: Callable[[KV | None], Any] | Any, item_type: int | None = None) -> Mutation:
    def apply(kvs: list[KV]) -> list[KV]:
        old = next((kv for kv in kvs if kv.key == key), None)
        new = KV(key, vtype, value(old) if callable(value) else value, item_type)
        return [new if kv.key == key else kv for kv in kvs] if old else kvs + [new]
    return apply


def _drop(key: str) -> Mutation:
    return lambda kvs: [kv for kv in kvs if kv.key != key]


def _n_tokens(kv: KV | None) -> int:
    assert kv is not None
    return len(kv.value)


def _duplicate(key: str) -> Mutation:
    return lambda kvs: kvs + [_get(kvs, key)]


TOKENS, CTX = "tokenizer.ggml.tokens", f"{ARCH}.context_length"

MUTANTS: dict[str, Mutation] = {
    "unchanged": lambda kvs: kvs,
    "an extra unknown key": _set("dgemma.fuzz.extra", STRING, "hello"),
    "tokens as i32": _set(TOKENS, ARRAY, lambda kv: list(range(_n_tokens(kv))), I32),
    "tokens as f32": _set(TOKENS, ARRAY, lambda kv: [float(i) for i in range(_n_tokens(kv))], F32),
    "tokens all empty": _set(TOKENS, ARRAY, lambda kv: [""] * _n_tokens(kv), STRING),
    "tokens all identical": _set(TOKENS, ARRAY, lambda kv: ["a"] * _n_tokens(kv), STRING),
    "tokens empty array": _set(TOKENS, ARRAY, [], STRING),
    "eos_token_id as an array": _set("tokenizer.ggml.eos_token_id", ARRAY, [1, 2], U32),
    "eos_token_id as a string": _set("tokenizer.ggml.eos_token_id", STRING, "1"),
    "bos_token_id out of range": _set("tokenizer.ggml.bos_token_id", U32, 1 << 30),
    "merges as i32": _set("tokenizer.ggml.merges", ARRAY, [1, 2, 3], I32),
    "token_type too short": _set("tokenizer.ggml.token_type", ARRAY, [1, 1], I32),
    "unknown tokenizer model": _set("tokenizer.ggml.model", STRING, "bpe2000"),
    "context_length missing": _drop(CTX),
    "context_length zero": _set(CTX, U32, 0),
    "context_length smaller than a canvas": _set(CTX, U32, 4),
    "canvas_length 65536": _set("diffusion.canvas_length", U32, 65536),
    "canvas_length zero": _set("diffusion.canvas_length", U32, 0),
    "canvas_length as a string": _set("diffusion.canvas_length", STRING, "16"),
    "duplicate key": _duplicate("diffusion.canvas_length"),
    "empty key": _set("", STRING, "x"),
    "duplicate tokenizer key": _duplicate(TOKENS),
}


def mutate(src: Path, dst: Path, name: str) -> Path:
    kvs, tensors = read(src)
    return write(dst, MUTANTS[name]([replace(kv) for kv in kvs]), tensors)
