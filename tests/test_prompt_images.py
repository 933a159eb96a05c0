"""Image files named in a `dgemma run` prompt (dgemma_cli/prompt_images.py): which paths are found (absolute, ./, ~/,
escaped or quoted spaces), what stays text, the one-line errors, and the one-shot and REPL runs against a model with
a projector (its images reach the runner; a text-only model keeps the path as text)."""
from __future__ import annotations

import base64
import sys

import pexpect
import pytest

import image_samples as samples
from dgemma_cli.prompt_images import PromptImageError, extract_images
from run_helpers import FakeBehaviour, FakeSetup, InProcessServer, fake_factory, make_store, run_cli
from server_harness import FAKE_IMAGE_MARKER, REPO, add_vision_model
from store_helpers import write_tiny_gguf, write_tiny_projector

PNG = samples.png(12, 10)


@pytest.fixture
def photos(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "home").mkdir()
    (tmp_path / "photo.png").write_bytes(PNG)
    (tmp_path / "my cat.jpg").write_bytes(samples.encoded(samples.Image.fromarray(samples.gradient(8, 8)), "JPEG"))
    (tmp_path / "home" / "pic.webp").write_bytes(samples.encoded(samples.Image.fromarray(samples.gradient()), "WEBP"))
    return tmp_path


def decoded(found) -> list[bytes]:
    return [base64.b64decode(image) for image in found.images]


def test_relative_path_is_cut_out_of_the_prompt(photos):
    found = extract_images("what is in ./photo.png ?")
    assert found.text == "what is in  ?" and found.added == ["./photo.png"] and decoded(found) == [PNG]


def test_absolute_home_escaped_and_quoted_paths_in_order(photos):
    absolute = f"{photos}/photo.png"
    found = extract_images(f"compare {absolute} with ~/pic.webp and ./my\\ cat.jpg")
    assert found.added == [absolute, "~/pic.webp", "./my cat.jpg"]
    assert found.text == "compare  with  and"
    found = extract_images(f"look at '{photos}/my cat.jpg' please")
    assert found.added == [f"{photos}/my cat.jpg"] and found.text == "look at  please"


def test_paths_that_are_not_files_stay_text(photos):
    found = extract_images("see ./missing.png and /nowhere/x.jpg, or photo.png without ./")
    assert found.images == [] and found.text == "see ./missing.png and /nowhere/x.jpg, or photo.png without ./"


def test_a_file_that_is_not_an_image_is_one_error(photos):
    (photos / "notes.png").write_text("hello")
    with pytest.raises(PromptImageError, match=r"^\./notes\.png: invalid file type \(not a PNG, JPEG, WebP or GIF"):
        extract_images("read ./notes.png")


def test_an_oversized_file_is_one_error(photos):
    (photos / "big.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\0" * (20 << 20))
    with pytest.raises(PromptImageError, match="file size exceeds maximum limit"):
        extract_images("./big.png")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from dgemma_cli.server.config import ServerConfig

    root = tmp_path_factory.mktemp("run-images")
    store = make_store(root / "models")
    gguf = write_tiny_gguf(root / "vis-model.gguf")
    add_vision_model(store, "vis", gguf, write_tiny_projector(root / "mmproj.gguf"))
    (root / "photo.png").write_bytes(PNG)
    behaviour = FakeBehaviour(answer="a cat", steps=1)
    config = ServerConfig.from_env({"DGEMMA_MODELS": str(root / "models")})
    with InProcessServer(config, store, fake_factory(behaviour)) as server:
        yield FakeSetup(server, behaviour, root / "models", root, "http://127.0.0.1:1")


def test_one_shot_run_sends_the_named_image(setup):
    result = run_cli(["run", "vis", "what is in ~/photo.png"], setup.env())
    assert result.returncode == 0, result.stderr
    assert result.stderr == "Added image '~/photo.png'\n" and result.stdout == "a cat\n"
    assert setup.behaviour.last_prompt[-1] == f"<user>{FAKE_IMAGE_MARKER}what is in<assistant>"
    assert [image.data for image in setup.behaviour.last_images[-1]] == [PNG]


def test_one_shot_run_of_a_text_model_keeps_the_path_as_text(setup):
    result = run_cli(["run", "tiny", f"what is in {setup.home}/photo.png"], setup.env())
    assert result.returncode == 0, result.stderr
    assert "Added image" not in result.stderr
    assert setup.behaviour.last_prompt[-1] == f"<user>what is in {setup.home}/photo.png<assistant>"


def test_one_shot_run_with_a_bad_image_file_is_one_error_line(setup):
    (setup.home / "fake.png").write_text("not an image")
    result = run_cli(["run", "vis", "what is ~/fake.png"], setup.env())
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "Error: ~/fake.png: invalid file type (not a PNG, JPEG, WebP or GIF image)"]


def test_repl_adds_images_to_the_message(setup):
    child = pexpect.spawn(sys.executable, ["-m", "dgemma_cli.main", "run", "vis"], env=setup.env(TERM="xterm"),
                          cwd=str(REPO), encoding="utf-8", timeout=30, dimensions=(40, 120))
    child.expect_exact(">>> ")
    child.sendline("describe ~/photo.png")
    child.expect_exact("Added image '~/photo.png'")
    child.expect_exact("a cat")
    child.expect_exact(">>> ")
    child.sendline("and again")
    child.expect_exact("a cat")
    child.expect_exact(">>> ")
    child.sendline("/bye")
    child.expect(pexpect.EOF)
    m = FAKE_IMAGE_MARKER
    assert setup.behaviour.last_prompt[-1] == f"<user>{m}describe<assistant>a cat<user>and again<assistant>"
    assert [image.data for image in setup.behaviour.last_images[-1]] == [PNG]  # the history keeps its image
