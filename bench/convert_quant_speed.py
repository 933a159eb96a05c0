"""Quantization rate (M elements/s) of ggml_quantize_chunk vs dgemma's fast K-quants, same rows, same run.

    python bench/convert_quant_speed.py [--rows 256] [--threads 1,2] [--repeats 3]

Rows of 2816 values (the release's hidden size) drawn like bf16 weights; the best of --repeats per cell. Each
accelerated type's bytes are compared too (docs/convert.md#fast-k-quants).
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np
from gguf import GGMLQuantizationType as T

from dgemma_convert.quantize import GGMLQuantizer

TYPES = (T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_0)


def rate(quantizer: GGMLQuantizer, t: T, rows: np.ndarray, repeats: int) -> tuple[float, np.ndarray]:
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        out = quantizer.quantize(t, rows)
        best = min(best, time.perf_counter() - started)
    return rows.size / best / 1e6, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    rows = (rng.standard_normal((args.rows, 2816)) * 0.02).astype(np.float32)
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    print("type  threads  ggml Melem/s  dgemma Melem/s  speed-up  same bytes")
    for threads in (int(n) for n in args.threads.split(",")):
        ggml, ours = GGMLQuantizer(threads, fast=False), GGMLQuantizer(threads)
        for t in TYPES:
            (r_ggml, b_ggml), (r_ours, b_ours) = rate(ggml, t, rows, args.repeats), rate(ours, t, rows, args.repeats)
            note = "" if t in ours.fast_types else "  (ggml on both sides: noise only)"
            print(f"{t.name:5} {threads:7}  {r_ggml:12.1f}  {r_ours:14.1f}  {r_ours / r_ggml:7.2f}x  "
                  f"{np.array_equal(b_ggml, b_ours)}{note}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
