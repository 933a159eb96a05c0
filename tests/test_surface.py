"""The user-visible surface (CLI help and errors, REST responses) is byte-identical to the recorded golden
(tests/reference/record_surface.py), after replacing run-dependent values such as durations and ids."""
import json

import pytest

from surface_capture import GOLDEN, capture


@pytest.fixture(scope="module")
def surface(tmp_path_factory, gguf_path):
    return capture(tmp_path_factory.mktemp("surface"), gguf_path("tiny-a", "f32"))


@pytest.fixture(scope="module")
def golden():
    return json.loads(GOLDEN.read_text())


@pytest.mark.parametrize("section", ["help", "cli", "api"])
def test_surface_matches_recording(surface, golden, section):
    assert sorted(surface[section]) == sorted(golden[section])
    for label, recorded in golden[section].items():
        assert surface[section][label] == recorded, f"{section}/{label} changed"
