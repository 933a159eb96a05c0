"""LangChain (`langchain-ollama` ChatOllama, `langchain-openai` ChatOpenAI, its Responses mode too) and LiteLLM
(`ollama/`, `ollama_chat/`, `openai/`), unmodified, against dgemma's server (docs/compat.md#clients).

Two servers: `dgemma serve` as a subprocess with the random-weight tiny model (the accept path, and structured output,
which the server guarantees valid whatever the weights), and the in-process server with a scripted runner whose answer
is a known Gemma 4 tool call (the parse path: the random model never writes one). No client may leave loopback: the
guard below makes any other connection fail at once, so a client that tries to reach the internet fails clearly
instead of hanging.
"""
import ipaddress
import json
import os
import socket

import jsonschema
import pytest
from pydantic import BaseModel

from server_harness import ServeProcess

os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"  # read when litellm is imported: no cost-map download
os.environ.setdefault("LITELLM_TELEMETRY", "False")
for _tracing in ("LANGCHAIN_TRACING_V2", "LANGSMITH_TRACING", "LANGCHAIN_API_KEY", "LANGSMITH_API_KEY"):
    os.environ.pop(_tracing, None)

import langchain_ollama  # noqa: E402  (after the environment above)
import langchain_openai  # noqa: E402
import litellm  # noqa: E402
from langchain_core.messages import HumanMessage, ToolMessage  # noqa: E402

CALL = '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>'
PERSON_CALL = '<|tool_call>call:Person{name:<|"|>Ada<|"|>,age:36}<tool_call|>'
QUESTION = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
PERSON_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                 "required": ["name", "age"], "additionalProperties": False}
BUDGET = 48  # tokens per answer of the tiny model: a few canvases, enough for a constrained object to close
# (the scripted runner writes one character per token: its answers get no budget, so a call is never cut)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:pydantic")  # LiteLLM's TypedDicts at import


class Person(BaseModel):
    """A person."""

    name: str
    age: int


def get_weather(city: str) -> str:
    """Current weather of a city."""
    return "sunny"


# ---- no network ----------------------------------------------------------------------------------------------------

def _is_loopback(host: str) -> bool:
    if host in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


class NetworkGuard(OSError):
    pass


@pytest.fixture(scope="module", autouse=True)
def loopback_only():
    """Connections and name lookups beyond loopback fail at once with a message naming the target."""
    connect, getaddrinfo = socket.socket.connect, socket.getaddrinfo

    def guarded_connect(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6) and not _is_loopback(str(address[0])):
            raise NetworkGuard(f"test network guard: a client tried to reach {address!r}")
        return connect(sock, address)

    def guarded_getaddrinfo(host, *args, **kwargs):
        if host is not None and not _is_loopback(host.decode() if isinstance(host, bytes) else str(host)):
            raise NetworkGuard(f"test network guard: a client tried to resolve {host!r}")
        return getaddrinfo(host, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(socket.socket, "connect", guarded_connect)
        patch.setattr(socket, "getaddrinfo", guarded_getaddrinfo)
        yield


def test_the_guard_refuses_the_internet():
    import httpx

    with pytest.raises(httpx.ConnectError, match="test network guard"):
        httpx.get("http://93.184.215.14/", timeout=5)


# ---- servers -------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def real(tmp_path_factory, gguf_path):
    """`dgemma serve` with the random-weight tiny model (its template declares tools)."""
    import ollama

    root = tmp_path_factory.mktemp("clients")
    with ServeProcess(root / "models", {"DGEMMA_NOPRUNE": "1"}) as server:
        setup = ollama.Client(host=server.url)
        digest = setup.create_blob(gguf_path("tiny-a", "f32"))
        setup.create(model="tiny", files={"tiny-a.gguf": digest}, parameters={"diffusion_steps": 2, "seed": 1})
        yield server


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    """The server with a scripted runner: each answer is `behaviour.answer`, committed canvas by canvas."""
    from dgemma_cli.server.config import ServerConfig
    from dgemma_cli.store import Store
    from server_harness import FakeBehaviour, InProcessServer, add_model, fake_factory, write_small_gguf
    from surface_capture import FIXTURES

    root = tmp_path_factory.mktemp("clients-scripted")
    store = Store(root / "models")
    template = (FIXTURES / "tiny-a" / "chat_template.jinja").read_text()  # a call syntax: tool_choice can name one
    add_model(store, "tiny", write_small_gguf(root / "t.gguf", chat_template=template))
    behaviour = FakeBehaviour(answer=CALL, steps=1)
    config = ServerConfig.from_env({"DGEMMA_MODELS": str(store.root)})
    with InProcessServer(config, store, fake_factory(behaviour)) as server:
        yield server, behaviour


def answering(scripted, answer: str):
    server, behaviour = scripted
    behaviour.answer = answer
    return server.url, behaviour


def assert_weather_call(calls: list[dict]) -> None:
    """LangChain's parsed calls: one `get_weather` with `{"city": "Paris"}` and an id."""
    assert [(c["name"], c["args"]) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert calls[0]["id"]


# ---- langchain-ollama ----------------------------------------------------------------------------------------------

def chat_ollama(url: str, budget: int | None = BUDGET):
    return langchain_ollama.ChatOllama(model="tiny", base_url=url, num_predict=budget, seed=3)


def test_chat_ollama_invoke_and_stream(real):
    llm = chat_ollama(real.url)
    message = llm.invoke("Hi")
    assert isinstance(message.content, str) and message.response_metadata["done_reason"] in ("stop", "length")
    assert message.usage_metadata["input_tokens"] > 0
    streamed = "".join(chunk.content for chunk in llm.stream("Hi"))
    assert streamed == message.content  # same seed, same answer, whether streamed or not


def test_chat_ollama_bind_tools_parses_the_call(scripted):
    url, behaviour = answering(scripted, "Checking." + CALL)
    llm = chat_ollama(url, budget=None).bind_tools([get_weather])
    message = llm.invoke("Weather in Paris?")
    assert_weather_call(message.tool_calls)
    assert message.content == "Checking." and behaviour.last_prompt[-1].startswith("<tools:get_weather>")
    chunks = list(llm.stream("Weather in Paris?"))
    assert_weather_call([c for chunk in chunks for c in chunk.tool_calls])


def test_chat_ollama_bind_tools_on_the_real_model(real):
    message = chat_ollama(real.url).bind_tools([get_weather]).invoke("Weather in Paris?")
    assert isinstance(message.content, str)
    assert all(call["name"] == "get_weather" for call in message.tool_calls)  # whatever the random model wrote


def test_chat_ollama_structured_output_json_schema(real):
    person = chat_ollama(real.url).with_structured_output(Person, method="json_schema").invoke("Who?")
    assert isinstance(person, Person)  # validated by pydantic: the canvas was constrained to the schema


def test_chat_ollama_structured_output_json_mode(real):
    answer = chat_ollama(real.url).with_structured_output(PERSON_SCHEMA, method="json_mode").invoke("Who? In JSON.")
    assert isinstance(answer, dict)  # `format: "json"`: any JSON object


def test_chat_ollama_structured_output_function_calling(scripted):
    url, _ = answering(scripted, PERSON_CALL)
    person = chat_ollama(url, budget=None).with_structured_output(Person, method="function_calling").invoke("Who?")
    assert person == Person(name="Ada", age=36)


# ---- langchain-openai ----------------------------------------------------------------------------------------------

def chat_openai(url: str, responses: bool = False, budget: int | None = BUDGET):
    seed = {} if responses else {"seed": 3}  # the Responses API has no `seed`
    return langchain_openai.ChatOpenAI(model="tiny", base_url=url + "/v1", api_key="unused", max_tokens=budget,
                                       max_retries=0, timeout=120, use_responses_api=responses, **seed)


@pytest.mark.parametrize("responses", [False, True], ids=["chat", "responses"])
def test_chat_openai_invoke_and_stream(real, responses):
    llm = chat_openai(real.url, responses)
    message = llm.invoke("Hi")
    assert isinstance(message.text, str) and message.usage_metadata["input_tokens"] > 0
    chunks = list(llm.stream("Hi"))
    assert all(isinstance(chunk.text, str) for chunk in chunks) and chunks


@pytest.mark.parametrize("responses", [False, True], ids=["chat", "responses"])
def test_chat_openai_bind_tools_parses_the_call(scripted, responses):
    url, behaviour = answering(scripted, "Checking." + CALL)
    llm = chat_openai(url, responses, budget=None).bind_tools([get_weather])
    message = llm.invoke("Weather in Paris?")
    assert_weather_call(message.tool_calls)
    assert message.text == "Checking." and behaviour.last_prompt[-1].startswith("<tools:get_weather>")
    merged = None
    for chunk in llm.stream("Weather in Paris?"):
        merged = chunk if merged is None else merged + chunk
    assert_weather_call(merged.tool_calls)
    # The call's result goes back through the template as a tool message.
    behaviour.answer = "It is sunny."
    reply = llm.invoke([HumanMessage("Weather in Paris?"), message,
                        ToolMessage("sunny", tool_call_id=message.tool_calls[0]["id"])])
    assert reply.text == "It is sunny." and not reply.tool_calls
    assert behaviour.last_prompt[-1].endswith("<tool:get_weather>sunny<assistant>")


@pytest.mark.parametrize("responses", [False, True], ids=["chat", "responses"])
def test_chat_openai_structured_output_json_schema(real, responses):
    llm = chat_openai(real.url, responses)
    person = llm.with_structured_output(Person, method="json_schema").invoke("Who?")
    assert isinstance(person, Person)


def test_chat_openai_structured_output_json_mode(real):
    answer = chat_openai(real.url).with_structured_output(PERSON_SCHEMA, method="json_mode").invoke("Who? In JSON.")
    assert isinstance(answer, dict)


@pytest.mark.parametrize("responses", [False, True], ids=["chat", "responses"])
def test_chat_openai_structured_output_function_calling(scripted, responses):
    url, _ = answering(scripted, PERSON_CALL)
    llm = chat_openai(url, responses, budget=None)
    assert llm.with_structured_output(Person, method="function_calling").invoke("Who?") == Person(name="Ada", age=36)


# ---- litellm -------------------------------------------------------------------------------------------------------

def litellm_args(provider: str, url: str, budget: int | None = BUDGET) -> dict:
    base = url + "/v1" if provider == "openai" else url
    limit = {"max_tokens": budget} if budget else {}
    return {"model": f"{provider}/tiny", "api_base": base, "api_key": "unused", "seed": 3, "timeout": 120,
            "num_retries": 0, **limit}


@pytest.mark.parametrize("provider", ["ollama", "ollama_chat", "openai"])
def test_litellm_completion_and_stream(real, provider):
    response = litellm.completion(messages=[{"role": "user", "content": "Hi"}], **litellm_args(provider, real.url))
    assert isinstance(response.choices[0].message.content, str) and response.usage.prompt_tokens > 0
    chunks = list(litellm.completion(messages=[{"role": "user", "content": "Hi"}], stream=True,
                                     **litellm_args(provider, real.url)))
    assert chunks and chunks[-1].choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("provider", ["ollama_chat", "openai"])
def test_litellm_tools_parse_the_call(scripted, provider):
    url, _ = answering(scripted, "Checking." + CALL)
    response = litellm.completion(messages=QUESTION, tools=[WEATHER], **litellm_args(provider, url, None))
    [call] = response.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert response.choices[0].finish_reason == "tool_calls"


def test_litellm_ollama_tools_use_json_format(scripted):
    """`ollama/` (/api/generate) has no native tools: LiteLLM asks for `format: "json"` and reads a
    `{"name", "arguments"}` object out of the answer."""
    url, behaviour = answering(scripted, json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}}))
    response = litellm.completion(messages=QUESTION, tools=[WEATHER], **litellm_args("ollama", url, None))
    [call] = response.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}


@pytest.mark.parametrize("provider", ["ollama", "ollama_chat", "openai"])
def test_litellm_response_format_json_schema(real, provider):
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA,
                                                              "strict": True}}
    response = litellm.completion(messages=[{"role": "user", "content": "Who?"}], response_format=response_format,
                                  **litellm_args(provider, real.url))
    jsonschema.validate(json.loads(response.choices[0].message.content), PERSON_SCHEMA)


@pytest.mark.parametrize("provider", ["ollama_chat", "openai"])
def test_litellm_response_format_json_object(real, provider):
    response = litellm.completion(messages=[{"role": "user", "content": "Who? In JSON."}],
                                  response_format={"type": "json_object"}, **litellm_args(provider, real.url))
    assert isinstance(json.loads(response.choices[0].message.content), dict)
