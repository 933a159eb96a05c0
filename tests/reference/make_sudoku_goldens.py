"""Record transformers' answers on the bundled Sudoku checkpoint: tests/goldens/sudoku.json.

    python tests/reference/make_sudoku_goldens.py        # after recipes/sudoku/bundle.py; ~1 min on 2 cores

For a fixed sample of puzzles (PER_LEVEL per difficulty, puzzle seed 30000: disjoint from training's 10000+ and the
bench's 20000), `DiffusionGemmaForBlockDiffusion.generate()` on recipes/sudoku/checkpoint/ (float32 compute) with the
released sampler and `torch.manual_seed(i)` before puzzle i. tests/test_sudoku_agreement.py replays the same puzzles
and seeds through dgemma's torch-RNG mode on modelfiles/sudoku.gguf and compares puzzle by puzzle. The file also
records which checkpoint and GGUF it was made from, so a re-bundled model with stale goldens fails loudly.

Needs torch==2.13.0 and transformers==5.23.0 (the tests do not).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "recipes" / "sudoku"))
import puzzles
import reference

CHECKPOINT = REPO / "recipes" / "sudoku" / "checkpoint"
OUT = REPO / "tests" / "goldens" / "sudoku.json"
PUZZLE_SEED = 30_000
PER_LEVEL = 4


def main() -> None:
    bundle = json.loads((CHECKPOINT / "bundle.json").read_text())
    model = reference.load(CHECKPOINT, threads=1)
    settings = reference.sampler_settings(CHECKPOINT)
    cases = []
    for level in ("easy", "medium", "hard"):
        for puzzle, _solution in puzzles.puzzle_set(level, PER_LEVEL, seed=PUZZLE_SEED):
            seed = len(cases)
            sol = reference.solve(model, puzzle, seed=seed, settings=settings)
            cases.append({"level": level, "puzzle": puzzle, "seed": seed, "grid": sol.grid, "steps": sol.steps,
                          "solved": puzzles.is_valid_solution(puzzle, sol.grid)})
            print(json.dumps(cases[-1]), flush=True)
    goldens = {
        "generator": "tests/reference/make_sudoku_goldens.py",
        "checkpoint_sha256": bundle["checkpoint_sha256"],
        "gguf_sha256": bundle["gguf_sha256"],
        "training_step": bundle.get("training_step"),
        "sampler": settings,  # the checkpoint's generation_config.json = the GGUF's diffusion.eb_* keys
        "cases": cases,
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(goldens, indent=1) + "\n")
    print(f"wrote {OUT.relative_to(REPO)}: {len(cases)} puzzles, {sum(c['solved'] for c in cases)} solved")


if __name__ == "__main__":
    main()
