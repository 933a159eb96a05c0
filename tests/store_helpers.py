"""Helpers for the store/pull/create tests: tiny GGUF files written with gguf-py, and a hand-rolled GGUF byte
builder for hostile headers that gguf-py refuses to write."""
from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np


def write_tiny_gguf(path: Path, arch: str = "diffusion-gemma", file_type: int = 0, canvas_length: int | None = 16,
                    dtype=np.float32, chat_template: str | None = None, context_length: int = 64,
                    eb_max_steps: int = 48) -> Path:
    """The smallest GGUF the engine loads: one sliding-window layer, H 8, two experts, a 16-token vocabulary,
    self-conditioning.

    Every tensor the engine binds is present with its shape, so `create`'s load check accepts it and a run can use it
    (weights are small deterministic values; the output is meaningless). `dtype` is the token embedding's type."""
    H, FF, FFE, E, HD, V = 8, 8, 8, 2, 4, 16
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(context_length)
    w.add_embedding_length(H)
    w.add_feed_forward_length(FF)
    w.add_uint32(f"{arch}.expert_feed_forward_length", FFE)
    w.add_expert_count(E)
    w.add_expert_used_count(1)
    w.add_head_count(1)
    w.add_head_count_kv(1)
    w.add_key_length(HD)
    w.add_uint32(f"{arch}.attention.key_length_swa", HD)
    w.add_sliding_window(8)
    w.add_array(f"{arch}.attention.sliding_window_pattern", [True])
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_float32(f"{arch}.rope.freq_base_swa", 10000.0)
    w.add_file_type(file_type)
    if canvas_length is not None:
        w.add_uint32("diffusion.canvas_length", canvas_length)
    w.add_uint32("diffusion.eb_max_steps", eb_max_steps)
    w.add_float32("diffusion.eb_t_max", 0.8)
    w.add_float32("diffusion.eb_t_min", 0.4)
    w.add_tokenizer_model("gemma4")
    w.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(V)])
    w.add_unk_token_id(0)  # any text encodes (as t0): create tries the tokenizer on a line
    if chat_template is not None:
        w.add_chat_template(chat_template)
    rng = np.random.default_rng(0)

    def matrix(*shape):
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    ones = np.ones(H, dtype=np.float32)
    w.add_tensor("token_embd.weight", np.arange(V * H, dtype=dtype).reshape(V, H))
    w.add_tensor("output_norm.weight", ones)
    w.add_tensor("self_cond_pre_norm.weight", ones)
    for name, shape in (("gate", (FF, H)), ("up", (FF, H)), ("down", (H, FF))):
        w.add_tensor(f"self_cond_{name}.weight", matrix(*shape))
    tensors = {
        "attn_norm.weight": ones, "attn_q.weight": matrix(HD, H), "attn_q_norm.weight": np.ones(HD, np.float32),
        "attn_k.weight": matrix(HD, H), "attn_k_norm.weight": np.ones(HD, np.float32), "attn_v.weight": matrix(HD, H),
        "attn_output.weight": matrix(H, HD), "post_attention_norm.weight": ones, "ffn_norm.weight": ones,
        "ffn_gate.weight": matrix(FF, H), "ffn_up.weight": matrix(FF, H), "ffn_down.weight": matrix(H, FF),
        "post_ffw_norm_1.weight": ones, "ffn_gate_inp.weight": matrix(E, H), "ffn_gate_inp.scale": ones,
        "pre_ffw_norm_2.weight": ones, "ffn_gate_up_exps.weight": matrix(E, 2 * FFE, H),
        "ffn_down_exps.weight": matrix(E, H, FFE), "ffn_down_exps.scale": np.ones(E, np.float32),
        "post_ffw_norm_2.weight": ones, "post_ffw_norm.weight": ones,
        "layer_output_scale.weight": np.ones(1, np.float32), "enc_layer_output_scale.weight": np.ones(1, np.float32),
    }
    for name, value in tensors.items():
        w.add_tensor(f"blk.0.{name}", value)
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


def write_tiny_projector(path: Path, n_embd_text: int = 8, max_soft_tokens: int = 16, arch: str = "clip",
                         projector_type: str = "gemma4v") -> Path:
    """The smallest vision projector the vision engine loads, in the mtmd layout (`general.architecture` "clip"): one
    block of width 32, one head, 4-pixel patches pooled 2x2, every tensor the engine binds (small deterministic
    weights: the embeddings are meaningless), so `create`'s load check accepts it and a run can encode images."""
    H, FF, P = 32, 32, 2 * max_soft_tokens  # P: position rows per axis, the longest side an image can have
    rng = np.random.default_rng(0)

    def matrix(*shape):
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    w = gguf.GGUFWriter(str(path), arch)
    w.add_type("mmproj")
    w.add_bool("clip.has_vision_encoder", True)
    w.add_string("clip.projector_type", projector_type)
    w.add_uint32("clip.vision.projection_dim", n_embd_text)
    w.add_uint32("clip.vision.embedding_length", H)
    w.add_uint32("clip.vision.feed_forward_length", FF)
    w.add_uint32("clip.vision.block_count", 1)
    w.add_uint32("clip.vision.attention.head_count", 1)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    w.add_uint32("clip.vision.patch_size", 4)
    w.add_uint32("clip.vision.projector.scale_factor", 2)
    w.add_uint32("dgemma.vision.max_soft_tokens", max_soft_tokens)
    w.add_tensor("v.patch_embd.weight", matrix(H, 3, 4, 4))
    w.add_tensor("v.position_embd.weight", matrix(2, P, H))
    ones = np.ones(H, np.float32)
    for name in ("ln1", "attn_q_norm", "attn_k_norm", "attn_post_norm", "ln2", "ffn_post_norm"):
        w.add_tensor(f"v.blk.0.{name}.weight", ones)
    for name, shape in (("attn_q", (H, H)), ("attn_k", (H, H)), ("attn_v", (H, H)), ("attn_out", (H, H)),
                        ("ffn_gate", (FF, H)), ("ffn_up", (FF, H)), ("ffn_down", (H, FF))):
        w.add_tensor(f"v.blk.0.{name}.weight", matrix(*shape))
    w.add_tensor("mm.input_projection.weight", matrix(n_embd_text, H))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
