"""Choose the Sudoku model's sampler settings on validation puzzles (never the bench's).

    python recipes/sudoku/tune.py --gguf modelfiles/sudoku.gguf --write

Runs a small grid of entropy-bound sampler settings through the dgemma engine (torch-RNG mode, one canvas per puzzle)
on medium puzzles generated with seed 30000 (bench/sudoku.py uses 20000, training evaluates on 10000+), and prints
solve rate and mean denoising steps per setting. --write stores the best setting whose mean step count stays within
--max-mean-steps in sampler.json, which bundle.py writes into the checkpoint's generation_config.json; the converter
carries it into the GGUF's `diffusion.eb_*` keys, so `dgemma run`, the bench and transformers all use it.
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import puzzles  # noqa: E402

VALIDATION_SEED = 30_000
SAMPLER_JSON = HERE / "sampler.json"

# the released values first; temperatures as (t_max, t_min) pairs
GRID = [dict(entropy_bound=eb, t_max=hi, t_min=lo, confidence_threshold=conf)
        for eb, (hi, lo), conf in itertools.product([0.1, 0.3, 1.0], [(0.8, 0.4), (0.5, 0.1)], [0.005, 0.05])]


def evaluate(model, tokenizer, ctx, cases, settings: dict) -> dict:
    from dgemma_engine.generate import SamplerParams

    from dgemma_cli.sudoku import solve_with_engine

    solved, steps = 0, []
    for i, (puzzle, _) in enumerate(cases):
        params = SamplerParams.from_metadata(model.metadata, seed=i, rng="torch", **settings)
        sol = solve_with_engine(model, tokenizer, puzzle, params, ctx)
        solved += puzzles.is_valid_solution(puzzle, sol.grid)
        steps.append(sol.steps)
    return {"solve_rate": solved / len(cases), "mean_steps": statistics.fmean(steps)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, required=True)
    ap.add_argument("--n", type=int, default=60, help="validation puzzles")
    ap.add_argument("--level", default="medium", choices=["easy", "medium", "hard"])
    ap.add_argument("--max-mean-steps", type=float, default=12.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--write", action="store_true", help=f"store the chosen setting in {SAMPLER_JSON.name}")
    args = ap.parse_args()

    from dgemma_engine.model import Context, Model
    from dgemma_engine.tokenizer import Tokenizer

    model = Model.load(str(args.gguf), threads=args.threads)
    tokenizer = Tokenizer.from_metadata(model.metadata)
    ctx = Context(model, n_ctx=256, threads=args.threads)
    cases = puzzles.puzzle_set(args.level, args.n, seed=VALIDATION_SEED)
    rows = []
    for settings in GRID:
        result = evaluate(model, tokenizer, ctx, cases, settings)
        rows.append((settings, result))
        print(json.dumps({**settings, **{k: round(v, 3) for k, v in result.items()}}), flush=True)
    within = [r for r in rows if r[1]["mean_steps"] <= args.max_mean_steps] or rows
    best, result = max(within, key=lambda r: (r[1]["solve_rate"], -r[1]["mean_steps"]))
    print(f"best within {args.max_mean_steps} mean steps: {best} -> {result}")
    if args.write:
        SAMPLER_JSON.write_text(json.dumps({"settings": best, "validation": {
            "level": args.level, "n": args.n, "seed": VALIDATION_SEED, **{k: round(v, 4) for k, v in result.items()}},
            "gguf": args.gguf.name}, indent=2) + "\n")
        print(f"wrote {SAMPLER_JSON}")


if __name__ == "__main__":
    main()
