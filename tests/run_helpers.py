"""Helpers for the `dgemma run` tests: a fake-runner server with a tmp store, and the CLI as a subprocess."""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from server_harness import REPO, FakeBehaviour, InProcessServer, add_model, fake_factory, write_small_gguf

TIMING_LABELS = ("total duration", "load duration", "prompt eval count", "prompt eval duration", "prompt eval rate",
                 "eval count", "eval duration", "eval rate", "denoise steps", "canvases", "steps per canvas",
                 "denoise rate")


@dataclass
class FakeSetup:
    server: InProcessServer
    behaviour: FakeBehaviour
    store_dir: Path
    home: Path
    registry_url: str

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DGEMMA_", "OLLAMA_"))}
        host = self.registry_url.split("://", 1)[1]
        # (the registry variables matter when the command serves in-process; the shared server has its own)
        env.update(DGEMMA_HOST=f"127.0.0.1:{self.server.port}", DGEMMA_MODELS=str(self.store_dir), HOME=str(self.home),
                   DGEMMA_REGISTRY_MIRRORS=f"registry.ollama.ai={self.registry_url}", DGEMMA_REGISTRY_ALLOW=host,
                   PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), COLUMNS="80",
                   DGEMMA_NOHISTORY="1")
        env.update(extra)
        return env


def make_store(root: Path):
    """A store with `tiny` (runs on the fake runner), `small-ctx` (num_ctx 16), `llama3` (another family) and
    `broken` (its GGUF blob truncated after creation)."""
    from dgemma_cli.store import Store

    store = Store(str(root))
    gguf = write_small_gguf(root.parent / "small.gguf")
    add_model(store, "tiny", gguf)
    add_model(store, "small-ctx", gguf, parameters={"num_ctx": 16})
    add_model(store, "llama3", gguf, family="llama")
    broken = root.parent / "broken.gguf"
    broken.write_bytes(gguf.read_bytes() + b"\0")  # a different digest from `small.gguf`
    add_model(store, "broken", broken)
    blob = store.resolve("broken").gguf_path
    blob.chmod(0o644)
    blob.write_bytes(blob.read_bytes()[:40])
    return store


def run_cli(args: list[str], env: dict[str, str], stdin: str | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dgemma_cli.main", *args], input=stdin if stdin is not None else "",
                          capture_output=True, text=True, env=env, cwd=str(REPO), timeout=timeout)


__all__ = ["FakeBehaviour", "FakeSetup", "InProcessServer", "TIMING_LABELS", "fake_factory", "make_store", "run_cli"]
