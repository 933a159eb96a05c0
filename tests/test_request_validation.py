"""Hostile request values are 400s with one clear line, the same rules and wording on both APIs (issue 14):
numbers beyond range, lone surrogates, oversize prompts, NULs in names, bad roles; `temperature: 0` is argmax;
`/v1/completions` takes a list of one prompt. The fast cases run against the fake runner; the ones where the engine
matters (tokenizer, template, sampler) against the tiny fixture model."""
from __future__ import annotations

import json

import httpx
import pytest

from dgemma_cli.errors import DgemmaError
from dgemma_cli.server.config import ServerConfig
from dgemma_cli.server.validation import MAX_DEPTH, parse_body
from dgemma_cli.store import Store
from server_harness import FakeBehaviour, InProcessServer, add_model, fake_factory, write_small_gguf

BIG = "1" + "0" * 400  # an integer literal beyond float range
OUT_OF_RANGE = "number out of range"
SAMPLER_OPTIONS = ("diffusion_steps", "diffusion_t_max", "diffusion_t_min", "diffusion_entropy_bound",
                   "diffusion_confidence_threshold", "diffusion_stability_threshold")
GENERATE = '{"model": "tiny", "prompt": "Hi", "stream": false, %s}'
CHAT = '{"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "stream": false, %s}'
OPENAI_CHAT = '{"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], %s}'
OPENAI_COMPLETION = '{"model": "tiny", "prompt": "Hi", %s}'


@pytest.fixture(scope="module")
def fake_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("validation")
    store = Store(root / "models")
    add_model(store, "tiny", write_small_gguf(root / "tiny.gguf"))
    config = ServerConfig.from_env({"DGEMMA_MODELS": str(store.root), "DGEMMA_NOPRUNE": "1"})
    with InProcessServer(config, store, fake_factory(FakeBehaviour())) as server:
        yield server


def post(server, path: str, body: str) -> httpx.Response:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        return client.post(path, content=body.encode("utf-8", "surrogatepass"))


def error_line(response: httpx.Response) -> str:
    error = response.json()["error"]
    return error["message"] if isinstance(error, dict) else error


def assert_refused(response: httpx.Response, expected: str) -> None:
    assert response.status_code == 400, response.text
    line = error_line(response)
    assert expected in line and "\n" not in line and len(line) < 200, line


# ---- numbers out of range ------------------------------------------------------------------------------------------

NUMBER_CASES = [
    *[("/api/generate", GENERATE % f'"options": {{"{name}": {BIG}}}', name)
      for name in ("temperature", "num_predict", "top_p", "min_p", "seed", "num_ctx", *SAMPLER_OPTIONS)],
    ("/api/generate", GENERATE % f'"steps": {BIG}', "steps"),
    ("/api/generate", GENERATE % f'"keep_alive": {BIG}', "keep_alive"),
    ("/api/generate", GENERATE % f'"keep_alive": "{BIG}"', "keep_alive"),
    ("/api/generate", GENERATE % '"keep_alive": 1e300', "keep_alive"),  # finite, but no Go duration
    ("/api/generate", GENERATE % '"keep_alive": "99999999999999h"', "keep_alive"),
    ("/api/generate", GENERATE % '"options": {"temperature": 1e400}', "temperature"),
    ("/api/generate", GENERATE % '"options": {"temperature": -1e400}', "temperature"),
    ("/api/generate", GENERATE % '"options": {"temperature": Infinity}', "temperature"),
    ("/api/generate", GENERATE % '"options": {"top_p": 1e39}', "top_p"),  # beyond float32
    ("/api/generate", GENERATE % '"options": {"num_predict": 9223372036854775808}', "num_predict"),  # 2**63
    ("/api/generate", GENERATE % f'"options": {{"num_predict": {"9" * 5000}}}', "num_predict"),  # > 4300 digits
    ("/api/generate", GENERATE % f'"context": [1, {BIG}]', "context.1"),
    ("/api/chat", CHAT % f'"options": {{"temperature": {BIG}}}', "temperature"),
    ("/api/chat", CHAT % f'"keep_alive": {BIG}', "keep_alive"),
    ("/api/chat", CHAT % f'"top_logprobs": {BIG}', "top_logprobs"),
    *[("/v1/chat/completions", OPENAI_CHAT % f'"{name}": {BIG}', name)
      for name in ("max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "frequency_penalty",
                   "presence_penalty", "n", "top_logprobs")],
    ("/v1/chat/completions", OPENAI_CHAT % '"temperature": 1e400', "temperature"),
    ("/v1/chat/completions", OPENAI_CHAT % '"top_p": 1e39', "top_p"),
    *[("/v1/completions", OPENAI_COMPLETION % f'"{name}": {BIG}', name)
      for name in ("max_tokens", "temperature", "top_p", "seed", "logprobs")],
    ("/api/create", f'{{"model": "x", "from": "tiny", "parameters": {{"temperature": {BIG}}}}}', "temperature"),
    ("/api/show", f'{{"model": "tiny", "options": {{"num_ctx": {BIG}}}}}', "num_ctx"),
]


@pytest.mark.parametrize("path, body, field", NUMBER_CASES,
                         ids=[f"{p}-{f}-{i}" for i, (p, _, f) in enumerate(NUMBER_CASES)])
def test_numbers_out_of_range_are_one_line_400s(fake_server, path, body, field):
    assert_refused(post(fake_server, path, body), f"invalid value for {field}: {OUT_OF_RANGE}")


def test_both_apis_word_the_same_field_the_same_way(fake_server):
    native = post(fake_server, "/api/generate", GENERATE % f'"options": {{"temperature": {BIG}}}')
    openai = post(fake_server, "/v1/chat/completions", OPENAI_CHAT % f'"temperature": {BIG}')
    assert error_line(native) == error_line(openai) == "invalid value for temperature: number out of range"


def test_numbers_in_range_still_work(fake_server):
    body = GENERATE % '"keep_alive": 9e9, "options": {"num_predict": 9223372036854775807, "top_p": 3e38, "seed": 5}'
    assert post(fake_server, "/api/generate", body).status_code == 200


# ---- strings ---------------------------------------------------------------------------------------------------------

SURROGATE = "a\\udfffb"  # a JSON escape of a lone surrogate
UNICODE_CASES = [
    ("/api/generate", GENERATE.replace('"Hi"', f'"{SURROGATE}"') % '"raw": false', "prompt"),
    ("/api/generate", GENERATE % f'"system": "{SURROGATE}"', "system"),
    ("/api/generate", GENERATE % f'"template": "{SURROGATE}"', "template"),
    ("/api/generate", GENERATE % f'"options": {{"stop": ["{SURROGATE}"]}}', "stop.0"),
    ("/api/generate", GENERATE.replace('"tiny"', f'"{SURROGATE}"') % '"raw": false', "model"),
    ("/api/generate", GENERATE % f'"{SURROGATE}": 1', SURROGATE),
    ("/api/chat", CHAT.replace('"Hi"', f'"{SURROGATE}"') % '"think": false', "messages.0.content"),
    ("/api/chat", CHAT % f'"format": {{"type": "{SURROGATE}"}}', "format.type"),
    ("/v1/chat/completions", OPENAI_CHAT.replace('"Hi"', f'"{SURROGATE}"') % '"n": 1', "messages.0.content"),
    ("/v1/chat/completions", OPENAI_CHAT % f'"stop": "{SURROGATE}"', "stop"),
    ("/v1/completions", OPENAI_COMPLETION.replace('"Hi"', f'"{SURROGATE}"') % '"n": 1', "prompt"),
    ("/api/create", f'{{"model": "x", "from": "tiny", "system": "{SURROGATE}"}}', "system"),
    ("/api/create", f'{{"model": "x", "from": "tiny", "template": "{SURROGATE}"}}', "template"),
    ("/api/show", f'{{"model": "{SURROGATE}"}}', "model"),
    ("/api/copy", f'{{"source": "tiny", "destination": "{SURROGATE}"}}', "destination"),
]


@pytest.mark.parametrize("path, body, field", UNICODE_CASES,
                         ids=[f"{p}-{i}" for i, (p, _, _) in enumerate(UNICODE_CASES)])
def test_lone_surrogates_are_one_line_400s(fake_server, path, body, field):
    response = post(fake_server, path, body)
    assert response.status_code == 400
    assert error_line(response) == f"invalid Unicode in {field}: lone surrogate U+DFFF"


@pytest.mark.parametrize("body", [
    '{"model": "x", "from": "tiny\\u0000"}',
    '{"model": "x\\u0000", "from": "tiny"}',
    '{"model": "x", "from": "\\u0000"}',
])
def test_nul_in_create_names_is_invalid_model_name(fake_server, body):
    response = post(fake_server, "/api/create", body)
    assert response.status_code == 400 and response.json() == {"error": "invalid model name"}


@pytest.mark.parametrize("path, body", [
    ("/api/show", '{"model": "tiny\\u0000"}'),
    ("/api/generate", '{"model": "ti\\u0000ny", "prompt": "x"}'),
    ("/api/copy", '{"source": "tiny", "destination": "a\\u0000b"}'),
    ("/v1/chat/completions", '{"model": "tiny\\u0000", "messages": [{"role": "user", "content": "x"}]}'),
])
def test_nul_in_any_name_is_a_400(fake_server, path, body):
    response = post(fake_server, path, body)
    assert response.status_code == 400 and "invalid" in error_line(response)


def test_deep_nesting_is_a_400(fake_server):
    deep = "[" * 5000 + "]" * 5000
    for body in (deep, GENERATE % f'"options": {{"x": {deep}}}', GENERATE % f'"format": {deep}'):
        assert_refused(post(fake_server, "/api/generate", body), "nested too deeply")
    shallow = "[" * (MAX_DEPTH - 2) + "]" * (MAX_DEPTH - 2)
    assert post(fake_server, "/api/generate", GENERATE % f'"options": {{"x": {shallow}}}').status_code == 200


# ---- prompt size ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("megabytes", [5, 20])
@pytest.mark.parametrize("api", ["generate", "chat", "openai-chat", "openai-completion"])
def test_huge_prompts_are_refused_before_rendering(fake_server, api, megabytes):
    text = "x" * (megabytes * 2**20)
    path, body = {
        "generate": ("/api/generate", {"model": "tiny", "prompt": text, "stream": False}),
        "chat": ("/api/chat", {"model": "tiny", "messages": [{"role": "user", "content": text}], "stream": False}),
        "openai-chat": ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": text}]}),
        "openai-completion": ("/v1/completions", {"model": "tiny", "prompt": [text]}),
    }[api]
    response = post(fake_server, path, json.dumps(body))
    # the window the runner loads: num_ctx 8192 capped by the model's trained context (4096)
    assert_refused(response, f"prompt too long: {len(text)} characters cannot fit a context window of 4096 tokens")


def test_truncated_chat_counts_only_what_must_stay(fake_server):
    old = [{"role": "user", "content": "y" * 400_000}, {"role": "assistant", "content": "z" * 400_000}]
    messages = old + [{"role": "user", "content": "Hi"}]
    ok = post(fake_server, "/api/chat", json.dumps({"model": "tiny", "messages": messages, "stream": False}))
    assert ok.status_code == 200  # the old messages are truncated away, as before
    refused = post(fake_server, "/api/chat", json.dumps({"model": "tiny", "messages": messages, "stream": False,
                                                         "truncate": False}))
    assert_refused(refused, "prompt too long: 800002 characters")


# ---- roles, the OpenAI prompt list ---------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/api/chat", "/v1/chat/completions"])
def test_one_role_check_for_both_chat_apis(fake_server, path):
    for role, status in (("wizard", 400), ("", 400), ("USER", 200), ("developer", 200), ("system", 200)):
        messages = [{"role": role, "content": "x"}] + ([{"role": "user", "content": "x"}] if role != "USER" else [])
        response = post(fake_server, path, json.dumps({"model": "tiny", "messages": messages, "stream": False}))
        assert response.status_code == status, (role, response.text)
        if status == 400:
            assert error_line(response) == f"invalid message role {role!r}"


@pytest.mark.parametrize("prompt, status", [("hi", 200), (["hi"], 200), (["a", "b"], 400), ([], 400)])
def test_completions_take_a_string_or_a_list_of_one(fake_server, prompt, status):
    response = post(fake_server, "/v1/completions", json.dumps({"model": "tiny", "prompt": prompt,
                                                               "best_of": 1, "user": "someone"}))
    assert response.status_code == status, response.text
    if status == 400:
        assert error_line(response) == f"prompt must be a string or a list of one string (got a list of {len(prompt)})"
    else:
        assert response.json()["choices"][0]["text"]


# ---- the parser on its own -----------------------------------------------------------------------------------------

def test_parse_body_names_the_field_and_keeps_good_values():
    assert parse_body(b'{"a": [1, 2.5, "x", null, NaN], "options": {"t": -9223372036854775808}}')["options"] == {
        "t": -(2**63)}
    with pytest.raises(DgemmaError, match="invalid value for a.b.1: number out of range"):
        parse_body(b'{"a": {"b": [0, 1e999]}}')
    with pytest.raises(DgemmaError, match="invalid value for t: number out of range"):
        parse_body(b'{"options": {"t": 1e999}}')
    with pytest.raises(DgemmaError, match="invalid Unicode in body: lone surrogate U\\+D800"):
        parse_body(b'"\\ud800"')
    with pytest.raises(json.JSONDecodeError):
        parse_body(b"{not json")
    assert parse_body('"\\ud83d\\ude00 ok"'.encode()) == "\U0001F600 ok"  # a surrogate *pair* is one code point


# ---- on the real tiny model ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_gguf(gguf_path):
    return gguf_path("tiny-a", "f32")


@pytest.fixture(scope="module")
def real_server(tmp_path_factory, tiny_gguf):
    """The engine behind the routes (default runner factory), model `tiny` from the converted fixture."""
    store = Store(tmp_path_factory.mktemp("validation-real") / "models")
    add_model(store, "tiny", tiny_gguf)
    config = ServerConfig.from_env({"DGEMMA_MODELS": str(store.root), "DGEMMA_NOPRUNE": "1"})
    with InProcessServer(config, store, None) as server:
        yield server


def direct_greedy_text(gguf, prompt: str, max_steps: int) -> str:
    """What `SamplerParams(greedy=True)` generates after the raw prompt, straight from the engine."""
    from dgemma_engine.generate import eos_ids_from_metadata, generate
    from dgemma_engine.events import CanvasEvent
    from dgemma_engine.model import Context, Model
    from dgemma_engine.settings import SamplerParams
    from dgemma_engine.tokenizer import Tokenizer
    from dgemma_cli.server.options import GREEDY_SEED

    with Model.load(str(gguf)) as model:
        metadata = dict(model.metadata)
        tokenizer = Tokenizer.from_metadata(metadata)
        params = SamplerParams.from_metadata(metadata, max_steps=max_steps, greedy=True, seed=GREEDY_SEED)
        canvases = 2
        with Context(model, n_ctx=int(model.hparams.n_ctx_train)) as ctx:
            events = generate(ctx, tokenizer.encode(prompt, special=True), params,
                              max_new_tokens=canvases * int(model.hparams.canvas_length),
                              eos_ids=eos_ids_from_metadata(metadata), tokenizer=tokenizer)
            return "".join(e.text for e in events if isinstance(e, CanvasEvent))


def test_temperature_zero_is_the_greedy_argmax_whatever_the_seed(real_server, tiny_gguf):
    answers = []
    for seed in (1, 2):
        body = {"model": "tiny", "prompt": "Hello", "raw": True, "stream": False,
                "options": {"temperature": 0, "seed": seed, "diffusion_steps": 4, "num_predict": 32}}
        response = post(real_server, "/api/generate", json.dumps(body))
        assert response.status_code == 200, response.text
        answers.append(response.json()["response"])
    assert answers[0] == answers[1] == direct_greedy_text(tiny_gguf, "Hello", max_steps=4)[: len(answers[0])]
    assert answers[0]


def test_temperature_zero_on_the_openai_api(real_server):
    texts = []
    for seed in (3, 4):
        body = {"model": "tiny", "prompt": "Hello", "temperature": 0, "seed": seed, "max_tokens": 16}
        response = post(real_server, "/v1/completions", json.dumps(body))
        assert response.status_code == 200, response.text
        texts.append(response.json()["choices"][0]["text"])
    assert texts[0] == texts[1]


@pytest.mark.parametrize("path, body", [
    ("/api/generate", GENERATE.replace('"Hi"', f'"{SURROGATE}"') % '"raw": true'),
    ("/api/generate", GENERATE.replace('"Hi"', f'"{SURROGATE}"') % '"raw": false'),
    ("/api/generate", GENERATE % f'"system": "{SURROGATE}"'),
    ("/api/generate", GENERATE % f'"template": "{{{{ messages[0].content }}}}{SURROGATE}"'),
    ("/api/chat", CHAT.replace('"Hi"', f'"{SURROGATE}"') % '"think": false'),
    ("/v1/chat/completions", OPENAI_CHAT.replace('"Hi"', f'"{SURROGATE}"') % '"n": 1'),
    ("/v1/completions", OPENAI_COMPLETION.replace('"Hi"', f'"{SURROGATE}"') % '"n": 1'),
])
def test_lone_surrogates_never_reach_the_engine(real_server, path, body):
    response = post(real_server, path, body)
    assert response.status_code == 400 and error_line(response).startswith("invalid Unicode in ")


@pytest.mark.parametrize("megabytes", [5, 20])
def test_huge_prompts_on_the_engine_are_400s(real_server, megabytes):
    text = "Hello " * (megabytes * 2**20 // 6)
    for path, body in (("/api/generate", {"model": "tiny", "prompt": text, "stream": False}),
                       ("/api/chat", {"model": "tiny", "messages": [{"role": "user", "content": text}]})):
        response = post(real_server, path, json.dumps(body))
        assert_refused(response, "prompt too long")


def test_create_from_a_name_with_nul_is_a_400_on_the_real_store(real_server):
    response = post(real_server, "/api/create", '{"model": "copy", "from": "tiny\\u0000"}')
    assert response.status_code == 400 and response.json() == {"error": "invalid model name"}
    assert post(real_server, "/api/create", '{"model": "copy", "from": "tiny", "stream": false}').status_code == 200


# ---- /v1/responses: the same rules -----------------------------------------------------------------------------------

RESPONSES = '{"model": "tiny", %s}'


@pytest.mark.parametrize("body, expected", [
    (RESPONSES % f'"input": "Hi", "max_output_tokens": {BIG}', OUT_OF_RANGE),
    (RESPONSES % f'"input": "Hi", "temperature": {BIG}', OUT_OF_RANGE),
    (RESPONSES % '"input": "a\\udfffb"', "lone surrogate"),
    (RESPONSES % '"input": [{"role": "wizard", "content": "x"}]', "invalid message role 'wizard'"),
])
def test_responses_follow_the_same_rules(fake_server, body, expected):
    assert_refused(post(fake_server, "/v1/responses", body), expected)
