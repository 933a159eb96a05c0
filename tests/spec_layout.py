"""What a GGUF must contain, derived in the tests straight from docs/gguf.md
(#metadata-keys, #tensor-table, #type-policy) and a config.json.

Deliberately independent of dgemma_convert: tests compare the converter's output with these expectations.
"""
from __future__ import annotations

import re

from gguf import GGMLQuantizationType as T

ARCH = "diffusion-gemma"
FULL = "full_attention"

# docs/gguf.md#metadata-keys: the 44 keys of the Unsloth Q8_0 file, plus the six optional sampler keys dgemma writes
SPEC_KEYS = {
    "general.architecture", "general.type", "general.name", "general.size_label", "general.quantization_version",
    "general.file_type",
    *(f"{ARCH}.{k}" for k in (
        "block_count", "context_length", "embedding_length", "feed_forward_length", "expert_feed_forward_length",
        "expert_count", "expert_used_count", "attention.head_count", "attention.head_count_kv",
        "attention.key_length", "attention.value_length", "attention.key_length_swa", "attention.value_length_swa",
        "attention.sliding_window", "attention.sliding_window_pattern", "attention.layer_norm_rms_epsilon",
        "attention.causal", "attention.shared_kv_layers", "embedding_length_per_layer_input", "rope.freq_base",
        "rope.freq_base_swa", "rope.dimension_count", "rope.dimension_count_swa", "final_logit_softcapping")),
    "diffusion.canvas_length",
    "tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id", "tokenizer.ggml.mask_token_id",
    "tokenizer.chat_template", "tokenizer.ggml.add_space_prefix", "tokenizer.ggml.add_bos_token",
}
EB_KEYS = {f"diffusion.eb_{k}" for k in ("max_steps", "t_min", "t_max", "entropy_bound", "stability_threshold",
                                         "confidence_threshold")}
assert len(SPEC_KEYS) == 44

FILE_TYPE = {"f32": 0, "f16": 1, "bf16": 32, "q8_0": 7, "q4_0": 2, "q4_k_m": 15, "q5_k_m": 17, "q6_k": 18}
BASE = {"f32": T.F32, "f16": T.F16, "bf16": T.BF16, "q8_0": T.Q8_0, "q4_0": T.Q4_0, "q4_k_m": T.Q4_K,
        "q5_k_m": T.Q5_K, "q6_k": T.Q6_K}
BLOCK = {T.Q8_0: 32, T.Q4_0: 32, T.Q5_0: 32, T.Q5_1: 32, T.Q4_K: 256, T.Q5_K: 256, T.Q6_K: 256, T.F16: 1,
         T.BF16: 1, T.F32: 1}


def layer_geometry(text: dict) -> list[tuple[bool, int, int]]:
    """(sliding, head_dim, n_kv) per layer from either config form (docs/model.md#per-layer-geometry)."""
    per_layer = {int(k): v for k, v in (text.get("per_layer_config") or {}).items()}
    out = []
    for i, kind in enumerate(text["layer_types"]):
        if "per_layer_config" in text:
            o = per_layer.get(i, {})
        elif kind == FULL:
            o = {"head_dim": text["global_head_dim"], "num_key_value_heads": text["num_global_key_value_heads"]}
        else:
            o = {}
        out.append((kind != FULL, o.get("head_dim", text["head_dim"]),
                    o.get("num_key_value_heads", text["num_key_value_heads"])))
    return out


def expected_tensors(text: dict, n_tokens: int) -> dict[str, tuple[int, ...]]:
    """GGUF tensor name -> ne (ggml order), docs/gguf.md#tensor-table."""
    H, FF, FFe, E, nH = (text["hidden_size"], text["intermediate_size"], text["moe_intermediate_size"],
                         text["num_experts"], text["num_attention_heads"])
    geo = layer_geometry(text)
    hd_full = next(hd for sliding, hd, _ in geo if not sliding)
    t = {"token_embd.weight": (H, n_tokens), "output_norm.weight": (H,), "rope_freqs.weight": (hd_full // 2,),
         "self_cond_pre_norm.weight": (H,), "self_cond_gate.weight": (H, FF), "self_cond_up.weight": (H, FF),
         "self_cond_down.weight": (FF, H)}
    for i, (sliding, hd, kv) in enumerate(geo):
        b = f"blk.{i}."
        t.update({b + "attn_norm.weight": (H,), b + "attn_q.weight": (H, nH * hd), b + "attn_q_norm.weight": (hd,),
                  b + "attn_k.weight": (H, kv * hd), b + "attn_k_norm.weight": (hd,),
                  b + "attn_output.weight": (nH * hd, H), b + "post_attention_norm.weight": (H,),
                  b + "ffn_norm.weight": (H,), b + "ffn_gate.weight": (H, FF), b + "ffn_up.weight": (H, FF),
                  b + "ffn_down.weight": (FF, H), b + "post_ffw_norm_1.weight": (H,),
                  b + "ffn_gate_inp.weight": (H, E), b + "ffn_gate_inp.scale": (H,),
                  b + "pre_ffw_norm_2.weight": (H,), b + "ffn_gate_up_exps.weight": (H, 2 * FFe, E),
                  b + "ffn_down_exps.weight": (FFe, H, E), b + "ffn_down_exps.scale": (E,),
                  b + "post_ffw_norm_2.weight": (H,), b + "post_ffw_norm.weight": (H,),
                  b + "layer_output_scale.weight": (1,), b + "enc_layer_output_scale.weight": (1,)})
        if sliding:
            t[b + "attn_v.weight"] = (H, kv * hd)
    return t


def hf_source(name: str) -> str | None:
    """The checkpoint tensor a GGUF tensor comes from (docs/gguf.md#tensor-table), None for the generated rope_freqs."""
    d = "model.decoder."
    fixed = {"token_embd.weight": d + "embed_tokens.weight", "output_norm.weight": d + "norm.weight",
             "rope_freqs.weight": None, "self_cond_pre_norm.weight": d + "self_conditioning.pre_norm.weight",
             "self_cond_gate.weight": d + "self_conditioning.gate_proj.weight",
             "self_cond_up.weight": d + "self_conditioning.up_proj.weight",
             "self_cond_down.weight": d + "self_conditioning.down_proj.weight"}
    if name in fixed:
        return fixed[name]
    i, rest = re.fullmatch(r"blk\.(\d+)\.(.+)", name).groups()
    if rest == "enc_layer_output_scale.weight":
        return f"model.encoder.language_model.layers.{i}.layer_scalar"
    per_layer = {
        "attn_norm.weight": "input_layernorm.weight", "attn_q.weight": "self_attn.q_proj.weight",
        "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k.weight": "self_attn.k_proj.weight",
        "attn_k_norm.weight": "self_attn.k_norm.weight", "attn_v.weight": "self_attn.v_proj.weight",
        "attn_output.weight": "self_attn.o_proj.weight",
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "ffn_norm.weight": "pre_feedforward_layernorm.weight", "ffn_gate.weight": "mlp.gate_proj.weight",
        "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight",
        "post_ffw_norm_1.weight": "post_feedforward_layernorm_1.weight", "ffn_gate_inp.weight": "router.proj.weight",
        "ffn_gate_inp.scale": "router.scale", "pre_ffw_norm_2.weight": "pre_feedforward_layernorm_2.weight",
        "ffn_gate_up_exps.weight": "experts.gate_up_proj", "ffn_down_exps.weight": "experts.down_proj",
        "ffn_down_exps.scale": "router.per_expert_scale",
        "post_ffw_norm_2.weight": "post_feedforward_layernorm_2.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight", "layer_output_scale.weight": "layer_scalar"}
    return f"{d}layers.{i}.{per_layer[rest]}"


def _more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def expected_types(tensors: dict[str, tuple[int, ...]], outtype: str, n_layer: int) -> dict[str, T]:
    """GGML type per tensor (docs/gguf.md#type-policy rules 1-5), tensors taken in file order (globals, then layers
    ascending)."""
    base = BASE[outtype]

    def order(name: str):
        m = re.match(r"blk\.(\d+)\.", name)
        return (1, int(m.group(1)), name) if m else (0, 0, name)

    names = sorted(tensors, key=order)
    n_v = sum(n.endswith("attn_v.weight") for n in names)
    i_v = 0
    out = {}
    for name in names:
        ne = tensors[name]
        weight_2d = len(ne) >= 2 and name.endswith(".weight") and not name.endswith("ffn_gate_inp.weight")
        if outtype in ("f32", "f16", "bf16"):
            out[name] = base if weight_2d else T.F32
            continue
        if not weight_2d or name.endswith("_norm.weight"):
            out[name] = T.F32
            continue
        t = base
        mix = outtype in ("q4_k_m", "q5_k_m")
        if name == "token_embd.weight":  # rule 2: tied output
            t = T.Q8_0 if ne[0] % BLOCK[base] else (base if base == T.Q8_0 else T.Q6_K)
        elif name.endswith("attn_v.weight"):  # rule 3
            if mix and _more_bits(i_v, n_v):
                t = T.Q6_K
            i_v += 1
        elif ".ffn_down" in name:  # rule 4
            if mix and _more_bits(int(name.split(".")[1]), n_layer):
                t = T.Q6_K
        if ne[0] % BLOCK[t]:  # rule 5
            t = {T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0}.get(t, T.F16)
            if ne[0] % BLOCK[t]:
                t = T.F16
        out[name] = t
    return out


# ---------------------------------------------------------------------------------------------------------------
# Checking a converted file against the expectations

# Relative RMS error bounds, ||dequant(q(x)) - x|| / ||x||, for Gaussian weights. Uniform quantisation with step d
# has RMS error d/sqrt(12); d is about (block max)/127 for Q8_0 (rms ~0.005), /32 for Q6_K on 16-wide sub-blocks
# (~0.016), range/31 or max/16 for the 5-bit types (~0.04) and range/15 or max/8 for the 4-bit types (~0.08).
# Measured on Gaussian synthetic weights (tests/test_convert_synthetic.py): Q8_0 0.0054, Q6_K 0.018, Q5_K 0.036,
# Q5_1 0.038, Q5_0 0.043, Q4_K 0.072, Q4_0 0.086, F16 0.0002, BF16 0.0017. Each bound is about 2x the estimate:
# loose enough for ggml's rounding choices, tight enough that a wrong block layout, scale or type (errors ~1) fails.
REL_RMS_BOUND = {T.F16: 1e-3, T.BF16: 5e-3, T.Q8_0: 0.01, T.Q6_K: 0.03, T.Q5_K: 0.07, T.Q5_0: 0.07,
                 T.Q5_1: 0.07, T.Q4_K: 0.15, T.Q4_0: 0.15}
# Types gguf-py can quantize itself (numpy ports of ggml's reference quantizers): the bytes must match exactly.
GGUF_PY_QUANTIZES = (T.BF16, T.Q8_0, T.Q4_0, T.Q5_0, T.Q5_1)


def read_gguf(path):
    """(key -> value, tensor name -> ReaderTensor, tensor names in file order)."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    kv = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    tensors = {t.name: t for t in reader.tensors}
    return kv, tensors, [t.name for t in reader.tensors]


def check_layout(path, config: dict, n_tokens: int, outtype: str) -> None:
    """Keys, key values derived from the config, tensor names, order, shapes and types
    (docs/gguf.md#metadata-keys, #tensor-table, #type-policy)."""
    text = config["text_config"]
    kv, tensors, order = read_gguf(path)
    assert set(kv) == SPEC_KEYS | EB_KEYS
    geo = layer_geometry(text)
    hd_full = next(hd for sliding, hd, _ in geo if not sliding)
    hd_swa = next((hd for sliding, hd, _ in geo if sliding), text["head_dim"])
    a = ARCH
    assert kv["general.architecture"] == ARCH
    assert kv["general.file_type"] == FILE_TYPE[outtype]
    assert kv["general.quantization_version"] == 2
    assert kv[f"{a}.block_count"] == len(geo)
    assert kv[f"{a}.embedding_length"] == text["hidden_size"]
    assert kv[f"{a}.feed_forward_length"] == text["intermediate_size"]
    assert kv[f"{a}.expert_feed_forward_length"] == text["moe_intermediate_size"]
    assert kv[f"{a}.expert_count"] == text["num_experts"]
    assert kv[f"{a}.expert_used_count"] == text["top_k_experts"]
    assert kv[f"{a}.attention.head_count"] == text["num_attention_heads"]
    assert kv[f"{a}.attention.head_count_kv"] == [kv_heads for _, _, kv_heads in geo]
    assert kv[f"{a}.attention.sliding_window_pattern"] == [sliding for sliding, _, _ in geo]
    assert kv[f"{a}.attention.key_length"] == kv[f"{a}.attention.value_length"] == hd_full
    assert kv[f"{a}.attention.key_length_swa"] == kv[f"{a}.attention.value_length_swa"] == hd_swa
    assert kv[f"{a}.rope.dimension_count"] == hd_full and kv[f"{a}.rope.dimension_count_swa"] == hd_swa
    assert kv[f"{a}.attention.sliding_window"] == text["sliding_window"]
    assert kv[f"{a}.context_length"] == text["max_position_embeddings"]
    assert kv[f"{a}.attention.causal"] is False
    assert kv[f"{a}.final_logit_softcapping"] == 30.0
    assert kv["diffusion.canvas_length"] == config["canvas_length"]
    assert kv["tokenizer.ggml.model"] == "gemma4"
    assert len(kv["tokenizer.ggml.tokens"]) == len(kv["tokenizer.ggml.token_type"]) == n_tokens

    expected = expected_tensors(text, n_tokens)
    assert set(tensors) == set(expected)
    globals_, blocks = order[:7], order[7:]  # 7 globals, then blk.0, blk.1, ... (sorted; docs/gguf.md#file-conventions)
    assert globals_ == sorted(globals_) and not any(n.startswith("blk.") for n in globals_)
    layers = [int(n.split(".")[1]) for n in blocks]
    assert layers == sorted(layers)
    types = expected_types(expected, outtype, len(geo))
    for name, t in tensors.items():
        assert tuple(int(d) for d in t.shape) == expected[name], name
        assert T(t.tensor_type) == types[name], (name, T(t.tensor_type).name, types[name].name)


def check_values(path, weights: dict, config: dict, n_tokens: int) -> None:
    """F32 bit-exact; F16/BF16/Q8_0/Q4_0/Q5_x byte-exact with gguf-py's references; every type within its bound."""
    import numpy as np
    from gguf import quants

    text = config["text_config"]
    _, tensors, _ = read_gguf(path)
    geo = layer_geometry(text)
    hd_full = next(hd for sliding, hd, _ in geo if not sliding)
    partial = config["text_config"].get("rope_parameters", {}).get(FULL, {}).get("partial_rotary_factor", 0.25)
    for name, t in tensors.items():
        t_type = T(t.tensor_type)
        source = hf_source(name)
        if source is None:
            n_rot = int(partial * hd_full / 2)
            want = np.array([1.0] * n_rot + [1e30] * (hd_full // 2 - n_rot), dtype=np.float32)
        else:
            want = np.asarray(weights[source], dtype=np.float32)
            if name == "token_embd.weight":
                want = want[:n_tokens]
            want = want.reshape(tuple(reversed([int(d) for d in t.shape])))
        if t_type == T.F32:
            got = np.asarray(t.data).reshape(want.shape)
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), name
            continue
        if t_type == T.F16:
            assert np.array_equal(np.asarray(t.data).reshape(-1).view(np.uint16),
                                  want.astype(np.float16).reshape(-1).view(np.uint16)), name
        elif t_type in GGUF_PY_QUANTIZES:
            ref = quants.quantize(want, t_type)
            assert np.array_equal(np.asarray(t.data).reshape(-1).view(np.uint8), ref.reshape(-1).view(np.uint8)), name
        got = quants.dequantize(np.asarray(t.data), t_type).reshape(want.shape)
        rel = np.sqrt(np.mean((got - want) ** 2) / np.mean(want ** 2))
        assert rel <= REL_RMS_BOUND[t_type], (name, t_type.name, rel)
