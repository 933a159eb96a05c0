"""Read a DiffusionGemma `config.json` (both serialized forms) and `generation_config.json`.

The released `config.json` (form A) describes full-attention layers with `global_head_dim` /
`num_global_key_value_heads`; configs re-saved by newer transformers (form B) carry a `per_layer_config` mapping of
layer index -> overrides instead. Both resolve to the same per-layer geometry (docs/model.md#per-layer-geometry).
Everything here is validated: a wrong type, a missing required key or an unsupported feature is a ConvertError, never a
KeyError later.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dgemma_convert.errors import ConvertError
from dgemma_engine.settings import FILE_SETTINGS, released_defaults

MODEL_TYPE = "diffusion_gemma"
TEXT_MODEL_TYPE = "diffusion_gemma_text"
SLIDING, FULL = "sliding_attention", "full_attention"

# Class defaults of transformers' DiffusionGemmaTextConfig / DiffusionGemmaConfig, used for absent keys.
DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}
DEFAULT_GLOBAL_HEAD_DIM = 512
DEFAULT_SLIDING_PATTERN = 6  # without `layer_types`, every 6th layer is full attention
_MISSING = object()


@dataclass(frozen=True)
class LayerGeometry:
    sliding: bool
    head_dim: int
    n_kv_heads: int


@dataclass(frozen=True)
class ModelConfig:
    """The text model's hyper-parameters, resolved per layer."""

    n_vocab: int
    n_embd: int
    n_ff: int  # dense MLP width (also the self-conditioning MLP width)
    n_ff_exp: int  # per-expert width
    n_head: int
    n_expert: int
    n_expert_used: int
    layers: tuple[LayerGeometry, ...]
    sliding_window: int
    context_length: int
    rms_eps: float
    rope_theta_full: float
    rope_theta_sliding: float
    partial_rotary_full: float
    logit_softcap: float
    canvas_length: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None
    default_head_dim: int  # `head_dim` of the config: the sliding head size when no layer is sliding

    @property
    def n_layer(self) -> int:
        return len(self.layers)

    @property
    def head_dim_full(self) -> int:
        return next(layer.head_dim for layer in self.layers if not layer.sliding)

    @property
    def head_dim_sliding(self) -> int:
        return next((layer.head_dim for layer in self.layers if layer.sliding), self.default_head_dim)

    @property
    def n_rot_full_pairs(self) -> int:
        """Rotated (frequency, frequency + hd/2) pairs of a full layer: floor(partial · hd_full / 2)."""
        return int(math.floor(self.partial_rotary_full * self.head_dim_full / 2))


# Sampler settings by SamplerParams field name (dgemma_engine.settings), as read from generation_config.json.
SamplerValues = dict[str, int | float]


# ----------------------------------------------------------------------------------------------------------------
# typed access to JSON values


def _get(obj: dict[str, Any], key: str, where: str, default: Any = _MISSING) -> Any:
    value = obj.get(key, _MISSING)
    if value is _MISSING or (value is None and default is not _MISSING):
        if default is _MISSING:
            raise ConvertError(f"{where}: missing required key '{key}'")
        return default
    return value


def _int(obj: dict[str, Any], key: str, where: str, default: Any = _MISSING, minimum: int = 1) -> int:
    value = _get(obj, key, where, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConvertError(f"{where}: '{key}' must be an integer, got {value!r}")
    if value < minimum:
        raise ConvertError(f"{where}: '{key}' must be >= {minimum}, got {value}")
    return value


def _float(obj: dict[str, Any], key: str, where: str, default: Any = _MISSING) -> float:
    value = _get(obj, key, where, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConvertError(f"{where}: '{key}' must be a finite number, got {value!r}")
    return float(value)


def _optional_id(obj: dict[str, Any], key: str) -> int | None:
    value = obj.get(key)
    if isinstance(value, list):  # eos_token_id may be a list; the first entry is the primary id
        value = value[0] if value else None
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConvertError(f"config.json: '{key}' must be a non-negative integer, got {value!r}")
    return value


def read_json(path: Path, what: str) -> dict[str, Any]:
    """Parse a JSON object file; any failure is a ConvertError naming the file."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConvertError(f"{what} not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConvertError(f"cannot read {what} {path}: {exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConvertError(f"{what} {path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ConvertError(f"{what} {path} must contain a JSON object")
    return data


# ----------------------------------------------------------------------------------------------------------------
# config.json


def load_model_config(hf_dir: Path) -> ModelConfig:
    return parse_model_config(read_json(hf_dir / "config.json", "config.json"))


def parse_model_config(config: dict[str, Any]) -> ModelConfig:
    model_type = config.get("model_type")
    if model_type != MODEL_TYPE:
        raise ConvertError(f"unsupported model_type {model_type!r} in config.json (expected {MODEL_TYPE!r})")
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise ConvertError("config.json: 'text_config' must be an object")
    where = "config.json text_config"
    if text.get("model_type", TEXT_MODEL_TYPE) != TEXT_MODEL_TYPE:
        raise ConvertError(f"unsupported text_config.model_type {text.get('model_type')!r} "
                           f"(expected {TEXT_MODEL_TYPE!r})")
    if text.get("use_bidirectional_attention") == "all":
        raise ConvertError("use_bidirectional_attention = 'all' is not supported (the encoder must be causal)")
    if text.get("attention_bias"):
        raise ConvertError("attention_bias = true is not supported (DiffusionGemma has no attention biases)")
    activation = text.get("hidden_activation") or "gelu_pytorch_tanh"
    if activation != "gelu_pytorch_tanh":
        raise ConvertError(f"unsupported hidden_activation {activation!r} (expected 'gelu_pytorch_tanh')")
    for key in ("num_experts", "top_k_experts", "moe_intermediate_size"):
        if text.get(key) is None:
            raise ConvertError(f"{where}: '{key}' is required (DiffusionGemma layers are mixture-of-experts)")

    n_layer = _int(text, "num_hidden_layers", where, 30)
    n_head = _int(text, "num_attention_heads", where, 8)
    n_expert = _int(text, "num_experts", where)
    n_expert_used = _int(text, "top_k_experts", where)
    if n_expert_used > n_expert:
        raise ConvertError(f"{where}: top_k_experts ({n_expert_used}) exceeds num_experts ({n_expert})")

    layers = _resolve_layers(text, n_layer, n_head, where)
    rope = text.get("rope_parameters") or DEFAULT_ROPE
    if not isinstance(rope, dict):
        raise ConvertError(f"{where}: 'rope_parameters' must be an object")
    theta_full, partial_full = _rope_of(rope, FULL, where)
    theta_sliding, partial_sliding = _rope_of(rope, SLIDING, where)
    if partial_sliding != 1.0:
        raise ConvertError(f"{where}: partial rotary on sliding layers is not supported ({partial_sliding})")

    softcap = text.get("final_logit_softcapping", 30.0)
    if softcap is None:
        raise ConvertError(f"{where}: final_logit_softcapping = null is not supported")
    tie = config.get("tie_word_embeddings", text.get("tie_word_embeddings", True))
    if not isinstance(tie, bool):
        raise ConvertError(f"config.json: 'tie_word_embeddings' must be true or false, got {tie!r}")

    return ModelConfig(
        n_vocab=_int(text, "vocab_size", where, 262_144),
        n_embd=_int(text, "hidden_size", where, 2304),
        n_ff=_int(text, "intermediate_size", where, 9216),
        n_ff_exp=_int(text, "moe_intermediate_size", where),
        n_head=n_head,
        n_expert=n_expert,
        n_expert_used=n_expert_used,
        layers=layers,
        sliding_window=_int(text, "sliding_window", where, 512),
        context_length=_int(text, "max_position_embeddings", where, 131_072),
        rms_eps=_float(text, "rms_norm_eps", where, 1e-6),
        rope_theta_full=theta_full,
        rope_theta_sliding=theta_sliding,
        partial_rotary_full=partial_full,
        logit_softcap=_float(text, "final_logit_softcapping", where, 30.0),
        canvas_length=_int(config, "canvas_length", "config.json", 256),
        tie_word_embeddings=tie,
        bos_token_id=_optional_id(text, "bos_token_id"),
        eos_token_id=_optional_id(text, "eos_token_id"),
        pad_token_id=_optional_id(text, "pad_token_id"),
        default_head_dim=_int(text, "head_dim", where, 256),
    )


def _layer_types(text: dict[str, Any], n_layer: int, where: str) -> list[str]:
    types = text.get("layer_types")
    if types is None:
        types = [SLIDING if (i + 1) % DEFAULT_SLIDING_PATTERN else FULL for i in range(n_layer)]
    if not isinstance(types, list) or len(types) != n_layer:
        raise ConvertError(f"{where}: 'layer_types' must list one type per layer ({n_layer})")
    for t in types:
        if t not in (SLIDING, FULL):
            raise ConvertError(f"{where}: unknown layer type {t!r} (expected {SLIDING!r} or {FULL!r})")
    types = list(types)
    types[-1] = FULL  # transformers forces the last layer to full attention
    return types


def _resolve_layers(text: dict[str, Any], n_layer: int, n_head: int, where: str) -> tuple[LayerGeometry, ...]:
    """Per-layer (sliding, head_dim, n_kv_heads) from form A (global_* keys) or form B (per_layer_config)."""
    types = _layer_types(text, n_layer, where)
    head_dim = _int(text, "head_dim", where, 256)
    n_kv = _int(text, "num_key_value_heads", where, 4)
    overrides: dict[int, dict[str, Any]] = {}
    per_layer = text.get("per_layer_config")
    if per_layer is not None:  # form B wins over any global_* keys, as in transformers
        if not isinstance(per_layer, dict):
            raise ConvertError(f"{where}: 'per_layer_config' must be an object")
        for key, value in per_layer.items():
            try:
                index = int(key)
            except ValueError:
                raise ConvertError(f"{where}: per_layer_config key {key!r} is not a layer index") from None
            if not 0 <= index < n_layer or not isinstance(value, dict):
                raise ConvertError(f"{where}: bad per_layer_config entry {key!r}")
            overrides[index] = value
    else:  # form A
        full = {"head_dim": text.get("global_head_dim", DEFAULT_GLOBAL_HEAD_DIM)}
        if text.get("num_global_key_value_heads") is not None and text.get("attention_k_eq_v", True):
            full["num_key_value_heads"] = text["num_global_key_value_heads"]
        overrides = {i: full for i, t in enumerate(types) if t == FULL}

    layers = []
    for i, layer_type in enumerate(types):
        merged = {"head_dim": head_dim, "num_key_value_heads": n_kv, **overrides.get(i, {})}
        lwhere = f"{where} layer {i}"
        hd = _int(merged, "head_dim", lwhere)
        kv = _int(merged, "num_key_value_heads", lwhere)
        if hd % 2:
            raise ConvertError(f"{lwhere}: head_dim {hd} must be even (rotary pairs)")
        if n_head % kv:
            raise ConvertError(f"{lwhere}: num_attention_heads {n_head} is not a multiple of num_key_value_heads {kv}")
        layers.append(LayerGeometry(sliding=layer_type == SLIDING, head_dim=hd, n_kv_heads=kv))

    # GGUF stores one head size per layer type (key_length / key_length_swa)
    for sliding in (True, False):
        sizes = {layer.head_dim for layer in layers if layer.sliding == sliding}
        if len(sizes) > 1:
            kind = "sliding" if sliding else "full"
            raise ConvertError(f"{where}: {kind} layers have different head sizes {sorted(sizes)}; "
                               "GGUF stores one per layer type")
    return tuple(layers)


def _rope_of(rope: dict[str, Any], layer_type: str, where: str) -> tuple[float, float]:
    params = rope.get(layer_type, DEFAULT_ROPE[layer_type])
    if not isinstance(params, dict):
        raise ConvertError(f"{where}: rope_parameters.{layer_type} must be an object")
    rwhere = f"{where} rope_parameters.{layer_type}"
    rope_type = params.get("rope_type", "default")
    if rope_type not in ("default", "proportional"):
        raise ConvertError(f"{rwhere}: unsupported rope_type {rope_type!r}")
    theta = _float(params, "rope_theta", rwhere, DEFAULT_ROPE[layer_type]["rope_theta"])
    partial = _float(params, "partial_rotary_factor", rwhere, 1.0)
    if not 0.0 < partial <= 1.0:
        raise ConvertError(f"{rwhere}: partial_rotary_factor must be in (0, 1], got {partial}")
    return theta, partial


# ----------------------------------------------------------------------------------------------------------------
# generation_config.json


def load_sampler_defaults(hf_dir: Path) -> SamplerValues:
    """Sampler settings for the `diffusion.eb_*` keys; a missing file or null field means transformers' default."""
    path = hf_dir / "generation_config.json"
    if not path.exists():
        return released_defaults()
    return parse_sampler_defaults(read_json(path, "generation_config.json"))


def parse_sampler_defaults(gen: dict[str, Any]) -> SamplerValues:
    """Each FILE_SETTINGS row read from its `hf_key`, checked as transformers checks the file."""
    where = "generation_config.json"
    sampler = gen.get("sampler_config") or {}
    if not isinstance(sampler, dict):
        raise ConvertError(f"{where}: 'sampler_config' must be an object")
    cls = sampler.get("_cls_name", "EntropyBoundSamplerConfig")
    if cls != "EntropyBoundSamplerConfig":
        raise ConvertError(f"{where}: unsupported sampler {cls!r} (expected 'EntropyBoundSamplerConfig')")
    sections = {"": (gen, where), "sampler_config": (sampler, f"{where} sampler_config")}
    result: SamplerValues = {}
    for setting in FILE_SETTINGS:
        section, _, key = setting.hf_key.rpartition(".")
        obj, owner = sections[section]
        if setting.type is int:
            minimum = setting.limits_for(reference=True).low
            result[setting.field] = _int(obj, key, owner, setting.default, minimum=int(minimum))
        else:
            result[setting.field] = _float(obj, key, owner, setting.default)
    # worded for the file's keys (a ConvertError names what to fix in generation_config.json)
    if not 0.0 <= result["t_min"] < result["t_max"]:
        raise ConvertError(f"{where}: need 0 <= t_min < t_max, got t_min={result['t_min']}, t_max={result['t_max']}")
    if result["entropy_bound"] <= 0 or result["confidence_threshold"] <= 0:
        raise ConvertError(f"{where}: entropy_bound and confidence_threshold must be > 0")
    return result
