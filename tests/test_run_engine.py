"""`dgemma run` end to end on the real engine with the tiny fixture model: no server is running, so the command
serves the store in-process (docs/compat.md#cli-surface: one code path, nothing left behind). Seeds make answers
reproducible."""
from __future__ import annotations

import os
import sys

import pexpect
import pytest

from run_helpers import TIMING_LABELS, run_cli
from server_harness import REPO, free_port


@pytest.fixture(scope="module")
def env(gguf_path, tmp_path_factory) -> dict[str, str]:
    from dgemma_cli.create import create_model
    from dgemma_cli.modelfile import parse_modelfile
    from dgemma_cli.store import Store

    root = tmp_path_factory.mktemp("engine-run")
    gguf = gguf_path("tiny-a", "f32")
    list(create_model("tiny-a", parse_modelfile(f"FROM {gguf}\n"), Store(str(root / "models")), root))
    base = {k: v for k, v in os.environ.items() if not k.startswith(("DGEMMA_", "OLLAMA_"))}
    return {**base, "DGEMMA_MODELS": str(root / "models"), "DGEMMA_HOST": f"127.0.0.1:{free_port()}",
            "HOME": str(root), "DGEMMA_NOHISTORY": "1", "COLUMNS": "80",
            "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def test_candidate_canvases_through_the_server(env):
    """num_canvases reaches the engine through run's flag and the server's options; same seed, same answer."""
    short = ["--steps", "6", "--num-predict", "16", "--seed", "3"]
    first = run_cli(["run", "tiny-a", "Tell me a story", "--num-canvases", "3", *short], env, timeout=180)
    second = run_cli(["run", "tiny-a", "Tell me a story", "--num-canvases", "3", *short], env, timeout=180)
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    assert first.stdout == second.stdout and first.stdout.strip()
    refused = run_cli(["run", "tiny-a", "x", "--num-canvases", "17", *short], env, timeout=180)
    assert refused.returncode == 1
    assert refused.stderr.strip().splitlines()[-1] == \
        "Error: invalid value for num_canvases: 17 (must be between 1 and 16)"


def test_one_shot_is_reproducible_with_a_seed(env):
    short = ["--steps", "6", "--num-predict", "16"]  # one canvas of the fixture (16 positions), at most 6 steps
    first = run_cli(["run", "tiny-a", "Tell me a story", "--seed", "7", "--verbose", *short], env, timeout=180)
    second = run_cli(["run", "tiny-a", "Tell me a story", "--seed", "7", *short], env, timeout=180)
    assert first.returncode == 0, first.stderr
    assert second.returncode == 0, second.stderr
    assert first.stdout == second.stdout
    assert "started one in-process" in first.stderr.splitlines()[0]
    labels = [line[:22].rstrip().rstrip(":") for line in first.stderr.splitlines()[1:] if line.strip()]
    assert labels == [label for label in TIMING_LABELS if label in labels]
    assert {"total duration", "prompt eval count", "denoise steps", "canvases"} <= set(labels)
    assert "canvases:             1" in first.stderr
    assert second.stderr == ""


def test_visual_draws_real_denoising_steps(env):
    child = pexpect.spawn(sys.executable, ["-m", "dgemma_cli.main", "run", "tiny-a", "Hello", "--visual", "--seed", "3",
                                                         "--steps", "6", "--num-predict", "16"],
                          env={**env, "TERM": "xterm"}, cwd=str(REPO), encoding="utf-8", timeout=180,
                          dimensions=(40, 120))
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0, child.before
    assert "canvas 1 · step 1/" in child.before
    assert "mean entropy" in child.before and "accepted" in child.before


def test_prompt_longer_than_the_context_is_truncated(env):
    """The real engine and tokenizer: the server keeps the prompt's end, so `run` answers (as `ollama run` does)."""
    result = run_cli(["run", "tiny-a", "word " * 5000, "--seed", "1"], env, timeout=180)
    assert result.returncode == 0 and result.stdout.strip(), result


def test_preview_chunks_carry_the_accept_mask(env, monkeypatch):
    """What the live view is fed on the real engine: per-position draft pieces and the sampler's accept mask."""
    from dgemma_cli import wire
    from dgemma_cli.local_server import connect

    for key in ("DGEMMA_MODELS", "DGEMMA_HOST", "HOME"):
        monkeypatch.setenv(key, env[key])
    with connect() as client:
        assert client.local is not None  # nothing listens at DGEMMA_HOST: served in this process
        chunks = list(client.generate_stream(wire.GenerateRequest(model="tiny-a", prompt="Hello", options={
            "seed": 3, "diffusion_steps": 5, "num_predict": 16, "diffusion_preview": True})))
        thread = client.local.thread
    assert not thread.is_alive()  # and stopped when the block ends
    steps = [c for c in chunks if "preview" in c]
    assert 1 <= len(steps) <= 5
    for chunk in steps:
        assert len(chunk["preview_tokens"]) == len(chunk["preview_accepted"]) == 16
        assert sum(chunk["preview_accepted"]) == chunk["accepted"] >= 1
        assert chunk["entropy"] >= 0
