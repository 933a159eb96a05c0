"""HF tensor names -> GGUF tensor names and shapes (llama.cpp PR #24423 layout,
docs/gguf.md#tensor-table, #rope_freqs, #dropped-and-generated-tensors, #type-policy).

`tensor_specs(cfg, n_tokens)` lists every tensor the GGUF must contain for a config, in the order the Unsloth files
use (the global tensors, then blk.0, blk.1, ...; alphabetical inside each group). Each spec names its checkpoint
source and the exact checkpoint shape the config implies, so a checkpoint that contradicts its config is caught
before anything is written. Values are copied unchanged: no +1 on norms, no folded scales, no permutes.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as T

from dgemma_convert.errors import ConvertError
from dgemma_convert.hf_config import ModelConfig

DECODER = "model.decoder."
ENCODER_SCALAR = re.compile(r"model\.encoder\.language_model\.layers\.(\d+)\.layer_scalar")
ROPE_FREQ_OFF = 1e30  # ggml divides a pair's angle by its factor: 1e30 stops the pair from rotating


@dataclass(frozen=True)
class TensorSpec:
    name: str  # GGUF name
    source: str | None  # checkpoint tensor name; None for a generated tensor
    hf_shape: tuple[int, ...]  # shape the checkpoint must have (torch order)
    ne: tuple[int, ...]  # GGUF shape, ggml order (fastest dimension first)

    @property
    def n_dims(self) -> int:
        return len(self.ne)

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.ne))


def _spec(name: str, source: str | None, hf_shape: tuple[int, ...], n_rows: int | None = None) -> TensorSpec:
    ne = tuple(reversed(hf_shape)) if hf_shape else (1,)
    if n_rows is not None:  # token_embd / output keep only the tokenizer's rows
        ne = (ne[0], n_rows)
    return TensorSpec(name, source, hf_shape, ne)


def _global_specs(cfg: ModelConfig, n_tokens: int) -> list[TensorSpec]:
    H, FF = cfg.n_embd, cfg.n_ff
    sc = DECODER + "self_conditioning."
    specs = [
        _spec("token_embd.weight", DECODER + "embed_tokens.weight", (cfg.n_vocab, H), n_rows=n_tokens),
        _spec("output_norm.weight", DECODER + "norm.weight", (H,)),
        _spec("rope_freqs.weight", None, (cfg.head_dim_full // 2,)),
        _spec("self_cond_pre_norm.weight", sc + "pre_norm.weight", (H,)),
        _spec("self_cond_gate.weight", sc + "gate_proj.weight", (FF, H)),
        _spec("self_cond_up.weight", sc + "up_proj.weight", (FF, H)),
        _spec("self_cond_down.weight", sc + "down_proj.weight", (H, FF)),
    ]
    if not cfg.tie_word_embeddings:  # untied head (not the release): written, and optional for loaders
        specs.append(_spec("output.weight", "lm_head.weight", (cfg.n_vocab, H), n_rows=n_tokens))
    return sorted(specs, key=lambda s: s.name)


def _block_specs(cfg: ModelConfig, i: int) -> list[TensorSpec]:
    layer = cfg.layers[i]
    H, hd, nH, nKV = cfg.n_embd, layer.head_dim, cfg.n_head, layer.n_kv_heads
    E, FF, FFe = cfg.n_expert, cfg.n_ff, cfg.n_ff_exp
    src = f"{DECODER}layers.{i}."
    blk = f"blk.{i}."
    specs = [
        _spec(blk + "attn_norm.weight", src + "input_layernorm.weight", (H,)),
        _spec(blk + "attn_q.weight", src + "self_attn.q_proj.weight", (nH * hd, H)),
        _spec(blk + "attn_q_norm.weight", src + "self_attn.q_norm.weight", (hd,)),
        _spec(blk + "attn_k.weight", src + "self_attn.k_proj.weight", (nKV * hd, H)),
        _spec(blk + "attn_k_norm.weight", src + "self_attn.k_norm.weight", (hd,)),
        _spec(blk + "attn_output.weight", src + "self_attn.o_proj.weight", (H, nH * hd)),
        _spec(blk + "post_attention_norm.weight", src + "post_attention_layernorm.weight", (H,)),
        _spec(blk + "ffn_norm.weight", src + "pre_feedforward_layernorm.weight", (H,)),
        _spec(blk + "ffn_gate.weight", src + "mlp.gate_proj.weight", (FF, H)),
        _spec(blk + "ffn_up.weight", src + "mlp.up_proj.weight", (FF, H)),
        _spec(blk + "ffn_down.weight", src + "mlp.down_proj.weight", (H, FF)),
        _spec(blk + "post_ffw_norm_1.weight", src + "post_feedforward_layernorm_1.weight", (H,)),
        _spec(blk + "ffn_gate_inp.weight", src + "router.proj.weight", (E, H)),
        _spec(blk + "ffn_gate_inp.scale", src + "router.scale", (H,)),
        _spec(blk + "pre_ffw_norm_2.weight", src + "pre_feedforward_layernorm_2.weight", (H,)),
        _spec(blk + "ffn_gate_up_exps.weight", src + "experts.gate_up_proj", (E, 2 * FFe, H)),
        _spec(blk + "ffn_down_exps.weight", src + "experts.down_proj", (E, H, FFe)),
        _spec(blk + "ffn_down_exps.scale", src + "router.per_expert_scale", (E,)),
        _spec(blk + "post_ffw_norm_2.weight", src + "post_feedforward_layernorm_2.weight", (H,)),
        _spec(blk + "post_ffw_norm.weight", src + "post_feedforward_layernorm.weight", (H,)),
        _spec(blk + "layer_output_scale.weight", src + "layer_scalar", (1,)),
        _spec(blk + "enc_layer_output_scale.weight", f"model.encoder.language_model.layers.{i}.layer_scalar", (1,)),
    ]
    if layer.sliding:  # full layers have no v_proj: V is the raw K projection there
        specs.append(_spec(blk + "attn_v.weight", src + "self_attn.v_proj.weight", (nKV * hd, H)))
    return sorted(specs, key=lambda s: s.name)


def tensor_specs(cfg: ModelConfig, n_tokens: int) -> list[TensorSpec]:
    """Every GGUF tensor for this config, in file order. `n_tokens` = tokenizer size (token_embd rows)."""
    if n_tokens > cfg.n_vocab:
        raise ConvertError(f"the tokenizer has {n_tokens} tokens but the embedding has only vocab_size = "
                           f"{cfg.n_vocab} rows")
    specs = _global_specs(cfg, n_tokens)
    for i in range(cfg.n_layer):
        specs.extend(_block_specs(cfg, i))
    return specs


def rope_freqs(cfg: ModelConfig) -> np.ndarray:
    """Frequency factors of full layers: 1.0 for the rotated pairs, 1e30 (no rotation) for the rest
    (docs/gguf.md#rope_freqs)."""
    n_pairs = cfg.head_dim_full // 2
    a = cfg.n_rot_full_pairs
    return np.array([1.0] * a + [ROPE_FREQ_OFF] * (n_pairs - a), dtype=np.float32)


def is_dropped(source_name: str, cfg: ModelConfig) -> bool:
    """Checkpoint tensors that are deliberately not converted (docs/gguf.md#dropped-and-generated-tensors): vision, tied
    duplicates, a tied lm_head."""
    if source_name.startswith(("model.encoder.vision_tower.", "model.encoder.embed_vision.")):
        return True
    if source_name.startswith("model.encoder.language_model.") and not ENCODER_SCALAR.fullmatch(source_name):
        return True  # tied copies of decoder weights in some exports
    return source_name == "lm_head.weight" and cfg.tie_word_embeddings


def source_shape_matches(spec: TensorSpec, shape: tuple[int, ...]) -> bool:
    if spec.hf_shape == (1,):  # layer scalars: [1] on disk, or a 0-d scalar in some exports
        return shape in ((1,), ())
    return shape == spec.hf_shape


def float_type(spec: TensorSpec, out: T) -> T:
    """Float conversion policy (docs/gguf.md#type-policy): weights of >= 2 dims get the out type, except the router; the
    rest is F32."""
    if spec.n_dims >= 2 and spec.name.endswith(".weight") and not spec.name.endswith("ffn_gate_inp.weight"):
        return out
    return T.F32


def is_quantizable(spec: TensorSpec) -> bool:
    """llama-quantize's filter (docs/gguf.md#type-policy rule 1): norms, scales, scalars, rope_freqs and the router stay
    F32."""
    name = spec.name
    return (spec.n_dims >= 2 and name.endswith("weight") and not name.endswith("_norm.weight")
            and not name.endswith("ffn_gate_inp.weight"))
