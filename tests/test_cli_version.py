"""`dgemma --version` (docs/compat.md#commands): the running server's version, or Ollama's two warnings when none
answers."""
from __future__ import annotations

import os
import subprocess
import sys

from cli_helpers import cli_env
from server_harness import ServeProcess

from dgemma_cli import __version__


def run_version(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dgemma_cli.main", "--version"], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=60)


def test_version_without_a_server_warns_twice(tmp_path):
    done = run_version(cli_env(tmp_path))
    assert done.returncode == 0
    assert done.stdout.splitlines() == ["Warning: could not connect to a running dgemma instance",
                                        f"Warning: client version is {__version__}"]


def test_version_reports_the_running_server(tmp_path):
    with ServeProcess(tmp_path / "models") as server:
        done = run_version({"DGEMMA_HOST": f"127.0.0.1:{server.port}"})
    assert done.returncode == 0
    assert done.stdout.splitlines() == [f"dgemma version is {__version__}"]


def test_no_subcommand_prints_help(tmp_path):
    done = subprocess.run([sys.executable, "-m", "dgemma_cli.main"], env={**os.environ, **cli_env(tmp_path)},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "Usage" in done.stdout and "run" in done.stdout
