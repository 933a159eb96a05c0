"""Benchmark the bundled Sudoku model: solve rates, denoising steps, wall time, and agreement with transformers.

    python bench/sudoku.py                       # 500 puzzles per level (the issue's measurement; tens of minutes)
    python bench/sudoku.py --n 50 --hf-n 20      # a quick look

For each difficulty (easy 36-45 clues, medium 30-35, hard 24-29), N unique-solution puzzles from
recipes/sudoku/puzzles.py with seed 20000 (training evaluates on seed 10000+, so the sets are disjoint), puzzle i
generated with sampler seed i:

- dgemma, adaptive stop (the GGUF's sampler settings, torch-RNG mode): solve rate, mean denoising steps, wall time
  per puzzle;
- dgemma, a fixed 48 steps (the early stop disabled; first --fixed-n puzzles): solve rate, wall time;
- dgemma as the server's task layer delivers it (dgemma_cli/server/tasks.py), on the engine directly: the bundled
  Modelfile's parameters (num_canvases candidates among them), the Sudoku checker choosing among the candidates and
  renoising cells that break a rule, and retries, each under a new random symmetry of the puzzle (up to the
  Modelfile's task_tries), `num_parallel` of them side by side at `num_thread` threads each, with the server's
  default (fast) RNG: solve rate, mean denoising steps per candidate, wall time per puzzle;
- the same through `dgemma run sudoku --seed i`'s own code (first --run-n puzzles): its renderer over the REST API of
  an in-process server, the tries made by the server (seeds i, i + 1, ... per try);
- the same through `/api/chat` with the `ollama` Python client (first --api-n puzzles, seed i): any client's path,
  with the answer's `done_reason` ("stop" exactly when the grid is a solution);
- transformers' generate() on the original checkpoint (first --hf-n puzzles, same seeds, adaptive): solve rate, mean
  steps, wall time, and the agreement with dgemma puzzle by puzzle (identical grid; identical step count).

"Solved" = a complete grid that keeps every clue and breaks no rule (puzzles.is_valid_solution). Timings are per
puzzle at batch 1 with --threads threads (the delivered path: the Modelfile's num_parallel x num_thread). Without
torch/transformers installed, pass --hf-n 0.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "recipes" / "sudoku"))
import puzzles

BENCH_SEED = 20_000
RETRY_SEED_STRIDE = 100_000_007  # try k of puzzle i uses seed i + k * stride: never another puzzle's seed, nor one of
# its candidates' (candidate j of a try adds j * CANDIDATE_SEED_STRIDE, 1_000_003)
LEVELS = ("easy", "medium", "hard")


@dataclass
class Run:
    """One configuration on one level: per-puzzle grids, steps and seconds."""

    grids: list[str]
    steps: list[int]
    seconds: list[float]

    def solved(self, cases: list[tuple[str, str]]) -> list[bool]:
        return [puzzles.is_valid_solution(p, g) for (p, _), g in zip(cases, self.grids)]

    def summary(self, cases: list[tuple[str, str]]) -> dict:
        ok = self.solved(cases)
        return {"n": len(self.grids), "solved": sum(ok), "solve_rate": round(sum(ok) / max(1, len(ok)), 4),
                "mean_steps": round(statistics.fmean(self.steps), 2) if self.steps else None,
                "s_per_puzzle": round(statistics.fmean(self.seconds), 4) if self.seconds else None}


def load_cases(level: str, n: int, cache_dir: Path) -> list[tuple[str, str]]:
    """The level's puzzle set; cached on disk because hard unique puzzles take ~0.1-0.5 s each to generate."""
    path = cache_dir / f"{level}-{BENCH_SEED}-{n}.json"
    if path.is_file():
        return [tuple(c) for c in json.loads(path.read_text())]
    cases = puzzles.puzzle_set(level, n, seed=BENCH_SEED)
    cache_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cases))
    return cases


def modelfile_parameters(path: Path) -> dict:
    """The bundled Modelfile's PARAMETERs by name."""
    from dgemma_cli.modelfile import parse_modelfile

    return parse_modelfile(path.read_text()).parameters


def sampler_overrides(parameters: dict) -> dict:
    """The sampler PARAMETERs among `parameters`, as SamplerParams overrides by field name."""
    from dgemma_engine.settings import SAMPLER_SETTINGS

    return {s.field: parameters[s.option] for s in SAMPLER_SETTINGS if s.option in parameters}


class Dgemma:
    def __init__(self, gguf: Path, threads: int):
        from dgemma_engine.model import Context, Model
        from dgemma_engine.tokenizer import Tokenizer

        self.threads = threads
        self.model = Model.load(str(gguf), threads=threads)
        self.tokenizer = Tokenizer.from_metadata(self.model.metadata)
        self.ctx = Context(self.model, n_ctx=256, threads=threads)

    def run(self, cases: list[tuple[str, str]], adaptive: bool = True, seed_offset: int = 0,
            only: list[int] | None = None) -> Run:
        from dgemma_engine.generate import SamplerParams

        from dgemma_cli.sudoku import solve_with_engine

        run = Run([], [], [])
        for i in (only if only is not None else range(len(cases))):
            overrides = {} if adaptive else {"stability_threshold": 49}  # S > N: the early stop never fires
            params = SamplerParams.from_metadata(self.model.metadata, seed=i + seed_offset, rng="torch", **overrides)
            sol = solve_with_engine(self.model, self.tokenizer, cases[i][0], params, self.ctx)
            run.grids.append(sol.grid)
            run.steps.append(sol.steps)
            run.seconds.append(sol.seconds)
        return run


    def delivered(self, cases: list[tuple[str, str]], parameters: dict, tries: int) -> dict:
        """As the server's task layer delivers it, on the engine directly: checker, candidates and self-correction,
        up to `tries` attempts, each after the first under a new random symmetry of the puzzle (attempt_symmetries,
        seeded by the puzzle's index) with its answer mapped back; `num_parallel` tries side by side at `num_thread`
        threads each, the lowest-index one that solves committed (the server's first_solution). Seconds are the wall
        time per puzzle."""
        from dgemma_engine.generate import SamplerParams
        from dgemma_engine.model import Context

        from dgemma_cli.server.tasks import first_solution
        from dgemma_cli.sudoku import solve_with_engine
        from dgemma_engine.tasks import attempt_symmetries

        overrides = sampler_overrides(parameters)
        n_canvases = int(overrides.get("num_canvases", 1))
        workers = int(parameters.get("num_parallel", 1))
        threads = int(parameters.get("num_thread", self.threads))
        contexts = [Context(self.model, n_ctx=256, threads=threads, max_canvases=n_canvases) for _ in range(workers)]
        solved, seconds, candidate_steps, attempts, started = [], [], 0, 0, 0
        try:
            for i, (puzzle, _) in enumerate(cases):
                symmetries = attempt_symmetries(tries, seed=i)

                def attempt(a, puzzle=puzzle, symmetries=symmetries, i=i):
                    # run's own random stream: the server samples in the default (fast) RNG mode, not torch's
                    params = SamplerParams.from_metadata(self.model.metadata, seed=i + a.index * RETRY_SEED_STRIDE,
                                                         **overrides)
                    symmetry = symmetries[a.index]
                    sol = solve_with_engine(self.model, self.tokenizer, symmetry.apply(puzzle), params,
                                            contexts[a.worker], check=True, cancel=a.cancel)
                    return symmetry.undo(sol.grid), sol.candidate_steps

                t0 = time.perf_counter()
                outcome = first_solution(attempt, tries, workers,
                                         solved=lambda answer, puzzle=puzzle: puzzles.is_valid_solution(puzzle,
                                                                                                         answer[0]))
                seconds.append(time.perf_counter() - t0)
                candidate_steps += sum(steps for _, steps in outcome.results)
                attempts += len(outcome.results)
                started += outcome.started
                solved.append(puzzles.is_valid_solution(puzzle, outcome.committed[0]))
        finally:
            for ctx in contexts:
                ctx.close()
        return {"n": len(cases), "solved": sum(solved), "solve_rate": round(sum(solved) / max(1, len(cases)), 4),
                "num_canvases": n_canvases, "tries": tries, "num_parallel": workers, "threads_per_try": threads,
                "mean_attempts": round(attempts / max(1, len(cases)), 2),
                "mean_attempts_started": round(started / max(1, len(cases)), 2),
                "mean_steps_per_candidate": round(candidate_steps / max(1, attempts * n_canvases), 2),
                "s_per_puzzle": round(statistics.fmean(seconds), 4) if seconds else None,
                "max_s_per_puzzle": round(max(seconds), 4) if seconds else None}


@contextlib.contextmanager
def in_process_server() -> Iterator[str]:
    """The REST app served in this process (as `run` starts one when no server answers) on a fresh store where the
    bundled model registers itself as on first use; yields its base URL."""
    from dgemma_cli.bundled import register_bundled
    from dgemma_cli.local_server import LocalServer
    from dgemma_cli.names import ModelName
    from dgemma_cli.store import Store

    with tempfile.TemporaryDirectory() as store_dir:
        register_bundled(Store(Path(store_dir)), ModelName.parse("sudoku"))
        server = LocalServer(models_dir=store_dir)
        server.start()
        try:
            yield server.url
        finally:
            server.stop()


def through_run(cases: list[tuple[str, str]]) -> dict:
    """The `dgemma run sudoku --seed i PUZZLE` command's own code: its renderer over the REST API of an in-process
    server. Adds what the engine path leaves out: HTTP, the server's request handling and its progress stream. Seconds
    per puzzle exclude the one model load (the first request's)."""
    import io

    from dgemma_cli.client import Client, http_client
    from dgemma_cli.session import RunSettings
    from dgemma_cli.sudoku import solve_and_show

    solved, seconds, tries = [], [], 0
    with in_process_server() as url, http_client(url) as http:
        client = Client(url, http)
        for _ in client.generate_stream({"model": "sudoku", "prompt": cases[0][0]}):  # loads the model
            pass
        for i, (puzzle, _) in enumerate(cases):
            out, err = io.StringIO(), io.StringIO()
            settings = RunSettings(model="sudoku", options={"seed": i}, verbose=True)
            t0 = time.perf_counter()
            solve_and_show(client, settings, puzzle, out=out, err=err)
            seconds.append(time.perf_counter() - t0)
            solved.append(puzzles.is_valid_solution(puzzle, out.getvalue().replace("\n", "")))
            tries += int(re.search(r"task tries:\s+(\d+)", err.getvalue()).group(1))
    return {"n": len(cases), "solved": sum(solved), "solve_rate": round(sum(solved) / max(1, len(cases)), 4),
            "mean_attempts": round(tries / max(1, len(cases)), 2),
            "s_per_puzzle": round(statistics.fmean(seconds), 4) if seconds else None,
            "max_s_per_puzzle": round(max(seconds), 4) if seconds else None}


def through_api(cases: list[tuple[str, str]]) -> dict:
    """`/api/chat` with the `ollama` Python client, as any client sends it: the puzzle as the user message, `seed` i,
    one request per puzzle (the tries are the server's). Counts the solved grids, the answers whose `done_reason` is
    "stop", and those where the two disagree (there should be none). Seconds per puzzle exclude the model load."""
    import ollama

    solved, stops, disagree, seconds = 0, 0, 0, []
    with in_process_server() as url:
        client = ollama.Client(host=url)
        client.chat(model="sudoku", messages=[{"role": "user", "content": cases[0][0]}])  # loads the model
        for i, (puzzle, _) in enumerate(cases):
            t0 = time.perf_counter()
            answer = client.chat(model="sudoku", messages=[{"role": "user", "content": puzzle}], options={"seed": i})
            seconds.append(time.perf_counter() - t0)
            ok = puzzles.is_valid_solution(puzzle, answer.message.content)
            stop = answer.done_reason == "stop"
            solved, stops, disagree = solved + ok, stops + stop, disagree + (ok != stop)
    return {"n": len(cases), "solved": solved, "solve_rate": round(solved / max(1, len(cases)), 4),
            "done_reason_stop": stops, "stop_but_unsolved_or_solved_but_not_stop": disagree,
            "s_per_puzzle": round(statistics.fmean(seconds), 4) if seconds else None,
            "max_s_per_puzzle": round(max(seconds), 4) if seconds else None}


def run_transformers(checkpoint: Path, cases: list[tuple[str, str]], threads: int) -> Run:
    import reference

    model = reference.load(checkpoint, threads=threads)
    settings = reference.sampler_settings(checkpoint)
    run = Run([], [], [])
    for i, (puzzle, _) in enumerate(cases):
        sol = reference.solve(model, puzzle, seed=i, settings=settings)
        run.grids.append(sol.grid)
        run.steps.append(sol.steps)
        run.seconds.append(sol.seconds)
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=500, help="puzzles per level")
    ap.add_argument("--levels", nargs="+", default=list(LEVELS), choices=LEVELS)
    ap.add_argument("--gguf", type=Path, default=REPO / "modelfiles" / "sudoku.gguf")
    ap.add_argument("--checkpoint", type=Path, default=REPO / "recipes" / "sudoku" / "checkpoint")
    ap.add_argument("--hf-n", type=int, default=None, help="puzzles per level through transformers (default: --n)")
    ap.add_argument("--fixed-n", type=int, default=None,
                    help="puzzles per level for the fixed-48-steps run (default: --n; 0 skips it)")
    ap.add_argument("--modelfile", type=Path, default=REPO / "modelfiles" / "sudoku.Modelfile",
                    help="the delivered configuration's PARAMETERs")
    ap.add_argument("--delivered-n", type=int, default=None, help="puzzles per level as `run` delivers them "
                    "(default: --n; 0 skips it)")
    ap.add_argument("--run-n", type=int, default=0, help="puzzles per level through `dgemma run`'s own code "
                    "(task renderer, REST, in-process server; default 0: skipped)")
    ap.add_argument("--api-n", type=int, default=0, help="puzzles per level through `/api/chat` with the ollama "
                    "Python client (in-process server; default 0: skipped)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache", type=Path, default=Path("/tmp/dgemma-sudoku-bench"), help="puzzle set cache")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args()
    hf_n = args.n if args.hf_n is None else min(args.hf_n, args.n)
    fixed_n = args.n if args.fixed_n is None else min(args.fixed_n, args.n)

    from dgemma_engine.gguf_keys import KEY_FILE_TYPE

    parameters = modelfile_parameters(args.modelfile)
    engine = Dgemma(args.gguf, args.threads)
    results: dict = {"gguf": str(args.gguf), "gguf_type": int(engine.model.metadata[KEY_FILE_TYPE]),
                     "n": args.n, "hf_n": hf_n, "fixed_n": fixed_n, "threads": args.threads, "bench_seed": BENCH_SEED,
                     "modelfile_parameters": parameters, "levels": {}}
    bundle = args.checkpoint / "bundle.json"
    if bundle.is_file():
        results["bundle"] = json.loads(bundle.read_text())
    for level in args.levels:
        t0 = time.perf_counter()
        cases = load_cases(level, args.n, args.cache)
        adaptive = engine.run(cases)
        row = {"adaptive": adaptive.summary(cases)}
        if fixed_n > 0:
            row["fixed48"] = engine.run(cases[:fixed_n], adaptive=False).summary(cases[:fixed_n])
        delivered_n = args.n if args.delivered_n is None else min(args.delivered_n, args.n)
        if delivered_n > 0:
            row["delivered"] = engine.delivered(cases[:delivered_n], parameters, int(parameters.get("task_tries", 1)))
        if args.run_n > 0:
            row["through_run"] = through_run(cases[:args.run_n])
        if args.api_n > 0:
            row["through_api"] = through_api(cases[:args.api_n])
        if hf_n > 0:
            hf = run_transformers(args.checkpoint, cases[:hf_n], args.threads)
            row["transformers"] = hf.summary(cases[:hf_n])
            same_grid = [a == b for a, b in zip(hf.grids, adaptive.grids)]
            same_steps = [a == b for a, b in zip(hf.steps, adaptive.steps)]
            row["agreement"] = {"n": hf_n, "same_grid": sum(same_grid), "same_steps": sum(same_steps),
                                "rate": round(sum(same_grid) / hf_n, 4),
                                "differing_puzzles": [i for i, same in enumerate(same_grid) if not same]}
        row["bench_seconds"] = round(time.perf_counter() - t0, 1)
        results["levels"][level] = row
        print(json.dumps({level: row}), flush=True)
    print_table(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


def print_table(results: dict) -> None:
    print("\n| level | solved as `run` delivers | steps per candidate | s/puzzle | through `run` (s/puzzle) | "
          "through /api/chat (done_reason stop, s/puzzle) | plain model, one canvas | mean steps | s/puzzle | "
          "solved (fixed 48) | transformers solved | mean steps (tf) | agreement |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for level, row in results["levels"].items():
        a, f, d, r = row["adaptive"], row.get("fixed48") or {}, row.get("delivered") or {}, row.get("through_run") or {}
        api = row.get("through_api") or {}
        tf, agree = row.get("transformers") or {}, row.get("agreement") or {}
        cells = [level, f"{d['solve_rate']:.1%} ({d['solved']}/{d['n']})" if d else "-",
                 d.get("mean_steps_per_candidate", "-"), d.get("s_per_puzzle", "-"),
                 f"{r['solve_rate']:.1%} ({r['s_per_puzzle']})" if r else "-",
                 f"{api['solve_rate']:.1%} ({api['done_reason_stop']}, {api['s_per_puzzle']})" if api else "-",
                 f"{a['solve_rate']:.1%} ({a['solved']}/{a['n']})", a["mean_steps"], a["s_per_puzzle"],
                 f"{f['solve_rate']:.1%}" if f else "-",
                 f"{tf['solve_rate']:.1%} ({tf['solved']}/{tf['n']})" if tf else "-", tf.get("mean_steps", "-"),
                 f"{agree['same_grid']}/{agree['n']}" if agree else "-"]
        print("| " + " | ".join(str(c) for c in cells) + " |")


if __name__ == "__main__":
    main()
