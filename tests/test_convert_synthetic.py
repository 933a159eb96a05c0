"""Conversion of synthetic checkpoints (no torch): real K-quants (256-wide rows), bf16 shards, untied head."""
from __future__ import annotations

import json

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from dgemma_convert import convert
from spec_layout import check_layout, check_values, read_gguf
from synthetic_checkpoint import hf_tensors, text_config, write_synthetic_checkpoint

N_TOKENS = 400  # fewer tokenizer entries than vocab_size (512): token_embd is truncated to 400 rows


def load_weights(folder) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    weights = {}
    for f in sorted(folder.glob("*.safetensors")):
        weights.update(load_file(str(f)))
    return weights


def load_weights_bf16(folder) -> dict[str, np.ndarray]:
    """safetensors.numpy cannot read bf16: decode the raw bytes (independent of the converter's reader)."""
    weights = {}
    for f in sorted(folder.glob("*.safetensors")):
        raw = f.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + n])
        for name, info in header.items():
            if name == "__metadata__":
                continue
            b, e = info["data_offsets"]
            u16 = np.frombuffer(raw[8 + n + b:8 + n + e], dtype="<u2")
            weights[name] = (u16.astype(np.uint32) << 16).view(np.float32).reshape(info["shape"])
    return weights


@pytest.fixture(scope="module")
def kquant_checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("synthetic") / "kq"
    return write_synthetic_checkpoint(folder, text_config(), n_tokens=N_TOKENS)


@pytest.mark.parametrize("outtype", ["q4_k_m", "q5_k_m", "q6_k", "q4_0", "bf16"])
def test_k_quants_on_256_wide_rows(tmp_path, kquant_checkpoint, outtype):
    out = tmp_path / "out.gguf"
    convert(kquant_checkpoint, out, outtype, threads=2)
    config = json.loads((kquant_checkpoint / "config.json").read_text())
    check_layout(out, config, N_TOKENS, outtype)
    check_values(out, load_weights(kquant_checkpoint), config, N_TOKENS)
    _, tensors, _ = read_gguf(out)
    types = {T(t.tensor_type) for t in tensors.values()}
    if outtype in ("q4_k_m", "q5_k_m"):  # a real mix: base K-quant, Q6_K bumps and 32-wide fallbacks
        base, fallback = (T.Q4_K, T.Q5_0) if outtype == "q4_k_m" else (T.Q5_K, T.Q5_1)
        assert {base, T.Q6_K, fallback, T.Q8_0} <= types
        assert T(tensors["token_embd.weight"].tensor_type) == T.Q6_K


def test_sharded_bf16_checkpoint(tmp_path):
    """Three shards through the index; bf16 -> bf16 is a byte copy, bf16 -> f32 exact, the untied head kept."""
    text = text_config(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, head_dim=32,
                       global_head_dim=64, num_experts=4, top_k_experts=2)
    folder = write_synthetic_checkpoint(tmp_path / "ckpt", text, dtype="BF16", n_shards=3, n_tokens=N_TOKENS)
    assert len(list(folder.glob("*.safetensors"))) == 3
    weights = load_weights_bf16(folder)
    config = json.loads((folder / "config.json").read_text())
    for outtype in ("bf16", "f32", "q8_0"):
        out = tmp_path / f"{outtype}.gguf"
        convert(folder, out, outtype, threads=2)
        check_layout(out, config, N_TOKENS, outtype)
        check_values(out, weights, config, N_TOKENS)


def test_untied_checkpoint_writes_output_weight(tmp_path):
    text = text_config(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, head_dim=32,
                       global_head_dim=64)
    folder = write_synthetic_checkpoint(tmp_path / "ckpt", text, n_tokens=N_TOKENS)
    config = json.loads((folder / "config.json").read_text())
    config["tie_word_embeddings"] = False
    (folder / "config.json").write_text(json.dumps(config))
    from safetensors.numpy import load_file, save_file

    weights = load_file(str(folder / "model.safetensors"))
    head = np.random.default_rng(5).standard_normal((512, 64)).astype(np.float32)
    save_file({**weights, "lm_head.weight": head}, str(folder / "model.safetensors"))
    out = tmp_path / "out.gguf"
    convert(folder, out, "q4_k_m", threads=2)
    _, tensors, _ = read_gguf(out)
    # with a real output tensor, the output gets the Q6_K/Q8_0 treatment and token_embd keeps the base rules
    assert tensors["output.weight"].shape.tolist() == [64, N_TOKENS]
    assert T(tensors["output.weight"].tensor_type) == T.Q8_0  # 64 is not a multiple of 256
    assert T(tensors["token_embd.weight"].tensor_type) == T.Q5_0  # Q4_K falls back on 64-wide rows
    from gguf import quants

    got = quants.dequantize(np.asarray(tensors["output.weight"].data), T.Q8_0)
    assert np.array_equal(np.asarray(tensors["output.weight"].data).reshape(-1),
                          quants.quantize(head[:N_TOKENS], T.Q8_0).reshape(-1))
    assert got.shape == (N_TOKENS, 64)


def test_synthetic_tensor_list_matches_spec_count():
    """The helper's checkpoint has what docs/model.md#hf-checkpoint-tensors lists (sanity of the test helper itself)."""
    names = [n for n, _ in hf_tensors(text_config())]
    assert sum(n.startswith("model.decoder.layers.0.") for n in names) == 22  # sliding: with v_proj
    assert sum(n.startswith("model.decoder.layers.1.") for n in names) == 21  # full: no v_proj
