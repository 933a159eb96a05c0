"""What a denoising step copies between the host and the devices, and what it costs: the CPU alone against every unit
on one ggml RPC server on loopback.

    python3 bench/host_bytes.py GGUF [GGUF...] [--steps 3] [--threads 2] [--server-threads 2] [--reps 1] [--json out]

Per file, `dgemma debug generate` runs in a child process (one 256-token canvas after a --prompt-token prompt, fast
RNG, early stop off) once with `--num-gpu 0` and once with every unit on the RPC server (`--num-gpu -1`, the server
started here: `python -m dgemma_engine.rpc_server`), alternating, --reps times. Reported from the child's JSON:
`host_bytes_per_step` (the engine's count, docs/engine.md#what-crosses) and the step times (the first step of a canvas
has no self-conditioning; the later ones are the self-conditioned step).

The server and the engine share this machine's cores, so the RPC figures measure the cost of the device boundary
(transfers, graph serialisation), not a speed-up.
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
from rpc_split import start_server


def run(gguf: Path, num_gpu: int, args, env: dict) -> dict:
    prompt = ",".join(str(5 + i % 200) for i in range(args.prompt_tokens))
    cmd = [sys.executable, "-m", "dgemma_cli.main", "debug", "generate", str(gguf), "--prompt-ids", prompt,
           "--max-new-tokens", "256", "--steps", str(args.steps), "--confidence-threshold", "1e-30",
           "--threads", str(args.threads), "--seed", "1", "--num-gpu", str(num_gpu)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.exit(f"debug generate failed on {gguf.name} (num_gpu {num_gpu}): {proc.stderr.strip()[-800:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])["timings"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gguf", type=Path, nargs="+")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--server-threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    proc, endpoint = start_server(args.server_threads)
    env = dict(os.environ, DGEMMA_RPC=endpoint)
    report = {"cpu": common.cpu_info(), "threads": args.threads, "server_threads": args.server_threads,
              "files": {}}
    try:
        for gguf in args.gguf:
            rows: dict[str, list[dict]] = {"cpu": [], "rpc": []}
            for _ in range(args.reps):
                for name, num_gpu in (("cpu", 0), ("rpc", -1)):
                    rows[name].append(run(gguf, num_gpu, args, env))
            entry = {}
            for name, runs in rows.items():
                first = [r["steps_s"][0] for r in runs]
                later = [s for r in runs for s in r["steps_s"][1:]]
                entry[name] = {"host_bytes_per_step": [r["host_bytes_per_step"] for r in runs],
                               "first_step_s": first, "sc_steps_s": later,
                               "sc_step_median_s": statistics.median(later) if later else None}
                print(f"{gguf.name} {name}: host bytes/step {entry[name]['host_bytes_per_step']}, first step "
                      f"{', '.join(f'{s:.2f}' for s in first)} s, self-conditioned steps "
                      f"{', '.join(f'{s:.2f}' for s in later)} s", flush=True)
            report["files"][gguf.name] = entry
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
