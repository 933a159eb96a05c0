"""Shared test helpers: the committed fixtures folder and session-cached GGUF conversions of each fixture."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="session")
def gguf_path(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], Path]:
    """`gguf_path(name, outtype="f32")`: tests/fixtures/<name> converted once per session; returns the .gguf path."""
    from dgemma_convert import convert

    cache: dict[tuple[str, str], Path] = {}

    def build(name: str, outtype: str = "f32") -> Path:
        key = (name, outtype)
        if key not in cache:
            out = tmp_path_factory.mktemp("gguf") / f"{name}-{outtype}.gguf"
            convert(FIXTURES / name, out, outtype, threads=2)
            cache[key] = out
        return cache[key]

    return build


@pytest.fixture(scope="module")
def registry_servers():
    """A fake registry and a second loopback "CDN" host serving the same blobs (tests/registry_server.py)."""
    from registry_server import FakeRegistry

    with FakeRegistry() as reg, FakeRegistry(blobs=reg.blobs) as cdn:
        reg.cdn = cdn
        yield reg, cdn


@pytest.fixture
def registry(registry_servers, monkeypatch):
    """The module's registry + CDN pair, emptied for this test and exempt from the SSRF gate."""
    reg, cdn = registry_servers
    reg.reset()
    cdn.reset()
    monkeypatch.setenv("DGEMMA_REGISTRY_ALLOW", f"{reg.host},{cdn.host}")
    monkeypatch.delenv("DGEMMA_REGISTRY_MIRRORS", raising=False)
    return reg
