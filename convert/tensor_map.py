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


# The HF -> GGUF name map, written once: the converter's specs and the LoRA converter's target lookup use it.
# Global tensors: GGUF name -> checkpoint name.
GLOBAL_SOURCES = {
    "token_embd.weight": DECODER + "embed_tokens.weight",
    "output_norm.weight": DECODER + "norm.weight",
    "self_cond_pre_norm.weight": DECODER + "self_conditioning.pre_norm.weight",
    "self_cond_gate.weight": DECODER + "self_conditioning.gate_proj.weight",
    "self_cond_up.weight": DECODER + "self_conditioning.up_proj.weight",
    "self_cond_down.weight": DECODER + "self_conditioning.down_proj.weight",
    "output.weight": "lm_head.weight",
}
# Block tensors: GGUF name after `blk.N.` -> checkpoint name after `model.decoder.layers.N.`.
BLOCK_SOURCES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "post_ffw_norm_1.weight": "post_feedforward_layernorm_1.weight",
    "ffn_gate_inp.weight": "router.proj.weight",
    "ffn_gate_inp.scale": "router.scale",
    "pre_ffw_norm_2.weight": "pre_feedforward_layernorm_2.weight",
    "ffn_gate_up_exps.weight": "experts.gate_up_proj",
    "ffn_down_exps.weight": "experts.down_proj",
    "ffn_down_exps.scale": "router.per_expert_scale",
    "post_ffw_norm_2.weight": "post_feedforward_layernorm_2.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "layer_output_scale.weight": "layer_scalar",
}
_BLOCK_SOURCE = re.compile(re.escape(DECODER) + r"layers\.(\d+)\.(.+)")
_GGUF_OF_GLOBAL = {source: name for name, source in GLOBAL_SOURCES.items()}
_GGUF_OF_BLOCK = {source: name for name, source in BLOCK_SOURCES.items()}


def gguf_name_of_source(source: str) -> str | None:
    """The GGUF name of a decoder checkpoint tensor (`model.decoder.layers.3.self_attn.q_proj.weight` ->
    `blk.3.attn_q.weight`), None for a name the layout does not have."""
    if source in _GGUF_OF_GLOBAL:
        return _GGUF_OF_GLOBAL[source]
    match = _BLOCK_SOURCE.fullmatch(source)
    if match is None or match.group(2) not in _GGUF_OF_BLOCK:
        return None
    return f"blk.{int(match.group(1))}.{_GGUF_OF_BLOCK[match.group(2)]}"


def _global_specs(cfg: ModelConfig, n_tokens: int) -> list[TensorSpec]:
    H, FF = cfg.n_embd, cfg.n_ff

    def g(name: str, hf_shape: tuple[int, ...], n_rows: int | None = None) -> TensorSpec:
        return _spec(name, GLOBAL_SOURCES[name], hf_shape, n_rows)

    specs = [
        g("token_embd.weight", (cfg.n_vocab, H), n_rows=n_tokens),
        g("output_norm.weight", (H,)),
        _spec("rope_freqs.weight", None, (cfg.head_dim_full // 2,)),
        g("self_cond_pre_norm.weight", (H,)),
        g("self_cond_gate.weight", (FF, H)),
        g("self_cond_up.weight", (FF, H)),
        g("self_cond_down.weight", (H, FF)),
    ]
    if not cfg.tie_word_embeddings:  # untied head (not the release): written, and optional for loaders
        specs.append(g("output.weight", (cfg.n_vocab, H), n_rows=n_tokens))
    return sorted(specs, key=lambda s: s.name)


def _block_specs(cfg: ModelConfig, i: int) -> list[TensorSpec]:
    layer = cfg.layers[i]
    H, hd, nH, nKV = cfg.n_embd, layer.head_dim, cfg.n_head, layer.n_kv_heads
    E, FF, FFe = cfg.n_expert, cfg.n_ff, cfg.n_ff_exp

    def b(name: str, hf_shape: tuple[int, ...]) -> TensorSpec:
        return _spec(f"blk.{i}.{name}", f"{DECODER}layers.{i}.{BLOCK_SOURCES[name]}", hf_shape)

    specs = [
        b("attn_norm.weight", (H,)),
        b("attn_q.weight", (nH * hd, H)),
        b("attn_q_norm.weight", (hd,)),
        b("attn_k.weight", (nKV * hd, H)),
        b("attn_k_norm.weight", (hd,)),
        b("attn_output.weight", (H, nH * hd)),
        b("post_attention_norm.weight", (H,)),
        b("ffn_norm.weight", (H,)),
        b("ffn_gate.weight", (FF, H)),
        b("ffn_up.weight", (FF, H)),
        b("ffn_down.weight", (H, FF)),
        b("post_ffw_norm_1.weight", (H,)),
        b("ffn_gate_inp.weight", (E, H)),
        b("ffn_gate_inp.scale", (H,)),
        b("pre_ffw_norm_2.weight", (H,)),
        b("ffn_gate_up_exps.weight", (E, 2 * FFe, H)),
        b("ffn_down_exps.weight", (E, H, FFe)),
        b("ffn_down_exps.scale", (E,)),
        b("post_ffw_norm_2.weight", (H,)),
        b("post_ffw_norm.weight", (H,)),
        b("layer_output_scale.weight", (1,)),
        _spec(f"blk.{i}.enc_layer_output_scale.weight", f"model.encoder.language_model.layers.{i}.layer_scalar", (1,)),
    ]
    if layer.sliding:  # full layers have no v_proj: V is the raw K projection there
        specs.append(b("attn_v.weight", (nKV * hd, H)))
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
