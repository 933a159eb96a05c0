"""The real `openai` Python client, unchanged, against `dgemma serve` (a subprocess) running the tiny fixture model."""
import openai
import pytest

from server_harness import ServeProcess

@pytest.fixture(scope="module")
def served(tmp_path_factory, gguf_path):
    import ollama

    root = tmp_path_factory.mktemp("openai-client")
    with ServeProcess(root / "models", {"DGEMMA_NOPRUNE": "1"}) as server:
        setup = ollama.Client(host=server.url)
        digest = setup.create_blob(gguf_path("tiny-a", "f32"))
        # PARAMETER diffusion_steps 4 keeps each request short: OpenAI requests carry no diffusion options.
        setup.create(model="tiny", files={"tiny-a.gguf": digest}, parameters={"diffusion_steps": 4})
        setup.create(model="hf.co/someone/tiny-GGUF:Q8_0", from_="tiny", parameters={"diffusion_steps": 4})
        yield server, openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_chat_completion_non_streaming(served):
    _, client = served
    completion = client.chat.completions.create(
        model="tiny", messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        max_tokens=16, seed=3)
    assert completion.object == "chat.completion" and completion.id.startswith("chatcmpl-")
    choice = completion.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert completion.usage.prompt_tokens > 0 and 0 <= completion.usage.completion_tokens <= 16
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + completion.usage.completion_tokens
    again = client.chat.completions.create(
        model="tiny", messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        max_tokens=16, seed=3)
    assert again.choices[0].message.content == choice.message.content  # same seed, same answer


def test_chat_completion_streaming_with_usage(served):
    _, client = served
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=16, seed=3)
    stream = client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1 and all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes in (["stop"], ["length"])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 0
    assert text == client.chat.completions.create(**kwargs).choices[0].message.content


def test_completions(served):
    _, client = served
    completion = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=16, seed=5)
    assert completion.object == "text_completion" and isinstance(completion.choices[0].text, str)
    streamed = list(client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=16, seed=5,
                                              stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == completion.choices[0].text


def test_models_list_and_retrieve(served):
    _, client = served
    ids = {m.id for m in client.models.list()}
    assert {"tiny:latest", "hf.co/someone/tiny-GGUF:Q8_0"} <= ids
    model = client.models.retrieve("hf.co/someone/tiny-GGUF:Q8_0")
    assert model.id == "hf.co/someone/tiny-GGUF:Q8_0" and model.owned_by == "someone"
    assert client.models.retrieve("tiny").owned_by == "library"


def test_error_objects_raise_the_right_exceptions(served):
    _, client = served
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="missing", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], n=2)
    assert err.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("missing")


def test_mid_stream_error_raises_and_503_is_an_api_error(tmp_path):
    """Fault injection through the scheduler's runner interface (fake runner); the client is the real one."""
    import threading
    import time

    from dgemma_cli.server.config import ServerConfig
    from dgemma_cli.store import Store
    from server_harness import FakeBehaviour, InProcessServer, add_model, fake_factory, write_small_gguf

    store = Store(tmp_path / "models")
    add_model(store, "tiny", write_small_gguf(tmp_path / "t.gguf"))
    behaviour = FakeBehaviour(answer="b" * 16, steps=5, step_delay=0.05, crash_at_step=3)
    config = ServerConfig.from_env({"DGEMMA_MODELS": str(store.root), "DGEMMA_MAX_QUEUE": "1"})
    with InProcessServer(config, store, fake_factory(behaviour)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.APIError, match="internal server error"):
            list(client.chat.completions.create(model="tiny", stream=True, messages=[{"role": "user", "content": "x"}]))
        behaviour.crash_at_step = None
        busy = [threading.Thread(target=lambda: client.completions.create(model="tiny", prompt="x")) for _ in range(2)]
        busy[0].start()
        deadline = time.monotonic() + 10
        while behaviour.generations < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        busy[1].start()
        time.sleep(0.2)
        with pytest.raises(openai.InternalServerError) as err:  # 503
            client.completions.create(model="tiny", prompt="x")
        assert err.value.status_code == 503
        for thread in busy:
            thread.join()


# ---- truncation and tools -------------------------------------------------------------------------------------------

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def long_history(turns: int) -> list[dict]:
    history = [{"role": "system", "content": "SYSTEM-PROMPT keep me"}]
    history += [{"role": "user" if i % 2 == 0 else "assistant", "content": f"old message {i} " * 3}
                for i in range(turns)]
    return history + [{"role": "user", "content": "LATEST question"}]


@pytest.fixture
def fake_served(tmp_path):
    from dgemma_cli.server.config import ServerConfig
    from dgemma_cli.store import Store
    from server_harness import FakeBehaviour, InProcessServer, add_model, fake_factory, write_small_gguf

    store = Store(tmp_path / "models")
    add_model(store, "tiny", write_small_gguf(tmp_path / "t.gguf"))
    behaviour = FakeBehaviour(answer="fine")
    config = ServerConfig.from_env({"DGEMMA_MODELS": str(store.root)})
    with InProcessServer(config, store, fake_factory(behaviour)) as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0), behaviour


def test_long_history_is_truncated_and_answered(served):
    server, client = served
    completion = client.chat.completions.create(model="tiny", messages=long_history(500), max_tokens=16, seed=3)
    assert completion.choices[0].finish_reason in ("stop", "length") and completion.usage.prompt_tokens <= 1024 - 16
    assert "truncating the prompt to fit the context window" in server.logs()
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=long_history(500), max_tokens=16,
                                       extra_body={"truncate": False})
    assert "leaves no room for a diffusion canvas (16 tokens)" in err.value.body["message"]


def test_truncation_keeps_the_system_prompt_and_the_latest_message(fake_served):
    client, behaviour = fake_served
    stream = client.chat.completions.create(model="tiny", messages=long_history(3000), stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == "fine"
    prompt = behaviour.last_prompt[-1]
    assert prompt.startswith("<system>SYSTEM-PROMPT keep me<") and prompt.endswith("<user>LATEST question<assistant>")
    assert "old message 2999" in prompt and "old message 0 " not in prompt and len(prompt) <= 8192 - 8


def test_tools_with_the_tiny_model_are_accepted(served):
    _, client = served
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER_TOOL],
                  max_tokens=16, seed=3)
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls") and isinstance(choice.message.content, str)
    for call in choice.message.tool_calls or []:
        assert call.id.startswith("call_") and call.type == "function" and isinstance(call.function.arguments, str)
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert chunks[-1].choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_tool_call_is_parsed_with_a_scripted_answer(fake_served):
    import json

    client, behaviour = fake_served
    behaviour.answer = 'Checking.<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    choice = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER_TOOL]).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER_TOOL], stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Checking."
    deltas = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
    assert len(deltas) == 1 and deltas[0].index == 0 and deltas[0].function.name == "get_weather"
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    follow_up = messages + [choice.message.model_dump(exclude_none=True),
                            {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    client.chat.completions.create(model="tiny", messages=follow_up, tools=[WEATHER_TOOL])
    assert behaviour.last_prompt[-1].endswith("<assistant>Checking.<call:get_weather><tool:get_weather>sunny<assistant>")


# ---- the Responses API with tools -----------------------------------------------------------------------------------

RESPONSES_TOOL = {"type": "function", "name": "get_weather", "description": "Current weather of a city",
                  "parameters": WEATHER_TOOL["function"]["parameters"]}


def test_responses_function_call_is_parsed_and_answered(fake_served):
    import json

    client, behaviour = fake_served
    behaviour.answer = 'Checking.<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'
    response = client.responses.create(model="tiny", input="Weather in Paris?", tools=[RESPONSES_TOOL])
    assert [item.type for item in response.output] == ["message", "function_call"]
    assert response.output_text == "Checking." and response.status == "completed"
    call = response.output[1]
    assert call.call_id.startswith("call_") and call.id.startswith("fc_") and call.status == "completed"
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert response.tools[0].name == "get_weather" and behaviour.last_prompt[-1].startswith("<tools:get_weather>")

    follow_up = [{"role": "user", "content": "Weather in Paris?"}, *[i.model_dump(exclude_none=True)
                                                                     for i in response.output],
                 {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    behaviour.answer = "It is sunny."
    answer = client.responses.create(model="tiny", input=follow_up, tools=[RESPONSES_TOOL])
    assert answer.output_text == "It is sunny." and [i.type for i in answer.output] == ["message"]
    assert behaviour.last_prompt[-1].endswith(
        "<user>Weather in Paris?<assistant>Checking.<call:get_weather><tool:get_weather>sunny<assistant>")


def test_responses_function_call_streams_as_ollama_sends_it(fake_served):
    import json

    client, behaviour = fake_served
    behaviour.answer = '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'
    events = list(client.responses.create(model="tiny", input="Weather?", tools=[RESPONSES_TOOL], stream=True))
    kinds = [e.type for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]  # a call alone: no message item
    added, delta, done = events[2], events[3], events[4]
    assert added.item.type == "function_call" and added.item.status == "in_progress" and added.item.arguments == ""
    assert delta.item_id == added.item.id and json.loads(delta.delta) == {"city": "Paris"} == json.loads(done.arguments)
    [call] = events[-1].response.output
    assert call.type == "function_call" and call.call_id == added.item.call_id and call.arguments == done.arguments
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_responses_tool_choice_none_and_unsupported_tools(fake_served):
    client, behaviour = fake_served
    behaviour.answer = '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'
    response = client.responses.create(model="tiny", input="Weather?", tools=[RESPONSES_TOOL], tool_choice="none")
    assert [i.type for i in response.output] == ["message"] and "<tools:" not in behaviour.last_prompt[-1]
    with pytest.raises(openai.BadRequestError, match="unsupported tool type: 'web_search'"):
        client.responses.create(model="tiny", input="x", tools=[{"type": "web_search"}])
    with pytest.raises(openai.BadRequestError, match="failed to parse function call arguments"):
        client.responses.create(model="tiny", input=[{"type": "function_call", "call_id": "c", "name": "f",
                                                      "arguments": "{nope"}])


def test_responses_tools_with_the_tiny_model_are_accepted(served):
    _, client = served
    response = client.responses.create(model="tiny", input="Weather in Paris?", tools=[RESPONSES_TOOL],
                                       max_output_tokens=16)
    assert response.status in ("completed", "incomplete") and response.output
    assert all(item.type in ("message", "function_call") for item in response.output)
    events = list(client.responses.create(model="tiny", input="Weather in Paris?", tools=[RESPONSES_TOOL],
                                          max_output_tokens=16, stream=True))
    assert events[-1].type in ("response.completed", "response.incomplete")
