"""The GGUF key/value metadata of a DiffusionGemma file (docs/gguf.md#metadata-keys, #tokenizer-keys): 44 keys + 6
sampler keys."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from gguf import GGML_QUANT_VERSION, GGUFValueType as V, size_label as gguf_size_label

from dgemma_convert.hf_config import ModelConfig, SamplerValues
from dgemma_convert.tensor_map import TensorSpec
from dgemma_convert.tokenizer_meta import TOKENIZER_MODEL, TokenizerMeta
from dgemma_engine.arch import ARCH
from dgemma_engine.settings import FILE_SETTINGS, SamplerSetting

# The order of the sampler keys in the files dgemma has always written (conversions stay byte-identical); a setting
# not listed here follows them.
SAMPLER_KEY_ORDER = ("max_steps", "t_min", "t_max", "entropy_bound", "stability_threshold", "confidence_threshold")


@dataclass(frozen=True)
class KeyValue:
    key: str
    value: Any
    vtype: V
    sub_type: V | None = None


def size_label(specs: Sequence[TensorSpec]) -> str:
    """gguf-py's size label ("128x2.6B" for the release): shared + per-expert parameters, times the expert count."""
    total = shared = expert = 0
    expert_counts = []
    for spec in specs:
        n = spec.n_elements
        total += n
        if "_exps." in spec.name and spec.n_dims >= 3:
            expert_counts.append(spec.ne[2])
            expert += n // spec.ne[2]
        else:
            shared += n
    count = sum(expert_counts) // len(expert_counts) if expert_counts else 0
    return gguf_size_label(total, shared, expert, count)


def build_metadata(cfg: ModelConfig, sampler: SamplerValues, tok: TokenizerMeta, *, name: str, file_type: int,
                   specs: Sequence[TensorSpec]) -> list[KeyValue]:
    a = ARCH
    kv = [
        KeyValue("general.architecture", ARCH, V.STRING),
        KeyValue("general.type", "model", V.STRING),
        KeyValue("general.name", name, V.STRING),
        KeyValue("general.size_label", size_label(specs), V.STRING),
        KeyValue("general.quantization_version", GGML_QUANT_VERSION, V.UINT32),
        KeyValue("general.file_type", int(file_type), V.UINT32),
        KeyValue(f"{a}.block_count", cfg.n_layer, V.UINT32),
        KeyValue(f"{a}.context_length", cfg.context_length, V.UINT32),
        KeyValue(f"{a}.embedding_length", cfg.n_embd, V.UINT32),
        KeyValue(f"{a}.feed_forward_length", cfg.n_ff, V.UINT32),
        KeyValue(f"{a}.expert_feed_forward_length", cfg.n_ff_exp, V.UINT32),
        KeyValue(f"{a}.expert_count", cfg.n_expert, V.UINT32),
        KeyValue(f"{a}.expert_used_count", cfg.n_expert_used, V.UINT32),
        KeyValue(f"{a}.attention.head_count", cfg.n_head, V.UINT32),
        KeyValue(f"{a}.attention.head_count_kv", [layer.n_kv_heads for layer in cfg.layers], V.ARRAY, V.INT32),
        KeyValue(f"{a}.attention.key_length", cfg.head_dim_full, V.UINT32),
        KeyValue(f"{a}.attention.value_length", cfg.head_dim_full, V.UINT32),
        KeyValue(f"{a}.attention.key_length_swa", cfg.head_dim_sliding, V.UINT32),
        KeyValue(f"{a}.attention.value_length_swa", cfg.head_dim_sliding, V.UINT32),
        KeyValue(f"{a}.attention.sliding_window", cfg.sliding_window, V.UINT32),
        # true = sliding layer, false = full layer
        KeyValue(f"{a}.attention.sliding_window_pattern", [layer.sliding for layer in cfg.layers], V.ARRAY, V.BOOL),
        KeyValue(f"{a}.attention.layer_norm_rms_epsilon", cfg.rms_eps, V.FLOAT32),
        KeyValue(f"{a}.attention.causal", False, V.BOOL),  # the graph builds its own encoder/decoder masks
        KeyValue(f"{a}.attention.shared_kv_layers", 0, V.UINT32),
        KeyValue(f"{a}.embedding_length_per_layer_input", 0, V.UINT32),
        KeyValue(f"{a}.rope.freq_base", cfg.rope_theta_full, V.FLOAT32),
        KeyValue(f"{a}.rope.freq_base_swa", cfg.rope_theta_sliding, V.FLOAT32),
        # full layers rotate the whole head with per-pair factors (rope_freqs) for the partial rotary
        KeyValue(f"{a}.rope.dimension_count", cfg.head_dim_full, V.UINT32),
        KeyValue(f"{a}.rope.dimension_count_swa", cfg.head_dim_sliding, V.UINT32),
        KeyValue(f"{a}.final_logit_softcapping", cfg.logit_softcap, V.FLOAT32),
        KeyValue("diffusion.canvas_length", cfg.canvas_length, V.UINT32),
    ]
    kv += sampler_metadata(sampler)
    kv += tokenizer_metadata(tok)
    return kv


def sampler_metadata(sampler: SamplerValues) -> list[KeyValue]:
    """One `diffusion.eb_*` key per FILE_SETTINGS row: uint32 for integers, float32 otherwise."""
    def position(setting: SamplerSetting) -> int:
        known = setting.field in SAMPLER_KEY_ORDER
        return SAMPLER_KEY_ORDER.index(setting.field) if known else len(SAMPLER_KEY_ORDER)

    return [KeyValue(s.gguf_key, sampler[s.field], V.UINT32 if s.type is int else V.FLOAT32)
            for s in sorted(FILE_SETTINGS, key=position)]


def tokenizer_metadata(tok: TokenizerMeta) -> list[KeyValue]:
    kv = [
        KeyValue("tokenizer.ggml.model", TOKENIZER_MODEL, V.STRING),
        KeyValue("tokenizer.ggml.tokens", tok.tokens, V.ARRAY, V.STRING),
        KeyValue("tokenizer.ggml.scores", tok.scores, V.ARRAY, V.FLOAT32),
        KeyValue("tokenizer.ggml.token_type", tok.token_types, V.ARRAY, V.INT32),
    ]
    if tok.merges:  # GGUF arrays cannot be empty
        kv.append(KeyValue("tokenizer.ggml.merges", tok.merges, V.ARRAY, V.STRING))
    key_of_role = {"bos": "bos_token_id", "eos": "eos_token_id", "unk": "unknown_token_id",
                   "pad": "padding_token_id", "mask": "mask_token_id"}
    for role, key in key_of_role.items():
        if role in tok.special_ids:
            kv.append(KeyValue(f"tokenizer.ggml.{key}", tok.special_ids[role], V.UINT32))
    if tok.chat_template is not None:
        kv.append(KeyValue("tokenizer.chat_template", tok.chat_template, V.STRING))
    kv += [
        KeyValue("tokenizer.ggml.add_space_prefix", False, V.BOOL),
        KeyValue("tokenizer.ggml.add_bos_token", True, V.BOOL),  # the chat template emits <bos> itself
    ]
    return kv
