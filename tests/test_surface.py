"""The user-visible surface (CLI help and errors, REST responses) matches the recorded golden
(tests/reference/record_surface.py), after replacing run-dependent values such as durations and ids.

Everything compares exactly except JSON floats: a progress entropy is a float32 reduction whose last bits depend on the
kernel path the CPU dispatches (AVX2, AVX-512, the portable scalar kernels, ggml's standard ops), so floats compare
within FLOAT_RTOL. The surface is captured once per kernel path this machine can run (tests/kernel_paths.py), so a
path whose arithmetic drifts further, or changes a token, fails here on every CPU.
"""
import json
import math
from typing import Any

import pytest

from kernel_paths import KERNEL_PATHS, kernel_path_env
from surface_capture import GOLDEN, capture

# Kernel paths differ by a few float32 ulp in a logit (summation order); an entropy moves ~1e-7 relative. 1e-5 is
# a hundred times that and still far below any change a user could see.
FLOAT_RTOL = 1e-5
FLOAT_ATOL = 1e-6


def differences(got: Any, want: Any, where: str = "") -> list[str]:
    """Where `got` differs from `want`: exact for everything but floats, which match within FLOAT_RTOL/ATOL."""
    if isinstance(want, float) and isinstance(got, (int, float)) and not isinstance(got, bool):
        ok = math.isclose(got, want, rel_tol=FLOAT_RTOL, abs_tol=FLOAT_ATOL)
        return [] if ok else [f"{where}: {got!r} != {want!r}"]
    if type(got) is not type(want):
        return [f"{where}: {got!r} != {want!r}"]
    if isinstance(want, dict):
        if sorted(got) != sorted(want):
            return [f"{where}: keys {sorted(got)} != {sorted(want)}"]
        return [d for k in want for d in differences(got[k], want[k], f"{where}/{k}")]
    if isinstance(want, list):
        if len(got) != len(want):
            return [f"{where}: {len(got)} items != {len(want)}"]
        return [d for i, (g, w) in enumerate(zip(got, want)) for d in differences(g, w, f"{where}[{i}]")]
    return [] if got == want else [f"{where}: {got!r} != {want!r}"]


@pytest.fixture(scope="module")
def surfaces(tmp_path_factory, gguf_path):
    """The surface captured per kernel path, once per module (help texts are the same on every path: native only)."""
    captured = {}

    def get(path: str):
        if path not in captured:
            with kernel_path_env(path):
                captured[path] = capture(tmp_path_factory.mktemp("surface"), gguf_path("tiny-a", "f32"),
                                         with_help=path == "native")
        return captured[path]

    return get


@pytest.fixture(scope="module")
def golden():
    return json.loads(GOLDEN.read_text())


@pytest.mark.parametrize("path,section", [(p, s) for p in KERNEL_PATHS for s in ("help", "cli", "api")
                                          if s != "help" or p == "native"])
def test_surface_matches_recording(surfaces, golden, path, section):
    surface = surfaces(path)
    assert sorted(surface[section]) == sorted(golden[section])
    for label, recorded in golden[section].items():
        found = differences(surface[section][label], recorded, f"{section}/{label}")
        assert not found, f"{section}/{label} changed: " + "; ".join(found[:5])


def test_float_tolerance_is_tight():
    """The comparison tolerates the last bits of a float and nothing a user could see."""
    assert differences({"entropy": 5.298466682434082}, {"entropy": 5.298466205596924}) == []
    assert differences({"entropy": 5.2986}, {"entropy": 5.2984}) != []
    assert differences({"n": 3}, {"n": 4}) != []
    assert differences(["a"], ["b"]) != []
    assert differences({"x": True}, {"x": 1.0}) != []
