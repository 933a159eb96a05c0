"""Each decision once: whether a model is DiffusionGemma (dgemma_engine.arch) and whether it supports vision
(server/request_images.py) are made by one function each, which every other door calls.

The source of dgemma_cli/ and ggml_ext/ is read with `ast`, so a sixth copy of the architecture check or a second
wording of either refusal fails here, and the functions themselves are held to what each door relies on.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
from dgemma_engine.arch import ARCH, check_architecture, is_diffusion_gemma
from dgemma_engine.errors import DgemmaError, EngineError

from dgemma_cli.server.errors import RequestError
from dgemma_cli.server.request_images import check_vision, supports_vision

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted([*(ROOT / "dgemma_cli").rglob("*.py"), *(ROOT / "ggml_ext").rglob("*.py")])
ARCH_MODULE = ROOT / "ggml_ext" / "arch.py"
VISION_MODULE = ROOT / "dgemma_cli" / "server" / "request_images.py"


def strings_in(path: Path) -> list[tuple[int, str]]:
    """Every string constant of a module, f-strings' literal parts included (docstrings too)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)]


def names_arch(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id == "ARCH") or \
        (isinstance(node, ast.Attribute) and node.attr == "ARCH") or \
        (isinstance(node, ast.Constant) and node.value == ARCH)


def arch_comparisons(path: Path) -> list[int]:
    """Lines where a comparison (==, !=, in, not in, is) has ARCH, or its spelling, on either side."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Compare) and any(names_arch(side) for side in (node.left, *node.comparators))]


def where(path: Path, line: int) -> str:
    return f"{path.relative_to(ROOT)}:{line}"


def test_the_sources_are_found():
    assert ARCH_MODULE in SOURCES and VISION_MODULE in SOURCES and len(SOURCES) > 50


def test_the_architecture_refusal_is_worded_in_one_module():
    found = [where(path, line) for path in SOURCES for line, text in strings_in(path)
             if "is not supported by dgemma" in text]
    assert found and all(place.startswith("ggml_ext/arch.py:") for place in found), found


def test_the_architecture_is_compared_in_one_module():
    found = [where(path, line) for path in SOURCES for line in arch_comparisons(path)]
    assert found and all(place.startswith("ggml_ext/arch.py:") for place in found), found


def test_the_architecture_is_spelled_in_one_module():
    found = [where(path, line) for path in SOURCES for line, text in strings_in(path) if text == ARCH]
    assert len(found) == 1 and found[0].startswith("ggml_ext/arch.py:"), found


def test_the_vision_refusal_is_worded_in_one_module():
    found = [where(path, line) for path in SOURCES for line, text in strings_in(path)
             if "does not support vision" in text]
    assert found and all(place.startswith("dgemma_cli/server/request_images.py:") for place in found), found


@pytest.mark.parametrize(("name", "families", "expected"), [
    (ARCH, (), True),
    ("llama", (), False),
    ("llama", [ARCH], True),  # a config whose families name it
    ("", (), False),
    (None, (), False),
    (5, (), False),
    ("llama", 5, False),  # an untrusted config's families that are not a list: not it, and no TypeError
    ("llama", "xdiffusion-gemmax", False),  # a string is not a list of families (no substring match)
])
def test_is_diffusion_gemma(name, families, expected):
    assert is_diffusion_gemma(name, families) is expected


def test_check_architecture_raises_the_callers_error_as_one_line_400():
    check_architecture(ARCH)
    with pytest.raises(EngineError) as default:
        check_architecture("llama")
    assert (default.value.status, str(default.value)) == (400, 'model architecture "llama" is not supported by dgemma')
    with pytest.raises(RequestError) as request:
        check_architecture(None, error=RequestError)
    assert (request.value.status, str(request.value)) == (400,
                                                          'model architecture "unknown" is not supported by dgemma')
    with pytest.raises(DgemmaError, match='^model architecture "llama" is not supported by dgemma$'):
        check_architecture("llama", families=5)


class Local:
    def __init__(self, projector):
        self.projector = projector


class Loaded:
    def __init__(self, marker):
        self.image_marker = marker


class Resolved:
    full = "registry.ollama.ai/library/m:latest"

    def __init__(self, projector):
        self.local = Local(projector)


def test_vision_is_a_projector_and_once_loaded_the_image_token():
    assert supports_vision(Local("mmproj.gguf")) and not supports_vision(Local(None))
    assert supports_vision(Local("mmproj.gguf"), Loaded("<|image|>"))
    assert not supports_vision(Local("mmproj.gguf"), Loaded(None))  # a vocabulary without the image token
    assert not supports_vision(Local(None), Loaded("<|image|>"))
    check_vision(Resolved("mmproj.gguf"))
    for model, runner in ((Resolved(None), None), (Resolved("mmproj.gguf"), Loaded(None))):
        with pytest.raises(RequestError) as exc:
            check_vision(model, runner)
        assert (exc.value.status, str(exc.value)) == (400, "registry.ollama.ai/library/m:latest does not support vision")
