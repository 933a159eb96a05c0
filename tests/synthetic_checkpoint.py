"""Synthetic DiffusionGemma checkpoints written without torch (tests and bench/convert_memory.py).

The tensor list follows docs/model.md#hf-checkpoint-tensors (HF names and shapes), independently of the converter's own
mapping. Tensors are generated and written one at a time, so even multi-GB checkpoints are produced with little memory.
"""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Iterator

import numpy as np

SLIDING, FULL = "sliding_attention", "full_attention"
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]


def text_config(**overrides) -> dict:
    """A small MoE text config whose widths are K-quant friendly (multiples of 256) except FFe (a multiple of 32)."""
    cfg = dict(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=96,
               num_hidden_layers=2, layer_types=[SLIDING, FULL], num_attention_heads=2, num_key_value_heads=1,
               head_dim=128, global_head_dim=256, num_global_key_value_heads=1, num_experts=2, top_k_experts=1,
               sliding_window=8, max_position_embeddings=1024, rms_norm_eps=1e-6, pad_token_id=0, eos_token_id=1,
               bos_token_id=2, model_type="diffusion_gemma_text")
    cfg.update(overrides)
    return cfg


def hf_tensors(text: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every checkpoint tensor, per docs/model.md#hf-checkpoint-tensors, plus one vision tensor to be
    dropped."""
    H, FF, FFe, E = text["hidden_size"], text["intermediate_size"], text["moe_intermediate_size"], text["num_experts"]
    nH, V = text["num_attention_heads"], text["vocab_size"]
    d = "model.decoder."
    out = [(d + "embed_tokens.weight", (V, H)), (d + "norm.weight", (H,))]
    out += [(d + "self_conditioning.pre_norm.weight", (H,)), (d + "self_conditioning.gate_proj.weight", (FF, H)),
            (d + "self_conditioning.up_proj.weight", (FF, H)), (d + "self_conditioning.down_proj.weight", (H, FF))]
    for i, kind in enumerate(text["layer_types"]):
        full = kind == FULL
        hd = text["global_head_dim"] if full else text["head_dim"]
        kv = text["num_global_key_value_heads"] if full else text["num_key_value_heads"]
        p = f"{d}layers.{i}."
        out += [(p + "input_layernorm.weight", (H,)), (p + "self_attn.q_proj.weight", (nH * hd, H)),
                (p + "self_attn.k_proj.weight", (kv * hd, H)), (p + "self_attn.o_proj.weight", (H, nH * hd)),
                (p + "self_attn.q_norm.weight", (hd,)), (p + "self_attn.k_norm.weight", (hd,)),
                (p + "post_attention_layernorm.weight", (H,)), (p + "pre_feedforward_layernorm.weight", (H,)),
                (p + "mlp.gate_proj.weight", (FF, H)), (p + "mlp.up_proj.weight", (FF, H)),
                (p + "mlp.down_proj.weight", (H, FF)), (p + "post_feedforward_layernorm_1.weight", (H,)),
                (p + "router.proj.weight", (E, H)), (p + "router.scale", (H,)), (p + "router.per_expert_scale", (E,)),
                (p + "pre_feedforward_layernorm_2.weight", (H,)), (p + "experts.gate_up_proj", (E, 2 * FFe, H)),
                (p + "experts.down_proj", (E, H, FFe)), (p + "post_feedforward_layernorm_2.weight", (H,)),
                (p + "post_feedforward_layernorm.weight", (H,)), (p + "layer_scalar", (1,)),
                (f"model.encoder.language_model.layers.{i}.layer_scalar", (1,))]
        if not full:
            out.append((p + "self_attn.v_proj.weight", (kv * hd, H)))
    out.append(("model.encoder.vision_tower.patch_embedder.input_proj.weight", (8, 12)))
    return out


def _values(name: str, shape: tuple[int, ...], rng: np.random.Generator, chunk: int) -> Iterator[np.ndarray]:
    """float32 values in chunks: norms/scales near 1, weights Gaussian."""
    n = math.prod(shape)
    for start in range(0, n, chunk):
        size = min(chunk, n - start)
        if len(shape) == 1:
            yield (1.0 + 0.3 * rng.standard_normal(size)).astype(np.float32)
        else:
            yield rng.standard_normal(size, dtype=np.float32)


def _fast_bf16(name: str, shape: tuple[int, ...], rng: np.random.Generator, chunk: int) -> Iterator[np.ndarray]:
    """Random bf16 bit patterns with magnitudes in [2^-7, 1): fast enough for multi-GB benchmark checkpoints."""
    n = math.prod(shape)
    for start in range(0, n, chunk):
        size = min(chunk, n - start)
        bits = rng.integers(0x3C00, 0x3F80, size, dtype=np.uint16)
        bits |= (rng.integers(0, 2, size, dtype=np.uint16) << 15)
        yield bits


def write_safetensors(path: Path, tensors: list[tuple[str, tuple[int, ...]]], dtype: str, rng: np.random.Generator,
                      fast: bool = False, chunk: int = 1 << 22) -> None:
    """Write one safetensors file, header first, then each tensor's data chunk by chunk."""
    size = {"F32": 4, "BF16": 2}[dtype]
    header, offset = {}, 0
    for name, shape in tensors:
        nbytes = math.prod(shape) * size
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for name, shape in tensors:
            if fast and dtype == "BF16" and len(shape) > 1:
                chunks = _fast_bf16(name, shape, rng, chunk)
            else:
                chunks = _values(name, shape, rng, chunk)
            for values in chunks:
                if values.dtype == np.uint16:
                    f.write(values.tobytes())
                elif dtype == "F32":
                    f.write(values.astype("<f4").tobytes())
                else:  # bf16 by truncation is fine for synthetic data
                    f.write((values.view(np.uint32) >> 16).astype("<u2").tobytes())


def write_synthetic_tokenizer(out_dir: Path, n_tokens: int) -> None:
    """A byte-fallback BPE tokenizer.json with exactly n_tokens tokens (specials, 256 bytes, filler pieces)."""
    vocab = {t: i for i, t in enumerate(SPECIALS)}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    letters = "abcdefghijklmnopqrstuvwxyz"
    for c in letters + "▁":
        vocab[c] = len(vocab)
    merges = [[a, b] for a in letters[:4] for b in letters[:4]]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    i = 0
    while len(vocab) < n_tokens:
        vocab[f"▁w{i}"] = len(vocab)
        i += 1
    added = [{"id": i, "content": t, "special": True, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False} for i, t in enumerate(SPECIALS)]
    tokenizer = {"version": "1.0", "added_tokens": added, "normalizer": None, "pre_tokenizer": None,
                 "decoder": {"type": "Sequence", "decoders": []},
                 "model": {"type": "BPE", "byte_fallback": True, "vocab": vocab, "merges": merges}}
    (out_dir / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>", "pad_token": "<pad>",
         "mask_token": "<mask>"}))
    (out_dir / "chat_template.jinja").write_text("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}")


def write_config(out_dir: Path, text: dict, canvas_length: int = 16) -> None:
    config = {"architectures": ["DiffusionGemmaForBlockDiffusion"], "model_type": "diffusion_gemma",
              "canvas_length": canvas_length, "tie_word_embeddings": True, "text_config": text,
              "vision_config": {"model_type": "gemma4_vision"}}
    (out_dir / "config.json").write_text(json.dumps(config, indent=1))
    (out_dir / "generation_config.json").write_text(json.dumps(
        {"max_denoising_steps": 48, "t_min": 0.4, "t_max": 0.8, "stability_threshold": 1,
         "confidence_threshold": 0.005,
         "sampler_config": {"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": 0.1}}))


def write_synthetic_checkpoint(out_dir: Path, text: dict, *, dtype: str = "F32", n_shards: int = 1, seed: int = 0,
                               tokenizer_from: Path | None = None, n_tokens: int | None = None,
                               fast: bool = False) -> Path:
    """config + tokenizer + weights (single file, or n_shards shards with an index)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    write_config(out_dir, text)
    if tokenizer_from is not None:
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            if (tokenizer_from / name).exists():
                shutil.copy(tokenizer_from / name, out_dir / name)
    else:
        write_synthetic_tokenizer(out_dir, n_tokens or text["vocab_size"])
    rng = np.random.default_rng(seed)
    tensors = hf_tensors(text)
    if n_shards == 1:
        write_safetensors(out_dir / "model.safetensors", tensors, dtype, rng, fast)
        return out_dir
    weight_map = {}
    per_shard = math.ceil(len(tensors) / n_shards)
    for k in range(n_shards):
        part = tensors[k * per_shard:(k + 1) * per_shard]
        shard = f"model-{k + 1:05d}-of-{n_shards:05d}.safetensors"
        write_safetensors(out_dir / shard, part, dtype, rng, fast)
        weight_map.update({name: shard for name, _ in part})
    (out_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out_dir
