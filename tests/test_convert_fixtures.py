"""`dgemma convert` on the committed tiny checkpoints: layout per docs/gguf.md, exact values, both config forms."""
from __future__ import annotations

import json
import shutil

import pytest
from safetensors.numpy import load_file

from conftest import FIXTURES
from spec_layout import check_layout, check_values

FIXTURE_NAMES = ["tiny-a", "tiny-b"]
OUTTYPES = ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_k_m", "q5_k_m", "q6_k"]


def n_tokens(folder) -> int:
    tok = json.loads((folder / "tokenizer.json").read_text())
    return len({*tok["model"]["vocab"].values(), *(t["id"] for t in tok.get("added_tokens", []))})


@pytest.fixture(scope="module")
def checkpoints():
    return {name: load_file(str(FIXTURES / name / "model.safetensors")) for name in FIXTURE_NAMES}


@pytest.mark.parametrize("outtype", OUTTYPES)
@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_fixture_converts_to_spec_layout(gguf_path, checkpoints, name, outtype):
    folder = FIXTURES / name
    config = json.loads((folder / "config.json").read_text())
    path = gguf_path(name, outtype)
    check_layout(path, config, n_tokens(folder), outtype)
    check_values(path, checkpoints[name], config, n_tokens(folder))


@pytest.mark.parametrize("outtype", ["f32", "q4_k_m"])
@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_config_forms_a_and_b_give_identical_files(tmp_path, gguf_path, name, outtype):
    """The fixture's other serialized config form must produce the same bytes (same folder name: same general.name)."""
    folder = FIXTURES / name
    (other,) = folder.glob("config_form_*.json")
    variant = tmp_path / name
    variant.mkdir()
    for f in folder.iterdir():
        if f.is_file() and f.name != "config.json":
            (variant / f.name).symlink_to(f)
    shutil.copy(other, variant / "config.json")
    assert json.loads((variant / "config.json").read_text()) != json.loads((folder / "config.json").read_text())

    from dgemma_convert import convert

    out = tmp_path / "variant.gguf"
    convert(variant, out, outtype, threads=2)
    assert out.read_bytes() == gguf_path(name, outtype).read_bytes()


@pytest.mark.parametrize("outtype", ["q8_0", "q4_k_m"])
def test_requantizing_the_f32_gguf_equals_direct_conversion(tmp_path, gguf_path, outtype):
    from dgemma_convert import requantize

    out = tmp_path / "requantized.gguf"
    requantize(gguf_path("tiny-a", "f32"), out, outtype, threads=2)
    assert out.read_bytes() == gguf_path("tiny-a", outtype).read_bytes()


def test_requantizing_a_quantized_gguf_is_refused(tmp_path, gguf_path):
    from dgemma_convert import ConvertError, requantize

    with pytest.raises(ConvertError, match="only F32, F16 or BF16"):
        requantize(gguf_path("tiny-a", "q8_0"), tmp_path / "x.gguf", "q4_0")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_tokenizer_keys(gguf_path, name):
    """tokenizer.* keys straight from tokenizer.json / tokenizer_config.json / chat_template.jinja
    (docs/gguf.md#tokenizer-keys)."""
    import re

    from spec_layout import read_gguf

    folder = FIXTURES / name
    tok = json.loads((folder / "tokenizer.json").read_text())
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    kv, _, _ = read_gguf(gguf_path(name, "f32"))
    by_id = {i: t for t, i in tok["model"]["vocab"].items()} | {a["id"]: a["content"] for a in tok["added_tokens"]}
    assert kv["tokenizer.ggml.tokens"] == [by_id[i] for i in range(len(by_id))]
    assert kv["tokenizer.ggml.merges"] == [f"{a} {b}" for a, b in tok["model"]["merges"]]
    assert kv["tokenizer.chat_template"] == (folder / "chat_template.jinja").read_text()
    ids = {t: i for i, t in by_id.items()}
    for role, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("unk", "unknown_token_id"),
                      ("pad", "padding_token_id"), ("mask", "mask_token_id")):
        assert kv[f"tokenizer.ggml.{key}"] == ids[tok_config[f"{role}_token"]]
    assert (kv["tokenizer.ggml.bos_token_id"], kv["tokenizer.ggml.eos_token_id"]) == (2, 1)
    types = kv["tokenizer.ggml.token_type"]
    for i, t in by_id.items():
        if re.fullmatch(r"<0x[0-9A-F]{2}>", t):
            assert types[i] == 6, t  # BYTE
        elif any(a["id"] == i and a["special"] for a in tok["added_tokens"]):
            assert types[i] == 3, t  # CONTROL
        else:
            assert types[i] == 1, t  # NORMAL
    assert set(kv["tokenizer.ggml.scores"]) == {-1000.0}
    assert kv["tokenizer.ggml.add_bos_token"] is True and kv["tokenizer.ggml.add_space_prefix"] is False


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_sampler_keys_come_from_generation_config(gguf_path, name):
    from spec_layout import read_gguf

    gen = json.loads((FIXTURES / name / "generation_config.json").read_text())
    kv, _, _ = read_gguf(gguf_path(name, "f32"))
    assert kv["diffusion.eb_max_steps"] == gen["max_denoising_steps"]
    assert kv["diffusion.eb_stability_threshold"] == gen["stability_threshold"]
    for key, value in (("t_min", gen["t_min"]), ("t_max", gen["t_max"]),
                       ("entropy_bound", gen["sampler_config"]["entropy_bound"]),
                       ("confidence_threshold", gen["confidence_threshold"])):
        assert kv[f"diffusion.eb_{key}"] == pytest.approx(value, rel=1e-7)  # stored as float32
