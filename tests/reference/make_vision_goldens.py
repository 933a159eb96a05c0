"""Write tests/fixtures/vision-e/: a small DiffusionGemma checkpoint whose vision tower exercises every part of the
gemma4v graph, test images, and transformers' outputs on them (the goldens of tests/test_vision.py).

    python tests/reference/make_vision_goldens.py      # torch + transformers 5.23, CPU, one thread; ~10 s

The tower: hidden 64, 2 layers, 4 query heads over 2 K/V heads (GQA), head_dim 16, FFN 80 (not a multiple of 32, so
a Q8_0 projector keeps ffn_down in F16), patch 4, pooling 2, a 64-row position table, `standardize` on and
`use_clipped_linears` on, with every bound set to 0.8 of the largest |value| that linear saw on the first image (so the
clamps act). Norm weights and std vectors are perturbed away from their init values like the text fixtures'.
Images (PNG, RGB): random smooth pictures of several sizes and aspect ratios, one already of a size the processor
keeps (56x80), one upscaled (5x7). For each: the processor's patches, positions and soft-token count
(Gemma4ImageProcessorPil, max_soft_tokens 70: the smallest the processor accepts), `get_image_features(...)
.pooler_output` in fp32, and the same in fp64 (the fp32 floor the engine's tolerance is judged against).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion
from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

OUT = Path(__file__).resolve().parent.parent / "fixtures" / "vision-e"
TEXT = dict(vocab_size=512, hidden_size=48, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
            layer_types=["sliding_attention", "full_attention"], num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, global_head_dim=32, num_global_key_value_heads=1, num_experts=4, top_k_experts=2,
            sliding_window=8, max_position_embeddings=1024, pad_token_id=0, eos_token_id=1, bos_token_id=2)
VISION = dict(model_type="gemma4_vision", hidden_size=64, intermediate_size=80, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, patch_size=4, pooling_kernel_size=2,
              position_embedding_size=64, standardize=True, use_clipped_linears=True)
PROCESSOR = dict(patch_size=4, pooling_kernel_size=2, max_soft_tokens=70)
IMAGES = {"square": (50, 47), "wide": (30, 90), "tall": (120, 40), "exact": (56, 80), "small": (5, 7),
          "strip": (13, 200)}  # name -> (height, width)


def smooth_image(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """Gradients, a few blobs and some noise: pictures with structure at several scales."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    img = np.zeros((height, width, 3))
    for c in range(3):
        wave_x, wave_y = np.sin(x / (3 + 5 * rng.random()) + rng.random() * 6), np.cos(y / (4 + 6 * rng.random()))
        img[..., c] = 128 + 90 * wave_x * wave_y
    for _ in range(3):
        cx, cy, r = rng.random() * width, rng.random() * height, 2 + rng.random() * max(height, width) / 4
        img += (rng.random(3) * 120 - 60) * np.exp(-((x - cx) ** 2 + (y - cy) ** 2) / (2 * r * r))[..., None]
    img += rng.normal(0, 12, img.shape)
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


def build_model() -> DiffusionGemmaForBlockDiffusion:
    cfg = DiffusionGemmaConfig(text_config=TEXT, vision_config=VISION, canvas_length=16, image_token_id=509,
                               boi_token_id=510, eoi_token_id=511)
    torch.manual_seed(7)
    model = DiffusionGemmaForBlockDiffusion._from_config(cfg, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif "position_embedding_table" in name:
                p.copy_(0.5 * torch.randn_like(p))  # init is all ones: every position would look alike
        tower = model.model.encoder.vision_tower
        tower.std_bias.copy_(0.3 * torch.randn_like(tower.std_bias))
        tower.std_scale.copy_(1.0 + 0.3 * torch.randn_like(tower.std_scale))
    return model


def clippable_linears(model) -> list:
    return [m for m in model.model.encoder.vision_tower.modules() if type(m).__name__.endswith("ClippableLinear")]


def set_clip_bounds(model, pixel_values, positions) -> None:
    """Each bound at 0.8 of the largest |input| / |output| its linear sees on one image: the clamps act."""
    seen = {}
    hooks = [m.register_forward_hook(lambda mod, args, out: seen.__setitem__(mod, (args[0].abs().max().item(),
                                                                                   out.abs().max().item())))
             for m in clippable_linears(model)]
    with torch.no_grad():
        model.model.encoder.get_image_features(pixel_values, positions)
    for h in hooks:
        h.remove()
    with torch.no_grad():
        for m in clippable_linears(model):
            inp, out = seen[m]
            m.input_min.fill_(-0.8 * inp)
            m.input_max.fill_(0.8 * inp)
            m.output_min.fill_(-0.8 * out)
            m.output_max.fill_(0.8 * out)


def main() -> None:
    torch.set_num_threads(1)
    (OUT / "images").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(2026)
    processor = Gemma4ImageProcessorPil(**PROCESSOR)
    model = build_model()
    images = {}
    for name, (h, w) in IMAGES.items():
        rgb = smooth_image(rng, h, w)
        Image.fromarray(rgb, "RGB").save(OUT / "images" / f"{name}.png")
        images[name] = np.asarray(Image.open(OUT / "images" / f"{name}.png").convert("RGB"))
    first = processor(images=[Image.fromarray(images["square"])], return_tensors="pt")
    set_clip_bounds(model, first["pixel_values"], first["image_position_ids"])
    model.save_pretrained(OUT)
    (OUT / "processor_config.json").write_text(json.dumps({"image_processor": {
        "image_processor_type": "Gemma4ImageProcessorPil", **PROCESSOR, "do_normalize": False,
        "image_mean": [0.0, 0.0, 0.0], "image_std": [1.0, 1.0, 1.0], "resample": 3, "rescale_factor": 1 / 255}},
        indent=2) + "\n")

    encoder64 = build_model().double()
    encoder64.load_state_dict(model.state_dict())
    for name, rgb in images.items():
        batch = processor(images=[Image.fromarray(rgb)], return_tensors="pt")
        n_soft = int(batch["num_soft_tokens_per_image"][0])
        n = n_soft * PROCESSOR["pooling_kernel_size"] ** 2
        with torch.no_grad():
            feats = model.model.encoder.get_image_features(batch["pixel_values"], batch["image_position_ids"])
            feats64 = encoder64.model.encoder.get_image_features(batch["pixel_values"].double(),
                                                                  batch["image_position_ids"])
        np.savez(OUT / f"golden-{name}.npz",
                 patches=batch["pixel_values"][0, :n].numpy().astype(np.float32),
                 positions=batch["image_position_ids"][0, :n].numpy().astype(np.int32),
                 n_soft_tokens=np.int32(n_soft),
                 features=feats.pooler_output.reshape(n_soft, -1).numpy().astype(np.float32),
                 features_fp64=feats64.pooler_output.reshape(n_soft, -1).numpy())
        floor = (feats.pooler_output.double() - feats64.pooler_output).abs().max().item()
        print(f"{name}: {rgb.shape[1]}x{rgb.shape[0]} -> {n} patches, {n_soft} soft tokens, |fp32 - fp64| {floor:.2e}")
    write_checksums()


def write_checksums() -> None:
    """SHA256SUMS of the folder (`cd tests/fixtures/vision-e && sha256sum -c SHA256SUMS` checks a regeneration)."""
    files = sorted(p for p in OUT.rglob("*") if p.is_file() and p.name != "SHA256SUMS")
    lines = [f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.relative_to(OUT).as_posix()}" for p in files]
    (OUT / "SHA256SUMS").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
