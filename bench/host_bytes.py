"""What a denoising step copies between the host and the devices, and what it costs: the CPU alone against every unit
on one ggml RPC server on loopback, each with the C sampler on the host and with the sampling reductions in the graph.

    python3 bench/host_bytes.py GGUF [GGUF...] [--steps 3] [--threads 2] [--server-threads 2] [--reps 1]
                                [--modes cpu:host,cpu:device,rpc:host,rpc:device] [--json out]

Per file and mode, a child process loads the model (`num_gpu 0`, or every unit on the RPC server started here with
`python -m dgemma_engine.rpc_server`) and generates one 256-token canvas after a --prompt-tokens prompt (fast RNG,
early stop off) through `run_debug_generation`, its steps sampled by the C sampler (`host`) or in the graph (`device`,
docs/engine.md#sampling-on-the-device; what a build picks by itself: `device` exactly when the logits live on a
device). Modes alternate, --reps times. Reported: `host_bytes_per_step` (the engine's count,
docs/engine.md#what-crosses) and the step times (decoder step and sampler; the first step of a canvas has no
self-conditioning).

The server and the engine share this machine's cores, so the RPC figures measure the cost of the device boundary
(transfers, graph serialisation, the server's own CPU kernels), not a speed-up.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import common
from rpc_split import rpc_servers

CHILD = """
import json, sys
from dgemma_engine.debug_generate import run_debug_generation
from dgemma_engine.generate import SamplerParams
from dgemma_engine.model import Model
path, num_gpu, on_device, threads, steps, prompt_tokens = sys.argv[1:]
threads, steps = int(threads), int(steps)
with Model.load(path, threads=threads, num_gpu=int(num_gpu)) as m:
    params = SamplerParams.from_metadata(m.metadata, max_steps=steps, confidence_threshold=1e-30, seed=1, rng="fast")
    prompt = [5 + i % 200 for i in range(int(prompt_tokens))]
    out = run_debug_generation(m, prompt, params, m.hparams.canvas_length, eos_ids=(), threads=threads, timings=True,
                               sample_on_device=on_device == "device")
print(json.dumps(out["timings"]))
"""


def run(gguf: Path, mode: str, args, env: dict) -> dict:
    where, sampling = mode.split(":")
    num_gpu = "0" if where == "cpu" else "-1"
    proc = subprocess.run([sys.executable, "-c", CHILD, str(gguf), num_gpu, sampling, str(args.threads),
                           str(args.steps), str(args.prompt_tokens)], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.exit(f"generation failed on {gguf.name} ({mode}): {proc.stderr.strip()[-800:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf", type=Path, nargs="+")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--server-threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--modes", default="cpu:host,cpu:device,rpc:host,rpc:device")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    modes = args.modes.split(",")
    report = {"cpu": common.cpu_info(), "threads": args.threads, "server_threads": args.server_threads,
              "prompt_tokens": args.prompt_tokens, "files": {}}
    with rpc_servers(1 if any(m.startswith("rpc") for m in modes) else 0, args.server_threads) as endpoints:
        env = dict(os.environ, DGEMMA_RPC=endpoints[0]) if endpoints else dict(os.environ)
        for gguf in args.gguf:
            rows: dict[str, list[dict]] = {m: [] for m in modes}
            for _ in range(args.reps):
                for mode in modes:
                    rows[mode].append(run(gguf, mode, args, env))
            entry = {}
            for mode, runs in rows.items():
                first = [r["steps_s"][0] for r in runs]
                later = [s for r in runs for s in r["steps_s"][1:]]
                entry[mode] = {"host_bytes_per_step": [r["host_bytes_per_step"] for r in runs],
                               "first_step_s": first, "sc_steps_s": later,
                               "first_step_median_s": statistics.median(first),
                               "sc_step_median_s": statistics.median(later) if later else None}
                print(f"{gguf.name} {mode}: host bytes/step {entry[mode]['host_bytes_per_step']}, first step "
                      f"{', '.join(f'{s:.2f}' for s in first)} s, self-conditioned steps "
                      f"{', '.join(f'{s:.2f}' for s in later)} s", flush=True)
            report["files"][gguf.name] = entry
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
