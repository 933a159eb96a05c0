"""The bounded load test (bench/load_test.py) in its fake-runner mode: 20 streaming clients, queue limit 8.

It runs as its own process, as a server does: inside pytest's process, whose heap holds every earlier test's objects,
a full garbage collection during the burst once stalled `/api/version` for 521 ms in CI."""
import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench" / "load_test.py"


def test_load_test_overflow_gets_503_and_health_stays_fast(tmp_path):
    out = tmp_path / "report.json"
    run = subprocess.run([sys.executable, str(BENCH), "--fake", "--clients", "20", "--queue", "8", "--json", str(out)],
                         capture_output=True, text=True, timeout=300)
    report = json.loads(out.read_text())
    assert run.returncode == 0, report["problems"]
    assert report["completed"] + report["refused_503"] == 20
    # 8 admitted for sure (the queue limit), a 9th when the first request held its slot before the burst arrived
    assert report["completed"] >= 8 and report["refused_503"] >= 1 and report["refusals_exact"]
    assert report["version_latency_s"]["max"] <= 0.2
