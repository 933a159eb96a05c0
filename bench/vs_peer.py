"""dgemma's self-conditioned denoising step against llama.cpp PR #24423 (`llama-diffusion-cli`) on the same GGUF files.

    python3 bench/vs_peer.py PEER_BIN GGUF... [--threads 2] [--reps 2] [--prompt 256] [--peer-args ARGS]
                             [--self-cond-top-k 0,256,...] [--json out]
    python3 bench/vs_peer.py --no-peer GGUF...           (dgemma alone)

One 256-token canvas after a --prompt-token prompt, early stop off, 2 threads, A/B interleaved, --reps rounds:

- dgemma: `dgemma debug generate --steps 3` in a child; its in-process per-step timers (`timings.steps_s`); the step
  figure is the mean of steps 2 and 3 (self-conditioned; step 1 has no self-conditioning and pays the page faults
  of a file read for the first time).
- the peer: it reports one in-process time per generation ("total time"), so its step is the marginal
  (t(3 steps) − t(1 step)) / 2, which cancels loading and prefill.

--self-cond-top-k: dgemma is timed at each k in every round (0: the dense, exact self-conditioning; the peer has no
such option and always runs dense); the ratio is against the first k listed.

Each file is read once before its first round (both sides then find it in the page cache). The report names the CPU,
the peer's build and every round's figures; the ratio is peer / dgemma of the medians.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

import common

WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hex bad jumping zebras " * 200).split()


def run(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace")
    if proc.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd[:4])}: {proc.stderr.strip()[-400:]}")
    return proc.stdout + proc.stderr


def dgemma_step(gguf: Path, threads: int, prompt: int, top_k: int = 0) -> list[float]:
    """In-process seconds of steps 2 and 3 of one generation."""
    ids = ",".join(str(5 + (i * 7919) % 250) for i in range(prompt))
    out = run([sys.executable, "-m", "dgemma_cli.main", "debug", "generate", str(gguf), "--prompt-ids", ids,
               "--seed", "1", "--max-new-tokens", "256", "--steps", "3", "--confidence-threshold", "1e-30",
               "--threads", str(threads), "--self-cond-top-k", str(top_k)])
    steps = json.loads(next(line for line in out.splitlines() if line.startswith("{")))["timings"]["steps_s"]
    return steps[1:]


def peer_total(peer: str, gguf: Path, steps: int, threads: int, prompt: int, extra: list[str] = ()) -> float:
    text = " ".join(WORDS[: int(prompt * 0.9)])  # about `prompt` tokens with the peer's tokenizer
    out = run([peer, "-m", str(gguf), "-p", text, "-n", "256", "--diffusion-eb-max-steps", str(steps),
               "--diffusion-eb-confidence", "1e-30", "-t", str(threads), "--seed", "1", "-no-cnv", *extra])
    found = re.search(r"total time: ([0-9.]+)ms", out)
    if not found:
        sys.exit(f"the peer printed no 'total time' for {gguf.name}")
    return float(found.group(1)) / 1000


def peer_build(peer: str) -> str:
    """What the peer's --version prints (its llama.cpp version line and compiler)."""
    proc = subprocess.run([peer, "--version"], capture_output=True, text=True, errors="replace")
    lines = [line.strip() for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    return "; ".join(lines[-2:]) if proc.returncode == 0 and lines else "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("peer", nargs="?", help="the peer's llama-diffusion-cli (omit with --no-peer)")
    ap.add_argument("ggufs", nargs="+", type=Path)
    ap.add_argument("--no-peer", action="store_true", help="time dgemma alone (the first argument is a GGUF then)")
    ap.add_argument("--peer-args", default="", help="more arguments for the peer, e.g. '-ngl 99' on a GPU")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--self-cond-top-k", default="0", help="comma-separated k values dgemma is timed at (0: dense)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    ks = [int(k) for k in a.self_cond_top_k.split(",")]
    if a.no_peer:
        a.ggufs, a.peer = [Path(a.peer), *a.ggufs] if a.peer else a.ggufs, None
    report = {"cpu": common.cpu_info(), "peer": peer_build(a.peer) if a.peer else None, "threads": a.threads,
              "files": {}}
    print(f"{common.cpu_description()} | {a.threads} threads | peer: {report['peer']}", flush=True)
    for gguf in a.ggufs:
        with gguf.open("rb") as f:  # into the page cache before either side runs
            while f.read(1 << 24):
                pass
        ours: dict[int, list[float]] = {k: [] for k in ks}
        theirs: list[float] = []
        for _ in range(a.reps):
            for k in ks:
                ours[k].append(statistics.mean(dgemma_step(gguf, a.threads, a.prompt, k)))
            if a.peer:
                one, three = (peer_total(a.peer, gguf, n, a.threads, a.prompt, a.peer_args.split()) for n in (1, 3))
                theirs.append((three - one) / 2)
        entry: dict = {"dgemma_step_s": ours[ks[0]],
                       "dgemma_step_s_by_self_cond_top_k": {str(k): v for k, v in ours.items()}}
        parts = [f"dgemma k={k} {statistics.median(v):.3f} s ({', '.join(f'{x:.3f}' for x in v)})"
                 for k, v in ours.items()]
        if theirs:
            p = statistics.median(theirs)
            entry.update(peer_step_s=theirs, ratio=p / statistics.median(ours[ks[0]]),
                         ratio_by_self_cond_top_k={str(k): p / statistics.median(v) for k, v in ours.items()})
            parts.append(f"peer {p:.3f} s ({', '.join(f'{x:.3f}' for x in theirs)})")
            parts += [f"peer / dgemma(k={k}) {p / statistics.median(v):.2f}x" for k, v in ours.items()]
        report["files"][gguf.name] = entry
        print(f"{gguf.name}: " + ", ".join(parts), flush=True)
    if a.json:
        a.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
