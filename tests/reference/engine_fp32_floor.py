"""Measure how far transformers' own fp32 logits are from an fp64 run of the same fixture, per recorded run.

    python3 tests/reference/engine_fp32_floor.py     # writes tests/reference/engine_fp32_floor.json

The engine tests compare fp32 ggml against the fp32 transformers recordings. On a well-conditioned model both are
within ~1e-5 of the exact (fp64) result; on a sharper one fp32 rounding alone moves the logits further, and no fp32
implementation with a different operation order can agree with transformers to better than that. This script
replays every recorded decoder call (same canvas, positions and self-conditioning input) in fp64 and stores
max |recorded fp32 − fp64| per run, which tests/test_engine.py uses as its tolerance floor.
Needs torch==2.13.0 and transformers==5.23.0 (CPU).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from transformers import DiffusionGemmaForBlockDiffusion
from transformers.cache_utils import DynamicCache

HERE = Path(__file__).resolve().parent
FIXTURES = HERE.parent / "fixtures"
RUNS = ("g1_seed0", "g2_seed0", "short_seed0", "greedy_seed0")


def fp64_replay(model, run: dict) -> float:
    """max |recorded − fp64| over the run's decoder calls; canvases are committed like the engine test does."""
    worst = 0.0
    cache = None
    n_past = -1
    with torch.no_grad():
        for i in range(len(run["pos"])):
            start = int(run["pos"][i][0])
            if start != n_past:  # a new canvas: encode everything before it from scratch (same math as a commit)
                cache = DynamicCache(config=model.config.text_config)
                model.model.encoder(input_ids=torch.tensor(run["seq"][None, :start].astype(np.int64)),
                                    past_key_values=cache)
                n_past = start
            sc = None
            if run["has_sc"][i]:
                sc = torch.tensor(run["raw"][i - 1] / run["T"][i - 1], dtype=torch.float32).double()[None]
            out = model(decoder_input_ids=torch.tensor(run["canvas"][i][None].astype(np.int64)),
                        decoder_position_ids=torch.tensor(run["pos"][i][None].astype(np.int64)),
                        past_key_values=cache, self_conditioning_logits=sc).logits[0].numpy()
            worst = max(worst, float(np.abs(out - run["raw"][i].astype(np.float64)).max()))
    return worst


def main() -> None:
    torch.set_num_threads(2)
    floors: dict = {}
    for name in ("tiny-a", "tiny-b"):
        model = DiffusionGemmaForBlockDiffusion.from_pretrained(
            FIXTURES / name, attn_implementation="eager", experts_implementation="eager",
            dtype=torch.float64).eval()
        floors[name] = {}
        for run_name in RUNS:
            with np.load(FIXTURES / name / "golden" / f"{run_name}.npz") as z:
                run = {k: z[k] for k in z.files}
            floors[name][run_name] = fp64_replay(model, run)
            print(name, run_name, f"{floors[name][run_name]:.3e}")
    (HERE / "engine_fp32_floor.json").write_text(json.dumps(floors, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
