"""`dgemma convert --mmproj-outfile`: the vision projector GGUF in llama.cpp's mtmd "gemma4v" layout.

The expected keys and tensors below were written from llama.cpp's sources (ggml-org/llama.cpp as mirrored by
unslothai/llama.cpp): conversion/base.py (`MmprojModel.set_gguf_parameters`: the `clip.vision.*` keys, image
mean/std, projection_dim = the text hidden size), conversion/gemma.py (`Gemma4VisionAudioModel`: projector type
"gemma4v", layer_norm_epsilon, the patch embedding reshaped to a [H, 3, p, p] kernel, the position table forced to
F32), gguf-py/gguf/tensor_mapping.py + constants.py (the V_* names: v.patch_embd, v.position_embd, v.blk.N.{ln1,
attn_q, attn_k, attn_v, attn_out, attn_q_norm, attn_k_norm, attn_post_norm, ln2, ffn_gate, ffn_up, ffn_down,
ffn_post_norm}, v.std_bias, v.std_scale, mm.input_projection), tools/mtmd/clip-impl.h (KEY_* / TN_* strings) and
tools/mtmd/clip.cpp (what its gemma4v loader reads: the required keys, the optional scale_factor = pooling kernel,
the clip bounds as `<linear>.input_min` … scalars).
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T, GGUFReader, quants

from dgemma_convert import ConvertError, convert_mmproj, plan_mmproj
from dgemma_convert.safetensors_reader import Checkpoint
from dgemma_engine import gguf_keys
from dgemma_engine.arch import CLIP_ARCH, PROJECTOR_GEMMA4V

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "vision-e"
TOWER = "model.encoder.vision_tower."

# key -> value for vision-e (H 64, FF 80, 2 layers, 4/2 heads of 16, patch 4, pooling 2, text H 48)
EXPECTED_KEYS = {
    "general.architecture": "clip",
    "general.type": "mmproj",
    "general.name": "vision-e-mmproj",
    "clip.has_vision_encoder": True,
    "clip.projector_type": "gemma4v",
    "clip.use_gelu": True,  # gelu_pytorch_tanh; without it mtmd would use gelu_quick
    "clip.vision.projection_dim": 48,
    "clip.vision.image_size": 224,  # required by mtmd, unused by gemma4v (llama.cpp writes 224)
    "clip.vision.patch_size": 4,
    "clip.vision.embedding_length": 64,
    "clip.vision.feed_forward_length": 80,
    "clip.vision.block_count": 2,
    "clip.vision.attention.head_count": 4,
    "clip.vision.attention.head_count_kv": 2,
    "clip.vision.attention.head_dim": 16,
    "clip.vision.attention.layer_norm_epsilon": pytest.approx(1e-6),
    "clip.vision.image_mean": [0.0, 0.0, 0.0],
    "clip.vision.image_std": [1.0, 1.0, 1.0],
    "clip.vision.projector.scale_factor": 2,
    "dgemma.vision.max_soft_tokens": 70,
    "dgemma.vision.rope.freq_base": 100.0,
}
LINEARS = {"attn_q": (64, 64), "attn_k": (64, 32), "attn_v": (64, 32), "attn_out": (64, 64), "ffn_gate": (64, 80),
           "ffn_up": (64, 80), "ffn_down": (80, 64)}  # ne of each layer's clippable linear


def expected_tensors() -> dict[str, tuple[int, ...]]:
    """GGUF name -> ne, in file order."""
    out = {"v.patch_embd.weight": (4, 4, 3, 64), "v.position_embd.weight": (64, 64, 2), "v.std_bias": (64,),
           "v.std_scale": (64,)}
    for i in range(2):
        b = f"v.blk.{i}."
        out[b + "ln1.weight"] = (64,)
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            out[b + name + ".weight"] = LINEARS[name]
        out[b + "attn_q_norm.weight"] = out[b + "attn_k_norm.weight"] = (16,)
        out[b + "attn_post_norm.weight"] = out[b + "ln2.weight"] = (64,)
        for name in ("ffn_gate", "ffn_up", "ffn_down"):
            out[b + name + ".weight"] = LINEARS[name]
        out[b + "ffn_post_norm.weight"] = (64,)
        for name in LINEARS:
            for bound in ("input_min", "input_max", "output_min", "output_max"):
                out[f"{b}{name}.{bound}"] = (1,)
    out["mm.input_projection.weight"] = (64, 48)
    return out


def field_value(field):
    value = field.contents()
    return value.item() if hasattr(value, "item") else value


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, GGUFReader]:
    folder = tmp_path_factory.mktemp("mmproj")
    return {t: GGUFReader(str(convert_mmproj(FIXTURE, folder / f"{t}.gguf", t).path)) for t in ("f32", "f16", "q8_0")}


@pytest.fixture(scope="module")
def checkpoint():
    with Checkpoint.open(FIXTURE) as ckpt:
        yield {name: next(ckpt.iter_rows_f32(e, 1 << 24)).reshape(e.shape) for name, e in ckpt.entries.items()}


def test_the_keys_are_mtmds(converted):
    fields = {k: f for k, f in converted["f32"].fields.items() if not k.startswith("GGUF.")}
    assert set(fields) == set(EXPECTED_KEYS) | {"general.file_type"}
    for key, want in EXPECTED_KEYS.items():
        assert field_value(fields[key]) == want, key
    assert [field_value(converted[t].fields["general.file_type"]) for t in ("f32", "f16", "q8_0")] == [0, 1, 7]


def test_the_tensors_are_mtmds(converted):
    want = expected_tensors()
    for outtype, reader in converted.items():
        got = {t.name: tuple(int(d) for d in t.shape) for t in reader.tensors}
        assert list(got) == list(want), outtype  # names and file order
        assert got == want, outtype


def tensor_types(reader: GGUFReader) -> dict[str, T]:
    return {t.name: T(t.tensor_type) for t in reader.tensors}


def test_the_type_policy(converted):
    """llama.cpp's for mmproj files: 1-D and the position table F32 always; the patch kernel F16 only in an F16
    file; matrices the output type, and Q8_0 rows that are not a multiple of 32 (ffn_down's 80) fall back to F16."""
    for outtype, reader in converted.items():
        for name, t in tensor_types(reader).items():
            ne = expected_tensors()[name]
            if len(ne) == 1 or name == "v.position_embd.weight":
                want = T.F32
            elif name == "v.patch_embd.weight":
                want = T.F16 if outtype == "f16" else T.F32
            elif outtype == "q8_0" and ne[0] % 32:
                want = T.F16
            else:
                want = {"f32": T.F32, "f16": T.F16, "q8_0": T.Q8_0}[outtype]
            assert t == want, (outtype, name)
    assert tensor_types(converted["q8_0"])["v.blk.0.ffn_down.weight"] == T.F16
    assert tensor_types(converted["q8_0"])["v.blk.0.ffn_up.weight"] == T.Q8_0


def source_of(name: str) -> str:
    """The checkpoint tensor of a GGUF name (the inverse map, written out here independently of convert/mmproj.py)."""
    table = {"ln1.weight": "input_layernorm.weight", "attn_q_norm.weight": "self_attn.q_norm.weight",
             "attn_k_norm.weight": "self_attn.k_norm.weight",
             "attn_post_norm.weight": "post_attention_layernorm.weight", "ln2.weight": "pre_feedforward_layernorm.weight",
             "ffn_post_norm.weight": "post_feedforward_layernorm.weight"}
    linear = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
              "attn_out": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
              "ffn_down": "mlp.down_proj"}
    fixed = {"v.patch_embd.weight": TOWER + "patch_embedder.input_proj.weight",
             "v.position_embd.weight": TOWER + "patch_embedder.position_embedding_table",
             "v.std_bias": TOWER + "std_bias", "v.std_scale": TOWER + "std_scale",
             "mm.input_projection.weight": "model.encoder.embed_vision.embedding_projection.weight"}
    if name in fixed:
        return fixed[name]
    i, rest = re.fullmatch(r"v\.blk\.(\d+)\.(.+)", name).groups()
    layer = f"{TOWER}encoder.layers.{i}."
    if rest in table:
        return layer + table[rest]
    stem, suffix = rest.split(".")
    return layer + linear[stem] + (".linear.weight" if suffix == "weight" else "." + suffix)


def expected_values(name: str, checkpoint) -> np.ndarray:
    value = checkpoint[source_of(name)]
    if name == "v.patch_embd.weight":  # [H, p·p·3] in (row, column, channel) -> the [H, 3, p, p] kernel
        value = value.reshape(64, 4, 4, 3).transpose(0, 3, 1, 2)
    return np.ascontiguousarray(value, dtype=np.float32).reshape(-1)


def test_f32_values_are_the_checkpoints(converted, checkpoint):
    for t in converted["f32"].tensors:
        assert np.array_equal(np.asarray(t.data).reshape(-1), expected_values(t.name, checkpoint)), t.name


def test_f16_and_q8_0_values_within_their_rounding(converted, checkpoint):
    for t in converted["f16"].tensors:
        want = expected_values(t.name, checkpoint)
        got = np.asarray(t.data).reshape(-1).astype(np.float32)
        assert np.array_equal(got, want.astype(np.float16).astype(np.float32) if t.tensor_type == T.F16 else want)
    for t in converted["q8_0"].tensors:
        want = expected_values(t.name, checkpoint)
        if t.tensor_type != T.Q8_0:
            continue
        got = quants.dequantize(np.asarray(t.data), T.Q8_0).reshape(-1)
        blocks = want.reshape(-1, 32)
        step = np.abs(blocks).max(axis=1, keepdims=True) / 127  # the block scale, stored as F16 (2^-11 relative)
        assert (np.abs(got.reshape(-1, 32) - blocks) <= 0.5 * step + np.abs(blocks) * 2.0 ** -10).all(), t.name


def test_a_checkpoint_without_a_vision_tower_writes_no_projector(tmp_path):
    ckpt = tmp_path / "text-only"
    shutil.copytree(ROOT / "tests" / "fixtures" / "tiny-a", ckpt, ignore=shutil.ignore_patterns("golden"))
    config = json.loads((ckpt / "config.json").read_text())
    del config["vision_config"]
    (ckpt / "config.json").write_text(json.dumps(config))
    assert plan_mmproj(ckpt, "f16") is None
    assert convert_mmproj(ckpt, tmp_path / "p.gguf") is None and not (tmp_path / "p.gguf").exists()
    result = subprocess.run([sys.executable, "-m", "dgemma_cli.main", "convert", str(ckpt), "--outfile",
                             str(tmp_path / "m.gguf"), "--outtype", "f32", "--mmproj-outfile",
                             str(tmp_path / "mm.gguf")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"note: {ckpt} has no vision tower (no vision_config in config.json); no projector written"]
    assert (tmp_path / "m.gguf").is_file() and not (tmp_path / "mm.gguf").exists()


def test_the_cli_writes_both_files(tmp_path):
    result = subprocess.run([sys.executable, "-m", "dgemma_cli.main", "convert", str(ROOT / "tests/fixtures/tiny-a"),
                             "--outfile", str(tmp_path / "m.gguf"), "--outtype", "q4_k_m", "--mmproj-outfile",
                             str(tmp_path / "mm.gguf")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    reader = GGUFReader(str(tmp_path / "mm.gguf"))
    assert field_value(reader.fields["general.file_type"]) == 1  # a K-quant text model gets an F16 projector
    assert field_value(reader.fields["general.architecture"]) == CLIP_ARCH
    assert field_value(reader.fields["clip.projector_type"]) == PROJECTOR_GEMMA4V


@pytest.mark.parametrize("args, message", [
    (["--mmproj-outfile", "mm.gguf", "--mmproj-outtype", "q4_k"],
     "unknown projector output type 'q4_k'; choose one of f32, f16, bf16, q8_0"),
    (["--mmproj-outtype", "f16"], "--mmproj-outtype goes with --mmproj-outfile"),
])
def test_cli_errors_are_one_line(tmp_path, args, message):
    args = [str(tmp_path / a) if a.endswith(".gguf") else a for a in args]
    result = subprocess.run([sys.executable, "-m", "dgemma_cli.main", "convert", str(FIXTURE), "--outfile",
                             str(tmp_path / "m.gguf"), *args], capture_output=True, text=True, timeout=120)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and lines == [f"Error: {message}"], result.stderr
    assert list(tmp_path.iterdir()) == []  # checked before the text model is converted


def test_a_misshapen_vision_tensor_is_one_line(tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(FIXTURE, ckpt, ignore=shutil.ignore_patterns("golden-*", "images"))
    config = json.loads((ckpt / "config.json").read_text())
    config["vision_config"]["intermediate_size"] = 96
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConvertError, match=r"tensor '.*layers\.0\.mlp\.gate_proj\.linear\.weight' has shape \[80, 64\] "
                                           r"but config.json implies \[96, 64\]"):
        convert_mmproj(ckpt, tmp_path / "p.gguf", "f32")
    assert not (tmp_path / "p.gguf").exists()
    config["vision_config"]["intermediate_size"] = 80
    config["vision_config"]["hidden_activation"] = "silu"
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConvertError, match="unsupported vision hidden_activation 'silu'"):
        plan_mmproj(ckpt, "f32")


def test_the_c_names_are_the_python_ones():
    """csrc/engine/vision_names.h spells the same keys and tensor names the converter writes."""
    header = (ROOT / "ggml_ext/csrc/engine/gguf_names.h").read_text(encoding="utf-8")
    header += (ROOT / "ggml_ext/csrc/engine/vision_names.h").read_text(encoding="utf-8")
    values: dict[str, str] = {}
    for name, body in re.findall(r'^#define\s+(DG_\w+)\s+([^\n(]*?)\s*(?://.*)?$', header, re.M):
        parts = re.findall(r'"[^"]*"|DG_\w+', body)
        if parts and all(p in values for p in parts if p.startswith("DG_")):  # DG_GGUF_KEY(...) ones are skipped
            values[name] = "".join(values[p] if p.startswith("DG_") else p[1:-1] for p in parts)
    c_keys = {v for k, v in values.items() if k.startswith("DG_V_KEY_")}
    py_keys = {v for k, v in vars(gguf_keys).items() if k.startswith(("KEY_CLIP_", "KEY_VISION_"))}
    read_only = {gguf_keys.KEY_ARCHITECTURE}
    optional_for_us = {gguf_keys.KEY_CLIP_USE_GELU, gguf_keys.KEY_VISION_IMAGE_SIZE, gguf_keys.KEY_VISION_IMAGE_MEAN,
                       gguf_keys.KEY_VISION_IMAGE_STD}  # written for mtmd; the engine needs none of them
    assert c_keys - read_only == py_keys - optional_for_us
    assert values["DG_V_ARCH"] == CLIP_ARCH and values["DG_V_PROJECTOR_GEMMA4V"] == PROJECTOR_GEMMA4V
    c_tensors = {v for k, v in values.items() if k.startswith("DG_V_TENSOR_")}
    block = {v for k, v in values.items() if k.startswith("DG_V_") and not k.startswith(("DG_V_KEY_", "DG_V_TENSOR_"))}
    for name in expected_tensors():
        m = re.fullmatch(r"v\.blk\.\d+\.(.+)", name)
        if m is None:
            assert name in c_tensors, name
        else:
            suffix = m.group(1)
            assert suffix in block or suffix.split(".")[0] in block and suffix.split(".")[1] in block | {"weight"}, name
