"""Helpers for the store/pull/create tests: tiny GGUF files written with gguf-py, and a hand-rolled GGUF byte
builder for hostile headers that gguf-py refuses to write."""
from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np


def write_tiny_gguf(path: Path, arch: str = "diffusion-gemma", file_type: int = 0, canvas_length: int | None = 16,
                    dtype=np.float32, chat_template: str | None = None) -> Path:
    """A small but well-formed GGUF: a few metadata keys and two tensors (element count 16*8 + 8 = 136)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_file_type(file_type)
    if canvas_length is not None:
        w.add_uint32("diffusion.canvas_length", canvas_length)
    w.add_uint32("diffusion.eb_max_steps", 48)
    w.add_float32("diffusion.eb_t_max", 0.8)
    w.add_float32("diffusion.eb_t_min", 0.4)
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(16)])
    if chat_template is not None:
        w.add_chat_template(chat_template)
    w.add_tensor("token_embd.weight", np.arange(16 * 8, dtype=dtype).reshape(16, 8))
    w.add_tensor("output_norm.weight", np.ones(8, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tiny_gguf_bytes(tmp_path: Path, **kwargs) -> bytes:
    return write_tiny_gguf(tmp_path / "tiny-helper.gguf", **kwargs).read_bytes()


# ---- raw GGUF bytes ------------------------------------------------------------------------------------------------

def gstr(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def kv_u32(key: str, value: int) -> bytes:
    return gstr(key) + struct.pack("<I", 4) + struct.pack("<I", value)


def kv_str(key: str, value: str) -> bytes:
    return gstr(key) + struct.pack("<I", 8) + gstr(value)


def tensor_info(name: str, shape: tuple[int, ...], ggml_type: int = 0, offset: int = 0, n_dims: int | None = None) -> bytes:
    n = len(shape) if n_dims is None else n_dims
    return gstr(name) + struct.pack("<I", n) + b"".join(struct.pack("<Q", d) for d in shape) + struct.pack("<IQ", ggml_type, offset)


def raw_gguf(kvs: list[bytes], tensors: list[bytes], data: bytes = b"", version: int = 3,
             n_kv: int | None = None, n_tensors: int | None = None, alignment: int = 32) -> bytes:
    """Assemble a GGUF from pre-encoded pieces; counts can be forged."""
    head = b"GGUF" + struct.pack("<IQQ", version, len(tensors) if n_tensors is None else n_tensors,
                                 len(kvs) if n_kv is None else n_kv)
    body = head + b"".join(kvs) + b"".join(tensors)
    pad = (-len(body)) % alignment
    return body + b"\0" * pad + data


def valid_raw_gguf() -> bytes:
    """A minimal valid diffusion-gemma GGUF built by hand (one F32 tensor of 8 elements)."""
    kvs = [kv_str("general.architecture", "diffusion-gemma"), kv_u32("diffusion.canvas_length", 16)]
    return raw_gguf(kvs, [tensor_info("a.weight", (8,))], data=b"\0" * 32)
