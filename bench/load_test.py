"""Load test of `dgemma serve` (loopback only, bounded): N concurrent streaming clients against a queue limit.

    python bench/load_test.py --fake                       # in-process server, fake runner with a fixed step time
    python bench/load_test.py --models-dir DIR --model M   # `dgemma serve` subprocess over a real store

What it checks (exit status 1 if any fails): every request either streams to a final `done` chunk or is refused at
once with 503 and Ollama's exact message; with more clients than 1 running + the queue limit, some are refused;
`/api/version`, probed every 50 ms throughout, answers within 200 ms. It reports throughput and latency percentiles.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
BUSY = "server busy, please try again.  maximum pending requests exceeded"
VERSION_BUDGET_S = 0.200


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


async def one_client(client: httpx.AsyncClient, model: str, options: dict, start: asyncio.Event) -> dict:
    await start.wait()
    began = time.perf_counter()
    result: dict = {"status": None, "first_byte_s": None, "total_s": None, "eval_count": 0, "done": False, "error": None}
    body = {"model": model, "prompt": "Write one sentence about the sea.", "options": options}
    async with client.stream("POST", "/api/generate", json=body) as response:
        result["status"] = response.status_code
        if response.status_code != 200:
            result["error"] = json.loads(await response.aread()).get("error")
        else:
            async for line in response.aiter_lines():
                if not line:
                    continue
                if result["first_byte_s"] is None:
                    result["first_byte_s"] = time.perf_counter() - began
                chunk = json.loads(line)
                if "error" in chunk:
                    result["error"] = chunk["error"]
                if chunk.get("done"):
                    result["done"] = True
                    result["eval_count"] = chunk.get("eval_count", 0)
    result["total_s"] = time.perf_counter() - began
    return result


async def probe_version(client: httpx.AsyncClient, stop: asyncio.Event, latencies: list[float],
                        slowest: list[tuple[float, float]]) -> None:
    origin = time.perf_counter()
    while not stop.is_set():
        began = time.perf_counter()
        response = await client.get("/api/version")
        latencies.append(time.perf_counter() - began)
        slowest.append((latencies[-1], began - origin))
        assert response.status_code == 200
        await asyncio.sleep(0.05)


async def run_load(url: str, model: str, clients: int, options: dict) -> dict:
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        preload = await client.post("/api/generate", json={"model": model, "keep_alive": "10m"})
        preload.raise_for_status()
        start, stop = asyncio.Event(), asyncio.Event()
        version_latencies: list[float] = []
        slowest: list[tuple[float, float]] = []
        prober = asyncio.create_task(probe_version(client, stop, version_latencies, slowest))
        tasks = [asyncio.create_task(one_client(client, model, options, start)) for _ in range(clients)]
        await asyncio.sleep(0.2)
        began = time.perf_counter()
        start.set()
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - began
        stop.set()
        await prober
    completed = [r for r in results if r["status"] == 200 and r["done"] and not r["error"]]
    refused = [r for r in results if r["status"] == 503]
    totals = [r["total_s"] for r in completed]
    firsts = [r["first_byte_s"] for r in completed if r["first_byte_s"] is not None]
    tokens = sum(r["eval_count"] for r in completed)
    return {
        "clients": clients,
        "completed": len(completed),
        "refused_503": len(refused),
        "other": [r for r in results if r not in completed and r not in refused],
        "refusals_exact": all(r["error"] == BUSY for r in refused),
        "refusal_latency_max_s": max((r["total_s"] for r in refused), default=0.0),
        "wall_s": wall,
        "throughput_req_per_s": len(completed) / wall if wall else 0.0,
        "throughput_tokens_per_s": tokens / wall if wall else 0.0,
        "latency_s": {f"p{q}": percentile(totals, q) for q in (50, 90, 99)},
        "first_byte_s": {f"p{q}": percentile(firsts, q) for q in (50, 90, 99)},
        "version_probes": len(version_latencies),
        "version_latency_s": {"p50": percentile(version_latencies, 50), "p99": percentile(version_latencies, 99),
                              "max": max(version_latencies, default=float("nan")),
                              "mean": statistics.fmean(version_latencies) if version_latencies else float("nan")},
        "version_slowest_at_s": [(round(lat, 3), round(at, 2)) for lat, at in sorted(slowest, reverse=True)[:5]],
    }


def verdict(report: dict, queue: int) -> list[str]:
    problems = []
    if report["other"]:
        problems.append(f"{len(report['other'])} request(s) neither completed nor got 503: {report['other'][:2]}")
    if not report["refusals_exact"]:
        problems.append("a 503 did not carry Ollama's exact message")
    if report["clients"] > queue + 1 and report["refused_503"] == 0:
        problems.append("no request was refused although clients exceed 1 running + the queue limit")
    # a request counts against the queue from its arrival until it holds a slot, so the burst admits `queue`
    # requests for sure, and one more only when the first took its slot before the rest of the burst arrived
    if report["completed"] < min(report["clients"], queue):
        problems.append(f"only {report['completed']} requests completed (expected at least {queue})")
    if not report["version_latency_s"]["max"] <= VERSION_BUDGET_S:
        problems.append(f"/api/version took {report['version_latency_s']['max'] * 1000:.0f} ms (budget 200 ms)")
    return problems


class FakeServer:
    """In-process server with the test suite's fake runner: a fixed step time, no model weights needed."""

    def __init__(self, queue: int, step_delay: float, steps: int):
        sys.path.insert(0, str(REPO / "tests"))
        from server_harness import FakeBehaviour, InProcessServer, add_model, fake_factory, write_small_gguf

        from dgemma_cli.server.config import ServerConfig
        from dgemma_cli.store import Store

        self.tmp = tempfile.TemporaryDirectory()
        root = Path(self.tmp.name)
        store = Store(root / "models")
        add_model(store, "fake", write_small_gguf(root / "fake.gguf"))
        behaviour = FakeBehaviour(answer="The sea is wide and deep. " * 2, steps=steps, step_delay=step_delay,
                                  canvas_length=16)
        config = ServerConfig.from_env({"DGEMMA_MODELS": str(store.root), "DGEMMA_MAX_QUEUE": str(queue)})
        self.server = InProcessServer(config, store, fake_factory(behaviour))

    def __enter__(self) -> str:
        self.server.__enter__()
        return self.server.url

    def __exit__(self, *exc) -> None:
        self.server.__exit__(*exc)
        self.tmp.cleanup()


class SubprocessServer:
    def __init__(self, models_dir: Path, queue: int):
        sys.path.insert(0, str(REPO / "tests"))
        from server_harness import ServeProcess

        self.server = ServeProcess(models_dir, {"DGEMMA_MAX_QUEUE": str(queue), "DGEMMA_NOPRUNE": "1"})

    def __enter__(self) -> str:
        return self.server.__enter__().url

    def __exit__(self, *exc) -> None:
        self.server.__exit__(*exc)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--queue", type=int, default=8, help="DGEMMA_MAX_QUEUE of the server under test")
    parser.add_argument("--fake", action="store_true", help="in-process server with a fake runner")
    parser.add_argument("--step-delay", type=float, default=0.02, help="fake runner: seconds per denoising step")
    parser.add_argument("--steps", type=int, default=4, help="denoising steps per canvas (diffusion_steps)")
    parser.add_argument("--models-dir", type=Path, help="store for a `dgemma serve` subprocess")
    parser.add_argument("--model", default="fake")
    parser.add_argument("--num-predict", type=int, default=32)
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args(argv)
    if args.clients > 64:
        parser.error("--clients is capped at 64 (this is a bounded loopback test)")
    if args.fake:
        server = FakeServer(args.queue, args.step_delay, args.steps)
    elif args.models_dir:
        server = SubprocessServer(args.models_dir, args.queue)
    else:
        parser.error("use --fake or --models-dir DIR --model NAME")
    options = {"num_predict": args.num_predict, "diffusion_steps": args.steps, "seed": 1}
    with server as url:
        assert url.startswith("http://127.0.0.1:"), "loopback only"
        report = asyncio.run(run_load(url, args.model, args.clients, options))
    problems = verdict(report, args.queue)
    report["problems"] = problems
    text = json.dumps(report, indent=2, default=str)
    print(text)
    if args.json:
        args.json.write_text(text)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
