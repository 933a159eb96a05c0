"""Build the tiny-v checkpoint (DiffusionGemma with a small vision tower) and its image goldens under tests/fixtures/tiny-v/.

    python3 tests/reference/make_vision_fixtures.py      # ~30 s; writes tests/fixtures/tiny-v/ and its SHA256SUMS

Needs torch==2.13.0, transformers==5.23.0 and Pillow (CPU, one thread); the tests read the files with numpy/json/PIL
only. The text model is tiny-a's recipe (make_fixtures.py) with `use_bidirectional_attention: "vision"` and a sliding
window chosen against the images' soft-token counts; the file formats are documented in tests/fixtures/README.md
(section 6). Reruns are byte-identical on the same machine (`cd tests/fixtures/tiny-v && sha256sum -c SHA256SUMS`).

Images go through transformers' Gemma 4 image processor (`Gemma4ImageProcessorPil`: the torchvision backend is not
installed here) and the prompt through the processor's own expansion code (`Gemma4Processor.replace_image_token`,
`ProcessorMixin.create_mm_token_type_ids`; the full `Gemma4Processor` cannot be built without torchvision).
Recordings follow `generate()`: transformers 5.23's plain encoder forward builds the vision block mask and then drops
it, so every manual prefill here passes `create_masks_for_generate`'s mapping as `attention_mask`, as generate does.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_fixtures import (  # noqa: E402
    FIXTURES, TINY_A, FixtureSpec, GenSpec, build_model, generate, load_model, run_arrays, save_npz,
    write_checkpoint, write_json,
)

from transformers.cache_utils import DynamicCache  # noqa: E402
from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil  # noqa: E402
from transformers.models.gemma4.processing_gemma4 import Gemma4Processor  # noqa: E402
from transformers.processing_utils import ProcessorMixin  # noqa: E402

OUT = FIXTURES / "tiny-v"
IMAGE_TOKEN, BOI_TOKEN, EOI_TOKEN = "<|image|>", "<|image>", "<image|>"
# The smallest budget transformers accepts (70, 140, 280, 560, 1120): 70 soft tokens = 280 patches of 4x4 pixels.
MAX_SOFT_TOKENS = 70
SLIDING_WINDOW = 52  # between the soft-token counts below: the square image's block is longer, the wide one's shorter
VISION_V = dict(model_type="gemma4_vision", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=2, head_dim=16, global_head_dim=16, patch_size=4,
                pooling_kernel_size=2, position_embedding_size=64, standardize=True)
TINY_V = FixtureSpec(
    name="tiny-v",
    text=dict(TINY_A.text, sliding_window=SLIDING_WINDOW, use_bidirectional_attention="vision"),
    image_ids=TINY_A.image_ids, primary_form="B", init_seed=3,
    long_prompt=TINY_A.long_prompt, short_prompt=TINY_A.short_prompt, vision=VISION_V,
)
IMAGE_ID = TINY_V.image_ids.image_token_id
GEN = GenSpec("GV", max_new_tokens=32)  # G1's sampler settings, 2 canvases
SEED = 0


@dataclass(frozen=True)
class TestImage:
    name: str
    height: int
    width: int
    n_soft: int  # what the processor makes of it (asserted)


IMAGES = (
    TestImage("square", 32, 32, n_soft=64),   # resized to 64x64: 16x16 patches -> 64 soft tokens (> W)
    TestImage("wide", 8, 64, n_soft=46),      # resized to 16x184: 4x46 patches -> 46 soft tokens (< W)
    TestImage("tall", 40, 24, n_soft=60),     # resized to 80x48: 12x20 patches -> 60 soft tokens
)


@dataclass(frozen=True)
class VisionCase:
    """A prompt with ONE image-token id per image (the marker); the processor expands each to boi, image×n, eoi."""

    name: str
    marker_prompt: list[int]
    images: tuple[str, ...]


CASES = (
    VisionCase("square", [2] + list(range(10, 18)) + [IMAGE_ID] + list(range(18, 28)), ("square",)),
    VisionCase("wide", [2, 10, 11, 12, 13, IMAGE_ID, 14, 15, 16, 17, 18, 19, 20], ("wide",)),
    VisionCase("two", [2, 10, 11, IMAGE_ID, 12, 13, IMAGE_ID, 14, 15, 16], ("tall", "wide")),
)


# ---------------------------------------------------------------------------------------------------------------
# Images and processor


def image_pixels(image: TestImage) -> np.ndarray:
    """Deterministic RGB pixels: smooth gradients plus a checker pattern, different per channel."""
    y, x = np.mgrid[0:image.height, 0:image.width].astype(np.float64)
    r = 255 * x / max(image.width - 1, 1)
    g = 255 * y / max(image.height - 1, 1)
    b = 127.5 + 127.5 * np.sin(0.9 * x + 0.6 * y) * ((x // 3 + y // 3) % 2 * 2 - 1)
    return np.clip(np.rint(np.stack([r, g, b], axis=-1)), 0, 255).astype(np.uint8)


def write_images() -> dict[str, Image.Image]:
    out = OUT / "images"
    out.mkdir(parents=True, exist_ok=True)
    loaded = {}
    for image in IMAGES:
        path = out / f"{image.name}.png"
        Image.fromarray(image_pixels(image), "RGB").save(path, format="PNG")
        loaded[image.name] = Image.open(path).convert("RGB")  # the tests decode the same file
    return loaded


def image_processor() -> Gemma4ImageProcessorPil:
    patch, kernel = VISION_V["patch_size"], VISION_V["pooling_kernel_size"]
    return Gemma4ImageProcessorPil(patch_size=patch, pooling_kernel_size=kernel, max_soft_tokens=MAX_SOFT_TOKENS)


def write_processor_configs(processor: Gemma4ImageProcessorPil) -> None:
    processor.save_pretrained(OUT)  # preprocessor_config.json
    image_config = json.loads((OUT / "preprocessor_config.json").read_text())
    write_json(OUT / "preprocessor_config.json", image_config)  # sorted keys, like every other json here
    write_json(OUT / "processor_config.json", {"processor_class": "Gemma4Processor", "image_seq_length": MAX_SOFT_TOKENS,
                                                "image_processor": image_config})


def expand_prompt(marker_prompt: list[int], n_soft: list[int]) -> tuple[list[int], list[int]]:
    """The processor's expansion, run through its own code: each marker -> boi, image×n_soft, eoi; mm types."""
    tok = SimpleNamespace(boi_token=BOI_TOKEN, eoi_token=EOI_TOKEN, image_token=IMAGE_TOKEN)
    ids = TINY_V.image_ids
    token_ids = {BOI_TOKEN: ids.boi_token_id, EOI_TOKEN: ids.eoi_token_id, IMAGE_TOKEN: ids.image_token_id}
    expanded: list[int] = []
    k = 0
    for t in marker_prompt:
        if t != IMAGE_ID:
            expanded.append(t)
            continue
        text = Gemma4Processor.replace_image_token(tok, {"num_soft_tokens_per_image": n_soft}, k)
        pieces = text.replace(BOI_TOKEN, f"\0{BOI_TOKEN}\0").replace(EOI_TOKEN, f"\0{EOI_TOKEN}\0").split("\0")
        for piece in filter(None, pieces):
            expanded += [token_ids[piece]] if piece in (BOI_TOKEN, EOI_TOKEN) else \
                [token_ids[IMAGE_TOKEN]] * (len(piece) // len(IMAGE_TOKEN))
        k += 1
    assert k == len(n_soft)
    types_self = SimpleNamespace(image_token_ids=[ids.image_token_id], video_token_ids=[None], audio_token_ids=[None])
    mm_types = ProcessorMixin.create_mm_token_type_ids(types_self, [expanded])[0]
    return expanded, mm_types


# ---------------------------------------------------------------------------------------------------------------
# Checkpoint


def build_vision_model():
    """tiny-a's perturbation recipe (build_model), then the vision tensors it leaves constant get informative values."""
    model = build_model(TINY_V)
    tower = model.model.encoder.vision_tower
    g = torch.Generator().manual_seed(TINY_V.init_seed)
    with torch.no_grad():
        table = tower.patch_embedder.position_embedding_table  # init ones (x4 = all 4): make it position-dependent
        table.copy_(torch.randn(table.shape, generator=g))
        tower.std_bias.copy_(0.5 * torch.randn(tower.std_bias.shape, generator=g))   # init empty (uninitialised)
        tower.std_scale.copy_(0.5 + torch.rand(tower.std_scale.shape, generator=g))
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.is_floating_point() and t.numel() > 1 and "inv_freq" not in name:
            assert t.std() > 0, f"{name} is constant"
    return model


def write_vision_checkpoint() -> None:
    write_checkpoint(TINY_V, OUT, build_vision_model(), reload_atol=1e-5)
    # The tokenizer names its image tokens (as Gemma 4's does), so a processor can find them
    config = json.loads((OUT / "tokenizer_config.json").read_text())
    config.update(image_token=IMAGE_TOKEN, boi_token=BOI_TOKEN, eoi_token=EOI_TOKEN)
    write_json(OUT / "tokenizer_config.json", config)


# ---------------------------------------------------------------------------------------------------------------
# Recordings


@dataclass
class Processed:
    pixel_values: torch.Tensor      # [n_images, max_patches, 3·p²] (padded, as the processor returns it)
    position_ids: torch.Tensor      # [n_images, max_patches, 2] ((-1, -1) rows are padding)
    n_soft: list[int]


def process(processor, images: list[Image.Image]) -> Processed:
    out = processor(images=images, return_tensors="pt")
    return Processed(out["pixel_values"], out["image_position_ids"], [int(k) for k in out["num_soft_tokens_per_image"]])


def encoder_mask_mapping(model, input_ids: torch.Tensor, mm_types: torch.Tensor | None, cache) -> dict:
    """What generate() builds for the prefill (and the plain forward drops)."""
    n = input_ids.shape[1]
    dummy = torch.empty((1, n, 0), dtype=model.dtype)
    return model.model.encoder.create_masks_for_generate(
        config=model.config, inputs_embeds=dummy, attention_mask=torch.ones((1, n), dtype=torch.bool),
        past_key_values=cache, position_ids=torch.arange(n).unsqueeze(0), mm_token_type_ids=mm_types)


def prefill_and_step(model, input_ids, proc: Processed, mm_types, canvas, mapping_override=None):
    """One prefill with the images, then the first decoder step on `canvas`: (raw logits [C, V], cache)."""
    cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    mapping = mapping_override if mapping_override is not None else encoder_mask_mapping(model, input_ids, mm_types, cache)
    n = input_ids.shape[1]
    c = canvas.shape[1]
    with torch.no_grad():
        model.model.encoder(input_ids=input_ids, pixel_values=proc.pixel_values, image_position_ids=proc.position_ids,
                            attention_mask=mapping, past_key_values=cache, position_ids=torch.arange(n).unsqueeze(0))
        raw = model(decoder_input_ids=canvas, decoder_position_ids=torch.arange(n, n + c).unsqueeze(0),
                    past_key_values=cache).logits[0].float()
    return raw, cache


def check_mask_matters(model, input_ids, proc, mm_types, run_raw0: np.ndarray, canvas, case: VisionCase) -> dict:
    """The recorded logits depend on the block mask in full AND sliding layers (else the fixture tests nothing)."""
    raw, _ = prefill_and_step(model, input_ids, proc, mm_types, canvas)
    assert np.array_equal(raw.numpy(), run_raw0), f"{case.name}: manual prefill differs from generate()"
    cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    with_block = encoder_mask_mapping(model, input_ids, mm_types, cache)
    causal = encoder_mask_mapping(model, input_ids, torch.zeros_like(mm_types), cache)
    moved = {}
    for label, override in (("no block mask", causal),
                            ("no block in sliding layers", {**with_block, "sliding_attention": causal["sliding_attention"]}),
                            ("no block in full layers", {**with_block, "full_attention": causal["full_attention"]})):
        other, _ = prefill_and_step(model, input_ids, proc, mm_types, canvas, mapping_override=override)
        moved[label] = float((other - raw).abs().max())
        assert moved[label] > 1e-3, f"{case.name}: {label} hardly changes the logits ({moved[label]:.2e})"
    return moved


def record_case(model, processor, images: dict[str, Image.Image], case: VisionCase) -> dict:
    proc = process(processor, [images[name] for name in case.images])
    expected = [next(i.n_soft for i in IMAGES if i.name == name) for name in case.images]
    assert proc.n_soft == expected, (case.name, proc.n_soft)
    prompt, mm_types = expand_prompt(case.marker_prompt, proc.n_soft)
    input_ids = torch.tensor([prompt])
    mm = torch.tensor([mm_types])
    run = generate(model, prompt, GEN, SEED, pixel_values=proc.pixel_values, image_position_ids=proc.position_ids,
                   mm_token_type_ids=mm)
    moved = check_mask_matters(model, input_ids, proc, mm, run.calls[0]["raw"],
                               torch.tensor(run.calls[0]["canvas"]).unsqueeze(0), case)
    _, cache = prefill_and_step(model, input_ids, proc, mm, torch.tensor(run.calls[0]["canvas"]).unsqueeze(0))
    with torch.no_grad():
        features = model.model.encoder.get_image_features(proc.pixel_values, proc.position_ids).pooler_output
    arrays = run_arrays(run, prompt, with_raw=True)
    arrays.update(marker_prompt=np.asarray(case.marker_prompt, np.int32),
                  mm_token_type_ids=np.asarray(mm_types, np.int32),
                  n_soft=np.asarray(proc.n_soft, np.int32), image_features=features.float().numpy())
    for i, layer in enumerate(cache.layers):
        arrays[f"k_{i}"] = layer.keys[0].float().numpy().copy()
        arrays[f"v_{i}"] = layer.values[0].float().numpy().copy()
    save_npz(OUT / "golden" / f"{case.name}.npz", arrays)
    print(f"{case.name}: {len(prompt)} prompt tokens, soft {proc.n_soft}, steps {run.steps_per_canvas}, "
          f"logit moves without the block mask {moved}")
    return {"file": f"{case.name}.npz", "images": list(case.images), "n_soft": proc.n_soft,
            "marker_prompt": case.marker_prompt, "prompt_length": len(prompt), "seed": SEED,
            "generation_config": GEN.name, "n_calls": len(run.calls), "steps_per_canvas": run.steps_per_canvas,
            "logit_change_without_block_mask": {k: round(v, 4) for k, v in moved.items()}}


def image_arrays(model, processor, images: dict[str, Image.Image]) -> dict[str, np.ndarray]:
    """Per image: the processor's output (padded) and the vision features (embed_vision output), one image at a time."""
    arrays = {}
    for image in IMAGES:
        proc = process(processor, [images[image.name]])
        with torch.no_grad():
            features = model.model.encoder.get_image_features(proc.pixel_values, proc.position_ids).pooler_output
        assert features.shape == (image.n_soft, TINY_V.text["hidden_size"]), features.shape
        arrays[f"{image.name}_pixel_values"] = proc.pixel_values[0].float().numpy()
        arrays[f"{image.name}_position_ids"] = proc.position_ids[0].numpy().astype(np.int32)
        arrays[f"{image.name}_features"] = features.float().numpy()
    return arrays


def write_checksums() -> None:
    lines = [f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.relative_to(OUT).as_posix()}"
             for p in sorted(OUT.rglob("*")) if p.is_file() and p.name != "SHA256SUMS"]
    (OUT / "SHA256SUMS").write_text("\n".join(lines) + "\n")


def main() -> None:
    torch.set_num_threads(1)
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    write_vision_checkpoint()
    images = write_images()
    processor = image_processor()
    write_processor_configs(processor)
    model = load_model(OUT)  # record with the weights exactly as stored
    (OUT / "golden").mkdir()
    save_npz(OUT / "golden" / "images.npz", image_arrays(model, processor, images))
    index = {"fixture": TINY_V.name, "sliding_window": SLIDING_WINDOW, "max_soft_tokens": MAX_SOFT_TOKENS,
             "canvas_length": TINY_V.canvas_length, "vocab_size": TINY_V.vocab_size,
             "images": {i.name: {"file": f"images/{i.name}.png", "height": i.height, "width": i.width,
                                 "n_soft": i.n_soft} for i in IMAGES},
             "generation_configs": {GEN.name: GEN.to_json()},
             "cases": {case.name: record_case(model, processor, images, case) for case in CASES}}
    write_json(OUT / "golden" / "index.json", index)
    write_checksums()
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
