"""Structured output under small token budgets: the share of seeded generations that end on a closed value that parses
and validates, per schema and canvas length, on the random-weight tiny-a (the hardest case: it never closes a value
on its own).

    python3 bench/structured_budget.py [--seeds 200] [--canvas 8 256] [--json out.json]

Each seed draws its budget (tests/budget_runs.py): a num_predict cut a few tokens past the schema's shortest value, a
context of a few canvases, or a DGEMMA_MAX_CANVASES cap, as the server would plan it. tests/test_structured_budget.py
runs the same generations with fewer seeds at C = 256.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from budget_runs import run_seed, with_canvas_length  # noqa: E402  (the generations the tests check)
from json_schemas import SCHEMAS  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=200)
    parser.add_argument("--canvas", type=int, nargs="+", default=[8, 256])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    from dgemma_convert import convert
    from dgemma_engine.constrained import compile_constraint
    from dgemma_engine.generate import eos_ids_from_metadata
    from dgemma_engine.model import Model
    from dgemma_engine.tokenizer import Tokenizer

    folder = Path(tempfile.mkdtemp())
    source = folder / "tiny-a.gguf"
    convert(ROOT / "tests" / "fixtures" / "tiny-a", source, "f32", threads=2)
    report: dict = {"seeds": args.seeds, "results": {}}
    automata = None
    for C in args.canvas:
        model = Model.load(str(with_canvas_length(source, folder / f"tiny-a-c{C}.gguf", C)), threads=1)
        metadata = model.metadata
        tokenizer = Tokenizer.from_metadata(metadata)
        if automata is None:  # one vocabulary for every canvas length
            automata = {label: compile_constraint(schema, metadata["tokenizer.ggml.tokens"],
                                                  metadata["tokenizer.ggml.token_type"],
                                                  eos_ids_from_metadata(metadata))
                        for label, schema in SCHEMAS.items()}
        for label, schema in SCHEMAS.items():
            contexts: dict = {}
            start = time.perf_counter()
            try:
                failures = [f for seed in range(args.seeds)
                            if (f := run_seed(model, tokenizer, automata[label], schema, seed, contexts))]
            finally:
                for ctx in contexts.values():
                    ctx.close()
            seconds = time.perf_counter() - start
            good = args.seeds - len(failures)
            report["results"][f"C={C} {label}"] = {"valid": good, "seeds": args.seeds, "seconds": seconds,
                                                    "failures": failures[:5]}
            print(f"C={C:<4d} {label:16s} shortest {automata[label].shortest_value:3d} tokens: {good}/{args.seeds} "
                  f"parse and validate ({100 * good / args.seeds:.1f} %)  {seconds:6.1f} s", flush=True)
            for failure in failures[:3]:
                print("    " + failure[:200])
        model.close()
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0 if all(r["valid"] == r["seeds"] for r in report["results"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
