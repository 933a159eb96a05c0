"""Tools through the server (fake runner): offered to the template, calls parsed out of the committed answer into
Ollama's `message.tool_calls` and OpenAI's `tool_calls`, streaming and not; tool results in history; a template that
cannot render tools; `capabilities`."""
import json
import logging

import httpx
import pytest

from dgemma_cli.server.config import ServerConfig
from dgemma_cli.store import Store
from server_harness import FakeBehaviour, InProcessServer, add_model, fake_factory, ndjson, write_small_gguf
from surface_capture import FIXTURES

CALL = '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>'
ANSWER = "Let me check." + CALL + " Done."
ARGUMENTS = {"city": "Paris", "days": 3}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
USER = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture
def served(tmp_path):
    store = Store(tmp_path / "models")
    add_model(store, "tiny", write_small_gguf(tmp_path / "tiny.gguf"))
    template = (FIXTURES / "tiny-a" / "chat_template.jinja").read_text()
    add_model(store, "toolish", write_small_gguf(tmp_path / "toolish.gguf", chat_template=template))
    behaviour = FakeBehaviour(answer=ANSWER, steps=1)
    config = ServerConfig.from_env({"DGEMMA_MODELS": str(store.root), "DGEMMA_NOPRUNE": "1"})
    with InProcessServer(config, store, fake_factory(behaviour)) as server:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            yield c, behaviour


def sse(response: httpx.Response) -> list[dict]:
    events = [e[len("data: "):] for e in response.text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_ollama_call_is_parsed_and_the_text_around_it_kept(served):
    c, behaviour = served
    body = c.post("/api/chat", json={"model": "tiny", "messages": USER, "tools": TOOLS, "stream": False}).json()
    assert body["message"] == {"role": "assistant", "content": "Let me check. Done.",
                               "tool_calls": [{"function": {"name": "get_weather", "arguments": ARGUMENTS}}]}
    assert body["done_reason"] == "stop"
    assert behaviour.last_prompt[-1].startswith("<tools:get_weather><user>Weather in Paris?")


def test_ollama_stream_sends_the_call_once_complete(served):
    c, _ = served
    lines = ndjson(c.post("/api/chat", json={"model": "tiny", "messages": USER, "tools": TOOLS}))
    assert "".join(line["message"]["content"] for line in lines) == "Let me check. Done."
    with_calls = [line for line in lines if "tool_calls" in line["message"]]
    assert len(with_calls) == 1 and not with_calls[0]["done"]
    assert with_calls[0]["message"]["tool_calls"] == [{"function": {"name": "get_weather", "arguments": ARGUMENTS}}]
    assert all(CALL[:5] not in line["message"]["content"] for line in lines)
    assert lines[-1]["done"] and "tool_calls" not in lines[-1]["message"]


def test_without_tools_the_answer_is_plain_text(served):
    c, _ = served
    body = c.post("/api/chat", json={"model": "tiny", "messages": USER, "stream": False}).json()
    assert body["message"] == {"role": "assistant", "content": ANSWER}


def test_ollama_tool_results_in_history_reach_the_template(served):
    c, behaviour = served
    history = USER + [{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather",
                                                                                      "arguments": ARGUMENTS}}]},
                      {"role": "tool", "content": "sunny", "tool_name": "get_weather"}]
    assert c.post("/api/chat", json={"model": "tiny", "messages": history, "tools": TOOLS,
                                     "stream": False}).status_code == 200
    assert behaviour.last_prompt[-1].endswith("<assistant><call:get_weather><tool:get_weather>sunny<assistant>")


def test_openai_call_is_parsed(served):
    c, _ = served
    body = c.post("/v1/chat/completions", json={"model": "tiny", "messages": USER, "tools": TOOLS}).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me check. Done."
    [call] = choice["message"]["tool_calls"]
    assert set(call) == {"id", "type", "function"} and call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == ARGUMENTS


def test_openai_stream_sends_the_call_as_one_delta(served):
    c, _ = served
    chunks = sse(c.post("/v1/chat/completions", json={"model": "tiny", "messages": USER, "tools": TOOLS,
                                                      "stream": True}))
    deltas = [ch["choices"][0]["delta"] for ch in chunks]
    assert "".join(d.get("content", "") for d in deltas) == "Let me check. Done."
    calls = [call for d in deltas for call in d.get("tool_calls", [])]
    assert len(calls) == 1 and calls[0]["index"] == 0 and calls[0]["id"].startswith("call_")
    assert json.loads(calls[0]["function"]["arguments"]) == ARGUMENTS
    assert [ch["choices"][0]["finish_reason"] for ch in chunks if ch["choices"][0]["finish_reason"]] == ["tool_calls"]


def test_openai_tool_results_in_history_reach_the_template(served):
    c, behaviour = served
    history = USER + [{"role": "assistant", "content": None, "tool_calls": [
                          {"id": "call_1", "type": "function",
                           "function": {"name": "get_weather", "arguments": json.dumps(ARGUMENTS)}}]},
                      {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    body = c.post("/v1/chat/completions", json={"model": "tiny", "messages": history, "tools": TOOLS}).json()
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    assert behaviour.last_prompt[-1].endswith("<assistant><call:get_weather><tool:get_weather>sunny<assistant>")


def test_a_template_without_tools_ignores_them_with_a_warning(served, caplog):
    c, behaviour = served
    behaviour.tools = False  # read when the runner loads (at this test's first request)
    with caplog.at_level(logging.WARNING, logger="dgemma.server"):
        body = c.post("/api/chat", json={"model": "tiny", "messages": USER, "tools": TOOLS, "stream": False}).json()
        openai = c.post("/v1/chat/completions", json={"model": "tiny", "messages": USER, "tools": TOOLS}).json()
    assert body["message"] == {"role": "assistant", "content": ANSWER}  # no syntax to parse: the text as written
    assert openai["choices"][0]["finish_reason"] == "stop" and "tool_calls" not in openai["choices"][0]["message"]
    assert "<tools:" not in behaviour.last_prompt[-1]
    assert "the chat template cannot render tools; ignoring the 1 tool(s) of the request" in caplog.text


def test_capabilities_list_tools_when_the_template_declares_them(served):
    c, _ = served
    assert c.post("/api/show", json={"model": "toolish"}).json()["capabilities"] == [
        "completion", "diffusion", "tools", "thinking"]
    assert "tools" not in c.post("/api/show", json={"model": "tiny"}).json()["capabilities"]
