"""config.json / generation_config.json handling, checked through plan() (reads JSON only, no weights)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from dgemma_convert import ConvertError, plan
from synthetic_checkpoint import SLIDING, FULL, text_config, write_config, write_synthetic_tokenizer


@pytest.fixture
def folder(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    write_config(d, text_config())
    write_synthetic_tokenizer(d, 400)
    return d


def metadata(folder, outtype="f32") -> dict:
    return {kv.key: kv.value for kv in plan(folder, outtype).metadata}


def edit(path, change):
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def test_sampler_keys_follow_generation_config(folder):
    (folder / "generation_config.json").write_text(json.dumps(
        {"max_denoising_steps": 12, "t_min": 0.25, "t_max": 0.9, "stability_threshold": 3,
         "confidence_threshold": 0.5, "sampler_config": {"_cls_name": "EntropyBoundSamplerConfig",
                                                        "entropy_bound": 0.2}}))
    kv = metadata(folder)
    assert (kv["diffusion.eb_max_steps"], kv["diffusion.eb_stability_threshold"]) == (12, 3)
    assert (kv["diffusion.eb_t_min"], kv["diffusion.eb_t_max"]) == (0.25, 0.9)
    assert (kv["diffusion.eb_entropy_bound"], kv["diffusion.eb_confidence_threshold"]) == (0.2, 0.5)


@pytest.mark.parametrize("gen", [None, {"max_denoising_steps": None, "t_min": None, "t_max": None,
                                        "sampler_config": None, "stability_threshold": None,
                                        "confidence_threshold": None}])
def test_missing_or_null_sampler_fields_mean_transformers_defaults(folder, gen):
    if gen is None:
        (folder / "generation_config.json").unlink()
    else:  # what a freshly built transformers model writes
        (folder / "generation_config.json").write_text(json.dumps(gen))
    kv = metadata(folder)
    assert [kv[f"diffusion.eb_{k}"] for k in ("max_steps", "t_min", "t_max", "entropy_bound",
                                               "stability_threshold", "confidence_threshold")] == \
        [48, 0.4, 0.8, 0.1, 1, 0.005]


@pytest.mark.parametrize("gen, message", [
    ({"t_min": 0.9, "t_max": 0.8}, "t_min < t_max"),
    ({"max_denoising_steps": 0}, "max_denoising_steps"),
    ({"sampler_config": {"_cls_name": "TopKSamplerConfig"}}, "unsupported sampler"),
])
def test_invalid_sampler_settings(folder, gen, message):
    (folder / "generation_config.json").write_text(json.dumps(gen))
    with pytest.raises(ConvertError, match=message):
        plan(folder, "f32")


def test_default_layer_types_and_forced_last_full_layer(folder):
    """Without layer_types every 6th layer is full; the last layer is always full (as in transformers)."""
    edit(folder / "config.json", lambda c: c["text_config"].update(num_hidden_layers=8, layer_types=None))
    kv = metadata(folder)
    assert kv["diffusion-gemma.attention.sliding_window_pattern"] == [True] * 5 + [False, True, False]
    edit(folder / "config.json", lambda c: c["text_config"].update(num_hidden_layers=2, layer_types=[FULL, SLIDING]))
    assert metadata(folder)["diffusion-gemma.attention.sliding_window_pattern"] == [False, False]


def test_rope_freqs_follow_the_partial_rotary_factor(folder):
    edit(folder / "config.json", lambda c: c["text_config"].update(rope_parameters={
        FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 5e5},
        SLIDING: {"rope_type": "default", "rope_theta": 1e4}}))
    p = plan(folder, "f32")
    from dgemma_convert.tensor_map import rope_freqs

    freqs = rope_freqs(p.config)  # global_head_dim 256: 128 pairs, 64 of them rotating
    assert freqs.tolist() == np.array([1.0] * 64 + [1e30] * 64, dtype=np.float32).tolist()
    assert {kv.key: kv.value for kv in p.metadata}["diffusion-gemma.rope.freq_base"] == 5e5


@pytest.mark.parametrize("change, message", [
    (lambda c: c.pop("text_config"), "text_config"),
    (lambda c: c["text_config"].update(model_type="gemma4_text"), "text_config.model_type"),
    (lambda c: c["text_config"].update(attention_bias=True), "attention_bias"),
    (lambda c: c["text_config"].update(num_experts=None), "num_experts"),
    (lambda c: c["text_config"].update(hidden_size="64"), "hidden_size"),
    (lambda c: c["text_config"].update(num_key_value_heads=3), "not a multiple"),
    (lambda c: c["text_config"].update(rope_parameters={FULL: {"rope_type": "yarn"}}), "rope_type"),
    (lambda c: c["text_config"].update(per_layer_config={"x": {}}), "per_layer_config"),
    (lambda c: c["text_config"].update(vocab_size=100), "tokenizer has 400 tokens"),
])
def test_config_errors(folder, change, message):
    edit(folder / "config.json", change)
    with pytest.raises(ConvertError, match=message):
        plan(folder, "f32")


def test_invalid_json_is_a_clear_error(folder):
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ConvertError, match="not valid JSON"):
        plan(folder, "f32")
