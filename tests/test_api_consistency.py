"""Answers that must agree with each other or with OpenAI's shapes (fake runner, real `openai` client where it reads
the field): /v1/embeddings names an unknown model in a 404 as /api/embed does; /api/tags lists the capabilities
/api/show lists; a Responses answer cut at max_output_tokens marks its message "incomplete", streamed or not; a chat
completion that is only tool calls has `content: null`."""
import httpx
import openai
import pytest

from dgemma_cli.server.config import ServerConfig
from dgemma_cli.store import Store
from server_harness import FakeBehaviour, InProcessServer, add_model, fake_factory, write_small_gguf
from surface_capture import FIXTURES

CALL = '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


@pytest.fixture
def served(tmp_path):
    store = Store(tmp_path / "models")
    add_model(store, "tiny", write_small_gguf(tmp_path / "t.gguf"))
    template = (FIXTURES / "tiny-a" / "chat_template.jinja").read_text()
    add_model(store, "toolish", write_small_gguf(tmp_path / "toolish.gguf", chat_template=template))
    behaviour = FakeBehaviour(answer="A rather long answer that does not fit.")
    config = ServerConfig.from_env({"DGEMMA_MODELS": str(store.root)})
    with InProcessServer(config, store, fake_factory(behaviour)) as server:
        yield (httpx.Client(base_url=server.url, timeout=30), behaviour,
               openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0))


def test_embeddings_name_the_model_as_api_embed_does(served):
    http, _, client = served
    missing = http.post("/v1/embeddings", json={"model": "nosuch", "input": "x"})
    native = http.post("/api/embed", json={"model": "nosuch", "input": "x"})
    assert missing.status_code == native.status_code == 404
    assert missing.json()["error"]["message"] == native.json()["error"] and "nosuch" in native.json()["error"]
    with pytest.raises(openai.BadRequestError, match="registry.ollama.ai/library/tiny:latest does not support "
                                                     "embedding"):
        client.embeddings.create(model="tiny", input="x")


def test_tags_list_the_capabilities_show_lists(served):
    http, _, _ = served
    listed = {m["name"]: m["capabilities"] for m in http.get("/api/tags").json()["models"]}
    for name in ("tiny:latest", "toolish:latest"):
        assert listed[name] == http.post("/api/show", json={"model": name}).json()["capabilities"]
    assert listed["toolish:latest"] == ["completion", "diffusion", "tools", "thinking"]


def test_an_incomplete_response_marks_its_message_incomplete(served):
    _, _, client = served
    whole = client.responses.create(model="tiny", input="Hi", max_output_tokens=4)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    [message] = whole.output
    assert message.status == "incomplete" and message.content[0].text == "A ra"
    events = list(client.responses.create(model="tiny", input="Hi", max_output_tokens=4, stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "incomplete"
    done = [e for e in events if e.type == "response.output_item.done"]
    assert [e.item.status for e in done] == ["incomplete"] == [i.status for i in events[-1].response.output]


def test_a_tool_calls_only_completion_has_null_content(served):
    http, behaviour, _ = served
    behaviour.answer = CALL
    body = http.post("/v1/chat/completions", json={"model": "tiny", "tools": TOOLS,
                                                   "messages": [{"role": "user", "content": "Weather?"}]}).json()
    message = body["choices"][0]["message"]
    assert "content" in message and message["content"] is None and len(message["tool_calls"]) == 1
    behaviour.answer = "Checking." + CALL  # text beside the call stays
    body = http.post("/v1/chat/completions", json={"model": "tiny", "tools": TOOLS,
                                                   "messages": [{"role": "user", "content": "Weather?"}]}).json()
    assert body["choices"][0]["message"]["content"] == "Checking."
