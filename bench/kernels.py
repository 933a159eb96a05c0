"""The engine's quantized product kernels against ggml's own ops and numpy's F32 GEMM, on the models' weight shapes.

    python3 bench/kernels.py [--threads 2] [--cpu-time] [--types q8_0,q4_K,q6_K,q5_0,iq4_nl,iq4_xs]
                             [--shapes real6,mid] [--only NAME] [--reps 3] [--json out]

For each weight shape and type: ggml's mul_mat_id (experts) or mul_mat (dense) on random weights quantized by ggml,
the same op with the weights in ggml's CPU repack buffer (interleaved for its tiled kernels, as llama.cpp loads them;
Q4_0, Q4_K, IQ4_NL),
the engine's kernels on the same shape (dg_bench_mul_mat of the engine's test library, `_engine_tests`, with engine_op
set; DGEMMA_QKERNELS picks the path), and numpy's F32 matmul on the same shapes in the same run (per expert:
[rows, kd] × [kd, m]).
Expert shapes keep the real rows per expert (256 tokens × top-k / experts) with fewer experts, so that the weights
still exceed the last-level cache as in the model. Rates are GFLOP/s of 2·kd·m per (token, slot), best of --reps.
The machine is named in the report (CPU model and the SIMD flags that matter here).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import common

TYPES = {"q8_0": 8, "q5_0": 6, "q4_K": 12, "q6_K": 14, "iq4_nl": 20, "iq4_xs": 23}
BLOCK = {"q8_0": 32, "q5_0": 32, "q4_K": 256, "q6_K": 256, "iq4_nl": 32, "iq4_xs": 256}


@dataclass
class Shape:
    name: str
    kd: int        # contraction
    m: int         # output rows per expert (or of the dense weight)
    tokens: int
    n_expert: int  # 0: dense
    n_used: int


# bench-real6 / released model: H 2816, FFe 704 (gate_up 1408), 128 experts top-8 -> 16 rows per expert at 256 tokens
SHAPES = {
    "real6": [Shape("experts gate_up", 2816, 1408, 128, 16, 2), Shape("experts down", 704, 2816, 128, 16, 2),
              Shape("LM head slice", 2816, 16384, 256, 0, 0), Shape("SC gate", 2816, 2112, 256, 0, 0)],
    # bench-mid: H 1024, FFe 256, 32 experts top-4 -> 32 rows per expert at 256 tokens
    "mid": [Shape("experts gate_up", 1024, 512, 256, 32, 4), Shape("experts down", 256, 1024, 256, 32, 4),
            Shape("LM head", 1024, 32768, 256, 0, 0)],
}


def engine_bench():
    from dgemma_engine._lib import load_library
    fn = load_library("engine_tests").dg_bench_mul_mat
    fn.restype = ctypes.c_double
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int,
                   ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_double), ctypes.c_char_p,
                   ctypes.c_size_t]
    err = ctypes.create_string_buffer(256)

    def run(type_id: int, s: Shape, engine_op: int, threads: int, reps: int) -> tuple[float, float] | None:
        """engine_op 0: ggml's op on a plain buffer, 1: ours, 2: ggml's op on its CPU repack buffer (None: no repack
        for this type)."""
        cpu = ctypes.c_double(0)
        wall = fn(type_id, s.kd, s.m, s.tokens, s.n_expert, s.n_used, engine_op, threads, reps,
                  ctypes.byref(cpu), err, len(err))
        if wall == -2 and engine_op == 2:
            return None
        if wall < 0:
            raise RuntimeError(err.value.decode())
        return wall, cpu.value
    return run


def numpy_seconds(s: Shape, reps: int) -> tuple[float, float]:
    """numpy F32 matmul of the same products: per expert its routed rows against its weight, or dense."""
    import numpy as np  # after main() has set OpenBLAS's thread count
    rng = np.random.default_rng(0)
    if s.n_expert:
        rows = s.tokens * s.n_used // s.n_expert
        x = rng.standard_normal((s.n_expert, rows, s.kd), dtype=np.float32)
        w = rng.standard_normal((s.n_expert, s.kd, s.m), dtype=np.float32)
    else:
        x = rng.standard_normal((s.tokens, s.kd), dtype=np.float32)
        w = rng.standard_normal((s.kd, s.m), dtype=np.float32)

    def product() -> None:
        if s.n_expert:
            for e in range(s.n_expert):  # 2-D GEMMs: numpy's stacked matmul does not call BLAS per slice
                np.matmul(x[e], w[e])
        else:
            np.matmul(x, w)
    product()
    best, best_cpu = float("inf"), float("inf")
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.process_time()
        product()
        best, best_cpu = min(best, time.perf_counter() - t0), min(best_cpu, time.process_time() - c0)
    return best, best_cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--shapes", default="real6,mid")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--only", default="", help="only shapes whose name contains this")
    ap.add_argument("--cpu-time", action="store_true",
                    help="rates from process CPU time (per thread-second x threads) instead of wall time: the "
                         "load-independent measure on a shared machine, exact at --threads 1")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    os.environ["OPENBLAS_NUM_THREADS"] = str(args.threads)
    # numpy first, all shapes: ggml's worker threads keep spinning for a while after a graph, which would slow it
    which = 1 if args.cpu_time else 0
    scale = args.threads if args.cpu_time else 1  # CPU time of all threads -> seconds of the whole product
    shapes = [(group, s) for group in args.shapes.split(",") for s in SHAPES[group] if args.only in s.name]
    f32_rate = {id(s): 2.0 * s.kd * s.m * s.tokens * (s.n_used or 1) / (numpy_seconds(s, args.reps)[which] / scale)
                / 1e9 for _, s in shapes}
    run = engine_bench()
    report = {"cpu": common.cpu_description(), "threads": args.threads, "clock": "cpu" if args.cpu_time else "wall",
              "path": os.environ.get("DGEMMA_QKERNELS", "auto"), "rows": []}
    print(report["cpu"], f"| {args.threads} threads | {report['clock']} time | DGEMMA_QKERNELS={report['path']}")
    print(f"{'shape':<28} {'type':<6} {'ggml GF/s':>9} {'repack':>7} {'ours GF/s':>9} {'numpy F32':>9} "
          f"{'ours/ggml':>9} {'ours/F32':>8}")
    for group, s in shapes:
        flop = 2.0 * s.kd * s.m * s.tokens * (s.n_used or 1)
        f32 = f32_rate[id(s)]
        for t in args.types.split(","):
            if s.kd % BLOCK[t]:
                continue  # K-quants need rows of 256 (the 704-wide rows fall back to 32-element types)
            ggml = flop / (run(TYPES[t], s, 0, args.threads, args.reps)[which] / scale) / 1e9
            ours = flop / (run(TYPES[t], s, 1, args.threads, args.reps)[which] / scale) / 1e9
            repacked = run(TYPES[t], s, 2, args.threads, args.reps)
            repack = flop / (repacked[which] / scale) / 1e9 if repacked else None
            row = {**asdict(s), "group": group, "type": t, "ggml_gflops": round(ggml, 1),
                   "ggml_repack_gflops": repack and round(repack, 1), "ours_gflops": round(ours, 1),
                   "numpy_f32_gflops": round(f32, 1)}
            report["rows"].append(row)
            shown = f"{repack:7.1f}" if repack else f"{'–':>7}"
            print(f"{group + ' ' + s.name:<28} {t:<6} {ggml:9.1f} {shown} {ours:9.1f} {f32:9.1f} {ours / ggml:9.2f} "
                  f"{ours / f32:8.2f}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
