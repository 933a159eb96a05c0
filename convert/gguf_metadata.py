"""The GGUF key/value metadata of a DiffusionGemma file (docs/gguf.md#metadata-keys, #tokenizer-keys): 44 keys + 6
sampler keys."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from gguf import GGML_QUANT_VERSION, GGUFValueType as V, size_label as gguf_size_label

from dgemma_convert.hf_config import ModelConfig, SamplerValues
from dgemma_convert.tensor_map import TensorSpec
from dgemma_convert.tokenizer_meta import TOKENIZER_MODEL, TokenizerMeta
from dgemma_engine import gguf_keys
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
    kv = [
        KeyValue(gguf_keys.KEY_ARCHITECTURE, ARCH, V.STRING),
        KeyValue(gguf_keys.KEY_GENERAL_TYPE, "model", V.STRING),
        KeyValue(gguf_keys.KEY_NAME, name, V.STRING),
        KeyValue(gguf_keys.KEY_SIZE_LABEL, size_label(specs), V.STRING),
        KeyValue(gguf_keys.KEY_QUANTIZATION_VERSION, GGML_QUANT_VERSION, V.UINT32),
        KeyValue(gguf_keys.KEY_FILE_TYPE, int(file_type), V.UINT32),
        KeyValue(gguf_keys.KEY_BLOCK_COUNT, cfg.n_layer, V.UINT32),
        KeyValue(gguf_keys.KEY_CONTEXT_LENGTH, cfg.context_length, V.UINT32),
        KeyValue(gguf_keys.KEY_EMBEDDING_LENGTH, cfg.n_embd, V.UINT32),
        KeyValue(gguf_keys.KEY_FEED_FORWARD_LENGTH, cfg.n_ff, V.UINT32),
        KeyValue(gguf_keys.KEY_EXPERT_FEED_FORWARD_LENGTH, cfg.n_ff_exp, V.UINT32),
        KeyValue(gguf_keys.KEY_EXPERT_COUNT, cfg.n_expert, V.UINT32),
        KeyValue(gguf_keys.KEY_EXPERT_USED_COUNT, cfg.n_expert_used, V.UINT32),
        KeyValue(gguf_keys.KEY_HEAD_COUNT, cfg.n_head, V.UINT32),
        KeyValue(gguf_keys.KEY_HEAD_COUNT_KV, [layer.n_kv_heads for layer in cfg.layers], V.ARRAY, V.INT32),
        KeyValue(gguf_keys.KEY_KEY_LENGTH, cfg.head_dim_full, V.UINT32),
        KeyValue(gguf_keys.KEY_VALUE_LENGTH, cfg.head_dim_full, V.UINT32),
        KeyValue(gguf_keys.KEY_KEY_LENGTH_SWA, cfg.head_dim_sliding, V.UINT32),
        KeyValue(gguf_keys.KEY_VALUE_LENGTH_SWA, cfg.head_dim_sliding, V.UINT32),
        KeyValue(gguf_keys.KEY_SLIDING_WINDOW, cfg.sliding_window, V.UINT32),
        # true = sliding layer, false = full layer
        KeyValue(gguf_keys.KEY_SLIDING_WINDOW_PATTERN, [layer.sliding for layer in cfg.layers], V.ARRAY, V.BOOL),
        KeyValue(gguf_keys.KEY_RMS_EPS, cfg.rms_eps, V.FLOAT32),
        KeyValue(gguf_keys.KEY_CAUSAL, False, V.BOOL),  # the graph builds its own encoder/decoder masks
        KeyValue(gguf_keys.KEY_SHARED_KV_LAYERS, 0, V.UINT32),
        KeyValue(gguf_keys.KEY_EMBEDDING_LENGTH_PER_LAYER_INPUT, 0, V.UINT32),
        KeyValue(gguf_keys.KEY_ROPE_FREQ_BASE, cfg.rope_theta_full, V.FLOAT32),
        KeyValue(gguf_keys.KEY_ROPE_FREQ_BASE_SWA, cfg.rope_theta_sliding, V.FLOAT32),
        # full layers rotate the whole head with per-pair factors (rope_freqs) for the partial rotary
        KeyValue(gguf_keys.KEY_ROPE_DIMENSION_COUNT, cfg.head_dim_full, V.UINT32),
        KeyValue(gguf_keys.KEY_ROPE_DIMENSION_COUNT_SWA, cfg.head_dim_sliding, V.UINT32),
        KeyValue(gguf_keys.KEY_LOGIT_SOFTCAP, cfg.logit_softcap, V.FLOAT32),
        KeyValue(gguf_keys.KEY_CANVAS_LENGTH, cfg.canvas_length, V.UINT32),
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
        KeyValue(gguf_keys.KEY_TOKENIZER_MODEL, TOKENIZER_MODEL, V.STRING),
        KeyValue(gguf_keys.KEY_TOKENS, tok.tokens, V.ARRAY, V.STRING),
        KeyValue(gguf_keys.KEY_SCORES, tok.scores, V.ARRAY, V.FLOAT32),
        KeyValue(gguf_keys.KEY_TOKEN_TYPE, tok.token_types, V.ARRAY, V.INT32),
    ]
    if tok.merges:  # GGUF arrays cannot be empty
        kv.append(KeyValue(gguf_keys.KEY_MERGES, tok.merges, V.ARRAY, V.STRING))
    for role, key in gguf_keys.SPECIAL_TOKEN_KEYS.items():
        if role in tok.special_ids:
            kv.append(KeyValue(key, tok.special_ids[role], V.UINT32))
    if tok.chat_template is not None:
        kv.append(KeyValue(gguf_keys.KEY_CHAT_TEMPLATE, tok.chat_template, V.STRING))
    kv += [
        KeyValue(gguf_keys.KEY_ADD_SPACE_PREFIX, False, V.BOOL),
        KeyValue(gguf_keys.KEY_ADD_BOS, True, V.BOOL),  # the chat template emits <bos> itself
    ]
    return kv
