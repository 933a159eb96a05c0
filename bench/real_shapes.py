"""Step time, its split and peak memory at the released model's shapes (bench-real6), with in-process timers.

    python3 bench/real_shapes.py [--layers 6] [--types q4_k_m,q8_0,q6_k] [--steps 3] [--threads 2] [--json out.json]

Builds bench-real6 (bench/configs/bench-real6.json: the released 26B-A4B geometry, V 262,144, `--layers` of its layers,
random bf16 written tensor by tensor without torch) into bench/work/real6-L<layers>/, converts it once per type (the
conversion time is reported: the converter's own speed), then runs `dgemma debug generate` in a child process: one
256-token canvas after a 256-token prompt with early stop off, and reads its `timings` (prefill, one wall time per
denoising step). Step 1 has no self-conditioning, so self-conditioning ≈ mean(steps 2..) − step 1. Also reported: the
child's peak RSS against the file size, the CPU (name, flags that matter) and numpy's float32 GEMM rate on the LM head's
shape in the same run (the machine's float-GEMM reference).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import common

CONFIG = common.CONFIGS / "bench-real6.json"
PROMPT_TOKENS = 256


def convert(ckpt: Path, outtype: str, out: Path, threads: int) -> float | None:
    """Seconds the conversion took (None: the GGUF was already there)."""
    if out.exists():
        return None
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "dgemma_cli.main", "convert", str(ckpt), "--outtype", outtype,
                    "--outfile", str(out), "--threads", str(threads)], check=True)
    return time.monotonic() - started


# The child runs `debug generate` and reports its own peak RSS (ru_maxrss is in KiB on Linux) on stderr's last line.
CHILD = """
import json, resource, sys
from dgemma_cli.main import app
try:
    app(sys.argv[1:], standalone_mode=False)
finally:
    print(json.dumps({"maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}), file=sys.stderr)
"""


def run_steps(gguf: Path, steps: int, threads: int) -> dict:
    """`debug generate` in a child: its timings and its peak RSS."""
    prompt = ",".join(str(5 + i % 200) for i in range(PROMPT_TOKENS))
    cmd = [sys.executable, "-c", CHILD, "debug", "generate", str(gguf), "--prompt-ids", prompt,
           "--max-new-tokens", "256", "--steps", str(steps), "--confidence-threshold", "1e-30",
           "--threads", str(threads), "--seed", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"debug generate failed on {gguf.name}: {proc.stderr.strip()[-500:]}")
    timings = json.loads(proc.stdout.strip().splitlines()[-1])["timings"]
    return {"timings": timings, "peak_rss_bytes": json.loads(proc.stderr.strip().splitlines()[-1])["maxrss"]}


def sgemm_rate(k: int, m: int, n: int, reps: int = 3) -> float:
    """numpy float32 GEMM GFLOP/s for [n, k] · [k, m] (the LM head's shape), best of reps."""
    a = np.random.default_rng(0).standard_normal((n, k), dtype=np.float32)
    b = np.random.default_rng(1).standard_normal((k, m), dtype=np.float32)
    best = float("inf")
    for _ in range(reps + 1):
        started = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - started)
    return 2 * k * m * n / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--types", default="q4_k_m,q8_0,q6_k")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workdir", type=Path, default=common.WORK)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    text = json.loads(CONFIG.read_text())["text_config"]
    ckpt = common.build_synthetic(CONFIG, a.workdir / f"real6-L{a.layers}", a.layers)
    report = {"cpu": common.cpu_info(), "threads": a.threads, "layers": a.layers,
              "numpy_sgemm_gflops_lm_head_shape": sgemm_rate(text["hidden_size"], 16384, 256), "types": {}}
    for outtype in a.types.split(","):
        gguf = a.workdir / f"real6-L{a.layers}-{outtype}.gguf"
        seconds = convert(ckpt, outtype, gguf, a.threads)
        run = run_steps(gguf, a.steps, a.threads)
        steps = run["timings"]["steps_s"]
        sc = sum(steps[1:]) / len(steps[1:]) - steps[0] if len(steps) > 1 else None
        file_size = gguf.stat().st_size
        entry = {"file_bytes": file_size, "convert_s": seconds, "prefill_s": run["timings"]["prefill_s"],
                 "steps_s": steps, "self_conditioning_s": sc, "peak_rss_bytes": run["peak_rss_bytes"],
                 "rss_over_file_bytes": run["peak_rss_bytes"] - file_size}
        report["types"][outtype] = entry
        print(f"{outtype}: file {file_size / 2**30:.2f} GiB, convert {seconds and round(seconds)} s, "
              f"prefill {entry['prefill_s']:.2f} s, steps {', '.join(f'{s:.2f}' for s in steps)} s, "
              f"SC ≈ {sc and round(sc, 2)} s, peak RSS − file {entry['rss_over_file_bytes'] / 2**30:.2f} GiB",
              flush=True)
    print(json.dumps(report, indent=1))
    if a.json:
        a.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
