"""The real `ollama` Python client, unchanged, against `dgemma serve` (a subprocess) running the tiny fixture model.

The model gets into the store the way users do it: `create_blob` + `create(files=...)` through the server; `pull`
goes through the server to the test registry (tests/registry_server.py).
"""
import threading
import time

import ollama
import pytest

from dgemma_cli.server.config import ServerConfig
from registry_server import FakeRegistry
from server_harness import FakeBehaviour, InProcessServer, ServeProcess, fake_factory

FAST = {"diffusion_steps": 4, "seed": 7, "num_predict": 16}
MEDIA_MODEL = "application/vnd.ollama.image.model"


@pytest.fixture(scope="module")
def tiny_gguf(gguf_path):
    return gguf_path("tiny-a", "f32")


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_gguf):
    root = tmp_path_factory.mktemp("ollama-client")
    with FakeRegistry() as registry:
        env = {"DGEMMA_REGISTRY_ALLOW": registry.host, "DGEMMA_NOPRUNE": "1"}
        with ServeProcess(root / "models", env) as server:
            client = ollama.Client(host=server.url)
            digest = client.create_blob(tiny_gguf)
            statuses = [p.status for p in client.create(model="tiny", files={"tiny-a.gguf": digest}, stream=True)]
            assert statuses[-1] == "success"
            yield server, client, registry


def test_list_and_show(served):
    _, client, _ = served
    names = [m.model for m in client.list().models]
    assert "tiny:latest" in names
    listed = next(m for m in client.list().models if m.model == "tiny:latest")
    assert listed.details.family == "diffusion-gemma" and listed.size > 0 and listed.modified_at is not None
    show = client.show("tiny")
    assert show.modelinfo["general.architecture"] == "diffusion-gemma"
    assert show.modelinfo["diffusion-gemma.context_length"] > 0
    assert "completion" in show.capabilities and show.template


def test_generate_non_streaming_is_deterministic_with_a_seed(served):
    _, client, _ = served
    first = client.generate(model="tiny", prompt="Hello", options=FAST)
    second = client.generate(model="tiny", prompt="Hello", options=FAST)
    assert first.done and first.done_reason in ("stop", "length")
    assert first.response == second.response
    assert 0 <= first.eval_count <= 16 and first.prompt_eval_count > 0 and first.total_duration > 0
    assert first.context and len(first.context) >= first.prompt_eval_count


def test_generate_streaming_matches_non_streaming(served):
    _, client, _ = served
    parts = list(client.generate(model="tiny", prompt="Hello", options=FAST, stream=True))
    assert parts[-1].done and all(not p.done for p in parts[:-1])
    whole = client.generate(model="tiny", prompt="Hello", options=FAST)
    assert "".join(p.response for p in parts) == whole.response and parts[-1].eval_count == whole.eval_count


def test_generate_steps_argument_and_progress(served):
    _, client, _ = served
    parts = list(client.generate(model="tiny", prompt="Hi", steps=3, stream=True,
                                 options={"seed": 1, "num_predict": 16, "diffusion_progress": True}))
    progress = [p for p in parts if getattr(p, "completed", None) is not None]
    assert progress and all(p["total"] == 3 and p.response == "" for p in progress)


def test_chat_streaming_and_not(served):
    _, client, _ = served
    messages = [{"role": "user", "content": "Say hi"}]
    reply = client.chat(model="tiny", messages=messages, options=FAST)
    assert reply.message.role == "assistant" and reply.done and isinstance(reply.message.content, str)
    parts = list(client.chat(model="tiny", messages=messages, options=FAST, stream=True))
    assert all(p.message.role == "assistant" for p in parts)
    assert "".join(p.message.content for p in parts) == reply.message.content
    assert parts[-1].eval_count == reply.eval_count


def test_ps_shows_the_loaded_model(served):
    _, client, _ = served
    client.generate(model="tiny", prompt="x", options=FAST, keep_alive="10m")
    running = client.ps().models
    assert [m.model for m in running] == ["tiny:latest"]
    assert running[0].expires_at is not None and running[0].context_length > 0


def test_copy_and_delete(served):
    _, client, _ = served
    assert client.copy("tiny", "tiny-copy").status == "success"
    assert "tiny-copy:latest" in [m.model for m in client.list().models]
    assert client.generate(model="tiny-copy").done_reason == "load"  # the copy resolves and loads
    assert client.delete("tiny-copy").status == "success"
    assert "tiny-copy:latest" not in [m.model for m in client.list().models]
    with pytest.raises(ollama.ResponseError) as err:
        client.delete("tiny-copy")
    assert err.value.status_code == 404


def test_pull_from_the_test_registry(served, tiny_gguf):
    _, client, registry = served
    config = {"model_format": "gguf", "model_family": "diffusion-gemma", "model_families": ["diffusion-gemma"]}
    registry.add_model("library/pulled:latest", [(MEDIA_MODEL, tiny_gguf.read_bytes())], config=config)
    name = f"{registry.host}/library/pulled:latest"
    statuses = [p.status for p in client.pull(name, insecure=True, stream=True)]
    assert statuses[0] == "pulling manifest" and statuses[-1] == "success"
    assert client.pull(name, insecure=True).status == "success"  # non-streaming, blobs already present
    assert name in [m.model for m in client.list().models]
    assert client.generate(model=name).done_reason == "load"  # the pulled GGUF loads in the engine
    with pytest.raises(ollama.ResponseError) as err:
        client.pull(f"{registry.host}/library/absent:latest", insecure=True)
    assert err.value.status_code == 404


def test_errors_raise_response_error(served):
    _, client, _ = served
    with pytest.raises(ollama.ResponseError) as err:
        client.show("does-not-exist")
    assert err.value.status_code == 404 and "not found" in err.value.error
    with pytest.raises(ollama.ResponseError) as err:
        client.generate(model="tiny", prompt="x", options={"diffusion_steps": 0})
    assert err.value.status_code == 400 and "diffusion_steps" in err.value.error


def test_malicious_template_in_a_stored_model_fails_safely(served):
    """A Jinja template that tries to escape the sandbox (as a pulled model could carry) never runs code: a 400 naming
    the refusal, as every rendering failure is."""
    server, client, _ = served
    from dgemma_cli.store import Store
    from server_harness import add_model

    store = Store(server.env["DGEMMA_MODELS"])
    local = store.resolve("tiny")
    add_model(store, "evil-template", local.gguf_path,
              template="{{ cycler.__init__.__globals__.os.popen('id').read() }}{% for m in messages %}{% endfor %}")
    with pytest.raises(ollama.ResponseError) as err:
        client.chat(model="evil-template", messages=[{"role": "user", "content": "x"}], options=FAST)
    assert err.value.status_code == 400
    assert err.value.error.startswith("template error: SecurityError: access to attribute '__init__' of a ")
    assert client.generate(model="tiny", prompt="still up", options=FAST).done


def test_api_key_via_ollama_api_key(tmp_path, monkeypatch, tiny_gguf):
    with ServeProcess(tmp_path / "models", {"DGEMMA_API_KEY": "k3y", "DGEMMA_NOPRUNE": "1"}) as server:
        monkeypatch.delenv("OLLAMA_API_KEY", raising=False)
        with pytest.raises(ollama.ResponseError) as err:
            ollama.Client(host=server.url).list()
        assert err.value.status_code == 401
        monkeypatch.setenv("OLLAMA_API_KEY", "k3y")
        assert ollama.Client(host=server.url).list().models == []


# ---- fault injection (a fake runner behind the scheduler; the client is still the real one) -------------------------

@pytest.fixture
def fake_served(tmp_path):
    from dgemma_cli.store import Store
    from server_harness import add_model, write_small_gguf

    store = Store(tmp_path / "models")
    add_model(store, "tiny", write_small_gguf(tmp_path / "t.gguf"))
    behaviour = FakeBehaviour(answer="a" * 20, steps=5, step_delay=0.04)
    config = ServerConfig.from_env({"DGEMMA_MODELS": str(store.root), "DGEMMA_MAX_QUEUE": "1"})
    with InProcessServer(config, store, fake_factory(behaviour)) as server:
        yield server, behaviour


def test_response_error_on_503_and_mid_stream_error(fake_served):
    server, behaviour = fake_served
    client = ollama.Client(host=server.url)
    background = [threading.Thread(target=lambda: client.generate(model="tiny", prompt="x")) for _ in range(2)]
    background[0].start()
    deadline = time.monotonic() + 5
    while behaviour.generations == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    background[1].start()  # waits in the queue (limit 1)
    time.sleep(0.2)
    with pytest.raises(ollama.ResponseError) as err:
        client.generate(model="tiny", prompt="x")
    assert err.value.status_code == 503
    assert err.value.error == "server busy, please try again.  maximum pending requests exceeded"
    for thread in background:
        thread.join()
    behaviour.crash_at_step = 2
    with pytest.raises(ollama.ResponseError) as err:
        list(client.generate(model="tiny", prompt="x", stream=True, options={"diffusion_progress": True}))
    assert err.value.error == "internal server error"


# ---- truncation and tools -------------------------------------------------------------------------------------------

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
GEMMA4_CALL = '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'


def long_history(turns: int) -> list[dict]:
    history = [{"role": "system", "content": "SYSTEM-PROMPT keep me"}]
    history += [{"role": "user" if i % 2 == 0 else "assistant", "content": f"old message {i} " * 3}
                for i in range(turns)]
    return history + [{"role": "user", "content": "LATEST question"}]


def test_long_history_is_truncated_and_answered(served):
    """500 messages are far beyond the tiny model's 1,024-token window: the oldest are dropped (logged)."""
    server, client, _ = served
    reply = client.chat(model="tiny", messages=long_history(500), options=FAST)
    assert reply.done and reply.prompt_eval_count <= 1024 - 16
    assert "truncating the prompt to fit the context window" in server.logs()
    streamed = list(client.chat(model="tiny", messages=long_history(500), options=FAST, stream=True))
    assert streamed[-1].done


def test_truncate_false_gives_the_no_room_error(served):
    _, client, _ = served
    body = {"model": "tiny", "messages": long_history(500), "truncate": False, "stream": False, "options": FAST}
    with pytest.raises(ollama.ResponseError) as err:
        client._request(ollama.ChatResponse, "POST", "/api/chat", json=body)  # the client has no `truncate` argument
    assert err.value.status_code == 400
    assert "leaves no room for a diffusion canvas (16 tokens) within the context window (1024 tokens)" in err.value.error


def test_truncation_keeps_the_system_prompt_and_the_latest_message(fake_served):
    server, behaviour = fake_served
    behaviour.step_delay = 0
    client = ollama.Client(host=server.url)
    reply = client.chat(model="tiny", messages=long_history(3000), options={"num_ctx": 512})
    assert reply.done
    prompt = behaviour.last_prompt[-1]
    assert prompt.startswith("<system>SYSTEM-PROMPT keep me<") and prompt.endswith("<user>LATEST question<assistant>")
    assert "old message 2999" in prompt and "old message 0 " not in prompt and len(prompt) <= 512 - 8


def test_tools_with_the_tiny_model_are_accepted(served):
    """The random model writes no real call; the answer is a well-formed 200 either way (the accept path)."""
    _, client, _ = served
    assert "tools" in client.show("tiny").capabilities  # the fixture template declares tools
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    reply = client.chat(model="tiny", messages=messages, tools=[WEATHER_TOOL], options=FAST)
    assert reply.done and isinstance(reply.message.content, str)
    for call in reply.message.tool_calls or []:
        assert isinstance(call.function.name, str) and isinstance(call.function.arguments, dict)
    parts = list(client.chat(model="tiny", messages=messages, tools=[WEATHER_TOOL], options=FAST, stream=True))
    assert parts[-1].done


def test_tool_call_is_parsed_with_a_scripted_answer(fake_served):
    server, behaviour = fake_served
    behaviour.answer, behaviour.step_delay = "Checking." + GEMMA4_CALL, 0
    client = ollama.Client(host=server.url)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    reply = client.chat(model="tiny", messages=messages, tools=[WEATHER_TOOL])
    assert reply.message.content == "Checking."
    [call] = reply.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == {"city": "Paris"}
    parts = list(client.chat(model="tiny", messages=messages, tools=[WEATHER_TOOL], stream=True))
    assert "".join(p.message.content for p in parts) == "Checking."
    calls = [c for p in parts for c in p.message.tool_calls or []]
    assert [(c.function.name, c.function.arguments) for c in calls] == [("get_weather", {"city": "Paris"})]
    follow_up = messages + [reply.message.model_dump(exclude_none=True),
                            {"role": "tool", "content": "sunny", "tool_name": "get_weather"}]
    client.chat(model="tiny", messages=follow_up, tools=[WEATHER_TOOL])
    assert behaviour.last_prompt[-1].endswith("<assistant>Checking.<call:get_weather><tool:get_weather>sunny<assistant>")
