"""What `self_cond_top_k` changes: the self-conditioned logits against the dense product, and the step time.

    python3 bench/self_cond_top_k.py [--ks 32,256,2048] [--gguf bench/work/real6-L1-q8_0.gguf] [--threads 2]
                                     [--reps 3] [--json out]

Fixtures (tests/fixtures/tiny-a, tiny-b, converted to F32 and Q8_0 into bench/work/ when missing): every recorded
self-conditioned decoder call of the golden runs (teacher-forced as tests/test_engine.py replays them: the recorded
previous logits, tempered by the recorded T) with `self_cond_top_k` k against 0; reported: the max |Δlogits| and the
tail mass the top k leaves out (the mean over rows of 1 − Σ top-k probabilities). k at least the vocabulary is the
dense product itself.

--gguf (a bench-real6-vocabulary file): one canvas after a 256-token prompt; a first step, then self-conditioned steps
on its logits (T 0.8) with k = 0 and each k, interleaved --reps times; reported: the step times and, against k = 0,
the max |Δlogits| and the tail mass. Random weights give nearly flat distributions (entropy near log V), the worst
case for a top-k: a trained model's are far more peaked.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

import common

FIXTURES = common.REPO / "tests" / "fixtures"


def tail_mass(prev_logits: np.ndarray, temperature: float, k: int) -> float:
    z = prev_logits.astype(np.float64) / temperature
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    if k <= 0 or k >= p.shape[1]:
        return 0.0
    top = np.sort(p, axis=1)[:, -k:]
    return float(np.mean(1.0 - top.sum(axis=1)))


def fixture_report(ks: list[int], threads: int) -> dict:
    from dgemma_convert import convert
    from dgemma_engine.model import Context, Model

    out: dict = {}
    for name in ("tiny-a", "tiny-b"):
        for outtype in ("f32", "q8_0"):
            path = common.WORK / f"{name}-{outtype}.gguf"
            if not path.exists():
                path.parent.mkdir(parents=True, exist_ok=True)
                convert(FIXTURES / name, path, outtype, threads=threads)
            index = json.loads((FIXTURES / name / "golden" / "index.json").read_text())
            worst = {k: 0.0 for k in ks}
            tails = {k: [] for k in ks}
            calls = 0
            with Model.load(path, threads=threads) as m:
                for run_name, meta in index["runs"].items():
                    if not meta["has_raw"]:
                        continue
                    with np.load(FIXTURES / name / "golden" / f"{run_name}.npz") as z:
                        run = {key: z[key] for key in z.files}
                    contexts = {k: Context(m, n_ctx=len(run["seq"]) + m.hparams.canvas_length, threads=threads)
                                for k in [0] + ks}
                    try:
                        for k, ctx in contexts.items():
                            ctx.self_cond_top_k = k
                            ctx.encode(run["prompt"])
                        for i in range(len(run["pos"])):
                            start = int(run["pos"][i][0])
                            logits = {}
                            for k, ctx in contexts.items():
                                if start != ctx.n_past:
                                    ctx.encode(run["seq"][ctx.n_past:start])
                                if run["has_sc"][i]:
                                    ctx.set_self_cond_logits(run["raw"][i - 1])
                                    logits[k] = np.array(ctx.step(run["canvas"][i],
                                                                  sc_temperature=float(run["T"][i - 1])))
                                else:
                                    logits[k] = np.array(ctx.step(run["canvas"][i]))
                            if run["has_sc"][i]:
                                calls += 1
                                for k in ks:
                                    worst[k] = max(worst[k], float(np.abs(logits[k] - logits[0]).max()))
                                    tails[k].append(tail_mass(run["raw"][i - 1], float(run["T"][i - 1]), k))
                    finally:
                        for ctx in contexts.values():
                            ctx.close()
                vocab = m.hparams.n_vocab
            out[f"{name} {outtype}"] = {"vocab": vocab, "sc_calls": calls,
                                        "max_abs_dlogits": worst,
                                        "mean_tail_mass": {k: float(np.mean(v)) for k, v in tails.items()}}
            print(f"{name} {outtype} (V {vocab}, {calls} self-conditioned calls): " + "; ".join(
                f"k {k}: max |Δlogits| {worst[k]:.3g}, tail {np.mean(tails[k]):.3g}" for k in ks), flush=True)
    return out


def gguf_report(path: Path, ks: list[int], threads: int, reps: int) -> dict:
    from dgemma_engine.model import Context, Model

    with Model.load(path, threads=threads, num_gpu=0) as m:
        C, V = m.hparams.canvas_length, m.hparams.n_vocab
        prompt = [5 + i % 200 for i in range(256)]
        canvas = np.random.default_rng(0).integers(5, V, C)
        with Context(m, n_ctx=len(prompt) + C, threads=threads) as ctx:
            ctx.encode(prompt)
            first = np.array(ctx.step(canvas))
            times: dict[int, list[float]] = {k: [] for k in [0] + ks}
            logits: dict[int, np.ndarray] = {}
            for _ in range(reps):
                for k in [0] + ks:
                    ctx.self_cond_top_k = k
                    ctx.set_self_cond_logits(first)
                    started = time.perf_counter()
                    logits[k] = np.array(ctx.step(canvas, sc_temperature=0.8))
                    times[k].append(time.perf_counter() - started)
    report = {"vocab": V, "step_s": times, "median_step_s": {k: statistics.median(v) for k, v in times.items()},
              "max_abs_dlogits": {k: float(np.abs(logits[k] - logits[0]).max()) for k in ks},
              "mean_tail_mass": {k: tail_mass(first, 0.8, k) for k in ks}}
    print(f"{path.name}: dense step {report['median_step_s'][0]:.2f} s; " + "; ".join(
        f"k {k}: {report['median_step_s'][k]:.2f} s, max |Δlogits| {report['max_abs_dlogits'][k]:.3g}, tail "
        f"{report['mean_tail_mass'][k]:.3g}" for k in ks), flush=True)
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ks", default="32,256,2048")
    ap.add_argument("--gguf", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    ks = [int(k) for k in args.ks.split(",")]
    report = {"cpu": common.cpu_info(), "threads": args.threads, "fixtures": fixture_report(ks, args.threads)}
    if args.gguf:
        report["gguf"] = {args.gguf.name: gguf_report(args.gguf, ks, args.threads, args.reps)}
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
