"""`dgemma serve` as a process: startup log, port clash message, non-loopback warnings, store pruning."""
import os
import socket
import subprocess
import sys
import time

from dgemma_cli.cmd_serve import startup_warnings
from dgemma_cli.server.config import ServerConfig
from server_harness import REPO, ServeProcess


def test_port_in_use_is_a_one_line_error(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        env = {**os.environ, "DGEMMA_HOST": f"127.0.0.1:{port}", "DGEMMA_MODELS": str(tmp_path / "m"),
               "PYTHONPATH": str(REPO)}
        done = subprocess.run([sys.executable, "-m", "dgemma_cli.main", "serve"], env=env, capture_output=True,
                              text=True, timeout=60, cwd=str(REPO))
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        f"Error: listen 127.0.0.1:{port}: address already in use (set DGEMMA_HOST to choose another address)")
    assert "Traceback" not in done.stderr


def test_startup_logs_config_sources_and_prunes_old_orphans(tmp_path):
    blobs = tmp_path / "models" / "blobs"
    blobs.mkdir(parents=True)
    orphan = blobs / ("sha256-" + "ab" * 32)
    fresh = blobs / ("sha256-" + "cd" * 32)
    orphan.write_bytes(b"old")
    fresh.write_bytes(b"new")
    two_hours_ago = time.time() - 7200
    os.utime(orphan, (two_hours_ago, two_hours_ago))
    with ServeProcess(tmp_path / "models", {"DGEMMA_MAX_QUEUE": "8"}) as server:
        logs = server.logs()
    assert "max_queue=8 (DGEMMA_MAX_QUEUE)" in logs and "keep_alive=300.0 (default)" in logs
    assert "WARNING" not in logs  # loopback bind: no exposure warning
    assert not orphan.exists() and fresh.exists()  # only orphans older than an hour are pruned


def test_noprune_keeps_orphans(tmp_path):
    blobs = tmp_path / "models" / "blobs"
    blobs.mkdir(parents=True)
    orphan = blobs / ("sha256-" + "ef" * 32)
    orphan.write_bytes(b"old")
    os.utime(orphan, (time.time() - 7200,) * 2)
    with ServeProcess(tmp_path / "models", {"DGEMMA_NOPRUNE": "true"}):
        pass
    assert orphan.exists()


def test_non_loopback_bind_warns_loudly():
    exposed = ServerConfig.from_env({"DGEMMA_HOST": "0.0.0.0:11435"})
    warnings = startup_warnings(exposed)
    assert any("non-loopback" in w for w in warnings) and any("DGEMMA_API_KEY is unset" in w for w in warnings)
    keyed = ServerConfig.from_env({"DGEMMA_HOST": "192.168.1.10", "DGEMMA_API_KEY": "k"})
    assert [w for w in startup_warnings(keyed) if "DGEMMA_API_KEY" in w] == []
    assert startup_warnings(ServerConfig.from_env({})) == []
