"""The Sudoku model through transformers' own `generate()`: the reference dgemma is compared with.

Used by bench/sudoku.py and tests/reference/make_sudoku_goldens.py. One puzzle per `generate` call with
`torch.manual_seed(seed)` just before it: that is the random stream dgemma's torch-RNG mode reproduces (a batch would
draw its random numbers for all rows at once). Needs torch==2.13.0 and transformers==5.23.0.
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import DiffusionGemmaForBlockDiffusion

sys.path.insert(0, str(Path(__file__).parent))
import bundle
import train
import vocab


@dataclass(frozen=True)
class Solution:
    grid: str  # 81 chars, '?' where the canvas holds no digit (or after an EOS)
    steps: int  # denoising steps used
    seconds: float


class _StepCounter:
    """A streamer that only counts denoising steps (`put_draft` is called once per step)."""

    def __init__(self) -> None:
        self.steps = 0

    def put_draft(self, value=None, logits=None) -> None:
        self.steps += 1

    def put(self, value) -> None:
        pass

    def end(self) -> None:
        pass


def load(checkpoint: Path, threads: int = 1) -> DiffusionGemmaForBlockDiffusion:
    """The checkpoint in float32 (the committed one stores float16 weights; computing in fp32 matches dgemma)."""
    torch.set_num_threads(threads)
    model = DiffusionGemmaForBlockDiffusion.from_pretrained(checkpoint, dtype=torch.float32,
                                                            attn_implementation="eager")
    model.set_experts_implementation("eager")
    return model.eval()


def sampler_settings(checkpoint: Path) -> dict:
    """The sampler values in the checkpoint's generation_config.json (bundle.py writes tune.py's choice there);
    the converter carries the same values into the GGUF, so dgemma and transformers sample alike."""
    return bundle.sampler_settings(json.loads((checkpoint / "generation_config.json").read_text()))


@torch.no_grad()
def solve(model: DiffusionGemmaForBlockDiffusion, puzzle: str, seed: int, settings: dict | None = None,
          adaptive: bool = True) -> Solution:
    """One puzzle with `settings` (sampler_settings(); None: the released values); `adaptive=False` runs all steps
    (stability needs more steps than there are, so the early stop can never fire)."""
    config = train.generation_config(**(settings or {}))
    if not adaptive:
        config.stability_threshold = config.max_denoising_steps + 1
    counter = _StepCounter()
    prompt = torch.tensor([vocab.prompt_ids(puzzle)])
    start = time.perf_counter()
    torch.manual_seed(seed)
    out = model.generate(prompt, generation_config=config, streamer=counter)
    seconds = time.perf_counter() - start
    canvas = out.sequences[0, prompt.shape[1]:].tolist()
    if vocab.EOS in canvas:  # transformers keeps the EOS and pads after it: the answer ends there
        canvas = canvas[:canvas.index(vocab.EOS)]
    grid = "".join(str(t - vocab.DIGIT_BASE) if vocab.DIGIT_BASE + 1 <= t <= vocab.DIGIT_BASE + 9 else "?"
                   for t in canvas)
    return Solution(grid.ljust(81, "?"), counter.steps, seconds)
