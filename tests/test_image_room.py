"""Images are counted and checked against the context the runner loads before any pixel is decoded (issue 36,
item 10), against a real `dgemma serve` of the tiny-v checkpoint (its projector: 70 soft tokens, 72 positions an
image; its trained context: 1024 tokens; its canvas: 16).

Sixteen valid 5792 x 5792 white PNGs (112 KB each, about 1.5 s and 100 MB each to decode) used to be decoded for
tens of seconds and then refused with a 400 about the prompt's length; the room check used the request's num_ctx
(8192 by default) while the runner loads at most the model's 1024. Now the headers alone decide, on every API."""
from __future__ import annotations

import base64
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

import image_samples
from dgemma_cli.create import create_model
from dgemma_cli.modelfile import parse_modelfile
from dgemma_cli.server.prompts import model_window
from dgemma_cli.store import Store
from dgemma_engine.images import ImageError, decode_image, read_header
from server_harness import ServeProcess

TINY_V = Path(__file__).parent / "fixtures" / "tiny-v"
OPTIONS = {"diffusion_steps": 2, "seed": 1, "num_predict": 16}
REFUSAL = ("16 images need 1152 tokens (72 each){prompt} and a diffusion canvas 16 more; the model's context holds "
           "1024 tokens (num_ctx {num_ctx}, this model's at most 1024)")
QUICK_S = 3.0  # headers only: well under a second alone, with room for a loaded machine


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> Store:
    root = tmp_path_factory.mktemp("image-room")
    store = Store(root / "models")
    list(create_model("tiny-v", parse_modelfile(f"FROM {TINY_V}\n"), store, root))
    return store


@pytest.fixture(scope="module")
def server(store):
    with ServeProcess(store.root, {"DGEMMA_NOPRUNE": "1"}) as server:
        yield server


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def big_requests() -> dict[str, dict]:
    big = base64.b64encode(image_samples.big_white_png()).decode()
    url = "data:image/png;base64," + big
    return {
        "/api/chat": {"model": "tiny-v", "stream": False, "options": OPTIONS,
                      "messages": [{"role": "user", "content": "what are these?", "images": [big] * 16}]},
        "/api/generate": {"model": "tiny-v", "stream": False, "options": {**OPTIONS, "num_ctx": 1_000_000},
                          "prompt": "x", "images": [big] * 16},
        "/v1/chat/completions": {"model": "tiny-v", "max_tokens": 16, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}] * 16}]},
        "/v1/responses": {"model": "tiny-v", "max_output_tokens": 16, "input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": url}] * 16}]},
    }


def error_of(answer: httpx.Response) -> str:
    body = answer.json()
    return body["error"] if isinstance(body["error"], str) else body["error"]["message"]


def test_sixteen_big_white_pngs_are_refused_from_their_headers(server):
    expected = {"/api/chat": REFUSAL.format(prompt="", num_ctx=8192),  # truncation may cut a chat's text
                "/api/generate": REFUSAL.format(prompt=", the prompt at least 1", num_ctx=1000000),
                "/v1/chat/completions": REFUSAL.format(prompt="", num_ctx=8192),
                "/v1/responses": REFUSAL.format(prompt="", num_ctx=8192)}
    with httpx.Client(base_url=server.url, timeout=120) as client:
        before = rss_mib(server.process.pid)
        for path, body in big_requests().items():
            started = time.perf_counter()
            answer = client.post(path, json=body)
            seconds = time.perf_counter() - started
            assert answer.status_code == 400, (path, answer.text)
            assert error_of(answer) == expected[path]
            assert seconds < QUICK_S, f"{path}: {seconds:.1f} s"
        grown = rss_mib(server.process.pid) - before
        assert grown < 100, f"server RSS grew by {grown:.0f} MiB"  # one decoded image alone is 100 MB
        # nothing was loaded for them
        assert client.get("/api/ps").json()["models"] == []


def test_images_that_fit_the_model_are_answered_whatever_num_ctx_says(server):
    """num_ctx above the model's 1024 is capped as the runner caps it: two images (144 positions) still fit."""
    square = base64.b64encode((TINY_V / "images" / "square.png").read_bytes()).decode()
    with httpx.Client(base_url=server.url, timeout=120) as client:
        answer = client.post("/api/chat", json={
            "model": "tiny-v", "stream": False, "options": {**OPTIONS, "num_ctx": 1_000_000},
            "messages": [{"role": "user", "content": "what is this?", "images": [square, square]}]})
        assert answer.status_code == 200, answer.text
        assert answer.json()["done"]
        # thirteen images and 200 characters, not truncated, pass the check before the load (936 + 16 + at least 4
        # positions), not once the text is tokenized (201 tokens): refused then, before any generation, naming the
        # images
        answer = client.post("/api/chat", json={
            "model": "tiny-v", "stream": False, "options": OPTIONS, "truncate": False,
            "messages": [{"role": "user", "content": "x " * 100, "images": [square] * 13}]})
        assert answer.status_code == 400
        assert error_of(answer).startswith("prompt with 13 image(s) (up to ")
        assert error_of(answer).endswith("leaves no room for a diffusion canvas (16 tokens) within the context "
                                         "window (1024 tokens)")


def test_the_window_checked_is_the_one_the_runner_loads(store):
    """model_window (the route's check, from the headers) and EngineRunner (what really loads) agree on the
    context, the canvas and one image's positions, for a num_ctx below, at and above the model's."""
    from dgemma_cli.names import ModelName
    from dgemma_cli.server.runner import EngineRunner

    local = store.resolve("tiny-v")
    model = SimpleNamespace(local=local, full=ModelName.parse("tiny-v").full)
    for num_ctx in (300, 1024, 8192):
        window = model_window(model, num_ctx)
        runner = EngineRunner(local, num_ctx, threads=1)
        try:
            assert (window.context_length, window.canvas_length, window.image_positions) == (
                runner.context_length, runner.canvas_length, runner.image_positions), num_ctx
        finally:
            runner.close()
    assert model_window(model, 8192).context_length == 1024


def test_a_header_read_decodes_nothing():
    """read_header gives the format and size of the 5792 x 5792 PNG at a small fraction of decode_image's cost, and
    refuses from the header what decode_image would refuse before decoding."""
    big = image_samples.big_white_png()
    started = time.perf_counter()
    header = read_header(big)
    header_s = time.perf_counter() - started
    assert (header.format, header.width, header.height) == ("PNG", 5792, 5792)
    started = time.perf_counter()
    assert decode_image(big).shape == (5792, 5792, 3)
    decode_s = time.perf_counter() - started
    assert header_s < decode_s / 20, (header_s, decode_s)
    for name in ("empty", "text", "tiff", "huge png header", "zero-size png"):
        with pytest.raises(ImageError):
            read_header(image_samples.hostile_images()[name])
