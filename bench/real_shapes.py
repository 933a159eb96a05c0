"""Step time, its split and peak memory at the released model's shapes (bench-real6), with in-process timers.

    python3 bench/real_shapes.py [--layers 6] [--types q4_k_m,q8_0,q6_k] [--steps 3] [--threads 2] [--json out.json]

Builds bench-real6 (bench/configs/bench-real6.json: the released 26B-A4B geometry, V 262,144, `--layers` of its layers,
random bf16 written tensor by tensor without torch) into bench/work/real6-L<layers>/, converts it once per type (the
conversion time is reported: the converter's own speed), then runs `dgemma debug generate` in a child process: one
256-token canvas after a 256-token prompt with early stop off, and reads its `timings` (prefill, one wall time per
denoising step). Step 1 has no self-conditioning, so self-conditioning ≈ mean(steps 2..) − step 1. Also reported:
the child's peak RSS against the file size; one self-conditioned step profiled node by node in a second child, as
seconds and GFLOP/s per class (experts, dense products, attention, LM head, self-conditioning, other); the CPU (name,
flags that matter) and numpy's float32 GEMM rate on the LM head's shape in the same run (the machine's float-GEMM
reference). `--types iq4_xs` builds an IQ4_XS-experts mix (bench_mixes).
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


# Mixes no `--outtype` names, built through the converter's API: "iq4_xs" is an Unsloth-style IQ4_XS file (IQ4_XS
# wherever the rows allow, IQ4_NL for the 704-wide expert down projections, Q6_K for the tied embedding). It is not
# llama-quantize's IQ4_XS recipe (which also bumps some layers to Q5_K), only its expert types.
def bench_mixes():
    from gguf import GGMLQuantizationType as T, LlamaFileType as FT

    from dgemma_convert.quantize import OutType
    return {"iq4_xs": OutType("iq4_xs", FT.MOSTLY_IQ4_XS, T.IQ4_XS)}


def convert(ckpt: Path, outtype: str, out: Path, threads: int) -> float | None:
    """Seconds the conversion took (None: the GGUF was already there)."""
    if out.exists():
        return None
    started = time.monotonic()
    mix = bench_mixes().get(outtype)
    if mix is not None:
        from dgemma_convert.converter import convert as convert_checkpoint
        convert_checkpoint(ckpt, out, mix, threads=threads)
        return time.monotonic() - started
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


# A second child times one self-conditioned step node by node (Context.step_profiled): seconds per class of node.
SPLIT_CHILD = """
import json, sys
import numpy as np
from dgemma_engine.model import Context, Model
path, threads, prompt_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
with Model.load(path, threads=threads) as m:
    C = m.hparams.canvas_length
    with Context(m, n_ctx=prompt_tokens + C, threads=threads) as ctx:
        ctx.encode([5 + i % 200 for i in range(prompt_tokens)])
        canvas = np.random.default_rng(0).integers(5, m.hparams.n_vocab, C)
        ctx.step(canvas)  # the canvas's first step: no self-conditioning
        ctx.step_profiled(canvas, 1.0)  # warm-up
        print(json.dumps(ctx.step_profiled(canvas, 1.0)))
"""


def step_split(gguf: Path, threads: int) -> dict[str, float]:
    """Seconds per class of node in one self-conditioned step (profiled node by node)."""
    proc = subprocess.run([sys.executable, "-c", SPLIT_CHILD, str(gguf), str(threads), str(PROMPT_TOKENS)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"profiled step failed on {gguf.name}: {proc.stderr.strip()[-500:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def step_flops(text: dict, layers: int, canvas: int = 256, keys: int = PROMPT_TOKENS + 256) -> dict[str, float]:
    """Floating-point operations of one self-conditioned step per class (2 per multiply-add), first `layers` layers."""
    H, V, FF, FFe = text["hidden_size"], text["vocab_size"], text["intermediate_size"], text["moe_intermediate_size"]
    nH, E, K = text["num_attention_heads"], text["num_experts"], text["top_k_experts"]
    dense = attention = 0
    for kind in text["layer_types"][:layers]:
        full = kind == "full_attention"
        hd = text["global_head_dim"] if full else text["head_dim"]
        nkv = text["num_global_key_value_heads"] if full else text["num_key_value_heads"]
        dense += H * nH * hd * 2 + H * nkv * hd * (1 if full else 2) + 3 * H * FF + H * E  # q, o, k (v), MLP, router
        attention += 2 * keys * nH * hd
    return {"experts": 2.0 * canvas * K * 3 * H * FFe * layers, "dense": 2.0 * canvas * dense,
            "attention": 2.0 * canvas * attention, "lm_head": 2.0 * canvas * H * V,
            "self_cond": 2.0 * canvas * (V * H + 3 * H * FF)}


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
        split = step_split(gguf, a.threads)
        flops = step_flops(text, a.layers)
        entry["split_s"] = split
        entry["split_gflops"] = {k: flops[k] / split[k] / 1e9 for k in flops if split.get(k)}
        report["types"][outtype] = entry
        print(f"{outtype}: file {file_size / 2**30:.2f} GiB, convert {seconds and round(seconds)} s, "
              f"prefill {entry['prefill_s']:.2f} s, steps {', '.join(f'{s:.2f}' for s in steps)} s, "
              f"SC ≈ {sc and round(sc, 2)} s, peak RSS − file {entry['rss_over_file_bytes'] / 2**30:.2f} GiB",
              flush=True)
        print("  split (profiled SC step): " + ", ".join(
            f"{k} {v:.2f} s" + (f" ({entry['split_gflops'][k]:.0f} GFLOP/s)" if k in entry["split_gflops"] else "")
            for k, v in split.items()), flush=True)
    print(json.dumps(report, indent=1))
    if a.json:
        a.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
