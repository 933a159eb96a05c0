"""What N candidate canvases cost against N sequential single-canvas runs (num_canvases).

    python bench/candidates.py                          # the bundled Sudoku model, N = 1 2 4 8, 1 and 2 threads
    python bench/candidates.py --gguf model.gguf --prompt-len 64 --n 1 4

Per configuration: one generation of one canvas with the early stop disabled (every candidate runs all --steps
steps), repeated --repeats times, best time kept; the same prompt and seeds. "sequential" = N runs of one canvas
(what N tries would cost); the ratio batched / sequential below 1 is the saving of one batched decoder step.
Reports the CPU model and flags beside the figures.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
from common import cpu_description  # noqa: E402


def one_generation(model, prompt: list[int], n_canvases: int, steps: int, threads: int, seed: int) -> float:
    from dgemma_engine.generate import SamplerParams, generate
    from dgemma_engine.model import Context

    params = SamplerParams.from_metadata(model.metadata, seed=seed, max_steps=steps, stability_threshold=steps + 1,
                                         num_canvases=n_canvases)
    C = model.hparams.canvas_length
    with Context(model, n_ctx=len(prompt) + C, threads=threads, max_canvases=n_canvases) as ctx:
        start = time.perf_counter()
        for _ in generate(ctx, prompt, params, max_new_tokens=C, eos_ids=(), threads=threads):
            pass
        return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, default=REPO / "modelfiles" / "sudoku.gguf")
    ap.add_argument("--prompt-len", type=int, default=82, help="prompt tokens (the Sudoku prompt has 82)")
    ap.add_argument("--n", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from dgemma_engine.model import Model

    rows = []
    for threads in args.threads:
        with Model.load(str(args.gguf), threads=threads) as model:
            V = model.hparams.n_vocab
            prompt = [2] + [(7 * i + 3) % V for i in range(args.prompt_len - 1)]
            single = min(one_generation(model, prompt, 1, args.steps, threads, 0) for _ in range(args.repeats))
            for n in args.n:
                batched = min(one_generation(model, prompt, n, args.steps, threads, 0) for _ in range(args.repeats))
                row = {"threads": threads, "n_canvases": n, "batched_s": round(batched, 4),
                       "sequential_s": round(n * single, 4), "ratio": round(batched / (n * single), 3),
                       "ms_per_step": round(1000 * batched / args.steps, 2)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(f"\n{cpu_description()}; {args.gguf.name}, prompt {args.prompt_len} tokens, {args.steps} steps per canvas\n")
    print("| threads | N | batched (s) | N sequential runs (s) | batched / sequential | ms per batched step |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['threads']} | {r['n_canvases']} | {r['batched_s']} | {r['sequential_s']} | {r['ratio']} | "
              f"{r['ms_per_step']} |")


if __name__ == "__main__":
    main()
