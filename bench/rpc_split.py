"""A model split three ways over ggml RPC: the CPU plus two RPC servers on loopback, against the CPU alone.

    python3 bench/rpc_split.py [--model bench/work/bench-mid] [--types f32] [--threads N] [--fixture]

Starts two `python -m dgemma_engine.rpc_server` processes on 127.0.0.1 (free ports), adds them with DGEMMA_RPC and
loads the model twice: `num_gpu 0` (the CPU alone) and a third of the layers on each device (the CPU keeps the first
third; the output goes with the last RPC server). For each it times one self-conditioned decoder step (the median of
--repeats, after an encoder pass over --ctx tokens) and checks that the split's logits agree with the CPU's.
`--fixture` runs on tests/fixtures/tiny-a instead of bench-mid (seconds; what CI-sized machines can afford);
`--synthetic` builds a random-bf16 checkpoint of bench-mid's geometry without torch (bench/common.py) when --model is
missing.

On one machine the servers share its cores with this process, so the split measures the cost of the RPC boundary
(every step sends each split's graph and copies activations between devices), not a speed-up: that needs servers on
other machines. Its numbers from the shared 2-core development machine are not recorded (docs/engine.md#rpc).
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

import common

THREE_WAYS = 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(threads: int) -> tuple[subprocess.Popen, str]:
    endpoint = f"127.0.0.1:{free_port()}"
    proc = subprocess.Popen([sys.executable, "-m", "dgemma_engine.rpc_server", endpoint, "--threads", str(threads)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(300):
        try:
            socket.create_connection(("127.0.0.1", int(endpoint.rsplit(":", 1)[1])), timeout=1).close()
            return proc, endpoint
        except OSError:
            if proc.poll() is not None:
                sys.exit("the RPC server exited (is llama-cpp-python built with -DGGML_RPC=on?)")
            time.sleep(0.2)
    proc.kill()
    sys.exit(f"the RPC server at {endpoint} did not start")


@contextlib.contextmanager
def rpc_servers(count: int, threads: int) -> Iterator[list[str]]:
    """`count` loopback RPC servers (`threads` each) for the duration of the block: their endpoints."""
    servers = []
    try:
        for _ in range(count):
            servers.append(start_server(threads))
        yield [endpoint for _, endpoint in servers]
    finally:
        for proc, _ in servers:
            proc.terminate()
            proc.wait(timeout=30)


def time_placement(path: Path, num_gpu: int, ctx_ids: np.ndarray, canvas: np.ndarray, threads: int,
                   repeats: int) -> dict:
    from dgemma_engine.model import Context, Model

    t0 = time.perf_counter()
    with Model.load(path, threads=threads, num_gpu=num_gpu) as m:
        load_s = time.perf_counter() - t0
        with Context(m, n_ctx=len(ctx_ids) + len(canvas), threads=threads) as ctx:
            t0 = time.perf_counter()
            ctx.encode(ctx_ids)
            encode_s = time.perf_counter() - t0
            steps = []
            for _ in range(repeats):
                ctx.step(canvas)
                t0 = time.perf_counter()
                logits = ctx.step(canvas, sc_temperature=0.8).copy()
                steps.append(time.perf_counter() - t0)
        return {"placement": m.placement.describe(), "load_s": load_s, "encode_s": encode_s,
                "sc_step_s": statistics.median(steps), "logits": logits}


def main() -> None:
    ap = common.bench_parser(__doc__)
    ap.set_defaults(types="f32")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--canvas", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--fixture", action="store_true", help="tests/fixtures/tiny-a instead of bench-mid")
    ap.add_argument("--synthetic", action="store_true", help="build bench-mid's geometry without torch if missing")
    args = ap.parse_args()
    if args.synthetic and not args.fixture:
        common.build_synthetic(common.CONFIGS / "bench-mid.json", args.model)
    model = common.REPO / "tests" / "fixtures" / "tiny-a" if args.fixture else args.model
    vocab = common.model_vocab_size(model)
    canvas_len = json.loads((model / "config.json").read_text()).get("canvas_length") if args.fixture else None
    ctx_len, canvas_n = (48, canvas_len or 16) if args.fixture else (args.ctx, args.canvas)
    rng = np.random.default_rng(0)
    ctx_ids = rng.integers(0, vocab, ctx_len).astype(np.int32)
    canvas = rng.integers(0, vocab, canvas_n).astype(np.int32)

    server_threads = max(1, args.threads // THREE_WAYS)
    report: dict = {"threads": args.threads, "server_threads": server_threads, "ctx": ctx_len, "canvas": canvas_n,
                    "types": {}}
    with rpc_servers(THREE_WAYS - 1, server_threads) as endpoints:
        os.environ["DGEMMA_RPC"] = ",".join(endpoints)
        from dgemma_convert import convert

        args.gguf_dir.mkdir(parents=True, exist_ok=True)
        for outtype in args.types.split(","):
            path = args.gguf_dir / f"{model.name}-{outtype}.gguf"
            if not path.exists():
                convert(model, path, outtype, threads=args.threads)
            from dgemma_engine.model import Model

            with Model.load(path, threads=1, num_gpu=0) as m:
                units = m.hparams.n_layer + 1
            cpu = time_placement(path, 0, ctx_ids, canvas, args.threads, args.repeats)
            split = time_placement(path, units - units // THREE_WAYS, ctx_ids, canvas, args.threads, args.repeats)
            agreement = float(np.abs(cpu.pop("logits") - split.pop("logits")).max())
            report["types"][outtype] = {"cpu": cpu, "split": split, "max_abs_logit_difference": agreement}
            print(f"{outtype}: CPU alone {cpu['sc_step_s']:.3f} s/step; split ({split['placement']}) "
                  f"{split['sc_step_s']:.3f} s/step; max |Δlogits| {agreement:.2e}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
