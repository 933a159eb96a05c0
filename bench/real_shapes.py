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
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import common

sys.path.insert(0, str(common.REPO / "tests"))
from synthetic_checkpoint import write_synthetic_checkpoint  # noqa: E402

CONFIG = common.CONFIGS / "bench-real6.json"
PROMPT_TOKENS = 256


def cpu_description() -> dict:
    name, flags = platform.processor() or "unknown", set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            name = value.strip()
        elif key.strip() == "flags":
            flags = set(value.split())
    wanted = ["avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "amx_int8"]
    return {"name": name, "cores": os.cpu_count(), "flags": [f for f in wanted if f in flags]}


def build_checkpoint(layers: int, out: Path) -> Path:
    if (out / "config.json").exists():
        return out
    text = json.loads(CONFIG.read_text())["text_config"]
    # the released pattern's first layers, ending on a full-attention layer as every DiffusionGemma does
    text = {**text, "num_hidden_layers": layers, "layer_types": text["layer_types"][:layers - 1] + ["full_attention"]}
    started = time.monotonic()
    write_synthetic_checkpoint(out, text, dtype="BF16", n_shards=max(1, layers), fast=True)
    cfg = json.loads((out / "config.json").read_text())
    cfg["canvas_length"] = 256
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    print(f"built {out} in {time.monotonic() - started:.0f} s", flush=True)
    return out


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
    ckpt = build_checkpoint(a.layers, a.workdir / f"real6-L{a.layers}")
    report = {"cpu": cpu_description(), "threads": a.threads, "layers": a.layers,
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
