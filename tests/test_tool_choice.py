"""`tool_choice` on both OpenAI APIs, with the real `openai` client against `dgemma serve` running the random-weight
tiny model (whose free output never is a call): "required" and a named function always give a call that parses and
validates against the function's schema, streaming and not; "none" leaves the tools out of the prompt; a name that is
not offered is a 400. bench/tool_choice.py runs the same checks over 200 seeds."""
import json

import jsonschema
import openai
import pytest

from server_harness import ServeProcess
from tool_choice_checks import (CHAT_TOOLS, RESPONSES_TOOLS, SCHEMAS, chat_call, forced_choices, responses_call)

SEEDS = range(4)  # per (API, choice, streaming); the bench runs 200


@pytest.fixture(scope="module")
def served(tmp_path_factory, gguf_path):
    import ollama

    root = tmp_path_factory.mktemp("tool-choice")
    with ServeProcess(root / "models", {"DGEMMA_NOPRUNE": "1"}) as server:
        setup = ollama.Client(host=server.url)
        digest = setup.create_blob(gguf_path("tiny-a", "f32"))
        setup.create(model="tiny", files={"tiny-a.gguf": digest}, parameters={"diffusion_steps": 2})
        setup.create(model="plain", from_="tiny", template="{% for m in messages %}{{ m.content }}{% endfor %}")
        yield server, openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("api", ["chat", "responses"])
def test_required_and_named_choices_always_give_a_valid_call(served, api, stream):
    _, client = served
    call = chat_call if api == "chat" else responses_call
    for label, choice, names in forced_choices(api):
        for seed in SEEDS:
            name, arguments, rest = call(client, choice, seed, stream)
            assert name in names, (label, seed, name)
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])
            assert rest == "", (label, seed, rest)  # the answer is the call alone


def test_none_leaves_the_tools_out_of_the_prompt(served):
    _, client = served
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    bare = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, seed=1)
    offered = client.chat.completions.create(model="tiny", messages=messages, tools=CHAT_TOOLS, max_tokens=16, seed=1)
    none = client.chat.completions.create(model="tiny", messages=messages, tools=CHAT_TOOLS, tool_choice="none",
                                          max_tokens=16, seed=1)
    assert none.usage.prompt_tokens == bare.usage.prompt_tokens < offered.usage.prompt_tokens
    assert none.choices[0].finish_reason != "tool_calls" and none.choices[0].message.tool_calls is None
    bare = client.responses.create(model="tiny", input="Weather in Paris?", max_output_tokens=16)
    none = client.responses.create(model="tiny", input="Weather in Paris?", tools=RESPONSES_TOOLS, tool_choice="none",
                                   max_output_tokens=16)
    assert none.usage.input_tokens == bare.usage.input_tokens
    assert [item.type for item in none.output] == ["message"]


def test_bad_tool_choices_are_400s(served):
    _, client = served
    messages = [{"role": "user", "content": "x"}]
    with pytest.raises(openai.BadRequestError, match="tool_choice names function 'nope', which is not among"):
        client.chat.completions.create(model="tiny", messages=messages, tools=CHAT_TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    with pytest.raises(openai.BadRequestError, match="tool_choice names function 'nope', which is not among"):
        client.responses.create(model="tiny", input="x", tools=RESPONSES_TOOLS,
                                tool_choice={"type": "function", "name": "nope"})
    with pytest.raises(openai.BadRequestError, match="tool_choice 'required' needs tools"):
        client.chat.completions.create(model="tiny", messages=messages, tool_choice="required")
    with pytest.raises(openai.BadRequestError, match="invalid tool_choice 'sometimes'"):
        client.chat.completions.create(model="tiny", messages=messages, tools=CHAT_TOOLS, tool_choice="sometimes")
    with pytest.raises(openai.BadRequestError, match='"plain" does not support tools'):
        client.chat.completions.create(model="plain", messages=messages, tools=CHAT_TOOLS, tool_choice="required")
    with pytest.raises(openai.BadRequestError, match="num_predict 4 is too small for this format"):
        client.chat.completions.create(model="tiny", messages=messages, tools=CHAT_TOOLS, tool_choice="required",
                                       max_tokens=4)


def test_allowed_tools_limit_the_functions(served):
    _, client = served
    only_time = [{"type": "function", "function": {"name": "get_time"}}]
    choice = {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": only_time}}
    for seed in SEEDS:
        name, arguments, _ = chat_call(client, choice, seed, False)
        assert name == "get_time"
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    response = client.responses.create(model="tiny", input="x", tools=RESPONSES_TOOLS, max_output_tokens=32,
                                       tool_choice={"type": "allowed_tools", "mode": "required",
                                                    "tools": [{"type": "function", "name": "get_weather"}]})
    assert [item.name for item in response.output if item.type == "function_call"] == ["get_weather"]
    messages = [{"role": "user", "content": "x"}]
    every = client.chat.completions.create(model="tiny", messages=messages, tools=CHAT_TOOLS, max_tokens=16)
    auto = client.chat.completions.create(model="tiny", messages=messages, tools=CHAT_TOOLS, max_tokens=16, tool_choice={
        "type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": only_time}})
    assert auto.usage.prompt_tokens < every.usage.prompt_tokens  # the other tool is left out of the prompt
