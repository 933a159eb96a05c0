"""The bounded load test (bench/load_test.py) in its fake-runner mode: 20 streaming clients, queue limit 8."""
import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench" / "load_test.py"


def test_load_test_overflow_gets_503_and_health_stays_fast(tmp_path):
    spec = importlib.util.spec_from_file_location("load_test", BENCH)
    load_test = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(load_test)
    out = tmp_path / "report.json"
    status = load_test.main(["--fake", "--clients", "20", "--queue", "8", "--json", str(out)])
    report = json.loads(out.read_text())
    assert status == 0, report["problems"]
    assert report["completed"] + report["refused_503"] == 20
    # 8 admitted for sure (the queue limit), a 9th when the first request held its slot before the burst arrived
    assert report["completed"] >= 8 and report["refused_503"] >= 1 and report["refusals_exact"]
    assert report["version_latency_s"]["max"] <= 0.2
