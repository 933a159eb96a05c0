"""The Responses API's state with the real `openai` client (fake runner: scripted answers, the rendered prompt
recorded): `previous_response_id` and `item_reference` bring earlier turns back, GET and DELETE /v1/responses/{id},
`store: false`, OpenAI's 404 for an unknown id; and the store's bounds (count, lifetime, bytes)."""
import httpx
import openai
import pytest

from dgemma_cli.server.config import ServerConfig
from dgemma_cli.server.response_store import ResponseStore
from dgemma_cli.store import Store
from server_harness import FakeBehaviour, InProcessServer, add_model, fake_factory, write_small_gguf

CALL = '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'
TOOL = {"type": "function", "name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


@pytest.fixture
def served(tmp_path):
    store = Store(tmp_path / "models")
    add_model(store, "tiny", write_small_gguf(tmp_path / "t.gguf"))
    behaviour = FakeBehaviour(answer="Paris is sunny.")
    config = ServerConfig.from_env({"DGEMMA_MODELS": str(store.root)})
    with InProcessServer(config, store, fake_factory(behaviour)) as server:
        yield (openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0), behaviour,
               httpx.Client(base_url=server.url, timeout=30))


def test_previous_response_id_continues_the_conversation(served):
    client, behaviour, _ = served
    first = client.responses.create(model="tiny", instructions="Be brief.", input="Weather in Paris?")
    assert first.store is True
    behaviour.answer = "Still sunny."
    second = client.responses.create(model="tiny", input="And tomorrow?", previous_response_id=first.id)
    assert second.previous_response_id == first.id and second.output_text == "Still sunny."
    # the earlier turn comes back; its instructions do not (as OpenAI: a continuation sends its own)
    assert behaviour.last_prompt[-1] == "<user>Weather in Paris?<assistant>Paris is sunny.<user>And tomorrow?<assistant>"
    third = client.responses.create(model="tiny", input="Thanks", previous_response_id=second.id, stream=True)
    assert list(third)[-1].type == "response.completed"
    assert behaviour.last_prompt[-1].startswith("<user>Weather in Paris?<assistant>Paris is sunny.<user>And tomorrow?")


def test_item_references_resolve_to_stored_items(served):
    client, behaviour, _ = served
    behaviour.answer = "Checking." + CALL
    first = client.responses.create(model="tiny", input="Weather in Paris?", tools=[TOOL])
    message, call = first.output
    assert message.type == "message" and call.type == "function_call"
    behaviour.answer = "It is sunny."
    # what @ai-sdk/openai sends with `store: true`: earlier items by reference, the tool's result in full
    answer = client.responses.create(model="tiny", tools=[TOOL], input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "item_reference", "id": message.id}, {"type": "item_reference", "id": call.id},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert answer.output_text == "It is sunny."
    assert behaviour.last_prompt[-1].endswith(
        "<user>Weather in Paris?<assistant>Checking.<call:get_weather><tool:get_weather>sunny<assistant>")


def test_get_and_delete_a_stored_response(served):
    client, _, http = served
    created = client.responses.create(model="tiny", input="Hi")
    assert client.responses.retrieve(created.id).model_dump() == created.model_dump()
    body = http.delete(f"/v1/responses/{created.id}").json()
    assert body == {"id": created.id, "object": "response.deleted", "deleted": True}
    gone = http.get(f"/v1/responses/{created.id}")
    assert gone.status_code == 404 and gone.json() == {"error": {
        "message": f"Response with id '{created.id}' not found.", "type": "not_found_error", "param": None,
        "code": None}}
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(created.id)


def test_unknown_ids_and_store_false_are_404s(served):
    client, _, _ = served
    unstored = client.responses.create(model="tiny", input="Hi", store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError, match=f"Response with id '{unstored.id}' not found"):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError, match=f"Response with id '{unstored.id}' not found"):
        client.responses.create(model="tiny", input="More", previous_response_id=unstored.id)
    with pytest.raises(openai.NotFoundError, match="Item with id 'msg_nope' not found"):
        client.responses.create(model="tiny", input=[{"type": "item_reference", "id": "msg_nope"}])


def test_the_store_is_bounded_in_count_lifetime_and_bytes():
    now = [0.0]
    store = ResponseStore(kept=3, lifetime_s=10, max_bytes=2000, clock=lambda: now[0])

    def put(n: int, padding: int = 0) -> None:
        store.put({"id": f"resp_{n}", "output": [{"id": f"msg_{n}", "type": "message"}]},
                  [{"type": "message", "role": "user", "content": "x" * padding}])

    for n in range(4):
        put(n)
    assert store.get("resp_0") is None and store.get("resp_3") is not None  # the oldest goes first
    assert store.item("msg_1")["id"] == "msg_1"
    now[0] = 11
    put(4)
    assert [store.get(f"resp_{n}") is not None for n in range(5)] == [False] * 4 + [True]  # past their lifetime
    put(5, padding=1500)
    put(6, padding=1500)  # the two do not fit together: the older goes
    assert store.get("resp_5") is None and store.get("resp_6") is not None
    put(7, padding=5000)  # larger than the whole store: never kept
    assert store.get("resp_7") is None and store.get("resp_6") is not None
    with pytest.raises(Exception, match="Item with id 'msg_5' not found"):
        store.item("msg_5")
