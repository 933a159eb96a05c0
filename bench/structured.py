"""Cost of structured output per canvas: a constrained canvas against a free one, on a tiny fixture model.

    python3 bench/structured.py [--model tiny-a] [--gguf PATH] [--runs 30] [--steps 2] [--threads 2] [--json out.json]

Per schema: the automaton's compile time and size (states, edges), then `--runs` one-canvas generations with and
without the constraint (same seeds; random weights, so every canvas runs all `--steps` steps) and the time of the
constrained commit alone (the dynamic program over positions × automaton states, on the last step's logits). The
decoder cost grows with the model and the DP cost with the automaton (edges ~ states × matching tokens), so on a
real model the DP is a smaller share of a canvas than here. Without --gguf the fixture is converted to a temp file.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from json_schemas import SCHEMAS  # noqa: E402  (the schemas the tests check)


def canvas_seconds(model, tokenizer, prompt, params, runs: int, threads: int, automaton=None) -> list[float]:
    from dgemma_engine.constrained import CanvasConstraint
    from dgemma_engine.events import CanvasEvent
    from dgemma_engine.generate import eos_ids_from_metadata, generate
    from dgemma_engine.model import Context

    C = model.hparams.canvas_length
    eos = eos_ids_from_metadata(model.metadata)
    times = []
    with Context(model, n_ctx=len(prompt) + 2 * C, threads=threads) as ctx:
        for seed in range(runs):
            ctx.reset()
            constraint = CanvasConstraint(automaton) if automaton is not None else None
            start = time.perf_counter()
            for event in generate(ctx, prompt, replace(params, seed=seed), max_new_tokens=C, eos_ids=eos,
                                  tokenizer=tokenizer, threads=threads, constraint=constraint):
                if isinstance(event, CanvasEvent):
                    times.append(time.perf_counter() - start)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-a", help="fixture under tests/fixtures")
    parser.add_argument("--gguf", type=Path, help="an existing GGUF instead of converting the fixture")
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    from dgemma_engine.constrained import CanvasConstraint, compile_constraint
    from dgemma_engine.generate import SamplerParams, eos_ids_from_metadata
    from dgemma_engine.model import Model
    from dgemma_engine.tokenizer import Tokenizer

    gguf = args.gguf
    if gguf is None:
        from dgemma_convert import convert

        gguf = Path(tempfile.mkdtemp()) / f"{args.model}.gguf"
        convert(ROOT / "tests" / "fixtures" / args.model, gguf, "f32", threads=args.threads)
    model = Model.load(str(gguf), threads=args.threads)
    metadata = model.metadata
    tokenizer = Tokenizer.from_metadata(metadata)
    prompt = tokenizer.encode("Answer in JSON.")
    params = replace(SamplerParams.from_metadata(metadata, seed=0), max_steps=args.steps)
    C, V = model.hparams.canvas_length, model.hparams.n_vocab

    free = canvas_seconds(model, tokenizer, prompt, params, args.runs, args.threads)
    report = {"model": str(gguf), "canvas": C, "vocab": V, "steps": args.steps, "runs": args.runs,
              "free_canvas_ms": 1e3 * statistics.median(free), "schemas": {}}
    print(f"{args.model}: C={C} V={V} steps={args.steps}; free canvas {report['free_canvas_ms']:.1f} ms (median)")
    logits = np.random.default_rng(0).normal(size=(C, V)).astype(np.float32)
    for label, schema in SCHEMAS.items():
        start = time.perf_counter()
        automaton = compile_constraint(schema, metadata["tokenizer.ggml.tokens"], metadata["tokenizer.ggml.token_type"],
                                       eos_ids_from_metadata(metadata))
        compile_s = time.perf_counter() - start
        commits = []
        for _ in range(args.runs):
            start = time.perf_counter()
            CanvasConstraint(automaton).commit(logits, tokens_after=0)
            commits.append(time.perf_counter() - start)
        constrained = canvas_seconds(model, tokenizer, prompt, params, args.runs, args.threads, automaton)
        row = {"compile_s": compile_s, "states": automaton.n_states, "edges": int(len(automaton.src)),
               "commit_ms": 1e3 * statistics.median(commits), "canvas_ms": 1e3 * statistics.median(constrained)}
        report["schemas"][label] = row
        print(f"  {label:16s} compile {compile_s:6.2f} s  {row['states']:5d} states {row['edges']:6d} edges  "
              f"commit {row['commit_ms']:6.2f} ms  canvas {row['canvas_ms']:6.1f} ms "
              f"({row['canvas_ms'] / report['free_canvas_ms']:.2f}x free)")
    model.close()
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
