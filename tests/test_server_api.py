"""REST behaviour of `dgemma serve` against a fake runner (fast; shapes, errors, scheduling and fault injection).

The runner is a controllable fake behind the scheduler's runner interface; the same routes run against the real
engine in tests/test_ollama_client.py and tests/test_openai_client.py.
"""
import json
import re
import threading
import time

import httpx
import pytest

from dgemma_cli.server.config import ServerConfig
from dgemma_cli.store import Store
from server_harness import FakeBehaviour, InProcessServer, add_model, fake_factory, ndjson, write_small_gguf

BUSY = "server busy, please try again.  maximum pending requests exceeded"
STAMP = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}\+00:00$")
METRICS = ("total_duration", "load_duration", "prompt_eval_count", "prompt_eval_duration", "eval_count",
           "eval_duration", "denoise_steps", "canvases")


@pytest.fixture
def make_server(tmp_path):
    """make_server(env={...}, behaviour=FakeBehaviour(...)) -> (server, behaviour, store) with model `tiny`."""
    started = []
    store = Store(tmp_path / "models")
    gguf = write_small_gguf(tmp_path / "tiny.gguf")
    add_model(store, "tiny", gguf, parameters={"diffusion_steps": 4, "stop": ["NEVER"]}, system="Be brief.")
    add_model(store, "other", gguf)

    def make(env=None, behaviour=None):
        behaviour = behaviour or FakeBehaviour()
        config = ServerConfig.from_env({"DGEMMA_MODELS": str(store.root), "DGEMMA_NOPRUNE": "1", **(env or {})})
        server = InProcessServer(config, store, fake_factory(behaviour)).__enter__()
        started.append(server)
        return server, behaviour, store

    yield make
    for server in started:
        server.__exit__(None, None, None)


def client(server, **kw):
    return httpx.Client(base_url=server.url, timeout=30, **kw)


def test_root_version_and_empty_lists(make_server):
    server, _, _ = make_server()
    with client(server) as c:
        for method in ("GET", "HEAD"):
            r = c.request(method, "/")
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        assert c.get("/").text == "Ollama is running"
        version = c.get("/api/version").json()
        assert re.fullmatch(r"\d+(\.\d+)+", version["version"]) and version["dgemma_version"]
        assert c.get("/api/ps").json() == {"models": []}
        assert c.head("/api/version").status_code == 200 and c.head("/api/tags").status_code == 200
        assert c.get("/nope").status_code == 404
        assert c.get("/api/generate").status_code == 405


def test_tags_show_and_modelfile(make_server):
    server, _, _ = make_server()
    with client(server) as c:
        models = c.get("/api/tags").json()["models"]
        assert {m["name"] for m in models} == {"tiny:latest", "other:latest"}
        tiny = next(m for m in models if m["name"] == "tiny:latest")
        assert STAMP.match(tiny["modified_at"]) and re.fullmatch(r"[0-9a-f]{64}", tiny["digest"])
        assert tiny["details"]["family"] == "diffusion-gemma" and tiny["capabilities"] == ["completion", "diffusion"]
        show = c.post("/api/show", json={"model": "tiny"}).json()
        assert show["model_info"]["general.architecture"] == "diffusion-gemma"
        assert show["model_info"]["diffusion-gemma.context_length"] == 4096
        assert show["model_info"]["tokenizer.ggml.tokens"] == []  # > 5 elements: hidden unless verbose
        assert show["parameters"].splitlines() == [f"{'diffusion_steps':<30} 4", f"{'stop':<30} \"NEVER\""]
        assert "SYSTEM Be brief." in show["modelfile"] and show["system"] == "Be brief."
        assert "diffusion" in show["capabilities"]
        verbose = c.post("/api/show", json={"name": "tiny", "verbose": True}).json()
        assert len(verbose["model_info"]["tokenizer.ggml.tokens"]) == 16 and verbose["tensors"][0]["name"]
        assert c.post("/api/show", json={"model": "missing"}).status_code == 404
        assert c.post("/api/show", json={"model": "a/b/c/d/e"}).json() == {"error": "invalid model name"}


def test_generate_stream_shape_progress_and_final_metrics(make_server):
    server, behaviour, _ = make_server(behaviour=FakeBehaviour(answer="Hello dgemma world", steps=2))
    with client(server) as c:
        r = c.post("/api/generate", json={"model": "tiny", "prompt": "Hi", "options": {"diffusion_progress": True}})
        assert r.status_code == 200 and r.headers["content-type"] == "application/x-ndjson"
        lines = ndjson(r)
        assert all(line["model"] == "tiny:latest" and STAMP.match(line["created_at"]) for line in lines)
        progress = [line for line in lines if "completed" in line]
        assert [(p["canvas"], p["completed"], p["total"]) for p in progress[:2]] == [(1, 1, 4), (1, 2, 4)]
        assert all(p["response"] == "" and "preview" not in p for p in progress)
        assert "".join(line["response"] for line in lines) == "Hello dgemma world"
        final = lines[-1]
        assert final["done"] is True and final["done_reason"] == "stop"
        assert all(isinstance(final[k], int) for k in METRICS)
        assert final["eval_count"] == len("Hello dgemma world") and final["canvases"] == 3
        assert final["denoise_steps"] == 6 and final["context"][-1] > 0
    # Modelfile SYSTEM is rendered; PARAMETER diffusion_steps reached the sampler.
    assert behaviour.last_prompt[-1] == "<system>Be brief.<user>Hi<assistant>"
    assert behaviour.last_sampler[-1].max_steps == 4


def test_generate_preview_and_non_streaming(make_server):
    server, _, _ = make_server(behaviour=FakeBehaviour(answer="abcdefghij", steps=1))
    with client(server) as c:
        lines = ndjson(c.post("/api/generate", json={"model": "tiny", "prompt": "x",
                                                       "options": {"diffusion_preview": True}}))
        previews = [line["preview"] for line in lines if "preview" in line]
        assert previews[0] == "abcdefgh"  # the draft of canvas 1, not inside `response`
        first = next(line for line in lines if "preview" in line)
        assert first["preview_tokens"] == list("abcdefgh") and first["accepted"] == 1
        single = c.post("/api/generate", json={"model": "tiny", "prompt": "x", "stream": False,
                                                "options": {"diffusion_progress": True}})
        body = single.json()
        assert single.headers["content-type"] == "application/json"
        assert body["response"] == "abcdefghij" and body["done"] is True and "completed" not in body


def test_chat_shapes_and_num_predict_and_stop(make_server):
    server, behaviour, _ = make_server(behaviour=FakeBehaviour(answer="one two three four five six"))
    with client(server) as c:
        lines = ndjson(c.post("/api/chat", json={"model": "tiny", "messages": [
            {"role": "SYSTEM", "content": "Own system."}, {"role": "user", "content": "count", "images": []}],
            "options": {"num_predict": 9, "diffusion_progress": True}}))
        assert all(line["message"]["role"] == "assistant" for line in lines)
        assert "".join(line["message"]["content"] for line in lines) == "one two t"
        assert lines[-1]["done_reason"] == "length" and lines[-1]["eval_count"] == 9 and "context" not in lines[-1]
        assert behaviour.last_prompt[-1] == "<system>Own system.<user>count<assistant>"
        body = c.post("/api/chat", json={"model": "tiny", "stream": False, "messages": [{"role": "user", "content": "c"}],
                                         "options": {"stop": ["four"]}}).json()
        assert body["message"]["content"] == "one two three " and body["done_reason"] == "stop"


def test_validation_errors_are_400_with_ollama_texts(make_server):
    server, _, _ = make_server()
    cases = [
        ("/api/generate", None, "missing request body"),
        ("/api/generate", b"{bad", None),
        ("/api/generate", {"model": "tiny", "prompt": "x", "raw": True, "system": "s"},
         "raw mode does not support template, system, or context"),
        ("/api/generate", {"model": "tiny", "prompt": "x", "suffix": "y"},
         "registry.ollama.ai/library/tiny:latest does not support insert"),
        ("/api/generate", {"model": "tiny", "prompt": "x", "images": ["aGk="]},
         "registry.ollama.ai/library/tiny:latest does not support vision"),
        ("/api/generate", {"model": "tiny", "prompt": "x", "format": "yaml"},
         'invalid format: "yaml"; expected "json" or a valid JSON Schema object'),
        ("/api/generate", {"model": "tiny", "prompt": "x", "format": {"type": "nope"}}, "unsupported JSON schema: Unsupported type: nope"),
        ("/api/generate", {"model": "tiny", "prompt": "x", "logprobs": True}, '"tiny" does not support logprobs'),
        ("/api/generate", {"model": "tiny", "prompt": "x", "top_logprobs": 30}, "top_logprobs must be between 0 and 20"),
        ("/api/generate", {"model": "tiny", "prompt": "x", "options": {"top_k": "many"}},
         'option "top_k" must be of type integer'),
        ("/api/generate", {"model": "tiny", "prompt": "x", "steps": 0},
         "invalid value for diffusion_steps: 0 (must be between 1 and 256)"),
        ("/api/generate", {"model": "tiny", "prompt": "x", "keep_alive": "forever"}, None),
        ("/api/chat", {"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}, None),
        ("/api/embed", {"model": "tiny", "input": "x"}, "registry.ollama.ai/library/tiny:latest does not support embedding"),
    ]
    with client(server) as c:
        for path, body, message in cases:
            r = c.post(path, content=body if body is None or isinstance(body, bytes) else json.dumps(body))
            assert r.status_code == 400, (path, body, r.text)
            if message is not None:
                assert r.json() == {"error": message}, (body, r.text)
            else:
                assert isinstance(r.json()["error"], str)
        assert c.post("/api/embed", json={"model": "nope"}).status_code == 404
        assert c.post("/api/push", json={"model": "tiny"}).json() == {"error": "push is not supported"}


def test_unknown_fields_and_options_are_ignored(make_server):
    server, _, _ = make_server()
    with client(server) as c:
        r = c.post("/api/generate", json={"model": "tiny", "prompt": "x", "stream": False, "width": 5, "whatever": [1],
                                          "options": {"mirostat": 1, "tfs_z": 1.0, "penalize_newline": True,
                                                      "top_k": 40, "num_thread": 2}})
        assert r.status_code == 200 and r.json()["done"] is True


def test_load_unload_and_keep_alive(make_server):
    server, behaviour, _ = make_server()
    with client(server) as c:
        body = c.post("/api/generate", json={"model": "tiny", "keep_alive": "1h", "stream": False}).json()
        assert body["done_reason"] == "load" and body["response"] == "" and behaviour.loads == 1
        ps = c.get("/api/ps").json()["models"]
        assert [m["name"] for m in ps] == ["tiny:latest"] and STAMP.match(ps[0]["expires_at"])
        assert ps[0]["context_length"] == 8192
        body = c.post("/api/chat", json={"model": "tiny", "messages": [], "keep_alive": 0}).json()
        assert body["done_reason"] == "unload" and body["message"] == {"role": "assistant", "content": ""}
        assert _eventually(lambda: c.get("/api/ps").json()["models"] == [])
        assert behaviour.closes == 1
        # keep_alive 0 on a real request unloads right after it
        c.post("/api/generate", json={"model": "tiny", "prompt": "x", "keep_alive": 0, "stream": False})
        assert _eventually(lambda: c.get("/api/ps").json()["models"] == [])
        # a short keep_alive expires on its own
        c.post("/api/generate", json={"model": "tiny", "keep_alive": "300ms"})
        assert c.get("/api/ps").json()["models"] != []
        assert _eventually(lambda: c.get("/api/ps").json()["models"] == [], timeout=5)
        # a different num_ctx reloads; unloading a model that is not loaded still answers
        assert c.post("/api/generate", json={"model": "other", "keep_alive": 0}).json()["done_reason"] == "unload"
        assert c.post("/api/generate", json={"model": "missing", "keep_alive": 0}).status_code == 404


def test_max_loaded_models_evicts_idle_model(make_server):
    server, behaviour, _ = make_server()
    with client(server) as c:
        c.post("/api/generate", json={"model": "tiny"})
        c.post("/api/generate", json={"model": "other"})
        assert [m["name"] for m in c.get("/api/ps").json()["models"]] == ["other:latest"]
        assert behaviour.loads == 2 and behaviour.closes == 1
        c.post("/api/generate", json={"model": "other", "options": {"num_ctx": 2048}})
        assert c.get("/api/ps").json()["models"][0]["context_length"] == 2048 and behaviour.loads == 3


def _eventually(predicate, timeout=3.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def _stream_in_thread(url, body, results, key, headers=None):
    def run():
        try:
            with httpx.Client(timeout=60) as c:
                r = c.post(url, json=body, headers=headers)
                results[key] = (r.status_code, r.text)
        except httpx.HTTPError as exc:
            results[key] = (None, repr(exc))

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_queue_overflow_is_503_with_ollama_text_and_health_stays_fast(make_server):
    server, behaviour, _ = make_server(env={"DGEMMA_MAX_QUEUE": "2"},
                                       behaviour=FakeBehaviour(answer="x" * 8, steps=4, step_delay=0.1))
    results: dict = {}
    body = {"model": "tiny", "prompt": "x"}
    threads = [_stream_in_thread(server.url + "/api/generate", body, results, 0)]
    assert _eventually(lambda: behaviour.generations == 1)
    threads += [_stream_in_thread(server.url + "/api/generate", body, results, i) for i in (1, 2)]
    with client(server) as c:
        time.sleep(0.1)
        started = time.perf_counter()
        assert c.get("/api/version").status_code == 200
        assert c.get("/api/tags").status_code == 200
        assert time.perf_counter() - started < 0.5  # served while a generation runs
        r = c.post("/api/generate", json=body)
        assert r.status_code == 503 and r.json() == {"error": BUSY}
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["message"] == BUSY
    for thread in threads:
        thread.join()
    assert [results[i][0] for i in range(3)] == [200, 200, 200]
    assert all(ndjson_text(results[i][1])[-1]["done"] for i in range(3))


def ndjson_text(text):
    return [json.loads(line) for line in text.splitlines() if line]


def test_disconnect_frees_the_model_within_one_step(make_server):
    step = 0.2
    server, behaviour, _ = make_server(behaviour=FakeBehaviour(answer="y" * 200, steps=50, step_delay=step))
    with httpx.Client(base_url=server.url, timeout=30) as c:
        with c.stream("POST", "/api/generate", json={"model": "tiny", "prompt": "x",
                                                     "options": {"diffusion_progress": True}}) as r:
            lines = r.iter_lines()
            first = json.loads(next(lines))
            assert first["completed"] == 1
            left_at = time.perf_counter()
        # The client is gone: the worker stops at its next step and the second request starts right away.
        assert _eventually(lambda: behaviour.finished_at, timeout=5)
        assert behaviour.finished_at[0] - left_at < step + 0.15
        behaviour.steps, behaviour.step_delay = 1, 0.0
        started = time.perf_counter()
        second = c.post("/api/generate", json={"model": "tiny", "prompt": "x", "stream": False})
        assert second.status_code == 200 and second.json()["done"]
        assert time.perf_counter() - started < 2 * step + 0.5


def test_non_streaming_disconnect_also_cancels(make_server):
    server, behaviour, _ = make_server(behaviour=FakeBehaviour(answer="z" * 200, steps=50, step_delay=0.1))
    with httpx.Client(base_url=server.url, timeout=0.5) as c:
        with pytest.raises(httpx.ReadTimeout):
            c.post("/api/generate", json={"model": "tiny", "prompt": "x", "stream": False})
    left_at = time.perf_counter()
    assert _eventually(lambda: behaviour.finished_at, timeout=3)
    assert behaviour.finished_at[0] - left_at < 0.25 + 0.1 + 0.15  # one poll interval + one step


def test_client_leaving_the_queue_is_dropped(make_server):
    server, behaviour, _ = make_server(behaviour=FakeBehaviour(answer="q" * 16, steps=10, step_delay=0.1))
    results: dict = {}
    first = _stream_in_thread(server.url + "/api/generate", {"model": "tiny", "prompt": "x"}, results, 0)
    assert _eventually(lambda: behaviour.generations == 1)
    with httpx.Client(base_url=server.url, timeout=0.4) as c:
        with pytest.raises(httpx.ReadTimeout):
            c.post("/api/generate", json={"model": "tiny", "prompt": "queued"})
    first.join()
    time.sleep(0.3)
    assert behaviour.generations == 1  # the queued request never ran
    assert results[0][0] == 200


def test_worker_crash_is_an_error_line_and_reloads(make_server):
    server, behaviour, _ = make_server(behaviour=FakeBehaviour(crash_at_step=1))
    with client(server) as c:
        lines = ndjson(c.post("/api/generate", json={"model": "tiny", "prompt": "x",
                                                     "options": {"diffusion_progress": True}}))
        assert lines[-1] == {"error": "internal server error"}  # no internals, no paths
        r = c.post("/api/generate", json={"model": "tiny", "prompt": "x", "stream": False})
        assert r.status_code == 500 and "/secret" not in r.text
        behaviour.crash_at_step = None
        assert c.post("/api/generate", json={"model": "tiny", "prompt": "x", "stream": False}).json()["done"]
        assert behaviour.loads >= 2  # the crashed runner was expired and reloaded


def test_prompt_too_long_and_truncation(make_server):
    server, _, _ = make_server()
    with client(server) as c:
        r = c.post("/api/generate", json={"model": "tiny", "prompt": "x" * 100, "truncate": False,
                                          "options": {"num_ctx": 64}})
        assert r.status_code == 400 and "leaves no room for a diffusion canvas (8 tokens)" in r.json()["error"]
        r = c.post("/api/generate", json={"model": "tiny", "prompt": "x" * 100, "stream": False,
                                          "options": {"num_ctx": 64}})
        assert r.status_code == 200  # truncated to its end, as Ollama does by default
        history = [{"role": "user", "content": "old " * 10}, {"role": "assistant", "content": "a"},
                   {"role": "user", "content": "new"}]
        r = c.post("/api/chat", json={"model": "tiny", "messages": history, "stream": False, "options": {"num_ctx": 64}})
        assert r.status_code == 200
        r = c.post("/api/chat", json={"model": "tiny", "messages": history, "stream": False, "truncate": False,
                                      "options": {"num_ctx": 64}})
        assert r.status_code == 400


def test_over_long_latest_message_keeps_its_end_and_generate_truncates_when_asked(make_server):
    server, behaviour, _ = make_server()
    with client(server) as c:
        r = c.post("/api/chat", json={"model": "tiny", "stream": False, "options": {"num_ctx": 64},
                                      "messages": [{"role": "user", "content": "old"},
                                                   {"role": "user", "content": "y" * 100 + "END"}]})
        assert r.status_code == 200
        prompt = behaviour.last_prompt[-1]
        assert len(prompt) == 64 - 8 and prompt.startswith("<system>Be brief.<user>y")
        assert prompt.endswith("yEND<assistant>")
        r = c.post("/api/generate", json={"model": "tiny", "prompt": "x" * 100 + "END", "truncate": True,
                                          "stream": False, "options": {"num_ctx": 64}})
        assert r.status_code == 200 and len(behaviour.last_prompt[-1]) == 64 - 8
        assert behaviour.last_prompt[-1].endswith("xEND<assistant>")


def test_openai_chat_completions_shapes(make_server):
    server, behaviour, _ = make_server(behaviour=FakeBehaviour(answer="Paris is big."))
    with client(server) as c:
        body = c.post("/v1/chat/completions", json={"model": "tiny", "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Capital?"}]}], "max_tokens": 5}).json()
        assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
        assert body["choices"][0]["message"] == {"role": "assistant", "content": "Paris"}
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == 5
        # no implicit temperature is forwarded: the sampler got the model's schedule
        assert behaviour.last_sampler[-1].t_max == pytest.approx(0.8)
        r = c.post("/v1/chat/completions", json={"model": "tiny", "stream": True, "stream_options": {"include_usage": True},
                                                 "messages": [{"role": "user", "content": "Capital?"}]})
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [e[len("data: "):] for e in r.text.split("\n\n") if e]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert len({c_["id"] for c_ in chunks}) == 1
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        assert "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks if ch["choices"]) == "Paris is big."
        assert chunks[-2]["choices"][0]["finish_reason"] == "stop" and chunks[-1]["choices"] == []
        assert chunks[-1]["usage"]["completion_tokens"] == len("Paris is big.")
        for bad, status in [({"model": "tiny", "messages": []}, 400),
                            ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "n": 2}, 400),
                            ({"model": "tiny", "messages": [{"role": "user", "content": [
                                {"type": "image_url", "image_url": {"url": "data:"}}]}]}, 400),
                            ({"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404)]:
            r = c.post("/v1/chat/completions", json=bad)
            assert r.status_code == status
            error = r.json()["error"]
            assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
            assert set(error) == {"message", "type", "param", "code"}


def test_openai_completions_and_models(make_server):
    server, _, _ = make_server(behaviour=FakeBehaviour(answer="42"))
    with client(server) as c:
        body = c.post("/v1/completions", json={"model": "tiny", "prompt": "Answer?"}).json()
        assert body["object"] == "text_completion" and body["choices"][0]["text"] == "42"
        assert c.post("/v1/completions", json={"model": "tiny", "prompt": "a", "suffix": "b"}).status_code == 400
        models = c.get("/v1/models").json()
        assert models["object"] == "list" and {m["id"] for m in models["data"]} == {"tiny:latest", "other:latest"}
        assert all(m["owned_by"] == "library" for m in models["data"])
        assert c.get("/v1/models/tiny:latest").json()["id"] == "tiny:latest"
        assert c.get("/v1/models/library/tiny").json()["id"] == "tiny:latest"
        assert c.get("/v1/models/hf.co/u/nope:Q4").status_code == 404


def test_per_request_go_template(make_server):
    server, behaviour, _ = make_server()
    with client(server) as c:
        r = c.post("/api/generate", json={"model": "tiny", "prompt": "hi", "stream": False,
                                          "template": "[{{ .System }}]{{ if .Prompt }}Q:{{ .Prompt }}{{ end }} A:"})
        assert r.status_code == 200
        assert behaviour.last_prompt[-1] == "[Be brief.]Q:hi A:"
        r = c.post("/api/generate", json={"model": "tiny", "prompt": "hi", "template": "{{ range .Messages }}{{ end }}"})
        assert r.status_code == 400 and r.json()["error"].startswith("template error")
        r = c.post("/api/generate", json={"model": "tiny", "prompt": "hi", "raw": True, "stream": False})
        assert r.status_code == 200 and behaviour.last_prompt[-1] == "hi" and "context" not in r.json()


def test_thinking_goes_to_its_own_field(make_server):
    answer = "<|channel>thought\nweigh options<channel|>Final answer."
    server, behaviour, _ = make_server(behaviour=FakeBehaviour(answer=answer))
    with client(server) as c:
        body = c.post("/api/chat", json={"model": "tiny", "think": True, "stream": False,
                                         "messages": [{"role": "user", "content": "q"}]}).json()
        assert body["message"] == {"role": "assistant", "content": "Final answer.", "thinking": "weigh options"}
        assert behaviour.last_prompt[-1].endswith("<think><assistant>")  # the template's thinking switch was on
        lines = ndjson(c.post("/api/generate", json={"model": "tiny", "prompt": "q", "think": "high"}))
        assert "".join(line.get("thinking", "") for line in lines) == "weigh options"
        assert "".join(line["response"] for line in lines) == "Final answer."
        oai = c.post("/v1/chat/completions", json={"model": "tiny", "reasoning_effort": "low",
                                                   "messages": [{"role": "user", "content": "q"}]}).json()
        assert oai["choices"][0]["message"] == {"role": "assistant", "content": "Final answer.",
                                                "reasoning": "weigh options"}
        plain = c.post("/api/chat", json={"model": "tiny", "think": False, "stream": False,
                                          "messages": [{"role": "user", "content": "q"}]}).json()
        assert plain["message"]["content"] == answer  # not asked to think: the text is left alone
        assert c.post("/api/chat", json={"model": "tiny", "think": "very", "messages": [
            {"role": "user", "content": "q"}]}).status_code == 400
    behaviour.has_thinking = False
    with client(server) as c:
        c.post("/api/generate", json={"model": "tiny", "keep_alive": 0})  # reload with the new behaviour
        r = c.post("/api/chat", json={"model": "tiny", "think": True, "messages": [{"role": "user", "content": "q"}]})
        assert r.status_code == 400 and r.json() == {"error": '"tiny" does not support thinking'}


def test_open_webui_request_shapes(make_server):
    """Open WebUI: int() of each version part, ps parsed with fromisoformat, unload via empty prompt + keep_alive 0."""
    from datetime import datetime

    server, _, _ = make_server()
    with client(server) as c:
        assert all(int(part) >= 0 for part in c.get("/api/version").json()["version"].split("."))
        c.post("/api/generate", json={"model": "tiny", "keep_alive": -1, "stream": False})
        ps = c.get("/api/ps").json()["models"]
        forever = datetime.fromisoformat(ps[0]["expires_at"])
        assert forever.year > datetime.now().year + 200  # "forever" shows ~290 years ahead
        r = c.post("/api/generate", json={"model": "tiny", "prompt": "", "keep_alive": 0, "stream": False})
        assert r.json()["done_reason"] == "unload"
        assert _eventually(lambda: c.get("/api/ps").json()["models"] == [])
        for model in c.get("/api/tags").json()["models"]:
            datetime.fromisoformat(model["modified_at"])


def test_sse_error_event_after_the_first_byte(make_server):
    server, behaviour, _ = make_server(behaviour=FakeBehaviour(answer="a" * 20, crash_at_step=2))
    with client(server) as c:
        r = c.post("/v1/chat/completions", json={"model": "tiny", "stream": True,
                                                 "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 200
        events = [e[len("data: "):] for e in r.text.split("\n\n") if e]
        assert json.loads(events[0])["choices"][0]["delta"]["role"] == "assistant"
        assert json.loads(events[-1]) == {"error": {"message": "internal server error", "type": "api_error",
                                                    "param": None, "code": None}}


def test_load_timeout_is_a_500_and_the_load_still_completes(make_server):
    server, behaviour, _ = make_server(env={"DGEMMA_LOAD_TIMEOUT": "300ms"}, behaviour=FakeBehaviour(load_delay=1.0))
    with client(server) as c:
        r = c.post("/api/generate", json={"model": "tiny", "prompt": "x", "stream": False})
        assert r.status_code == 500 and r.json() == {"error": "timed out waiting for model to load"}
        assert _eventually(lambda: behaviour.loads == 1, timeout=5)
        assert c.post("/api/generate", json={"model": "tiny", "prompt": "x", "stream": False}).json()["done"]
        assert behaviour.loads == 1  # the finished load is reused


def test_other_model_waits_for_the_busy_one_then_evicts_it(make_server):
    server, behaviour, _ = make_server(behaviour=FakeBehaviour(answer="w" * 16, steps=5, step_delay=0.06))
    results: dict = {}
    first = _stream_in_thread(server.url + "/api/generate", {"model": "tiny", "prompt": "x"}, results, "tiny")
    assert _eventually(lambda: behaviour.generations == 1)
    with client(server) as c:
        assert c.get("/api/ps").json()["models"][0]["name"] == "tiny:latest"
        r = c.post("/api/generate", json={"model": "other", "prompt": "y", "stream": False})
        assert r.status_code == 200 and r.json()["done"]
        assert behaviour.loaded_at[1] >= behaviour.finished_at[0]  # `other` loaded only after tiny's generation
        assert [m["name"] for m in c.get("/api/ps").json()["models"]] == ["other:latest"]
    first.join()
    assert results["tiny"][0] == 200 and ndjson_text(results["tiny"][1])[-1]["done"]
    assert behaviour.loads == 2 and behaviour.closes == 1


def test_bad_options_are_refused_before_any_model_load(make_server):
    server, behaviour, _ = make_server()
    with client(server) as c:
        for options in [{"diffusion_steps": 0}, {"diffusion_t_min": 0.9, "diffusion_t_max": 0.5},
                        {"diffusion_entropy_bound": -1}, {"num_ctx": 0}]:
            r = c.post("/api/generate", json={"model": "tiny", "prompt": "x", "options": options})
            assert r.status_code == 400, options
    assert behaviour.loads == 0


def test_a_running_non_streaming_request_is_not_pending(make_server):
    """Queue limit 1: one non-streaming request running, one waiting, the third is refused (the running one no
    longer counts once it holds the slot)."""
    server, behaviour, _ = make_server(env={"DGEMMA_MAX_QUEUE": "1"},
                                       behaviour=FakeBehaviour(answer="n" * 8, steps=6, step_delay=0.1))
    results: dict = {}
    body = {"model": "tiny", "prompt": "x", "stream": False}
    threads = [_stream_in_thread(server.url + "/api/generate", body, results, 0)]
    assert _eventually(lambda: behaviour.generations == 1)
    threads.append(_stream_in_thread(server.url + "/api/generate", body, results, 1))
    time.sleep(0.2)
    with client(server) as c:
        assert c.post("/api/generate", json=body).status_code == 503
    for thread in threads:
        thread.join()
    assert results[0][0] == 200 and results[1][0] == 200


def test_num_parallel_runs_generations_side_by_side(make_server):
    server, behaviour, _ = make_server(env={"DGEMMA_NUM_PARALLEL": "2"},
                                       behaviour=FakeBehaviour(answer="p" * 8, steps=5, step_delay=0.08))
    results: dict = {}
    threads = [_stream_in_thread(server.url + "/api/generate", {"model": "tiny", "prompt": "x"}, results, i)
               for i in range(3)]
    assert _eventually(lambda: behaviour.generations == 2)
    assert behaviour.finished_at == [] and behaviour.generations == 2  # two at once, the third waits
    for thread in threads:
        thread.join()
    assert [results[i][0] for i in range(3)] == [200, 200, 200] and behaviour.loads == 1


def test_a_models_num_parallel_parameter_sets_its_slots(make_server):
    """`PARAMETER num_parallel 2` gives that model two slots on a server whose default is one; `other` keeps one."""
    server, behaviour, store = make_server(behaviour=FakeBehaviour(answer="p" * 8, steps=5, step_delay=0.08))
    add_model(store, "pair", store.resolve("tiny").gguf_path, parameters={"num_parallel": 2})
    for name, side_by_side in (("pair", 2), ("other", 1)):
        results: dict = {}
        before = behaviour.generations
        threads = [_stream_in_thread(server.url + "/api/generate", {"model": name, "prompt": "x"}, results, i)
                   for i in range(3)]
        assert _eventually(lambda: behaviour.generations - before == side_by_side)
        time.sleep(0.1)
        assert behaviour.generations - before == side_by_side  # the rest wait for a slot
        for thread in threads:
            thread.join()
        assert [results[i][0] for i in range(3)] == [200, 200, 200]


def test_langchain_chatollama_request_shape(make_server):
    """The body LangChain's ChatOllama sends by default: every Ollama option present (mostly null), empty images,
    empty tools, format "" and keep_alive null. It must be accepted, and the final chunk carries the usage counts."""
    server, _, _ = make_server(behaviour=FakeBehaviour(answer="Hello there."))
    options = {name: None for name in ("mirostat", "mirostat_eta", "mirostat_tau", "num_ctx", "num_gpu", "num_thread",
                                       "num_predict", "repeat_last_n", "repeat_penalty", "temperature", "seed", "stop",
                                       "tfs_z", "top_k", "top_p")}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi", "images": []}], "stream": True,
            "options": options, "tools": [], "format": "", "keep_alive": None, "think": None}
    with client(server) as c:
        lines = ndjson(c.post("/api/chat", json=body))
        assert "".join(line["message"]["content"] for line in lines) == "Hello there."
        assert lines[-1]["prompt_eval_count"] > 0 and lines[-1]["eval_count"] == len("Hello there.")
