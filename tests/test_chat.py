"""Chat template rendering equals transformers' apply_chat_template (goldens recorded by
tests/reference/make_chat_goldens.py), and hostile templates fail safely with a clear error."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from dgemma_engine.chat.jinja import ChatTemplateError, render_chat, special_tokens
from dgemma_engine.errors import EngineError
from dgemma_engine.tokenizer import Tokenizer

GOLDENS = json.loads((Path(__file__).parent / "goldens" / "chat_template.json").read_text())
FIXTURE_TEMPLATE = (Path(__file__).parent / "fixtures" / "tiny-a" / "chat_template.jinja").read_text()


def template_of(case: dict) -> str:
    return FIXTURE_TEMPLATE if case["template"] == "fixture" else GOLDENS["helpers_template"]


@pytest.fixture(scope="module")
def tiny_a(gguf_path) -> tuple[Tokenizer, dict]:
    from gguf import GGUFReader

    path = gguf_path("tiny-a", "f32")
    reader = GGUFReader(str(path), "r")
    metadata = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    return Tokenizer.from_metadata(metadata), metadata


def test_goldens_cover_the_features() -> None:
    cases = GOLDENS["cases"]
    assert {c["enable_thinking"] for c in cases} == {True, False}
    assert any(c["tools"] for c in cases) and any(not c["add_generation_prompt"] for c in cases)
    assert {"multi_turn", "system_and_user", "tool_call_and_response"} <= {c["conversation"] for c in cases}


def test_rendering_equals_transformers(tiny_a) -> None:
    tok, metadata = tiny_a
    extra = special_tokens(metadata)
    assert extra == GOLDENS["special_tokens"]  # the GGUF gives the template the same special-token strings
    for case in GOLDENS["cases"]:
        text = render_chat(template_of(case), case["messages"], add_generation_prompt=case["add_generation_prompt"],
                           enable_thinking=case["enable_thinking"], tools=case["tools"], **extra)
        label = (f'{case["template"]}/{case["conversation"]} thinking={case["enable_thinking"]} '
                 f'tools={bool(case["tools"])}')
        assert text == case["rendered"], label
        assert tok.encode(text) == case["ids"], label  # exactly one BOS: the template's


def test_template_from_the_gguf_is_the_checkpoint_template(tiny_a) -> None:
    _, metadata = tiny_a
    assert metadata["tokenizer.chat_template"] == FIXTURE_TEMPLATE


def test_thinking_switch() -> None:
    messages = [{"role": "user", "content": "Hi"}]
    on = render_chat(FIXTURE_TEMPLATE, messages, enable_thinking=True, bos_token="<bos>")
    off = render_chat(FIXTURE_TEMPLATE, messages, enable_thinking=False, bos_token="<bos>")
    assert "<|think|>" in on and "<|think|>" not in off
    assert off.endswith("<|turn>model\n<|channel>thought\n<channel|>") and on.endswith("<|turn>model\n")


def test_raise_exception_is_a_clear_error() -> None:
    with pytest.raises(ChatTemplateError, match=GOLDENS["raise_exception_message"]):
        render_chat(GOLDENS["helpers_template"], [{"role": "forbidden", "content": "x"}])


MALICIOUS = {
    "mro walk": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "globals via cycler": "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "globals via joiner": "{{ joiner.__init__.__globals__ }}",
    "namespace dunder": "{% set ns = namespace() %}{% set ns.__class__ = 1 %}{{ ns }}",
    "namespace init dunder": "{{ namespace(__init__=1) }}",
    "message method": "{{ messages[0].update({'role': 'x'}) }}",
    "list append": "{% set l = [] %}{{ l.append(1) }}",
    "format string": "{{ '{0.__class__}'.format(messages) }}",
    "attr filter": "{{ messages | attr('__class__') }}",
    "huge repetition": "{{ 'a' * 1000000000 }}",
    "huge power": "{{ 10 ** 100000000 }}",
    "huge output": "{% for i in range(100000) %}{% for j in range(100000) %}xxxxxxxxxx{% endfor %}{% endfor %}",
    "syntax error": "{% if %}",
    "undefined call": "{{ nothing() }}",
}


@pytest.mark.parametrize("name", sorted(MALICIOUS))
def test_malicious_template_fails_safely(name: str) -> None:
    start = time.monotonic()
    with pytest.raises(ChatTemplateError) as info:
        render_chat(MALICIOUS[name], [{"role": "user", "content": "hi"}])
    assert isinstance(info.value, EngineError)  # the CLI/server show it as one line
    message = str(info.value)
    assert message.startswith("chat template") and "\n" not in message
    assert time.monotonic() - start < 5


def test_caller_objects_never_reach_the_template() -> None:
    class Sneaky:
        pass

    with pytest.raises(ChatTemplateError, match="not a JSON value"):
        render_chat(FIXTURE_TEMPLATE, [{"role": "user", "content": Sneaky()}])
    messages = [{"role": "user", "content": "hi"}]
    render_chat("{% set x = messages[0] %}{{ x.role }}", messages)
    assert messages == [{"role": "user", "content": "hi"}]


def test_no_template_is_a_clear_error() -> None:
    with pytest.raises(ChatTemplateError, match="no chat template"):
        render_chat("", [{"role": "user", "content": "hi"}])
