"""Structured output end to end: the random-weight tiny models (whose free output is garbage) always produce text that
parses and validates when a format is given, through the real engine loop and through `dgemma serve` with the real
`ollama` and `openai` clients (`format=`, `response_format=`, the Responses API's `text.format`)."""
import json
from dataclasses import replace

import jsonschema
import openai
import pytest

from dgemma_engine.constrained import CanvasConstraint, compile_constraint
from dgemma_engine.generate import SamplerParams, eos_ids_from_metadata, generate
from dgemma_engine.model import Context, Model
from dgemma_engine.tokenizer import Tokenizer
from json_schemas import SCHEMAS
from server_harness import ServeProcess

GENERATIONS = {"tiny-a": 50, "tiny-b": 20}  # seeded generations per schema (tiny-b fewer: CI time)
PERSON = SCHEMAS["object-required"]


@pytest.fixture(scope="module", params=list(GENERATIONS))
def engine(request, gguf_path):
    model = Model.load(gguf_path(request.param, "f32"), threads=2)
    metadata = model.metadata
    automata = {label: compile_constraint(schema, metadata["tokenizer.ggml.tokens"],
                                          metadata["tokenizer.ggml.token_type"], eos_ids_from_metadata(metadata))
                for label, schema in SCHEMAS.items()}
    yield request.param, model, Tokenizer.from_metadata(metadata), automata
    model.close()


@pytest.mark.parametrize("label", list(SCHEMAS))
def test_seeded_generations_always_validate(engine, label):
    name, model, tokenizer, automata = engine
    C = model.hparams.canvas_length
    prompt = tokenizer.encode("Answer in JSON.")
    eos = eos_ids_from_metadata(model.metadata)
    with Context(model, n_ctx=len(prompt) + 4 * C, threads=2) as ctx:
        for seed in range(GENERATIONS[name]):
            ctx.reset()
            params = SamplerParams.from_metadata(model.metadata, seed=seed)
            params = replace(params, max_steps=2)
            events = list(generate(ctx, prompt, params, max_new_tokens=C, eos_ids=eos, tokenizer=tokenizer,
                                   constraint=CanvasConstraint(automata[label])))
            text = "".join(e.text for e in events if hasattr(e, "text"))
            assert events[-1].reason == "eos", (name, label, seed, text)
            jsonschema.validate(json.loads(text), SCHEMAS[label] or {"type": "object"})


def test_without_a_constraint_the_canvas_is_the_argmax(engine):
    _, model, tokenizer, _ = engine
    C = model.hparams.canvas_length
    prompt = tokenizer.encode("Answer in JSON.")
    with Context(model, n_ctx=len(prompt) + 2 * C, threads=2) as ctx:
        params = replace(SamplerParams.from_metadata(model.metadata, seed=1), max_steps=2)
        steps = [e for e in generate(ctx, prompt, params, max_new_tokens=C, tokenizer=tokenizer)
                 if type(e).__name__ in ("StepEvent", "CanvasEvent")]
    last_step = [e for e in steps if type(e).__name__ == "StepEvent"][-1]
    canvas = [e for e in steps if type(e).__name__ == "CanvasEvent"][0]
    assert list(canvas.canvas) == list(last_step.argmax_ids)


# ---- through the server --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def served(tmp_path_factory, gguf_path):
    import ollama

    root = tmp_path_factory.mktemp("structured")
    with ServeProcess(root / "models", {"DGEMMA_NOPRUNE": "1"}) as server:
        setup = ollama.Client(host=server.url)
        digest = setup.create_blob(gguf_path("tiny-a", "f32"))
        setup.create(model="tiny", files={"tiny-a.gguf": digest}, parameters={"diffusion_steps": 2})
        yield (server, ollama.Client(host=server.url, timeout=300),
               openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300))


def test_ollama_format_schema_and_json(served):
    _, client, _ = served
    reply = client.chat(model="tiny", messages=[{"role": "user", "content": "Who?"}], format=PERSON,
                        options={"num_predict": 64, "seed": 1})
    jsonschema.validate(json.loads(reply.message.content), PERSON)
    parts = list(client.chat(model="tiny", messages=[{"role": "user", "content": "Who?"}], format=PERSON,
                             options={"num_predict": 64, "seed": 1}, stream=True))
    assert "".join(p.message.content for p in parts) == reply.message.content
    answer = client.generate(model="tiny", prompt="Some JSON", format="json", options={"num_predict": 64, "seed": 2})
    assert isinstance(json.loads(answer.response), dict) and answer.done_reason == "stop"


def test_ollama_format_errors(served):
    import ollama

    _, client, _ = served
    with pytest.raises(ollama.ResponseError) as err:  # (the client itself refuses a format string but "json")
        client.generate(model="tiny", prompt="x", format={"type": "nope"})
    assert err.value.status_code == 400 and err.value.error == "unsupported JSON schema: Unsupported type: nope"


def test_num_predict_inside_a_canvas_still_closes_the_value(served):
    _, client, _ = served
    answer = client.generate(model="tiny", prompt="Colour?", format=SCHEMAS["enum"],
                             options={"num_predict": 6, "seed": 4})
    assert json.loads(answer.response) in ("red", "green", "blue") and answer.eval_count <= 6


def test_openai_response_format(served):
    _, _, client = served
    messages = [{"role": "user", "content": "Who?"}]
    completion = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=64, seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    jsonschema.validate(json.loads(completion.choices[0].message.content), PERSON)
    stream = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=64, seed=3, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == \
        completion.choices[0].message.content
    anything = client.chat.completions.create(model="tiny", messages=messages, max_tokens=64, seed=3,
                                              response_format={"type": "json_object"})
    assert isinstance(json.loads(anything.choices[0].message.content), dict)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=messages,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "x", "schema": {"type": "nope"}}})


def test_responses_api_text_and_stream(served):
    _, _, client = served
    response = client.responses.create(model="tiny", input="Hello", instructions="Be brief.", max_output_tokens=16,
                                       temperature=0.5)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output[0].type == "message" and response.output[0].role == "assistant"
    assert isinstance(response.output_text, str)
    assert response.usage.input_tokens > 0 and response.usage.output_tokens <= 16
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    assert response.status in ("completed", "incomplete")

    events = list(client.responses.create(model="tiny", input=[{"role": "user", "content": "Hello"}],
                                          max_output_tokens=16, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete") and "response.output_text.done" in kinds
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == deltas == events[-1].response.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_responses_api_json_schema(served):
    _, _, client = served
    text = {"format": {"type": "json_schema", "name": "person", "schema": PERSON}}
    response = client.responses.create(model="tiny", input="Who?", max_output_tokens=64, text=text)
    jsonschema.validate(json.loads(response.output_text), PERSON)
    assert response.status == "completed"
    events = list(client.responses.create(model="tiny", input="Who?", max_output_tokens=64, text=text, stream=True))
    jsonschema.validate(json.loads(events[-1].response.output_text), PERSON)
