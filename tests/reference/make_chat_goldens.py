"""Record transformers' apply_chat_template renderings as goldens for tests/test_chat.py (needs transformers).

For the fixture checkpoint's template (tests/fixtures/tiny-a: chat_template.jinja + tokenizer) and for a small
template exercising HF's helpers (tojson options, namespace, loop controls, dict, raise_exception, generation
blocks), it renders a set of conversations (system prompt, multi-turn, thinking on/off, tools, tool calls and
responses, content parts) and stores the text and its token ids (`tokenize=True`, which adds no second BOS here).

    python3 tests/reference/make_chat_goldens.py     # writes tests/goldens/chat_template.json
"""
from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "fixtures" / "tiny-a"
OUT = ROOT / "goldens" / "chat_template.json"

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
CLOCK_TOOL = {"type": "function", "function": {"name": "now", "description": "", "parameters": {}}}

CONVERSATIONS = {
    "single_user": [{"role": "user", "content": "Why is the sky blue?"}],
    "system_and_user": [{"role": "system", "content": "You are terse."},
                        {"role": "user", "content": "Hello there"}],
    "multi_turn": [{"role": "system", "content": "Answer in French."},
                   {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Bonjour !"},
                   {"role": "user", "content": "How are you?\nTwo lines."}],
    "unicode_and_spaces": [{"role": "user", "content": "  日本語 🎉 héllo  \n\n  tabs\there "}],
    "content_parts": [{"role": "user", "content": [{"type": "text", "text": "part one "},
                                                   {"type": "text", "text": "part two"}]}],
    "tool_call_and_response": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]},
        {"role": "tool", "name": "get_weather", "content": {"temp": 21.5, "sky": "clear", "rain": None,
                                                           "windy": False}},
    ],
    "tool_response_then_answer": [
        {"role": "user", "content": "Time?"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "now", "arguments": {}}}]},
        {"role": "tool", "name": "now", "content": "12:00"},
        {"role": "assistant", "content": "It is noon."},
        {"role": "user", "content": "Thanks"}],
}

HELPERS_TEMPLATE = """{%- set ns = namespace(count=0, names=[]) -%}
{%- for m in messages -%}
  {%- if m.role == 'forbidden' %}{{ raise_exception('forbidden role: ' ~ m.role) }}{% endif -%}
  {%- if m.role == 'skip' %}{% continue %}{% endif -%}
  {%- set ns.count = ns.count + 1 -%}
  {%- generation %}[{{ m.role | upper }}] {{ m.content | trim }}{% endgeneration %}
{% if loop.index > 5 %}{% break %}{% endif -%}
{%- endfor -%}
{{ bos_token }}|{{ eos_token }}|{{ ns.count }}|{{ tools | tojson }}|{{ tools | tojson(indent=2) }}
{{ {'b': 1, 'a': [1, 2.5, 'é', none, true]} | tojson(sort_keys=true, separators=(',', ':')) }}
{{ dict(x=1, y='<b>') | tojson }}|{{ messages | length }}|{% if add_generation_prompt %}GEN{% endif %}
"""


def cases(tokenizer, template: str, name: str) -> list[dict]:
    out = []
    for conv_name, messages in CONVERSATIONS.items():
        for thinking in (False, True):
            for tools in (None, [WEATHER_TOOL, CLOCK_TOOL]):
                last_is_tool = messages[-1]["role"] == "tool"
                for add_gen in ((True,) if not last_is_tool else (True, False)):
                    kwargs = dict(add_generation_prompt=add_gen, enable_thinking=thinking, tools=tools)
                    text = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False, **kwargs)
                    ids = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=True,
                                                        return_dict=False, **kwargs)
                    out.append({"template": name, "conversation": conv_name, "messages": messages, **kwargs,
                                "rendered": text, "ids": list(ids)})
    return out


def main() -> None:
    tokenizer = AutoTokenizer.from_pretrained(FIXTURE)
    fixture_template = (FIXTURE / "chat_template.jinja").read_text()
    records = cases(tokenizer, fixture_template, "fixture") + cases(tokenizer, HELPERS_TEMPLATE, "helpers")
    # raise_exception must surface as an error, with HF's message.
    try:
        tokenizer.apply_chat_template([{"role": "forbidden", "content": "x"}], chat_template=HELPERS_TEMPLATE,
                                      tokenize=False)
        raise AssertionError("raise_exception did not raise")
    except Exception as exc:  # jinja2 TemplateError
        error = str(exc)
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps({"helpers_template": HELPERS_TEMPLATE, "raise_exception_message": error,
                               "special_tokens": {k: v for k, v in tokenizer.special_tokens_map.items()
                                                  if isinstance(v, str)},
                               "cases": records}, ensure_ascii=False, indent=1) + "\n")
    print(f"{len(records)} renderings -> {OUT}")


if __name__ == "__main__":
    main()
