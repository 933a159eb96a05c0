"""The released 26B-A4B config, planned without weights, against the inventory of Unsloth's files
(docs/gguf.md#metadata-keys, #tensor-table, #quant-mixes)."""
from __future__ import annotations

import json
from collections import Counter

import pytest
from gguf import GGMLQuantizationType as T

from dgemma_convert import plan
from spec_layout import EB_KEYS, SPEC_KEYS, expected_tensors
from synthetic_checkpoint import write_synthetic_tokenizer

V = 262_144
SLIDING, FULL = "sliding_attention", "full_attention"
# docs/model.md#released-geometry, #top-level-config: the released config.json (form A)
RELEASED_TEXT = dict(
    model_type="diffusion_gemma_text", vocab_size=V, hidden_size=2816, intermediate_size=2112,
    moe_intermediate_size=704, num_hidden_layers=30, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
    global_head_dim=512, num_global_key_value_heads=2, layer_types=([SLIDING] * 5 + [FULL]) * 5,
    sliding_window=1024, max_position_embeddings=262_144, rms_norm_eps=1e-6, num_experts=128, top_k_experts=8,
    hidden_activation="gelu_pytorch_tanh", use_bidirectional_attention="vision", tie_word_embeddings=True,
    attention_bias=False, pad_token_id=0, eos_token_id=1, bos_token_id=2,
    rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                     FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}},
)
RELEASED = dict(architectures=["DiffusionGemmaForBlockDiffusion"], model_type="diffusion_gemma", canvas_length=256,
                boi_token_id=255_999, eoi_token_id=258_882, image_token_id=258_880, tie_word_embeddings=True,
                eos_token_id=[1, 106, 50], text_config=RELEASED_TEXT, vision_config={"model_type": "gemma4_vision"})
# element count of Unsloth's Q8_0 file (spec: 25,250,987,068)
DUMP_ELEMENTS = 25_250_987_068


@pytest.fixture(scope="module")
def released_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("released") / "diffusiongemma-26B-A4B-it"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(RELEASED))
    write_synthetic_tokenizer(folder, V)
    return folder


def counts(p) -> Counter:
    return Counter(T(t.ggml_type).name for t in p.tensors)


def test_q8_0_inventory(released_dir):
    p = plan(released_dir, "q8_0")
    assert len(p.tensors) == 692
    assert counts(p) == {"F32": 423, "Q8_0": 269}
    assert sum(t.spec.n_elements for t in p.tensors) == DUMP_ELEMENTS
    # names and shapes as the tensor table of docs/gguf.md prescribes for this config
    assert {t.name: t.spec.ne for t in p.tensors} == expected_tensors(RELEASED_TEXT, V)
    assert {kv.key for kv in p.metadata} == SPEC_KEYS | EB_KEYS
    kv = {m.key: m.value for m in p.metadata}
    assert kv["general.size_label"] == "128x2.6B"
    assert kv["general.file_type"] == 7
    assert kv["diffusion-gemma.attention.head_count_kv"] == [8, 8, 8, 8, 8, 2] * 5
    assert kv["diffusion-gemma.attention.sliding_window_pattern"] == [True] * 5 + [False] + ([True] * 5 + [False]) * 4
    assert (kv["diffusion-gemma.attention.key_length"], kv["diffusion-gemma.attention.key_length_swa"]) == (512, 256)
    assert (kv["diffusion-gemma.rope.dimension_count"], kv["diffusion-gemma.rope.dimension_count_swa"]) == (512, 256)
    assert kv["diffusion.canvas_length"] == 256
    # Q8_0: 26.9 GB (25.0 GiB) in the table of docs/gguf.md#quant-mixes
    assert 24.9 < p.total_bytes / 2**30 < 25.2


@pytest.mark.parametrize("outtype, mix, gib", [
    ("q4_k_m", {"F32": 423, "Q5_0": 33, "Q8_0": 28, "Q4_K": 194, "Q6_K": 14}, 15.6),
    ("q5_k_m", {"F32": 423, "Q5_1": 33, "Q8_0": 28, "Q5_K": 194, "Q6_K": 14}, 17.8),
    ("q6_k", {"F32": 423, "Q6_K": 208, "Q8_0": 61}, 21.1),
    ("bf16", {"F32": 423, "BF16": 269}, 47.1),
])
def test_type_mixes(released_dir, outtype, mix, gib):
    p = plan(released_dir, outtype)
    assert counts(p) == mix
    assert abs(p.total_bytes / 2**30 - gib) < 0.15


def test_q4_k_m_per_tensor_choices(released_dir):
    """docs/gguf.md#type-policy rules 3 and 4: which attn_v and ffn_down tensors get Q6_K / Q8_0."""
    types = {t.name: T(t.ggml_type) for t in plan(released_dir, "q4_k_m").tensors}
    assert types["token_embd.weight"] == T.Q6_K
    q6_v = {int(n.split(".")[1]) for n, t in types.items() if n.endswith("attn_v.weight") and t == T.Q6_K}
    assert q6_v == {0, 1, 2, 6, 9, 13, 16, 20, 24, 25, 26, 27, 28}
    q8_down = {int(n.split(".")[1]) for n, t in types.items() if ".ffn_down" in n and t == T.Q8_0}
    assert q8_down == {0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29}
    assert all(types[f"blk.{i}.ffn_down_exps.weight"] == T.Q8_0 for i in q8_down)
    assert types["self_cond_down.weight"] == T.Q5_0
    assert all(t == T.F32 for n, t in types.items() if n.endswith("ffn_gate_inp.weight"))


def test_form_b_with_zero_padded_layer_keys_gives_the_same_plan(released_dir, tmp_path):
    """Form B (per_layer_config, keys "05", "11", ...) describes the same model as the released form A."""
    text = {k: v for k, v in RELEASED_TEXT.items() if k not in ("global_head_dim", "num_global_key_value_heads")}
    text["per_layer_config"] = {f"{i:02d}": {"head_dim": 512, "num_key_value_heads": 2} for i in (5, 11, 17, 23, 29)}
    form_b = tmp_path / released_dir.name
    form_b.mkdir()
    (form_b / "config.json").write_text(json.dumps({**RELEASED, "text_config": text}))
    for f in released_dir.iterdir():
        if f.name != "config.json":
            (form_b / f.name).symlink_to(f)
    a, b = plan(released_dir, "q4_k_m"), plan(form_b, "q4_k_m")
    assert a.metadata == b.metadata
    assert a.tensors == b.tensors
