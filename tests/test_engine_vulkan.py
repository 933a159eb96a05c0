"""The engine on a GPU API: ggml's Vulkan backend on Mesa's lavapipe (docs/engine.md#vulkan).

lavapipe is a Vulkan driver that runs on the CPU, so CI executes what a GPU backend executes (ggml's Vulkan shaders,
its buffers, the scheduler's copies between them and the host) without a GPU. Every check of the RPC device tests runs
here with the Vulkan device in place of the RPC server: all units on it, the last two units, and all units with the
routed experts on the CPU. Per placement: every golden decoder call against transformers within VULKAN_TOLERANCE,
`--rng torch` generations token-exact, sampling steps against the C sampler, and where a self-conditioned sampling
step ran (the scheduler's splits, the nodes it left on the CPU, with why).

It needs a llama-cpp-python built with `-DGGML_VULKAN=on`, which `.ci/run` builds only where Debian's Vulkan headers
are new enough for the pinned ggml (>= 1.3.261: Debian 13); elsewhere the tests skip and say so.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from test_engine import FIXTURE_NAMES
from test_engine_devices import run_device_check
from test_engine_sampling import assert_agreement
from test_generate_free_running import golden

# ggml's Vulkan backend on a device with fp16 support (lavapipe has it) keeps some operands of its matrix products in
# f16 (relative rounding 2**-11): far from transformers' fp32 logits. GGML_VK_DISABLE_F16 makes it compute in f32;
# with contiguous operands (graph.c) it then differs from the CPU only in summation order and the driver's exp/tanh:
# measured 1.1e-5..1.3e-5 from the CPU fast path on tiny-a, the fixtures' own fp32 floor (1.1e-5..1.5e-5 from fp64,
# tests/fixtures/README.md). It is held to the CPU's bar, 1e-4, and to token-exact torch-RNG generation.
VULKAN_TOLERANCE = 1e-4
FREE_RUNNING = [("tiny-a", "g2_seed7"), ("tiny-b", "g3_seed42")]
PLACEMENTS = [{"num_gpu": None}, {"num_gpu": 2}, {"num_gpu": None, "num_cpu_moe": -1}]


# lavapipe is a Vulkan device of type CPU, which ggml's Vulkan backend leaves out unless it is named. Only the checks'
# children name it: in this process (and the rest of the suite) an accelerator would take every layer of every load.
VISIBLE = {"GGML_VK_VISIBLE_DEVICES": "0"}
F32 = {**VISIBLE, "GGML_VK_DISABLE_F16": "1"}


def vulkan_devices() -> list[str]:
    """The Vulkan devices ggml's registry lists in a child that names the first one."""
    code = ("from dgemma_engine import devices; "
            "print('\\n'.join(d.name + '\\t' + d.description for d in devices.list_devices()))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **VISIBLE})
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [line for line in proc.stdout.splitlines() if line.startswith("Vulkan")]


needs_vulkan = pytest.mark.skipif(
    not vulkan_devices(),
    reason="no Vulkan device in ggml's registry: llama-cpp-python was built without -DGGML_VULKAN=on (.ci/run builds "
           "it only where Debian's Vulkan headers are >= 1.3.261, e.g. Debian 13) or no Vulkan driver is installed")


@needs_vulkan
def test_vulkan_device_in_f32_matches_transformers_and_generates_the_golden_sequences(gguf_path):
    ggufs = {name: gguf_path(name, "f32") for name in FIXTURE_NAMES}
    results = run_device_check(None, ggufs, PLACEMENTS, [list(r) for r in FREE_RUNNING], env=F32)
    report = {}
    for result in results:
        for name, fixture in result["fixtures"].items():
            where = f"{name} {result['placement']}: {fixture['describe']}"
            assert "Vulkan0" in fixture["describe"], where
            assert fixture["max_vs_transformers"] <= VULKAN_TOLERANCE, where
            assert fixture["calls"] > 80, where
            for run, out in fixture["runs"].items():
                meta, _, rec = golden(name, run)
                assert out == {"sequence": rec["seq"].tolist(), "steps_per_canvas": meta["steps_per_canvas"]}, where
            assert_agreement(fixture["sampling"], where)
            report[where] = {"max_vs_transformers": fixture["max_vs_transformers"], **fixture["step_report"]}
            if result["placement"] == {"num_gpu": None}:
                assert fixture["fast_host_bytes_per_step"] <= 32 * 16 + 4 * 2 * 64 + 4 * 256, where
                assert fixture["step_report"]["cpu_fallbacks"] == [], where
    print(json.dumps(report, indent=1))  # the figures docs/engine.md#vulkan reports (pytest -s shows them)

