"""The API fuzz run (tests/fuzz_api.py) at a small size: hostile requests and GGUF uploads against `dgemma serve`
with the tiny model give no 5xx, no hang, no dead server, every model create accepts can generate, and generations in
a hostile schema's format get a 4xx within the compile limit."""
from fuzz_api import run


def test_small_fuzz_run_finds_nothing(gguf_path, tmp_path):
    report = run(cases=250, seed=14, gguf=gguf_path("tiny-a", "f32"), time_budget=45, deadline=30,
                 workdir=tmp_path)
    print(report.summary())
    assert report.failures == [], "\n".join(report.failures[:20])
    assert report.requests >= 100 and not report.stopped_early
    assert report.gguf_cases > 0 and report.models_checked > 0 and report.hostile_formats > 0
    assert report.image_cases > 0  # hostile images on every API (tests/image_samples.py)
    assert sum(n for status, n in report.statuses.items() if isinstance(status, int) and 400 <= status < 500) > 0
