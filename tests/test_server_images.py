"""Images on every API (docs/server.md, "Images"), with the real `ollama` and `openai` clients against uvicorn: where
the markers land in the prompt, what reaches the runner, and every refusal as a 400 with one line before any
generation slot is taken (a text-only model, a corrupt image, a remote URL, too many images, images that cannot fit
`num_ctx`, a body over the JSON cap).

The runner is the scripted fake (tests/server_harness.py): a model with a projector layer gets one marker character
per image in its prompt and receives the decoded images; the real vision encoder is wired after the merge."""
from __future__ import annotations

import base64
import resource
import select
import socket
import time

import httpx
import ollama
import openai
import pytest

from dgemma_cli.server.config import ServerConfig
from dgemma_cli.store import Store
import image_samples as samples
from server_harness import FAKE_IMAGE_MARKER, FakeBehaviour, InProcessServer, add_model, add_vision_model, fake_factory
from store_helpers import write_tiny_gguf, write_tiny_projector

FAST = {"diffusion_steps": 2, "seed": 1, "num_predict": 8}
PNG = samples.png(24, 16)
B64 = base64.b64encode(PNG).decode()
DATA_URL = "data:image/png;base64," + B64


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("images")
    store = Store(root / "store")
    gguf = write_tiny_gguf(root / "model.gguf", canvas_length=8, context_length=4096)  # as the fake runner's canvas
    add_model(store, "text", gguf)
    add_vision_model(store, "vis", gguf, write_tiny_projector(root / "mmproj.gguf", max_soft_tokens=16))
    behaviour = FakeBehaviour(answer="a cat", steps=1)
    config = ServerConfig.from_env({"DGEMMA_MODELS": str(store.root), "DGEMMA_NOPRUNE": "1",
                                    "DGEMMA_MAX_IMAGES": "4"})
    with InProcessServer(config, store, fake_factory(behaviour)) as server:
        yield server, behaviour


@pytest.fixture
def server(served):
    server, behaviour = served
    behaviour.last_prompt.clear()
    behaviour.last_images.clear()
    yield server, behaviour
    assert_no_slot_held(server)


def assert_no_slot_held(server) -> None:
    """Nothing pending and no slot held (a finished answer releases its slot just after its last byte)."""
    scheduler = server.app.state.services.scheduler
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if scheduler.pending == 0 and all(r.refcount == 0 for r in scheduler.residents.values()):
            return
        time.sleep(0.01)
    raise AssertionError(f"pending {scheduler.pending}, "
                         f"held {[(r.name, r.refcount) for r in scheduler.residents.values()]}")


def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)


# ---- what a model with a projector receives ------------------------------------------------------------------------

def test_ollama_generate_puts_one_marker_before_the_prompt(server):
    srv, behaviour = server
    reply = ollama.Client(host=srv.url).generate(model="vis", prompt="what is this?", images=[PNG], options=FAST)
    assert reply.done
    assert f"<user>{FAKE_IMAGE_MARKER}what is this?<assistant>" in behaviour.last_prompt[-1]
    [images] = behaviour.last_images
    assert len(images) == 1 and images[0].data == PNG and (images[0].width, images[0].height) == (24, 16)
    assert images[0].pixels().shape == (16, 24, 3)


def test_ollama_chat_images_stay_with_their_message(server):
    srv, behaviour = server
    messages = [{"role": "user", "content": "first", "images": [PNG]},
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "and these?", "images": [B64, samples.encoded(
                    samples.Image.fromarray(samples.gradient(8, 8)), "JPEG")]}]
    ollama.Client(host=srv.url).chat(model="vis", messages=messages, options=FAST)
    m = FAKE_IMAGE_MARKER
    assert f"<user>{m}first<assistant>ok<user>{m}{m}and these?<assistant>" in behaviour.last_prompt[-1]
    assert [image.width for image in behaviour.last_images[-1]] == [24, 24, 8]


def test_openai_image_url_parts_keep_their_place(server):
    srv, behaviour = server
    content = [{"type": "text", "text": "left "}, {"type": "image_url", "image_url": {"url": DATA_URL}},
               {"type": "text", "text": " right"}, {"type": "image_url", "image_url": DATA_URL}]
    reply = oai(srv).chat.completions.create(model="vis", messages=[{"role": "user", "content": content}],
                                             max_tokens=8)
    assert reply.choices[0].message.content is not None
    m = FAKE_IMAGE_MARKER
    assert f"<user>left {m} right{m}<assistant>" in behaviour.last_prompt[-1]
    assert len(behaviour.last_images[-1]) == 2


def test_responses_input_image(server):
    srv, behaviour = server
    item = {"role": "user", "content": [{"type": "input_image", "image_url": DATA_URL},
                                        {"type": "input_text", "text": "describe"}]}
    oai(srv).responses.create(model="vis", input=[item], max_output_tokens=8)
    assert f"<user>{FAKE_IMAGE_MARKER}describe<assistant>" in behaviour.last_prompt[-1]
    assert len(behaviour.last_images[-1]) == 1


def test_data_url_without_a_media_type_is_accepted_as_ollama_does(server):
    srv, behaviour = server
    content = [{"type": "image_url", "image_url": {"url": "data:;base64," + B64}}]
    oai(srv).chat.completions.create(model="vis", messages=[{"role": "user", "content": content}], max_tokens=8)
    assert len(behaviour.last_images[-1]) == 1


# ---- refusals: 400, one line, nothing generated, no slot held -------------------------------------------------------

def refused_ollama(srv, behaviour, call) -> str:
    with pytest.raises(ollama.ResponseError) as info:
        call(ollama.Client(host=srv.url))
    assert info.value.status_code == 400
    assert not behaviour.last_prompt  # nothing reached the runner
    message = info.value.error
    assert "\n" not in message
    return message


def test_text_only_model_is_refused_with_ollamas_error(server):
    srv, behaviour = server
    message = refused_ollama(srv, behaviour, lambda c: c.generate(model="text", prompt="hi", images=[PNG]))
    assert message == "registry.ollama.ai/library/text:latest does not support vision"  # Ollama's text
    message = refused_ollama(srv, behaviour, lambda c: c.chat(
        model="text", messages=[{"role": "user", "content": "hi", "images": [PNG]}]))
    assert message.endswith("does not support vision")
    with pytest.raises(openai.BadRequestError, match="does not support vision"):
        oai(srv).chat.completions.create(model="text", max_tokens=8, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": DATA_URL}}]}])


@pytest.mark.parametrize("name", sorted(set(samples.hostile_images()) - {"empty"}))  # empty: sent raw below
def test_hostile_images_are_400s(server, name):
    srv, behaviour = server
    data = samples.hostile_images()[name]
    message = refused_ollama(srv, behaviour, lambda c: c.generate(model="vis", prompt="x", images=[data]))
    assert message.startswith("image 1: ") and ("invalid image" in message or "image too large" in message)


def test_raw_hostile_payloads_are_400s(server):
    srv, behaviour = server
    cases = {"": "image 1: invalid image: no data", "!!not base64!!": "invalid image: not valid base64",
             "aGVsbG8=": "image 1: invalid image: not a PNG, JPEG, WebP or GIF image"}
    for payload, message in cases.items():
        answer = httpx.post(f"{srv.url}/api/generate", json={"model": "vis", "prompt": "x", "images": [payload],
                                                              "stream": False})
        assert answer.status_code == 400 and answer.json() == {"error": message}, payload
    assert not behaviour.last_prompt


@pytest.mark.parametrize("url,message", [
    ("https://example.com/cat.png", "image URLs are not currently supported, please use base64 encoded data instead"),
    ("http://127.0.0.1:1/cat.png", "image URLs are not currently supported, please use base64 encoded data instead"),
    ("data:image/svg+xml;base64," + B64, "invalid image input"),
    ("data:text/plain;base64," + B64, "invalid image input"),
    ("data:image/png," + B64, "invalid image input"),
    ("data:image/png;base64,***", "invalid image input"),
    ("file:///etc/passwd", "invalid image input"),
])
def test_openai_urls_that_are_not_base64_data_are_refused(server, url, message):
    srv, behaviour = server
    content = [{"type": "image_url", "image_url": {"url": url}}]
    with pytest.raises(openai.BadRequestError) as info:
        oai(srv).chat.completions.create(model="vis", messages=[{"role": "user", "content": content}], max_tokens=8)
    assert info.value.body["message"] == message
    with pytest.raises(openai.BadRequestError) as info:
        oai(srv).responses.create(model="vis", max_output_tokens=8, input=[
            {"role": "user", "content": [{"type": "input_image", "image_url": url}]}])
    assert info.value.body["message"] == message
    assert not behaviour.last_prompt


def test_remote_url_is_never_fetched(server):
    """The refusal happens without any connection to the URL's host."""
    srv, _ = server
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    content = [{"type": "image_url", "image_url": {"url": f"http://127.0.0.1:{port}/x.png"}}]
    with pytest.raises(openai.BadRequestError):
        oai(srv).chat.completions.create(model="vis", messages=[{"role": "user", "content": content}], max_tokens=8)
    with pytest.raises(socket.timeout):
        listener.accept()
    listener.close()


def test_too_many_images(server):
    srv, behaviour = server
    message = refused_ollama(srv, behaviour, lambda c: c.generate(model="vis", prompt="x", images=[PNG] * 5))
    assert message == "too many images: 5 (at most 4 per request, DGEMMA_MAX_IMAGES)"


def test_a_hundred_images_in_one_chat_message(server):
    """The count is checked before any image is decoded: 100 images of 200 KB (27 MB of base64, under the body cap)
    get a one-line 400 and no slot, and the process's peak memory grows by what the request's bytes take, not by 100
    decoded images."""
    srv, behaviour = server
    big = (PNG * (200_000 // len(PNG) + 1))[:200_000]
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    message = refused_ollama(srv, behaviour, lambda c: c.chat(
        model="vis", messages=[{"role": "user", "content": "x", "images": [big] * 100}]))
    assert message == "too many images: 100 (at most 4 per request, DGEMMA_MAX_IMAGES)"
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mib < 400, grown_mib  # client and server share this process: base64, JSON and bytes, a few copies


def test_images_that_cannot_fit_num_ctx(server):
    srv, behaviour = server
    options = {**FAST, "num_ctx": 40}
    message = refused_ollama(srv, behaviour, lambda c: c.generate(model="vis", prompt="x", images=[PNG] * 3,
                                                                   options=options))
    assert message == ("3 images need 54 tokens (18 each), the prompt at least 1 and a diffusion canvas 8 more; "
                       "the model's context holds 40 tokens (num_ctx)")


def test_images_are_checked_against_the_models_context_not_num_ctx(server):
    """num_ctx beyond the model's trained context (4096 here) is capped when the runner loads, so the check uses
    the cap: 250 x 18 positions cannot fit 4096 whatever num_ctx says."""
    srv, behaviour = server
    answer = httpx.post(f"{srv.url}/api/chat", timeout=30, json={
        "model": "vis", "stream": False, "options": {**FAST, "num_ctx": 1_000_000},
        "messages": [{"role": "user", "content": "x", "images": [B64] * 4}]})
    assert answer.status_code == 200, answer.text  # 4 x 18 fit: the cap does not refuse what fits
    text = "y" * (64 * 4050)  # at least 4050 tokens, whatever it tokenizes to, and not truncated
    answer = httpx.post(f"{srv.url}/api/chat", timeout=30, json={
        "model": "vis", "stream": False, "options": {**FAST, "num_ctx": 1_000_000}, "truncate": False,
        "messages": [{"role": "user", "content": text, "images": [B64] * 4}]})
    assert answer.status_code == 400
    assert answer.json()["error"] == ("4 images need 72 tokens (18 each), the prompt at least 4050 and a diffusion "
                                      "canvas 8 more; the model's context holds 4096 tokens (num_ctx 1000000, this "
                                      "model's at most 4096)")
    assert len(behaviour.last_images) == 1  # only the first reached the runner


def test_images_leave_no_room_for_a_canvas(server):
    """Within num_ctx but with no room for the canvas once loaded: still a 400 before the first byte."""
    srv, behaviour = server
    answer = httpx.post(f"{srv.url}/api/generate", json={
        "model": "vis", "prompt": "x", "images": [B64, B64], "stream": True, "options": {**FAST, "num_ctx": 50}})
    assert answer.status_code == 400
    assert answer.json()["error"].startswith("prompt with 2 image(s) (up to ")
    assert answer.json()["error"].endswith("leaves no room for a diffusion canvas (8 tokens) within the context "
                                           "window (50 tokens)")
    assert not behaviour.last_images  # never generated without them
    # a chat whose older message carries an image: that message (and its image) may be dropped to fit
    answer = httpx.post(f"{srv.url}/api/chat", json={
        "model": "vis", "stream": False, "options": {**FAST, "num_ctx": 48},
        "messages": [{"role": "user", "content": "old " * 20, "images": [B64]},
                     {"role": "assistant", "content": "ok"},
                     {"role": "user", "content": "new", "images": [B64]}]})
    assert answer.status_code == 200, answer.text
    assert len(behaviour.last_images[-1]) == 1 and "old" not in behaviour.last_prompt[-1]


def test_a_1_gib_base64_body_is_413_without_holding_it(server):
    """A request announcing a 1 GiB base64 image is answered 413 once the 32 MiB JSON cap is passed: the server
    stops reading there, and its memory grows by far less than the body."""
    srv, behaviour = server
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    head = b'{"model": "vis", "prompt": "x", "images": ["'
    length = len(head) + (1 << 30) + 3
    sent = 0
    chunk = b"A" * (1 << 20)
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as conn:
        conn.sendall(b"POST /api/generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % length + head)
        answer = b""
        while sent < length and not answer:
            readable, _, _ = select.select([conn], [], [], 0)
            if readable:
                answer = conn.recv(65536)
                break
            try:
                conn.sendall(chunk)
            except OSError:  # the server answered and closed: read what it said
                break
            sent += len(chunk)
        while not answer.endswith(b"}"):  # the whole answer: headers and its one-line JSON body
            more = conn.recv(65536)
            if not more:
                break
            answer += more
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"request body too large" in answer
    print(f"sent {sent >> 20} MiB before the 413; peak RSS +{(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024} MiB")
    assert sent < 64 << 20, f"the client could send {sent >> 20} MiB before the answer"
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert grown_mib < 80, f"peak RSS grew by {grown_mib:.0f} MiB"
    assert not behaviour.last_prompt


def test_show_and_tags_list_vision_only_with_a_projector(server):
    srv, _ = server
    assert "vision" in ollama.Client(host=srv.url).show("vis").capabilities
    assert "vision" not in ollama.Client(host=srv.url).show("text").capabilities
    tags = {m["name"]: m["capabilities"] for m in httpx.get(f"{srv.url}/api/tags").json()["models"]}
    assert tags["vis:latest"] == ["completion", "diffusion", "vision"]
    assert tags["text:latest"] == ["completion", "diffusion"]


# ---- markers, unit level ------------------------------------------------------------------------------------------

class MarkerRunner:
    image_marker = "<|image|>"


def test_markers_go_where_the_images_were():
    from dgemma_cli.server.prompts import with_image_markers

    message = {"role": "user", "content": "left right", "images": ["a", "b"], "image_places": [5, 10]}
    assert with_image_markers(message, MarkerRunner(), parts=False) == {
        "role": "user", "content": "left <|image|>right<|image|>"}
    assert with_image_markers(message, MarkerRunner(), parts=True)["content"] == [
        {"type": "text", "text": "left "}, {"type": "image"}, {"type": "text", "text": "right"}, {"type": "image"}]
    ollama_style = {"role": "user", "content": "what?", "images": ["a"]}  # no places: before the text
    assert with_image_markers(ollama_style, MarkerRunner(), parts=False)["content"] == "<|image|>what?"
    assert with_image_markers({"role": "user", "content": "x"}, MarkerRunner(), parts=False) == {
        "role": "user", "content": "x"}


def test_a_template_that_renders_image_parts_is_detected():
    from dgemma_cli.server.runner import template_renders_images
    from dgemma_engine.chat.templates import ChatTemplate

    gemma_like = ("{% for m in messages %}<|turn>{{ m.role }}\n{% if m.content is string %}{{ m.content }}"
                  "{% else %}{% for p in m.content %}{% if p.type == 'image' %}<|image|>{% else %}{{ p.text }}"
                  "{% endif %}{% endfor %}{% endif %}<turn|>\n{% endfor %}<|turn>model\n")
    text_only = "{% for m in messages %}<|turn>{{ m.role }}\n{{ m.content }}<turn|>\n{% endfor %}<|turn>model\n"
    assert template_renders_images(ChatTemplate("jinja", gemma_like), {"bos_token": "<bos>"})
    assert not template_renders_images(ChatTemplate("jinja", text_only), {"bos_token": "<bos>"})
    assert not template_renders_images(ChatTemplate("go", "{{ .Prompt }}"), {"bos_token": "<bos>"})


def test_more_image_tokens_than_images_is_a_400():
    from dgemma_cli.server.errors import RequestError
    from dgemma_cli.server.prompts import prompt_images

    class Runner:
        image_token_id, image_positions, canvas_length, context_length = 7, 18, 8, 100

    with pytest.raises(RequestError, match="the prompt holds 2 image tokens but the request has 1 image"):
        prompt_images([1, 7, 7, 2], ["img"], Runner(), kept=1)
    assert prompt_images([1, 7, 2], ["old", "new"], Runner(), kept=1) == ["new"]  # the older one was truncated
