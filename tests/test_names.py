"""Model names: Ollama's grammar, defaults, validation and display form (docs/compat.md#names-and-store)."""
from __future__ import annotations

import pytest

from dgemma_cli.errors import DgemmaError
from dgemma_cli.names import MAX_NAME_CHARS, MAX_PART_BYTES, ModelName


@pytest.mark.parametrize("text,parts,display", [
    ("tiny", ("registry.ollama.ai", "library", "tiny", "latest"), "tiny:latest"),
    ("tiny:Q4", ("registry.ollama.ai", "library", "tiny", "Q4"), "tiny:Q4"),
    ("me/tiny", ("registry.ollama.ai", "me", "tiny", "latest"), "me/tiny:latest"),
    ("hf.co/unsloth/diffusiongemma-26B-A4B-it-GGUF:Q4_K_M",
     ("hf.co", "unsloth", "diffusiongemma-26B-A4B-it-GGUF", "Q4_K_M"),
     "hf.co/unsloth/diffusiongemma-26B-A4B-it-GGUF:Q4_K_M"),
    ("127.0.0.1:5000/ns/m", ("127.0.0.1:5000", "ns", "m", "latest"), "127.0.0.1:5000/ns/m:latest"),
    ("registry.ollama.ai/library/m:7b", ("registry.ollama.ai", "library", "m", "7b"), "m:7b"),
    ("REGISTRY.OLLAMA.AI/Library/m", ("REGISTRY.OLLAMA.AI", "Library", "m", "latest"), "m:latest"),
    ("_x/y.z:a-b_c.d", ("registry.ollama.ai", "_x", "y.z", "a-b_c.d"), "_x/y.z:a-b_c.d"),
])
def test_parse_and_display(text, parts, display):
    name = ModelName.parse(text)
    assert name.parts == parts and name.display == display and name.scheme == "https"


def test_scheme():
    assert ModelName.parse("http://127.0.0.1:5000/ns/m:t").scheme == "http"
    assert ModelName.parse("https://h.example/ns/m").scheme == "https"


@pytest.mark.parametrize("text", [
    "", ":", "m:", "/m", "ns/", "a/b/c/d", "a/b/c/d:e", "../m", "ns/../m", "..", "h/../m", "m:..", "m:a/b",
    "m:../../x", "m\\x", ".hidden", "-dash", "ns/.m", "m:.t", "m:-t", "x" * 81, "m:" + "t" * 81, "n" * 81 + "/m",
    "h" * 256 + "/ns/m", "h" * 300 + "/ns/m", "h" * 350 + "/ns/m", "h" * 351 + "/ns/m", "1" * 250 + ":11434/ns/m",
    "ns.dotted/m", "m@sha256:" + "0" * 64, "ftp://h/ns/m", "m\x00", "mö", "m x", "host name/ns/m",
])
def test_invalid_names_give_one_message(text):
    with pytest.raises(DgemmaError) as exc:
        ModelName.parse(text)
    assert str(exc.value) == "invalid model name"


def test_limits_are_inclusive():
    assert ModelName.parse("m" * 80 + ":" + "t" * 80).model == "m" * 80
    assert ModelName.parse("h" * 255 + "/ns/m").host == "h" * 255  # a file name's limit (Ollama allows 350)


def test_the_longest_valid_name_parses_and_longer_text_is_refused_before_parsing():
    longest = "https://" + "h" * 255 + "/" + "n" * 80 + "/" + "m" * 80 + ":" + "t" * 80
    assert len(longest) == MAX_NAME_CHARS and ModelName.parse(longest).tag == "t" * 80
    assert ModelName.parse("  " + longest + "\n").model == "m" * 80  # surrounding space is not part of the name
    for text in (longest + "t", "x" * 10_000_000):
        with pytest.raises(DgemmaError, match="^invalid model name$"):
            ModelName.parse(text)


def test_every_valid_name_is_a_path_the_file_system_takes(tmp_path):
    """Each part becomes a folder or file name of the store: at most 255 bytes, whatever the part."""
    name = ModelName.parse("h" * 255 + "/" + "n" * 80 + "/" + "m" * 80 + ":" + "t" * 80)
    path = tmp_path.joinpath(*name.parts)
    path.parent.mkdir(parents=True)
    path.write_text("ok")
    assert all(len(part.encode()) <= MAX_PART_BYTES for part in name.parts) and path.read_text() == "ok"


def test_case_insensitive_key():
    assert ModelName.parse("HF.co/User/Repo:Q4").key() == ModelName.parse("hf.co/user/repo:q4").key()
