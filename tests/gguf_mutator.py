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


def _resize_vocabulary(delta: int) -> Mutation:
    """The vocabulary (tokens, scores, token types) made `delta` entries longer or shorter, consistently with itself
    but no longer with the token embedding's rows."""
    def apply(kvs: list[KV]) -> list[KV]:
        out = []
        for kv in kvs:
            if kv.key in (TOKENS, SCORES, TOKEN_TYPE):
                extra = {TOKENS: [f"<extra{i}>" for i in range(max(delta, 0))], SCORES: [0.0] * max(delta, 0),
                         TOKEN_TYPE: [1] * max(delta, 0)}[kv.key]
                values = list(kv.value)
                kv = replace(kv, value=values[:delta] if delta < 0 else values + extra)
            out.append(kv)
        return out
    return apply


TOK, D = "tokenizer.ggml", "diffusion"
TOKENS, CTX = f"{TOK}.tokens", f"{ARCH}.context_length"
MODEL, SCORES, TOKEN_TYPE, MERGES = f"{TOK}.model", f"{TOK}.scores", f"{TOK}.token_type", f"{TOK}.merges"
TEMPLATE, TASK = "tokenizer.chat_template", "diffusion.task"

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
    # a header of a million one-byte keys (issue 36: 160 times its size in memory through gguf-py's reader)
    "a million one-byte keys": lambda kvs: kvs + [KV(f"k{i:06d}", U8, 1) for i in range(1_000_000)],
    # ---- issue 36: files that parse, whose every request failed once stored ------------------------------------
    # tokenizer keys missing, mistyped, or inconsistent with the weights
    "tokenizer model missing": _drop(MODEL),
    "tokens missing": _drop(TOKENS),
    "tokenizer model as an integer": _set(MODEL, U32, 4),
    "tokenizer model empty": _set(MODEL, STRING, ""),
    "llama tokenizer without scores": lambda kvs: _set(MODEL, STRING, "llama")(_drop(SCORES)(kvs)),
    "vocabulary shorter than the embeddings": _resize_vocabulary(-8),
    "vocabulary longer than the embeddings": _resize_vocabulary(+8),
    "merges missing": _drop(MERGES),
    "merge without a space": _set(MERGES, ARRAY, ["ab"], STRING),
    "merge of unknown tokens": _set(MERGES, ARRAY, ["zzq qqz"], STRING),
    "token_type as strings": _set(TOKEN_TYPE, ARRAY, lambda kv: ["1"] * len(kv.value), STRING),
    "token_type values out of range": _set(TOKEN_TYPE, ARRAY, lambda kv: [99] * len(kv.value), I32),
    "eos_token_id missing": _drop(f"{TOK}.eos_token_id"),
    "eos_token_id negative": _set(f"{TOK}.eos_token_id", I32, -1),
    "mask_token_id missing": _drop(f"{TOK}.mask_token_id"),
    "mask_token_id out of range": _set(f"{TOK}.mask_token_id", U32, 1 << 20),
    "bos_token_id as a float": _set(f"{TOK}.bos_token_id", F32, 2.0),
    "add_space_prefix as a string": _set(f"{TOK}.add_space_prefix", STRING, "yes"),
    "chat template as an integer": _set(TEMPLATE, U32, 7),
    "chat template empty": _set(TEMPLATE, STRING, ""),
    "chat template that does not parse": _set(TEMPLATE, STRING, "{% for %}"),
    "chat template that raises": _set(TEMPLATE, STRING, "{{ raise_exception('no') }}"),
    "chat template missing": _drop(TEMPLATE),
    # the sampler's defaults (diffusion.eb_*), which every request starts from
    "eb_max_steps zero": _set(f"{D}.eb_max_steps", U32, 0),
    "eb_max_steps negative": _set(f"{D}.eb_max_steps", I32, -5),
    "eb_max_steps huge": _set(f"{D}.eb_max_steps", U64, 1 << 40),
    "eb_max_steps NaN": _set(f"{D}.eb_max_steps", F32, float("nan")),
    "eb_max_steps infinite": _set(f"{D}.eb_max_steps", F64, float("inf")),
    "eb_max_steps as a string": _set(f"{D}.eb_max_steps", STRING, "48"),
    "eb_t_min NaN": _set(f"{D}.eb_t_min", F32, float("nan")),
    "eb_t_min negative": _set(f"{D}.eb_t_min", F32, -0.5),
    "eb_t_max infinite": _set(f"{D}.eb_t_max", F32, float("inf")),
    "eb_t_max below eb_t_min": _set(f"{D}.eb_t_max", F32, 0.2),
    "eb_t_max equal to eb_t_min": _set(f"{D}.eb_t_max", F32, 0.4),
    "eb_entropy_bound zero": _set(f"{D}.eb_entropy_bound", F32, 0.0),
    "eb_entropy_bound NaN": _set(f"{D}.eb_entropy_bound", F32, float("nan")),
    "eb_confidence_threshold negative": _set(f"{D}.eb_confidence_threshold", F32, -1.0),
    "eb_confidence_threshold NaN": _set(f"{D}.eb_confidence_threshold", F64, float("nan")),
    "eb_stability_threshold zero": _set(f"{D}.eb_stability_threshold", U32, 0),
    "eb_stability_threshold as a bool": _set(f"{D}.eb_stability_threshold", BOOL, True),
    # the task key (dgemma_engine.tasks)
    "unknown task": _set(TASK, STRING, "chess"),
    "task as an integer": _set(TASK, U32, 7),
    "task empty": _set(TASK, STRING, ""),
    "sudoku task on a text vocabulary": _set(TASK, STRING, "sudoku"),
    # hyperparameters the engine reads
    "block_count larger than the tensors": _set(f"{ARCH}.block_count", U32, 8),
    "head_count zero": _set(f"{ARCH}.attention.head_count", U32, 0),
    "rms epsilon NaN": _set(f"{ARCH}.attention.layer_norm_rms_epsilon", F32, float("nan")),
    "rms epsilon zero": _set(f"{ARCH}.attention.layer_norm_rms_epsilon", F32, 0.0),
    "rope freq_base zero": _set(f"{ARCH}.rope.freq_base", F32, 0.0),
    "rope freq_base NaN": _set(f"{ARCH}.rope.freq_base", F32, float("nan")),
    "logit softcapping NaN": _set(f"{ARCH}.final_logit_softcapping", F32, float("nan")),
    "logit softcapping zero": _set(f"{ARCH}.final_logit_softcapping", F32, 0.0),
    "sliding_window zero": _set(f"{ARCH}.attention.sliding_window", U32, 0),
    "expert_used_count above expert_count": _set(f"{ARCH}.expert_used_count", U32, 9),
    "context_length 2^31": _set(CTX, U32, 1 << 31),
    "canvas_length 4096 in a 1024 context": _set(f"{D}.canvas_length", U32, 4096),
    "general.type adapter": _set("general.type", STRING, "adapter"),
    "file_type unknown": _set("general.file_type", U32, 999),
}


# ---- vision projectors (applied to a projector GGUF, e.g. tiny-v's) ------------------------------------------------

V = "clip.vision"
PROJECTOR_MUTANTS: dict[str, Mutation] = {
    "unchanged": lambda kvs: kvs,
    "patch_size zero": _set(f"{V}.patch_size", U32, 0),
    "patch_size larger than the tensors": _set(f"{V}.patch_size", U32, 8),
    "head_count zero": _set(f"{V}.attention.head_count", U32, 0),
    "head_count not dividing the width": _set(f"{V}.attention.head_count", U32, 3),
    "head_count_kv zero": _set(f"{V}.attention.head_count_kv", U32, 0),
    "head_dim zero": _set(f"{V}.attention.head_dim", U32, 0),
    "head_dim not a multiple of 4": _set(f"{V}.attention.head_dim", U32, 6),
    "layer_norm_epsilon NaN": _set(f"{V}.attention.layer_norm_epsilon", F32, float("nan")),
    "layer_norm_epsilon missing": _drop(f"{V}.attention.layer_norm_epsilon"),
    "layer_norm_epsilon as an integer": _set(f"{V}.attention.layer_norm_epsilon", U32, 1),
    "block_count larger than the tensors": _set(f"{V}.block_count", U32, 3),
    "block_count smaller than the tensors": _set(f"{V}.block_count", U32, 1),
    "block_count zero": _set(f"{V}.block_count", U32, 0),
    "embedding_length not the tensors'": _set(f"{V}.embedding_length", U32, 48),
    "feed_forward_length not the tensors'": _set(f"{V}.feed_forward_length", U32, 48),
    "feed_forward_length missing": _drop(f"{V}.feed_forward_length"),
    "projection_dim not the model's": _set(f"{V}.projection_dim", U32, 32),
    "projection_dim zero": _set(f"{V}.projection_dim", U32, 0),
    "pooling zero": _set(f"{V}.projector.scale_factor", U32, 0),
    "max_soft_tokens zero": _set("dgemma.vision.max_soft_tokens", U32, 0),
    "max_soft_tokens larger than the context": _set("dgemma.vision.max_soft_tokens", U32, 4096),
    "max_soft_tokens as a string": _set("dgemma.vision.max_soft_tokens", STRING, "70"),
    "rope freq_base NaN": _set("dgemma.vision.rope.freq_base", F32, float("nan")),
    "rope freq_base zero": _set("dgemma.vision.rope.freq_base", F32, 0.0),
    "no vision encoder": _set("clip.has_vision_encoder", BOOL, False),
    "vision encoder flag missing": _drop("clip.has_vision_encoder"),
    "projector type mlp": _set("clip.projector_type", STRING, "mlp"),
    "projector type missing": _drop("clip.projector_type"),
    "an extra unknown key": _set("dgemma.fuzz.extra", STRING, "hello"),
}


def mutate(src: Path, dst: Path, name: str, mutants: dict[str, Mutation] | None = None) -> Path:
    """`src` with the mutation `name` of `mutants` (default MUTANTS; PROJECTOR_MUTANTS for a projector) applied."""
    kvs, tensors = read(src)
    return write(dst, (MUTANTS if mutants is None else mutants)[name]([replace(kv) for kv in kvs]), tensors)
