"""Time one image through the vision encoder at the released geometry, against transformers on the same weights.

    python3 bench/vision_encoder.py [--threads 2] [--types f32,f16,q8_0] [--repeats 3] [--json out.json]

The released DiffusionGemma (google/diffusiongemma-26B-A4B-it) carries Gemma 4's vision tower: hidden 1152, 27
layers, 16 heads of 72 (no GQA), FFN 4304, patch 16, pooling 3, a 10240-row position table, standardize on, no clip
bounds, projected to the text width 2816 (0.57 B parameters). Random weights of that geometry (std 0.02; norms and
std_scale near 1) are saved as a checkpoint under bench/work/vision-real (reused), converted to each projector type,
and one 672x960 image (the largest the 280-token budget allows at 4:3: 2520 patches, 280 soft tokens) is encoded
--repeats times after one warm-up, by the engine per type and by transformers' get_image_features in fp32 at the
same thread count. Reported: wall and process CPU seconds per image (the median), and the engine's max |Δ| to
transformers. The q/k norm weights are scaled by 0.35: with weights near 1 (and attention scale 1) 27 random layers
were so sharp that transformers' own fp32 result was 0.22 from its fp64 one (the engine: 0.45), which says nothing
about either.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np

import common

VISION = dict(model_type="gemma4_vision", hidden_size=1152, intermediate_size=4304, num_hidden_layers=27,
              num_attention_heads=16, num_key_value_heads=16, head_dim=72, patch_size=16, pooling_kernel_size=3,
              position_embedding_size=10240, rms_norm_eps=1e-6, standardize=True, use_clipped_linears=False,
              hidden_activation="gelu_pytorch_tanh", rope_parameters={"rope_theta": 100.0, "rope_type": "default"})
TEXT_HIDDEN = 2816
MAX_SOFT_TOKENS = 280
IMAGE = (672, 960)  # height, width: 14 x 20 blocks of 3x3 patches of 16 px


def build_tower(seed: int = 0):
    """transformers' tower + embedder with random weights of the released geometry (fp32)."""
    import torch
    from transformers import Gemma4VisionConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4MultimodalEmbedder, Gemma4VisionModel

    torch.manual_seed(seed)
    cfg = Gemma4VisionConfig(**{k: v for k, v in VISION.items() if k != "model_type"})
    tower = Gemma4VisionModel(cfg).eval()
    embedder = Gemma4MultimodalEmbedder(cfg, argparse.Namespace(hidden_size=TEXT_HIDDEN)).eval()
    with torch.no_grad():
        for module in (tower, embedder):
            for name, p in module.named_parameters():
                if "q_norm" in name or "k_norm" in name:  # softer attention: with norm weights near 1 and scale 1
                    p.copy_(0.35 * (1.0 + 0.1 * torch.randn_like(p)))  # the random tower is chaotic (see below)
                elif "norm" in name:
                    p.copy_(1.0 + 0.1 * torch.randn_like(p))
                else:
                    p.copy_(0.02 * torch.randn_like(p))
        tower.std_bias.copy_(0.1 * torch.randn_like(tower.std_bias))
        tower.std_scale.copy_(1.0 + 0.1 * torch.randn_like(tower.std_scale))
    return tower, embedder


def save_checkpoint(tower, embedder, out: Path) -> None:
    """The tensors under the DiffusionGemma names `dgemma convert` reads, and a config.json naming the geometry."""
    from safetensors.torch import save_file

    state = {f"model.encoder.vision_tower.{k}": v.contiguous() for k, v in tower.state_dict().items()}
    state |= {f"model.encoder.embed_vision.{k}": v.contiguous() for k, v in embedder.state_dict().items()}
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"))
    config = {"model_type": "diffusion_gemma", "text_config": {"hidden_size": TEXT_HIDDEN}, "vision_config": VISION,
              "vision_soft_tokens_per_image": MAX_SOFT_TOKENS}
    (out / "config.json").write_text(json.dumps(config, indent=1))


def timed(fn, repeats: int) -> tuple[float, float, object]:
    """Median wall and process-CPU seconds of fn() over `repeats` runs after one warm-up, and its last result."""
    result = fn()
    walls, cpus = [], []
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        result = fn()
        walls.append(time.perf_counter() - w0)
        cpus.append(time.process_time() - c0)
    return statistics.median(walls), statistics.median(cpus), result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--types", default="f32,f16,q8_0")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--work", type=Path, default=common.WORK / "vision-real")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    import torch

    from dgemma_convert import convert_mmproj
    from dgemma_engine.vision import Projector, prepare_image

    torch.set_num_threads(args.threads)
    ckpt = args.work / "checkpoint"
    tower, embedder = build_tower()
    if not (ckpt / "model.safetensors").exists():
        save_checkpoint(tower, embedder, ckpt)
    rng = np.random.default_rng(0)
    rgb = rng.integers(0, 256, (*IMAGE, 3), dtype=np.uint8)

    report = {"cpu": common.cpu_description(), "threads": args.threads, "image": list(IMAGE), "runs": {}}
    reference = None
    if not args.skip_transformers:
        from PIL import Image
        from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

        batch = Gemma4ImageProcessorPil(max_soft_tokens=MAX_SOFT_TOKENS)(images=[Image.fromarray(rgb)],
                                                                          return_tensors="pt")

        def hf() -> np.ndarray:
            with torch.no_grad():
                hidden = tower(batch["pixel_values"], batch["image_position_ids"]).last_hidden_state
                return embedder(hidden).numpy()
        wall, cpu, reference = timed(hf, args.repeats)
        report["runs"]["transformers fp32"] = {"wall_s": wall, "cpu_s": cpu}
        print(f"transformers fp32: {wall:.2f} s wall, {cpu:.2f} s CPU per image", flush=True)
    del tower, embedder
    gc.collect()

    for outtype in args.types.split(","):
        path = args.work / f"mmproj-{outtype}.gguf"
        if not path.exists():
            convert_mmproj(ckpt, path, outtype)
        with Projector.load(str(path), args.threads) as projector:
            image = prepare_image(rgb, projector.geometry)
            wall, cpu, got = timed(lambda: projector.encode(image), args.repeats)
        run = {"wall_s": wall, "cpu_s": cpu, "file_mib": path.stat().st_size / 2**20,
               "n_patches": int(image.patches.shape[0]), "n_soft_tokens": image.n_soft_tokens}
        if reference is not None:
            run["max_abs_diff"] = float(np.abs(got - reference.reshape(got.shape)).max())
            run["speedup"] = report["runs"]["transformers fp32"]["wall_s"] / wall
        report["runs"][outtype] = run
        print(f"{outtype}: {wall:.2f} s wall, {cpu:.2f} s CPU per image, {run}", flush=True)
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
