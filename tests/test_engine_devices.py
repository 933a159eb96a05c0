"""The engine off the CPU fast path (docs/engine.md#devices), checked on the CPU: CI has no accelerator.

- The standard-op graph (what accelerators run: no fused GELU, no tiled experts), forced on the CPU with
  DGEMMA_STANDARD_OPS, against transformers' goldens (every recorded decoder call, 1e-4) and the fast path, and
  free-running `--rng torch` generations token-exact.
- A real second device: a ggml RPC server on loopback (`python -m dgemma_engine.rpc_server`) holding part or all of the
  layers, so weights, K/V cache, logits and activations cross a device boundary: num_gpu 0 / partial / all, experts on
  the CPU; in each, sampling steps against the C sampler, and what a fast-mode step copies between host and device. Those placements run in subprocesses (tests/device_check.py): ggml's device registry only grows within a
  process, and a vanished RPC server would abort a later load in this one.
"""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from dgemma_engine import devices
from dgemma_engine.errors import EngineError
from dgemma_engine.model import Model, Placement
from test_engine import FIXTURE_NAMES, TOLERANCE, golden_index, load_run
from test_engine_sampling import assert_agreement
from test_generate_free_running import debug_generate_cmd, golden, params_for

from dgemma_cli.cmd_run import ps_table
from dgemma_cli.server.runner import vram_bytes
from dgemma_cli.server.scheduler import model_identity

HERE = Path(__file__).parent
THREADS = 1
FREE_RUNNING = [("tiny-a", "g2_seed7"), ("tiny-a", "g4_seed42"), ("tiny-b", "g3_seed42"), ("tiny-b", "short_seed0")]
# num_gpu counts the output as one unit (llama.cpp's -ngl): 2 = the last layer and the output
PLACEMENTS = [{"num_gpu": 0}, {"num_gpu": 1}, {"num_gpu": 2}, {"num_gpu": None}, {"num_gpu": None, "num_cpu_moe": -1},
              {"num_gpu": 3, "num_cpu_moe": 5}]
FAST_PATH_AGREEMENT = 5e-5  # the two graphs differ only in summation order and GELU rounding


needs_rpc = pytest.mark.skipif(not devices.rpc_available(), reason="llama-cpp-python without ggml's RPC backend "
                               "(CMAKE_ARGS=-DGGML_RPC=on; .ci/run installs such a build)")


# ---- the standard-op graph on the CPU -----------------------------------------------------------------------------

@pytest.fixture
def standard_ops(monkeypatch):
    monkeypatch.setenv("DGEMMA_STANDARD_OPS", "1")  # read by the engine when it places a model's weights


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_standard_op_graph_matches_transformers_and_the_fast_path(gguf_path, standard_ops, monkeypatch, name):
    from device_check import teacher_forced

    with Model.load(gguf_path(name, "f32"), threads=THREADS) as m:
        standard = teacher_forced(m, name)
    monkeypatch.delenv("DGEMMA_STANDARD_OPS")
    with Model.load(gguf_path(name, "f32"), threads=THREADS) as m:
        fast = teacher_forced(m, name)
    assert set(standard) == set(fast) and len(standard) == 4
    for run, calls in standard.items():
        for (got, want), (ref, _) in zip(calls, fast[run]):
            assert np.abs(got - want).max() <= TOLERANCE
            assert np.abs(got - ref).max() <= FAST_PATH_AGREEMENT


@pytest.mark.parametrize("name,run", FREE_RUNNING)
def test_standard_op_graph_generates_the_golden_sequences(gguf_path, standard_ops, name, run):
    from dgemma_engine.debug_generate import run_debug_generation

    meta, gen, rec = golden(name, run)
    with Model.load(gguf_path(name, "f32"), threads=THREADS) as m:
        out = run_debug_generation(m, rec["prompt"].tolist(), params_for(gen, meta), gen["max_new_tokens"],
                                   eos_ids=gen["eos_token_id"], pad_id=gen["pad_token_id"], threads=THREADS)
    assert out == {"sequence": rec["seq"].tolist(), "steps_per_canvas": meta["steps_per_canvas"]}


def test_cpu_only_placement_keeps_everything_mapped(gguf_path):
    with Model.load(gguf_path("tiny-a", "f32"), threads=THREADS, num_gpu=99) as m:  # no accelerator in this process
        p = m.placement
    assert p.devices == ("CPU",) and p.offloaded_layers == 0 and p.device_bytes == (0,)
    assert p.describe() == "CPU: layers 0-3, output"


# ---- a CPU + RPC-device split ---------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_rpc_server() -> tuple[subprocess.Popen, str]:
    endpoint = f"127.0.0.1:{free_port()}"
    proc = subprocess.Popen([sys.executable, "-m", "dgemma_engine.rpc_server", endpoint, "--threads", "1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the RPC server exited: {proc.stderr.read()}")
        try:
            socket.create_connection(("127.0.0.1", int(endpoint.rsplit(":", 1)[1])), timeout=1).close()
            return proc, endpoint
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the RPC server did not start within 60 s")


@pytest.fixture(scope="module")
def rpc_endpoint():
    proc, endpoint = start_rpc_server()
    yield endpoint
    proc.terminate()
    proc.wait(timeout=30)


def run_device_check(endpoint: str | None, ggufs: dict, placements: list, free_running: list,
                     env: dict | None = None) -> list[dict]:
    """tests/device_check.py in a child; endpoint: the RPC server it adds (None: the registry's own devices); env:
    more environment for the child."""
    request = {"ggufs": {k: str(v) for k, v in ggufs.items()}, "placements": placements, "free_running": free_running}
    env = {**__import__("os").environ, **(env or {})}
    if endpoint:
        env["DGEMMA_RPC"] = endpoint
    proc = subprocess.run([sys.executable, str(HERE / "device_check.py")], input=json.dumps(request),
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@needs_rpc
def test_rpc_split_matches_transformers_and_generates_the_golden_sequences(gguf_path, rpc_endpoint):
    ggufs = {name: gguf_path(name, "f32") for name in FIXTURE_NAMES}
    results = run_device_check(rpc_endpoint, ggufs, PLACEMENTS, [list(r) for r in FREE_RUNNING])
    offloaded = {}
    for result in results:
        for name, fixture in result["fixtures"].items():
            where = f"{name} {result['placement']}: {fixture['describe']}"
            assert fixture["max_vs_transformers"] <= TOLERANCE, where
            assert fixture["max_vs_fast_path"] <= FAST_PATH_AGREEMENT, where
            assert fixture["top_k_vs_fast_path"] <= FAST_PATH_AGREEMENT, where  # self_cond_top_k 32 on the device
            assert fixture["calls"] > 80, where
            for run, out in fixture["runs"].items():
                meta, _, rec = golden(name, run)
                assert out == {"sequence": rec["seq"].tolist(), "steps_per_canvas": meta["steps_per_canvas"]}, where
            assert_agreement(fixture["sampling"], where)
            assert max(fixture["kept_candidate"]) <= TOLERANCE, where  # batched against alone, as test_candidates
            if result["placement"] == {"num_gpu": None}:
                # every unit on the device: per step the ids, positions, uniforms, two mask rows and five reductions
                # per row cross (and the RoPE factors, a weight on the CPU), never a [canvas, vocabulary] tensor
                C = 16
                assert fixture["fast_host_bytes_per_step"] <= 32 * C + 4 * 2 * 64 + 4 * 256, where
                # 4 sampling steps: five numbers per row each; then one plain step: its logits
                assert fixture["sampling"]["transfers"]["from_device"] == 4 * 5 * 4 * C + 4 * C * fixture["n_vocab"]
                # a self-conditioned sampling step: no node falls back to the CPU (the mapped embedding is not read)
                assert fixture["step_report"]["cpu_fallbacks"] == [], where
            elif result["placement"] == {"num_gpu": 0}:
                assert fixture["fast_host_bytes_per_step"] == 0, where
            offloaded[name, json.dumps(result["placement"])] = fixture["describe"]
    # the placements are what they claim (tiny-a: 4 layers, tiny-b: 6)
    assert offloaded["tiny-a", '{"num_gpu": 0}'] == "CPU: layers 0-3, output"
    assert offloaded["tiny-a", '{"num_gpu": 1}'].startswith("CPU: layers 0-3; RPC0: no layers, output")
    assert offloaded["tiny-a", '{"num_gpu": 2}'].startswith("CPU: layers 0-2; RPC0: layers 3, output")
    assert offloaded["tiny-b", '{"num_gpu": null}'].startswith("CPU: no layers; RPC0: layers 0-5, output")
    assert offloaded["tiny-b", '{"num_gpu": null, "num_cpu_moe": -1}'].startswith(
        "CPU: no layers, experts of layers 0-5; RPC0: layers 0-5, output")
    assert offloaded["tiny-b", '{"num_gpu": 3, "num_cpu_moe": 5}'].startswith(
        "CPU: layers 0-3, experts of layers 4; RPC0: layers 4-5, output")


@needs_rpc
def test_debug_generate_cli_on_an_rpc_split(gguf_path, rpc_endpoint):
    meta, gen, rec = golden("tiny-a", "g2_seed7")
    cmd = debug_generate_cmd(gguf_path("tiny-a", "f32"), meta, gen, rec, "--threads", "1", "--num-gpu", "3",
                             "--num-cpu-moe", "3")
    env = {**__import__("os").environ, "DGEMMA_RPC": rpc_endpoint}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out.pop("timings")
    assert out == {"sequence": rec["seq"].tolist(), "steps_per_canvas": meta["steps_per_canvas"]}


@needs_rpc
def test_debug_logits_cli_takes_the_placement(gguf_path, rpc_endpoint, tmp_path):
    """`debug logits --num-gpu/--num-cpu-moe` on an RPC split: the recorded first step of a golden run, within the
    fixtures' tolerance of transformers (parity per placement)."""
    name, run_name = "tiny-a", next(n for n, m in golden_index("tiny-a")["runs"].items() if m["has_raw"])
    run = load_run(name, run_name)
    assert int(run["pos"][0][0]) == len(run["prompt"]) and not run["has_sc"][0]  # the first step after the prompt
    canvas, want = run["canvas"][0], run["raw"][0]
    env = {**__import__("os").environ, "DGEMMA_RPC": rpc_endpoint}
    out = tmp_path / "logits.npy"
    cmd = [sys.executable, "-m", "dgemma_cli.main", "debug", "logits", str(gguf_path(name, "f32")), "--prompt-ids",
           ",".join(map(str, run["prompt"])), "--canvas-ids", ",".join(map(str, canvas)), "--out", str(out),
           "--threads", "1", "--num-gpu", "2", "--num-cpu-moe", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    assert np.abs(np.load(out) - want).max() <= TOLERANCE


@needs_rpc
def test_server_runner_places_by_parameters_and_ps_shows_it(gguf_path, rpc_endpoint):
    request = {"runner": str(gguf_path("tiny-a", "f32")),
               "parameters": [{}, {"num_gpu": 0}, {"num_gpu": 2}, {"num_gpu": 5, "num_cpu_moe": -1}]}
    env = {**__import__("os").environ, "DGEMMA_RPC": rpc_endpoint}
    proc = subprocess.run([sys.executable, str(HERE / "device_check.py")], input=json.dumps(request),
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    default, cpu, partial, experts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "devices: CPU (" in proc.stderr and "RPC0 (" + rpc_endpoint + ")" in proc.stderr  # the load's log line
    assert default["size_vram"] == default["size"] and "100% GPU" in default["ps"]
    assert cpu["size_vram"] == 0 and "100% CPU" in cpu["ps"] and cpu["describe"] == "CPU: layers 0-3, output"
    assert 0 < partial["size_vram"] < partial["size"] and "CPU/GPU" in partial["ps"]
    assert experts["describe"].startswith("CPU: no layers, experts of layers 0-3; RPC0: layers 0-3, output")
    assert "CPU/GPU" in experts["ps"]


# ---- RPC endpoints, ps, reloads -------------------------------------------------------------------------------------

def test_rpc_endpoints_are_checked_before_ggml_sees_them():
    assert devices.parse_endpoints(" 127.0.0.1:50052, [::1]:7 ,") == ["127.0.0.1:50052", "[::1]:7"]
    for bad in ("localhost", "host:", ":80", "host:0", "host:99999", "host:port"):
        with pytest.raises(EngineError, match="expected host:port"):
            devices.parse_endpoints(bad)
    with pytest.raises(EngineError, match=r"cannot reach the RPC server at 127\.0\.0\.1:\d+"):
        devices.add_rpc_server(f"127.0.0.1:{free_port()}")  # nothing listens: an error, not ggml's abort
    assert devices.is_loopback_or_private("127.0.0.1:1") and devices.is_loopback_or_private("10.1.2.3:1")
    assert not devices.is_loopback_or_private("8.8.8.8:1")


def placement(layers, experts, output, device_bytes) -> Placement:
    return Placement(("CPU", "RPC0"), tuple(layers), tuple(experts), output, device_bytes)


def test_ps_shows_the_split():
    size = 1000
    cases = [(placement([0, 0], [0, 0], 0, (0,)), "100% CPU"),
             (placement([1, 1], [1, 1], 1, (0, 900)), "100% GPU"),
             (placement([0, 1], [0, 1], 1, (0, 520)), "48%/52% CPU/GPU"),
             (placement([1, 1], [0, 0], 1, (0, 300)), "70%/30% CPU/GPU")]
    for p, shown in cases:
        table = ps_table([{"name": "m:latest", "digest": "0" * 64, "size": size, "size_vram": vram_bytes(p, size),
                           "context_length": 8, "expires_at": "2099-01-01T00:00:00Z"}])
        assert shown in table, table


def test_placement_options_tell_runners_apart(tmp_path):
    from types import SimpleNamespace

    def local(**parameters):
        return SimpleNamespace(gguf_path=tmp_path / "m.gguf", manifest_digest="sha256:x", parameters=parameters)

    assert model_identity(local(num_ctx=8)) == model_identity(local(num_ctx=8, seed=3))
    assert model_identity(local(num_gpu=2)) != model_identity(local(num_gpu=3))
    assert model_identity(local(num_cpu_moe=1)) != model_identity(local())

