"""The vision tower + `embed_vision` of a DiffusionGemma checkpoint -> a projector GGUF in llama.cpp's mtmd `gemma4v`
layout (docs/gguf.md#vision-projector), streamed through the same writer as the text weights.

The layout is llama.cpp's for Gemma 4 (conversion/gemma.py `Gemma4VisionAudioModel`, gguf-py's tensor_mapping.py,
tools/mtmd/clip-impl.h and clip.cpp): `general.architecture` "clip", `clip.projector_type` "gemma4v", tensors under
`v.` and `mm.`. Two changes of bytes only: the patch embedding's [H, p·p·3] linear (HF flattens a patch as row,
column, channel) is stored as the [H, 3, p, p] convolution kernel mtmd expects, and 0-d clip bounds become [1]. Type
policy (llama.cpp's for mmproj files): norms, the standardize vectors, clip bounds and the position table are F32 in
every file; the patch kernel is F16 in an F16 file and F32 otherwise; the other matrices take the output type, and in
a Q8_0 file a matrix whose rows are not a multiple of 32 (the released FFN width 4304) falls back to F16.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
from gguf import GGMLQuantizationType as T, GGUFValueType as V, GGUFType, LlamaFileType as FT

from dgemma_convert.converter import (CHUNK_ELEMENTS, ConversionResult, PlannedTensor, ProgressSink, encode_rows,
                                      make_quantizer, write_gguf)
from dgemma_convert.errors import ConvertError
from dgemma_convert.gguf_metadata import KeyValue
from dgemma_convert.hf_config import read_json
from dgemma_convert.quantize import block_size, nbytes
from dgemma_convert.safetensors_reader import FLOAT_DTYPES, Checkpoint
from dgemma_convert.tensor_map import TensorSpec
from dgemma_engine import gguf_keys as K
from dgemma_engine.arch import CLIP_ARCH, PROJECTOR_GEMMA4V

TOWER = "model.encoder.vision_tower."
EMBEDDER = "model.encoder.embed_vision."
VISION_MODEL_TYPE = "gemma4_vision"
MMPROJ_OUT_TYPES = {"f32": FT.ALL_F32, "f16": FT.MOSTLY_F16, "bf16": FT.MOSTLY_BF16, "q8_0": FT.MOSTLY_Q8_0}
BASE_TYPES = {"f32": T.F32, "f16": T.F16, "bf16": T.BF16, "q8_0": T.Q8_0}
DEFAULT_MAX_SOFT_TOKENS = 280  # Gemma 4's image processor default (the release's vision_soft_tokens_per_image)
MTMD_IMAGE_SIZE = 224  # mtmd requires clip.vision.image_size; llama.cpp writes 224 for Gemma 4 ("unused")
CLIP_BOUNDS = ("input_min", "input_max", "output_min", "output_max")

# Per layer: GGUF name after `v.blk.N.` -> checkpoint name after `…vision_tower.encoder.layers.N.` (tensor_mapping.py)
BLOCK_SOURCES = {
    "ln1.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.linear.weight",
    "attn_k.weight": "self_attn.k_proj.linear.weight",
    "attn_v.weight": "self_attn.v_proj.linear.weight",
    "attn_out.weight": "self_attn.o_proj.linear.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_post_norm.weight": "post_attention_layernorm.weight",
    "ln2.weight": "pre_feedforward_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.linear.weight",
    "ffn_up.weight": "mlp.up_proj.linear.weight",
    "ffn_down.weight": "mlp.down_proj.linear.weight",
    "ffn_post_norm.weight": "post_feedforward_layernorm.weight",
}
CLIPPABLE = ("attn_q", "attn_k", "attn_v", "attn_out", "ffn_gate", "ffn_up", "ffn_down")  # Gemma4ClippableLinear
PATCH_EMBD = "v.patch_embd.weight"
POSITION_EMBD = "v.position_embd.weight"
INPUT_PROJECTION = "mm.input_projection.weight"


@dataclass(frozen=True)
class VisionConfig:
    hidden: int
    ff: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    patch_size: int
    pooling: int
    position_table: int
    eps: float
    rope_theta: float
    standardize: bool
    clipped_linears: bool
    n_embd_text: int
    max_soft_tokens: int
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]


@dataclass(frozen=True)
class MmprojPlan:
    hf_dir: Path
    outtype: str
    config: VisionConfig
    metadata: list[KeyValue]
    tensors: list[PlannedTensor]


def _int(obj: dict[str, Any], key: str, default: int | None = None) -> int:
    value = obj.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConvertError(f"config.json vision_config: '{key}' must be a positive integer, got {value!r}")
    return value


def _flag(obj: dict[str, Any], key: str) -> bool:
    value = obj.get(key, False)
    if not isinstance(value, bool):
        raise ConvertError(f"config.json vision_config: '{key}' must be true or false, got {value!r}")
    return value


def _processor_settings(hf_dir: Path) -> dict[str, Any]:
    """The image processor's settings: preprocessor_config.json, then processor_config.json's image_processor."""
    merged: dict[str, Any] = {}
    for name, section in (("preprocessor_config.json", None), ("processor_config.json", "image_processor")):
        path = hf_dir / name
        if path.is_file():
            data = read_json(path, name)
            part = data.get(section, {}) if section else data
            if isinstance(part, dict):
                merged.update(part)
    return merged


def _triple(settings: dict[str, Any], key: str, default: float) -> tuple[float, float, float]:
    value = settings.get(key, [default] * 3)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = [value] * 3
    if (not isinstance(value, list) or len(value) != 3
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value)):
        raise ConvertError(f"image processor '{key}' must be three numbers, got {value!r}")
    return (float(value[0]), float(value[1]), float(value[2]))


def load_vision_config(hf_dir: Path) -> VisionConfig | None:
    """The vision tower's geometry from config.json (None when the checkpoint has no vision tower)."""
    config = read_json(hf_dir / "config.json", "config.json")
    vision = config.get("vision_config")
    if vision is None:
        return None
    if not isinstance(vision, dict):
        raise ConvertError("config.json: 'vision_config' must be an object")
    if vision.get("model_type", VISION_MODEL_TYPE) != VISION_MODEL_TYPE:
        raise ConvertError(f"unsupported vision_config.model_type {vision.get('model_type')!r} "
                           f"(expected {VISION_MODEL_TYPE!r})")
    activation = vision.get("hidden_activation") or "gelu_pytorch_tanh"
    if activation != "gelu_pytorch_tanh":
        raise ConvertError(f"unsupported vision hidden_activation {activation!r} (expected 'gelu_pytorch_tanh')")
    if vision.get("attention_bias"):
        raise ConvertError("vision attention_bias = true is not supported (Gemma 4's tower has no biases)")
    rope = vision.get("rope_parameters") or {}
    if not isinstance(rope, dict) or rope.get("rope_type", "axial") not in ("axial", "default"):
        raise ConvertError(f"unsupported vision rope_parameters {rope!r} (expected axial 2-D RoPE)")
    theta = rope.get("rope_theta", 100.0)
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 1.0 or not math.isfinite(theta):
        raise ConvertError(f"config.json vision_config: rope_theta must be a finite number > 1, got {theta!r}")
    eps = vision.get("rms_norm_eps", 1e-6)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
        raise ConvertError(f"config.json vision_config: rms_norm_eps must be in (0, 1), got {eps!r}")
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise ConvertError("config.json: 'text_config' must be an object")
    n_head = _int(vision, "num_attention_heads", 12)
    n_head_kv = _int(vision, "num_key_value_heads", n_head)
    head_dim = _int(vision, "head_dim", 64)  # Gemma4VisionConfig's default, which its attention uses as is
    if head_dim % 4:
        raise ConvertError(f"vision head_dim {head_dim} must be a multiple of 4 (two rotated halves, x and y)")
    if n_head % n_head_kv:
        raise ConvertError(f"vision num_attention_heads {n_head} is not a multiple of num_key_value_heads {n_head_kv}")
    settings = _processor_settings(hf_dir)
    max_soft = settings.get("max_soft_tokens", config.get("vision_soft_tokens_per_image", DEFAULT_MAX_SOFT_TOKENS))
    if isinstance(max_soft, bool) or not isinstance(max_soft, int) or max_soft < 1:
        raise ConvertError(f"image processor 'max_soft_tokens' must be a positive integer, got {max_soft!r}")
    pooling = _int(vision, "pooling_kernel_size", 3)
    patch = _int(vision, "patch_size", 16)
    for key in ("patch_size", "pooling_kernel_size"):
        if key in settings and settings[key] != vision.get(key, settings[key]):
            raise ConvertError(f"the image processor's {key} ({settings[key]}) differs from vision_config's "
                               f"({vision.get(key)})")
    return VisionConfig(
        hidden=_int(vision, "hidden_size", 768), ff=_int(vision, "intermediate_size", 3072),
        n_layer=_int(vision, "num_hidden_layers", 16), n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim,
        patch_size=patch, pooling=pooling, position_table=_int(vision, "position_embedding_size", 10240),
        eps=float(eps), rope_theta=float(theta), standardize=_flag(vision, "standardize"),
        clipped_linears=_flag(vision, "use_clipped_linears"), n_embd_text=_int(text, "hidden_size"),
        max_soft_tokens=max_soft, image_mean=_triple(settings, "image_mean", 0.0),
        image_std=_triple(settings, "image_std", 1.0))


def _spec(name: str, source: str, hf_shape: tuple[int, ...], ne: tuple[int, ...] | None = None) -> TensorSpec:
    return TensorSpec(name, source, hf_shape, ne or tuple(reversed(hf_shape)))


def vision_tensor_specs(cfg: VisionConfig) -> list[TensorSpec]:
    """Every projector tensor in file order: the embeddings, the standardize vectors, blk.0, blk.1, …, the
    projection."""
    H, FF, p = cfg.hidden, cfg.ff, cfg.patch_size
    q_out, kv_out = cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
    specs = [
        _spec(PATCH_EMBD, TOWER + "patch_embedder.input_proj.weight", (H, 3 * p * p), (p, p, 3, H)),
        _spec(POSITION_EMBD, TOWER + "patch_embedder.position_embedding_table", (2, cfg.position_table, H)),
    ]
    if cfg.standardize:
        specs += [_spec("v.std_bias", TOWER + "std_bias", (H,)), _spec("v.std_scale", TOWER + "std_scale", (H,))]
    shapes = {"ln1.weight": (H,), "attn_q.weight": (q_out, H), "attn_k.weight": (kv_out, H),
              "attn_v.weight": (kv_out, H), "attn_out.weight": (H, q_out), "attn_q_norm.weight": (cfg.head_dim,),
              "attn_k_norm.weight": (cfg.head_dim,), "attn_post_norm.weight": (H,), "ln2.weight": (H,),
              "ffn_gate.weight": (FF, H), "ffn_up.weight": (FF, H), "ffn_down.weight": (H, FF),
              "ffn_post_norm.weight": (H,)}
    for i in range(cfg.n_layer):
        layer = f"{TOWER}encoder.layers.{i}."
        for name, source in BLOCK_SOURCES.items():
            specs.append(_spec(f"v.blk.{i}.{name}", layer + source, shapes[name]))
        if cfg.clipped_linears:
            for stem in CLIPPABLE:
                linear = layer + BLOCK_SOURCES[stem + ".weight"].removesuffix("weight")
                specs += [_spec(f"v.blk.{i}.{stem}.{bound}", linear.removesuffix("linear.") + bound, (), (1,))
                          for bound in CLIP_BOUNDS]
    specs.append(_spec(INPUT_PROJECTION, EMBEDDER + "embedding_projection.weight", (cfg.n_embd_text, H)))
    return specs


def vision_tensor_type(spec: TensorSpec, outtype: str) -> T:
    """llama.cpp's mmproj policy (module docstring)."""
    base = BASE_TYPES[outtype]
    if spec.name == PATCH_EMBD:
        return T.F16 if base == T.F16 else T.F32
    if spec.n_dims < 2 or spec.name == POSITION_EMBD:
        return T.F32
    if base == T.Q8_0 and spec.ne[0] % block_size(T.Q8_0):
        return T.F16
    return base


def vision_metadata(cfg: VisionConfig, outtype: str, name: str) -> list[KeyValue]:
    return [
        KeyValue(K.KEY_GENERAL_TYPE, GGUFType.MMPROJ, V.STRING),
        KeyValue(K.KEY_NAME, name, V.STRING),
        KeyValue(K.KEY_FILE_TYPE, int(MMPROJ_OUT_TYPES[outtype]), V.UINT32),
        KeyValue(K.KEY_CLIP_HAS_VISION_ENCODER, True, V.BOOL),
        KeyValue(K.KEY_CLIP_PROJECTOR_TYPE, PROJECTOR_GEMMA4V, V.STRING),
        KeyValue(K.KEY_CLIP_USE_GELU, True, V.BOOL),  # gelu_pytorch_tanh = ggml_gelu (mtmd's default is gelu_quick)
        KeyValue(K.KEY_VISION_PROJECTION_DIM, cfg.n_embd_text, V.UINT32),
        KeyValue(K.KEY_VISION_IMAGE_SIZE, MTMD_IMAGE_SIZE, V.UINT32),
        KeyValue(K.KEY_VISION_PATCH_SIZE, cfg.patch_size, V.UINT32),
        KeyValue(K.KEY_VISION_EMBEDDING_LENGTH, cfg.hidden, V.UINT32),
        KeyValue(K.KEY_VISION_FEED_FORWARD_LENGTH, cfg.ff, V.UINT32),
        KeyValue(K.KEY_VISION_BLOCK_COUNT, cfg.n_layer, V.UINT32),
        KeyValue(K.KEY_VISION_HEAD_COUNT, cfg.n_head, V.UINT32),
        KeyValue(K.KEY_VISION_HEAD_COUNT_KV, cfg.n_head_kv, V.UINT32),
        KeyValue(K.KEY_VISION_HEAD_DIM, cfg.head_dim, V.UINT32),
        KeyValue(K.KEY_VISION_LAYER_NORM_EPS, cfg.eps, V.FLOAT32),
        KeyValue(K.KEY_VISION_IMAGE_MEAN, list(cfg.image_mean), V.ARRAY, V.FLOAT32),
        KeyValue(K.KEY_VISION_IMAGE_STD, list(cfg.image_std), V.ARRAY, V.FLOAT32),
        KeyValue(K.KEY_VISION_POOLING, cfg.pooling, V.UINT32),
        KeyValue(K.KEY_VISION_MAX_SOFT_TOKENS, cfg.max_soft_tokens, V.UINT32),
        KeyValue(K.KEY_VISION_ROPE_FREQ_BASE, cfg.rope_theta, V.FLOAT32),
    ]


def parse_mmproj_outtype(name: str) -> str:
    key = name.lower()
    if key not in MMPROJ_OUT_TYPES:
        raise ConvertError(f"unknown projector output type {name!r}; choose one of {', '.join(MMPROJ_OUT_TYPES)}")
    return key


def plan_mmproj(hf_dir: Path, outtype: str) -> MmprojPlan | None:
    """Keys and tensors of the projector file (None when the checkpoint has no vision tower)."""
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise ConvertError(f"not a checkpoint folder: {hf_dir}")
    out = parse_mmproj_outtype(outtype)
    cfg = load_vision_config(hf_dir)
    if cfg is None:
        return None
    specs = vision_tensor_specs(cfg)
    tensors = []
    for spec in specs:
        t = vision_tensor_type(spec, out)
        tensors.append(PlannedTensor(spec, t, nbytes(t, spec.ne)))
    metadata = vision_metadata(cfg, out, hf_dir.resolve().name + "-mmproj")
    return MmprojPlan(hf_dir, out, cfg, metadata, tensors)


def _source_rows(spec: TensorSpec, rows: np.ndarray, patch: int) -> np.ndarray:
    """Checkpoint rows -> output rows: the patch kernel's (row, column, channel) -> (channel, row, column)."""
    if spec.name != PATCH_EMBD:
        return rows
    return rows.reshape(-1, patch, patch, 3).transpose(0, 3, 1, 2).reshape(rows.shape[0], -1)


def convert_mmproj(hf_dir: Path, outfile: Path, outtype: str = "f16", *, threads: int | None = None,
                   progress: ProgressSink | None = None) -> ConversionResult | None:
    """Write the projector GGUF (atomically); None, writing nothing, when the checkpoint has no vision tower."""
    started = time.monotonic()
    p = plan_mmproj(hf_dir, outtype)
    if p is None:
        return None
    with Checkpoint.open(p.hf_dir) as ckpt:
        entries = {}
        for t in p.tensors:
            entry = ckpt.entries.get(t.spec.source)
            if entry is None:
                raise ConvertError(f"checkpoint lacks tensor '{t.spec.source}' (needed for {t.name})")
            scalar_ok = t.spec.hf_shape == () and entry.shape in ((), (1,))
            if entry.shape != t.spec.hf_shape and not scalar_ok:
                raise ConvertError(f"tensor '{t.spec.source}' has shape {list(entry.shape)} but config.json implies "
                                   f"{list(t.spec.hf_shape)}")
            if entry.dtype not in FLOAT_DTYPES:
                raise ConvertError(f"tensor '{t.spec.source}' has unsupported dtype {entry.dtype}")
            entries[t.name] = entry
        quantizer = make_quantizer(p.tensors, threads)

        def tensor_bytes(t: PlannedTensor) -> Iterator[np.ndarray]:
            entry = entries[t.name]
            rows = (_source_rows(t.spec, chunk, p.config.patch_size).reshape(-1, t.spec.ne[0])
                    for chunk in ckpt.iter_rows_f32(entry, CHUNK_ELEMENTS))
            yield from encode_rows(rows, t.ggml_type, quantizer)

        write_gguf(Path(outfile), p.metadata, p.tensors, tensor_bytes, progress, arch=CLIP_ARCH)
    return ConversionResult(Path(outfile), len(p.tensors), Path(outfile).stat().st_size, time.monotonic() - started)

