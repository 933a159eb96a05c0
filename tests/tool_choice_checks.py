"""What tests/test_tool_choice.py and bench/tool_choice.py send and check: two function tools in both APIs' shapes,
the forced choices, and one call read back from each API (whole or streamed) with the real `openai` client."""
import json

# (numeric bounds are left out: structured output does not enforce them, docs/generation.md)
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                            "days": {"type": "integer"}, "unit": {"enum": ["C", "F"]}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}}, "required": ["zone"],
        "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
CHAT_TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name} of a place",
                                                "parameters": schema}} for name, schema in SCHEMAS.items()]
RESPONSES_TOOLS = [{"type": "function", "name": name, "description": f"{name} of a place", "parameters": schema}
                   for name, schema in SCHEMAS.items()]
MESSAGE = "What is the weather in Paris for the next three days?"
MAX_TOKENS = 64


def forced_choices(api: str) -> list[tuple[str, object, set[str]]]:
    """(label, tool_choice, the functions the call may name)."""
    named = ({"type": "function", "function": {"name": "get_time"}} if api == "chat"
             else {"type": "function", "name": "get_time"})
    return [("required", "required", set(SCHEMAS)), ("named", named, {"get_time"})]


def chat_call(client, choice, seed: int, stream: bool) -> tuple[str, str, str]:
    """(name, arguments, the answer's text) of the one call of a chat completion; asserts there is exactly one."""
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": MESSAGE}], tools=CHAT_TOOLS, tool_choice=choice,
                  max_tokens=MAX_TOKENS, seed=seed)
    if not stream:
        choice_ = client.chat.completions.create(**kwargs).choices[0]
        assert choice_.finish_reason == "tool_calls", (seed, choice_)
        [call] = choice_.message.tool_calls
        assert choice_.message.content is None
        return call.function.name, call.function.arguments, ""
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(calls) == 1 and chunks[-1].choices[0].finish_reason == "tool_calls", (seed, text, calls)
    return calls[0].function.name, calls[0].function.arguments, text


def responses_call(client, choice, seed: int, stream: bool) -> tuple[str, str, str]:
    """The same for a Responses API answer (its output is the one `function_call` item)."""
    kwargs = dict(model="tiny", input=MESSAGE, tools=RESPONSES_TOOLS, tool_choice=choice,
                  max_output_tokens=MAX_TOKENS, extra_body={"seed": seed})
    if stream:
        events = list(client.responses.create(stream=True, **kwargs))
        assert events[-1].type == "response.completed", (seed, events[-1])
        response = events[-1].response
    else:
        response = client.responses.create(**kwargs)
    calls = [item for item in response.output if item.type == "function_call"]
    text = "".join(part.text for item in response.output if item.type == "message" for part in item.content)
    assert len(calls) == 1 and response.status == "completed", (seed, response)
    json.loads(calls[0].arguments)
    return calls[0].name, calls[0].arguments, text
