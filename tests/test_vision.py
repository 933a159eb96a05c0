"""The vision encoder (dgemma_engine.vision, csrc/engine/vision.c) against transformers' Gemma 4 vision tower.

Goldens: tests/fixtures/vision-e/golden-*.npz, written by tests/reference/make_vision_goldens.py (a 2-layer GQA tower
with standardize and clip bounds; six images of different sizes and aspect ratios). `prepare_image` must give the
HF processor's patches bit for bit; the F32 projector must give `get_image_features(...).pooler_output` within 1e-4
(measured: 7.4e-7, at transformers' own fp32-vs-fp64 floor of 5e-7..8e-7). The F16 and Q8_0 tolerances come from the
weights' rounding: F16 weights and activations each round to 2^-11 relative (measured relative RMS 1.3e-3, bound
3e-3); BF16 rounds both to 2^-8 (measured 1.1 %, bound 2.5 %); Q8_0 rounds each weight to 1/254 of its block's
largest magnitude, which alone moves this sharp tiny tower by
1.9-2.3 % relative RMS (the F32 path on the file's dequantized weights), plus as much again from the Q8 activations:
measured 2.7-3.2 %, bound 5 % (and the largest error within 8 % of the largest feature).
"""
from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dgemma_convert import convert_mmproj
from dgemma_engine.errors import EngineError
from dgemma_engine.vision import PreparedImage, Projector, VisionGeometry, prepare_image, target_size
from gguf_mutator import KV, Tensor, read, write

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "vision-e"
NAMES = ("square", "wide", "tall", "exact", "small", "strip")
# relative RMS error, largest error / largest |feature|
TOLERANCE = {"f16": (3e-3, 4e-3), "bf16": (2.5e-2, 3e-2), "q8_0": (5e-2, 8e-2)}


def golden(name: str) -> dict:
    return dict(np.load(FIXTURE / f"golden-{name}.npz"))


def rgb(name: str) -> np.ndarray:
    return np.asarray(Image.open(FIXTURE / "images" / f"{name}.png").convert("RGB"))


@pytest.fixture(scope="module")
def projectors(tmp_path_factory) -> dict[str, Projector]:
    folder = tmp_path_factory.mktemp("mmproj")
    out = {t: Projector.load(str(convert_mmproj(FIXTURE, folder / f"{t}.gguf", t).path), 2)
           for t in ("f32", "f16", "bf16", "q8_0")}
    yield out
    for p in out.values():
        p.close()


@pytest.fixture(scope="module")
def f32_file(projectors) -> Path:
    return Path(projectors["f32"].path)


# ---- preprocessing --------------------------------------------------------------------------------------------------

def test_the_geometry_comes_from_the_file(projectors):
    assert projectors["f32"].geometry == VisionGeometry(patch_size=4, pooling_kernel_size=2, max_soft_tokens=70,
                                                        n_embd_text=48)
    hp = projectors["f32"].hparams
    assert (hp.n_embd, hp.n_layer, hp.n_head, hp.n_head_kv, hp.n_pos_table) == (64, 2, 4, 2, 64)
    assert hp.has_standardize and hp.has_clip and hp.rope_base == 100.0


@pytest.mark.parametrize("name", NAMES)
def test_prepare_image_is_the_hf_processor(projectors, name):
    g = golden(name)
    image = prepare_image(rgb(name), projectors["f32"].geometry)
    assert image.n_soft_tokens == int(g["n_soft_tokens"])
    assert image.positions.dtype == np.int32 and np.array_equal(image.positions, g["positions"])
    assert image.patches.dtype == np.float32 and image.patches.shape == g["patches"].shape
    assert np.array_equal(image.patches, g["patches"])  # Pillow's BICUBIC, the same rescale: bit for bit


def test_the_target_size_keeps_the_aspect_ratio_within_the_budget():
    geo = VisionGeometry(patch_size=16, pooling_kernel_size=3, max_soft_tokens=280, n_embd_text=8)
    for h, w in [(768, 1024), (1024, 768), (100, 5000), (5000, 100), (1, 1), (224, 224)]:
        th, tw = target_size(h, w, geo)
        assert th % 48 == 0 and tw % 48 == 0 and th * tw <= 280 * 9 * 256, (h, w, th, tw)
    # by hand: factor sqrt(645120 / (768·1024)) = 0.9057; 695.6 px -> 14 blocks of 48, 927.4 px -> 19 blocks
    # (the function agreed with transformers' get_aspect_ratio_preserving_size on 80,000 random sizes offline)
    assert target_size(768, 1024, geo) == (672, 912)
    assert target_size(10, 5000, geo) == (48, 13440)  # one row of blocks, its width capped at 280 blocks
    assert target_size(5000, 10, geo) == (13440, 48)
    assert target_size(1, 1, geo) == (768, 768)  # upscaled


def test_an_image_that_fits_is_not_resized(projectors):
    pixels = rgb("exact")  # 56 x 80: exactly 70 blocks of 2x2 patches of 4 px
    image = prepare_image(pixels, projectors["f32"].geometry)
    back = image.patches.reshape(14, 20, 4, 4, 3).transpose(0, 2, 1, 3, 4).reshape(56, 80, 3)
    assert np.array_equal(back, (pixels * (1 / 255)).astype(np.float32))


@pytest.mark.parametrize("bad", [np.zeros((4, 4), np.uint8), np.zeros((4, 4, 4), np.uint8),
                                 np.zeros((4, 4, 3), np.float32), np.zeros((0, 4, 3), np.uint8)])
def test_a_bad_array_is_one_line(projectors, bad):
    with pytest.raises(EngineError) as info:
        prepare_image(bad, projectors["f32"].geometry)
    assert "\n" not in str(info.value)


# ---- the encoder against transformers -------------------------------------------------------------------------------

def encode_golden(projector: Projector, name: str) -> tuple[np.ndarray, np.ndarray]:
    g = golden(name)
    got = projector.encode(PreparedImage(g["patches"], g["positions"], int(g["n_soft_tokens"])))
    return got, g["features"]


@pytest.mark.parametrize("name", NAMES)
def test_f32_matches_transformers(projectors, name):
    got, ref = encode_golden(projectors["f32"], name)
    assert got.shape == ref.shape == (int(golden(name)["n_soft_tokens"]), 48)
    assert np.abs(got - ref).max() < 1e-4


@pytest.mark.parametrize("outtype", ["f16", "bf16", "q8_0"])
@pytest.mark.parametrize("name", ["square", "tall", "strip"])
def test_quantized_projectors_within_their_rounding(projectors, outtype, name):
    got, ref = encode_golden(projectors[outtype], name)
    rms, peak = TOLERANCE[outtype]
    assert np.sqrt(((got - ref) ** 2).mean() / (ref ** 2).mean()) < rms
    assert np.abs(got - ref).max() < peak * np.abs(ref).max()
    # and not trivially: the rounding is visible
    assert np.abs(got - ref).max() > 1e-5


def test_the_whole_path_from_the_png(projectors):
    got = projectors["f32"].encode(prepare_image(rgb("wide"), projectors["f32"].geometry))
    assert np.abs(got - golden("wide")["features"]).max() < 1e-4


def test_encoding_twice_gives_the_same_bits(projectors):
    a, _ = encode_golden(projectors["f32"], "small")
    b, _ = encode_golden(projectors["f32"], "small")
    assert np.array_equal(a, b)


def test_the_patch_order_matters(projectors):
    """A transposed patch (column, row) gives other features: the engine reads HF's (row, column, channel) order."""
    g = golden("square")
    swapped = g["patches"].reshape(-1, 4, 4, 3).transpose(0, 2, 1, 3).reshape(g["patches"].shape)
    got = projectors["f32"].encode(PreparedImage(np.ascontiguousarray(swapped), g["positions"], 64))
    assert np.abs(got - g["features"]).max() > 1e-2


# ---- bad input to encode ------------------------------------------------------------------------------------------

def bad_encode(projector: Projector, patches, positions, n_soft) -> str:
    with pytest.raises(EngineError) as info:
        projector.encode(PreparedImage(patches, positions, n_soft))
    assert "\n" not in str(info.value)
    return str(info.value)


def test_bad_images_are_refused(projectors):
    p = projectors["f32"]
    g = golden("square")
    patches, positions = g["patches"], g["positions"]
    assert "outside the position table" in bad_encode(p, patches, positions + np.int32([64, 0]), 64)
    assert "outside the position table" in bad_encode(p, patches, -positions - 1, 64)
    assert "multiple of 4 patches" in bad_encode(p, patches[:255], positions[:255], 63)
    assert "do not tile" in bad_encode(p, patches, np.zeros_like(positions), 64)
    big = np.zeros((284, 48), np.float32)
    grid = np.stack(np.meshgrid(np.arange(71 * 2 // 2), np.arange(4), indexing="xy"), -1).reshape(-1, 2)
    assert "at most 280" in bad_encode(p, big, grid.astype(np.int32)[:284], 71)
    assert "patches must be [n, 48]" in bad_encode(p, patches[:, :47], positions, 64)
    assert "claims" in bad_encode(p, patches, positions, 63) or "room" in bad_encode(p, patches, positions, 63)


def test_a_closed_projector_is_refused(f32_file):
    p = Projector.load(str(f32_file), 1)
    p.close()
    p.close()
    with pytest.raises(EngineError, match="closed"):
        p.encode(PreparedImage(np.zeros((4, 48), np.float32), np.zeros((4, 2), np.int32), 1))


# ---- malformed projector files --------------------------------------------------------------------------------------

def load_error(path: Path) -> str:
    with pytest.raises(EngineError) as info:
        Projector.load(str(path), 1)
    message = str(info.value)
    assert "\n" not in message and message.startswith("cannot load the projector")
    return message


def set_kv(kvs: list[KV], key: str, value) -> list[KV]:
    return [dataclasses.replace(kv, value=value) if kv.key == key else kv for kv in kvs]


def test_malformed_projectors_are_one_line(f32_file, tmp_path):
    kvs, tensors = read(f32_file)
    data = f32_file.read_bytes()

    (tmp_path / "cut.gguf").write_bytes(data[: len(data) - 1000])
    assert "outside" in load_error(tmp_path / "cut.gguf") or "truncated" in load_error(tmp_path / "cut.gguf")
    (tmp_path / "head.gguf").write_bytes(data[:20])
    assert "not a GGUF file" in load_error(tmp_path / "head.gguf")

    write(tmp_path / "type.gguf", set_kv(kvs, "clip.projector_type", "gemma3"), tensors)
    assert "unsupported projector type 'gemma3'" in load_error(tmp_path / "type.gguf")
    write(tmp_path / "arch.gguf", set_kv(kvs, "general.architecture", "diffusion-gemma"), tensors)
    assert "not a vision projector" in load_error(tmp_path / "arch.gguf")
    write(tmp_path / "nokey.gguf", [kv for kv in kvs if kv.key != "clip.vision.block_count"], tensors)
    assert "missing the required key 'clip.vision.block_count'" in load_error(tmp_path / "nokey.gguf")
    write(tmp_path / "layers.gguf", set_kv(kvs, "clip.vision.block_count", 3), tensors)
    assert "missing tensor 'v.blk.2.ln1.weight'" in load_error(tmp_path / "layers.gguf")
    write(tmp_path / "hd.gguf", set_kv(kvs, "clip.vision.attention.head_dim", 18), tensors)
    assert "multiple of 4" in load_error(tmp_path / "hd.gguf")

    def with_tensor(name: str, **change) -> list[Tensor]:
        return [dataclasses.replace(t, **change) if t.name == name else t for t in tensors]
    q = next(t for t in tensors if t.name == "v.blk.0.attn_q.weight")
    half = with_tensor(q.name, ne=(q.ne[1], q.ne[0] // 2), data=q.data[: len(q.data) // 2])
    write(tmp_path / "shape.gguf", kvs, half)
    assert "'v.blk.0.attn_q.weight' has shape [64, 32, 1, 1], expected [64, 64, 1, 1]" in load_error(
        tmp_path / "shape.gguf")
    norm = next(t for t in tensors if t.name == "v.blk.0.ln1.weight")
    write(tmp_path / "f16norm.gguf", kvs, with_tensor(norm.name, ggml_type=1, data=norm.data[: len(norm.data) // 2]))
    assert "unsupported type f16" in load_error(tmp_path / "f16norm.gguf")
    write(tmp_path / "nostd.gguf", kvs, [t for t in tensors if t.name != "v.std_scale"])
    assert "only one of v.std_bias and v.std_scale" in load_error(tmp_path / "nostd.gguf")
    bound = next(t for t in tensors if t.name == "v.blk.1.ffn_up.input_min")
    write(tmp_path / "nan.gguf", kvs, with_tensor(bound.name, data=np.float32([np.nan]).tobytes()))
    assert "is NaN" in load_error(tmp_path / "nan.gguf")
    write(tmp_path / "minmax.gguf", kvs, with_tensor(bound.name, data=np.float32([1e9]).tobytes()))
    assert "min > max" in load_error(tmp_path / "minmax.gguf")


def test_a_text_model_is_not_a_projector(tmp_path):
    from dgemma_convert import convert

    text = convert(FIXTURE.parent / "tiny-a", tmp_path / "text.gguf", "f32").path
    assert "general.architecture is 'diffusion-gemma'" in load_error(text)


def test_a_missing_file(tmp_path):
    assert "cannot open" in load_error(tmp_path / "nope.gguf")
    shutil.copy(FIXTURE / "config.json", tmp_path / "x.gguf")
    assert "GGUF" in load_error(tmp_path / "x.gguf")


# ---- the shared vision fixture tiny-v (tests/reference/make_vision_fixtures.py): its image goldens ------------------

TINY_V = FIXTURE.parent / "tiny-v"


@pytest.fixture(scope="module")
def tiny_v(tmp_path_factory) -> Projector:
    path = convert_mmproj(TINY_V, tmp_path_factory.mktemp("tiny-v") / "p.gguf", "f32").path
    with Projector.load(str(path), 2) as projector:
        yield projector


@pytest.mark.parametrize("name", ["square", "tall", "wide"])
def test_tiny_v_images(tiny_v, name):
    """tiny-v's processor output (padded to max_soft_tokens·k² rows, padding at position -1) and image features."""
    goldens = np.load(TINY_V / "golden" / "images.npz")
    image = prepare_image(np.asarray(Image.open(TINY_V / "images" / f"{name}.png").convert("RGB")), tiny_v.geometry)
    n = image.patches.shape[0]
    assert (goldens[f"{name}_position_ids"][n:] == -1).all() and (goldens[f"{name}_position_ids"][:n] >= 0).all()
    assert np.array_equal(image.patches, goldens[f"{name}_pixel_values"][:n])
    assert np.array_equal(image.positions, goldens[f"{name}_position_ids"][:n])
    features = goldens[f"{name}_features"]
    assert image.n_soft_tokens == features.shape[0]
    assert np.abs(tiny_v.encode(image) - features).max() < 1e-4
