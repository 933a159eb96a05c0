"""Peak memory and throughput of `dgemma convert` on a synthetic multi-GB checkpoint.

Generates a bf16 checkpoint with the released 26B-A4B tensor shapes (H 2816, 128 experts of width 704, a 262,144-token
vocabulary) but only a few layers, sharded through an index, written tensor by tensor (~6.4 GB with 3 layers). Then
runs `dgemma convert` on it once per out type in a child process and reports the child's peak RSS (getrusage
ru_maxrss, cross-checked by sampling /proc/<pid>/status) and throughput. Fails if any peak RSS reaches the limit.

    python bench/convert_memory.py [--workdir /tmp/dgemma-bench] [--layers 3] [--outtypes q8_0,bf16] [--keep]
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from synthetic_checkpoint import FULL, SLIDING, text_config, write_synthetic_checkpoint  # noqa: E402

RSS_LIMIT_BYTES = int(1.5 * 10**9)
VOCAB = 262_144

# The child converts and reports its own peak RSS (ru_maxrss is in KiB on Linux).
CHILD = """
import json, resource, sys, time
from dgemma_cli.main import app
t = time.monotonic()
try:
    app(sys.argv[1:], standalone_mode=False)
finally:
    print(json.dumps({"maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                      "seconds": time.monotonic() - t}), file=sys.stderr)
"""


def released_shapes(n_layers: int) -> dict:
    kinds = [SLIDING] * (n_layers - 1) + [FULL]
    return text_config(vocab_size=VOCAB, hidden_size=2816, intermediate_size=2112, moe_intermediate_size=704,
                       num_hidden_layers=n_layers, layer_types=kinds, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=256, global_head_dim=512, num_global_key_value_heads=2, num_experts=128,
                       top_k_experts=8, sliding_window=1024)


def sample_rss(pid: int, peak: list[int], done: threading.Event) -> None:
    """Poll VmRSS of the child every 50 ms (an independent check of ru_maxrss)."""
    while not done.is_set():
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    peak[0] = max(peak[0], int(line.split()[1]) * 1024)
        except (FileNotFoundError, ProcessLookupError):
            return
        time.sleep(0.05)


def convert_once(ckpt: Path, out: Path, outtype: str, threads: int) -> dict:
    args = [sys.executable, "-c", CHILD, "convert", str(ckpt), "--outfile", str(out), "--outtype", outtype,
            "--threads", str(threads)]
    child = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak, done = [0], threading.Event()
    sampler = threading.Thread(target=sample_rss, args=(child.pid, peak, done), daemon=True)
    sampler.start()
    stdout, stderr = child.communicate()
    done.set()
    sampler.join()
    if child.returncode != 0:
        raise SystemExit(f"conversion to {outtype} failed:\n{stderr}")
    report = json.loads(stderr.strip().splitlines()[-1])
    return {"outtype": outtype, "peak_rss_bytes": report["maxrss"], "sampled_peak_rss_bytes": peak[0],
            "seconds": report["seconds"], "output_bytes": out.stat().st_size}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=None, help="where to write (default: a new temp folder)")
    ap.add_argument("--layers", type=int, default=3, help="layers of released width (3 -> ~6.4 GB)")
    ap.add_argument("--outtypes", default="q8_0,bf16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--keep", action="store_true", help="keep the generated checkpoint and outputs")
    args = ap.parse_args()

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="dgemma-convert-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    ckpt = workdir / "synthetic-ckpt"
    try:
        t = time.monotonic()
        write_synthetic_checkpoint(ckpt, released_shapes(args.layers), dtype="BF16", n_shards=2, fast=True)
        input_bytes = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
        print(f"generated {input_bytes / 1e9:.2f} GB checkpoint ({args.layers} layers, bf16, 2 shards) "
              f"in {time.monotonic() - t:.0f} s", flush=True)
        results = []
        for outtype in args.outtypes.split(","):
            out = workdir / f"out-{outtype}.gguf"
            r = convert_once(ckpt, out, outtype, args.threads)
            r["input_bytes"] = input_bytes
            r["input_MB_per_s"] = input_bytes / r["seconds"] / 1e6
            results.append(r)
            print(f"{outtype:>6}: peak RSS {r['peak_rss_bytes'] / 1e6:7.1f} MB "
                  f"(sampled {r['sampled_peak_rss_bytes'] / 1e6:.1f} MB), "
                  f"{r['seconds']:6.1f} s, {r['input_MB_per_s']:6.1f} MB/s in, output {r['output_bytes'] / 1e9:.2f} GB",
                  flush=True)
            if not args.keep:
                out.unlink()
        print(json.dumps({"input_bytes": input_bytes, "layers": args.layers, "threads": args.threads,
                          "results": results}, indent=1))
        worst = max(r["peak_rss_bytes"] for r in results)
        if worst >= RSS_LIMIT_BYTES:
            raise SystemExit(f"peak RSS {worst / 1e9:.2f} GB exceeds the {RSS_LIMIT_BYTES / 1e9:.1f} GB limit")
    finally:
        if not args.keep:
            shutil.rmtree(workdir if args.workdir is None else ckpt, ignore_errors=True)


if __name__ == "__main__":
    main()
