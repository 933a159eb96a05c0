"""Run the fixture checks of tests/test_engine_devices.py in one placement, in a process of its own.

ggml's device registry only grows within a process, and an RPC device whose server has gone would abort a later
load, so every placement that uses an RPC device is checked here, in a subprocess. Input (stdin, JSON):
{"ggufs": {"tiny-a": path, ...}, "placements": [{"num_gpu": n | null, "num_cpu_moe": k}, ...],
 "free_running": [[fixture, run], ...]}; DGEMMA_RPC names the servers. Output (stdout, one JSON line): per placement,
the placement's description, the max |Δlogits| against transformers over every golden decoder call, the max against
the CPU fast path, and each free-running run's sequence and steps per canvas (`debug generate --rng torch`); sampling
steps against the C sampler (tests/sampling_check.py) and the bytes a fast-mode step copies between host and devices.
"""
from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from sampling_check import kept_candidate, reduced_vs_host  # noqa: E402
from test_engine import golden_index, load_run, replay  # noqa: E402
from test_generate_free_running import golden, params_for  # noqa: E402

from dgemma_engine.debug_generate import run_debug_generation  # noqa: E402
from dgemma_engine.generate import SamplerParams  # noqa: E402
from dgemma_engine.model import Context, Model  # noqa: E402

THREADS = 1
SAMPLING_PROMPT = list(range(2, 30))


def teacher_forced(model: Model, name: str) -> dict[str, list[np.ndarray]]:
    """Every recorded decoder call of every golden run: the engine's logits and the recorded ones."""
    out = {}
    for run_name, meta in golden_index(name)["runs"].items():
        if not meta["has_raw"]:  # the runs that record their logits: test_engine.py's four
            continue
        run = load_run(name, run_name)
        with Context(model, n_ctx=len(run["seq"]) + model.hparams.canvas_length, threads=THREADS) as ctx:
            out[run_name] = [(logits.copy(), want) for _, logits, want in replay(ctx, run)]
    return out


def top_k_step(model: Model, name: str, k: int = 32) -> np.ndarray:
    """The first self-conditioned call of a golden run with self_cond_top_k k (the top-k gather of standard ops when
    the output is off the CPU)."""
    run = load_run(name, "g1_seed0")
    with Context(model, n_ctx=len(run["seq"]) + model.hparams.canvas_length, threads=THREADS) as ctx:
        ctx.self_cond_top_k = k
        ctx.encode(run["prompt"])
        ctx.set_self_cond_logits(run["raw"][0])
        return np.array(ctx.step(run["canvas"][1], sc_temperature=float(run["T"][0])))


def step_report(model: Model) -> dict:
    """Where a self-conditioned sampling step ran: the scheduler's splits and the nodes it left on the CPU."""
    C = model.hparams.canvas_length
    with Context(model, n_ctx=len(SAMPLING_PROMPT) + C, threads=THREADS) as ctx:
        ctx.encode(SAMPLING_PROMPT)
        canvas = [3 + i % 20 for i in range(C)]
        uniforms = np.linspace(0.05, 0.95, C, dtype=np.float32)
        ctx.step_reduced(canvas, 0.8, uniforms)
        ctx.step_reduced(canvas, 0.8, uniforms, sc_temperature=0.8)
        report = ctx.step_report()
    return {"splits": report.splits, "cpu_fallbacks": [[f.op, f.reason, f.nodes] for f in report.cpu_fallbacks]}


def check(ggufs: dict[str, str], placement: dict, free_running: list, reference: dict | None) -> dict:
    result: dict = {"placement": placement, "fixtures": {}}
    for name, path in ggufs.items():
        with Model.load(path, threads=THREADS, **placement) as model:
            calls = teacher_forced(model, name)
            fixture = {
                "describe": model.placement.describe(),
                "offloaded": model.placement.offloaded_layers,
                "calls": sum(len(v) for v in calls.values()),
                "max_vs_transformers": max(float(np.abs(got - want).max()) for v in calls.values() for got, want in v),
                "runs": {},
            }
            if reference is not None:
                fixture["max_vs_fast_path"] = max(
                    float(np.abs(got - ref).max())
                    for run_name, v in calls.items() for (got, _), ref in zip(v, reference[name][run_name]))
                fixture["top_k_vs_fast_path"] = float(np.abs(top_k_step(model, name) - reference[name]["top_k"]).max())
            # sampling steps against the C sampler, candidates dropped on the device, and what a fast-mode step copies
            fixture["sampling"] = reduced_vs_host(model, SAMPLING_PROMPT)
            fixture["kept_candidate"] = [kept_candidate(model, SAMPLING_PROMPT, sampling) for sampling in (True, False)]
            fast = SamplerParams(max_steps=4, seed=2, rng="fast")
            timings = run_debug_generation(model, SAMPLING_PROMPT, fast, model.hparams.canvas_length, eos_ids=(),
                                           threads=THREADS, timings=True)["timings"]
            fixture["fast_host_bytes_per_step"] = timings["host_bytes_per_step"]
            fixture["step_report"] = step_report(model)
            fixture["n_vocab"] = model.hparams.n_vocab
            for fixture_name, run in free_running:
                if fixture_name != name:
                    continue
                meta, gen, rec = golden(name, run)
                out = run_debug_generation(model, rec["prompt"].tolist(), params_for(gen, meta), gen["max_new_tokens"],
                                           eos_ids=gen["eos_token_id"], pad_id=gen["pad_token_id"], threads=THREADS)
                fixture["runs"][run] = out
            result["fixtures"][name] = fixture
    return result


def fast_path_logits(ggufs: dict[str, str]) -> dict:
    ref = {}
    for name, path in ggufs.items():
        with Model.load(path, threads=THREADS, num_gpu=0) as model:
            ref[name] = {k: [got for got, _ in v] for k, v in teacher_forced(model, name).items()}
            ref[name]["top_k"] = top_k_step(model, name)
    return ref


def runner_check(path: str, parameters: dict) -> dict:
    """What the server makes of PARAMETERs num_gpu / num_cpu_moe: the runner's placement, size_vram and `ps` line."""
    from types import SimpleNamespace

    from dgemma_cli.cmd_run import ps_table
    from dgemma_cli.server.runner import EngineRunner

    local = SimpleNamespace(name="tiny:latest", gguf_path=Path(path), parameters=parameters, template=None, config={})
    runner = EngineRunner(local, num_ctx=64, threads=THREADS)
    try:
        table = ps_table([{"name": "tiny:latest", "digest": "0" * 64, "size": runner.size,
                           "size_vram": runner.size_vram, "context_length": 64,
                           "expires_at": "2099-01-01T00:00:00Z"}])
        return {"describe": runner.model.placement.describe(), "size": runner.size, "size_vram": runner.size_vram,
                "ps": table}
    finally:
        runner.close()


def main() -> None:
    request = json.loads(sys.stdin.read())
    if "runner" in request:
        logging.basicConfig(level=logging.INFO, stream=sys.stderr)
        print(json.dumps([runner_check(request["runner"], p) for p in request["parameters"]]))
        return
    reference = fast_path_logits(request["ggufs"])
    results = [check(request["ggufs"], p, request["free_running"], reference) for p in request["placements"]]
    print(json.dumps(results))


if __name__ == "__main__":
    main()
