"""Tool-call parsing from committed text: Gemma 4's syntax, streaming across canvas boundaries, malformed calls."""
import jinja2
from hypothesis import given, settings, strategies as st

from dgemma_engine.chat.tool_calls import (FORMATS, ToolCall, ToolCallFormat, ToolCallStream, format_for_template,
                                      parse_gemma4_body)
from surface_capture import FIXTURES

GEMMA4 = FORMATS[0]
TEMPLATE = (FIXTURES / "tiny-a" / "chat_template.jinja").read_text()


def split_tool_calls(text: str, fmt: ToolCallFormat) -> tuple[str, list[ToolCall]]:
    """Whole-text form of `ToolCallStream`."""
    stream = ToolCallStream(fmt)
    plain, calls = stream.feed(text)
    return plain + stream.finish(), calls


def render_call(name, arguments):
    """A model turn with one call, rendered by the fixture's Gemma-4-style template (the syntax the model learns)."""
    env = jinja2.Environment()
    text = env.from_string(TEMPLATE).render(
        messages=[{"role": "user", "content": "u"},
                  {"role": "assistant", "content": "", "tool_calls": [
                      {"function": {"name": name, "arguments": arguments}}]},
                  {"role": "tool", "content": "r"}],
        bos_token="")
    start = text.index("<|tool_call>")
    return text[start:text.index("<tool_call|>") + len("<tool_call|>")]


def test_template_picks_the_gemma4_format():
    assert format_for_template(TEMPLATE) is GEMMA4
    assert format_for_template("{{ messages[0].content }}") is None
    assert format_for_template(None) is None


def test_parses_what_the_template_renders():
    args = {"city": "Paris", "days": 3, "metric": True, "ratio": -0.5, "tags": ["a", "b"], "nested": {"x": None}}
    text = "Let me check." + render_call("get_weather", args) + " done"
    plain, calls = split_tool_calls(text, GEMMA4)
    assert plain == "Let me check. done"
    assert calls == [ToolCall("get_weather", args)]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.text(alphabet="abc xyz,:{}[]'", max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.from_regex(r"[a-z_]{1,6}", fullmatch=True),
                                                                inner, max_size=3),
    max_leaves=8)


@settings(max_examples=150, deadline=None)
@given(args=st.dictionaries(st.from_regex(r"[a-z_]{1,8}", fullmatch=True), json_values, max_size=4))
def test_round_trips_any_arguments(args):
    assert split_tool_calls(render_call("fn", args), GEMMA4) == ("", [ToolCall("fn", args)])


@settings(max_examples=100, deadline=None)
@given(cuts=st.lists(st.integers(0, 200), max_size=6))
def test_streaming_is_independent_of_where_canvases_end(cuts):
    text = "a<|tool_" + "b" + render_call("f", {"k": "v<|"}) + "c" + render_call("g", {}) + "<|tool_ca"
    pieces, last = [], 0
    for cut in sorted(set(c for c in cuts if c < len(text))) + [len(text)]:
        pieces.append(text[last:cut])
        last = cut
    stream = ToolCallStream(GEMMA4)
    plain, calls = "", []
    for piece in pieces:
        out, new = stream.feed(piece)
        plain += out
        calls += new
    plain += stream.finish()
    assert calls == [ToolCall("f", {"k": "v<|"}), ToolCall("g", {})]
    assert plain == "a<|tool_bc<|tool_ca"


def test_malformed_call_stays_text():
    text = "x<|tool_call>call:f{a:}<tool_call|>y<|tool_call>nonsense<tool_call|>"
    assert split_tool_calls(text, GEMMA4) == (text, [])


def test_unclosed_call_is_released_at_the_end():
    stream = ToolCallStream(GEMMA4)
    assert stream.feed("hi <|tool_call>call:f{a:1") == ("hi ", [])
    assert stream.finish() == "<|tool_call>call:f{a:1"


def test_json_strings_and_quoted_keys_are_accepted():
    assert parse_gemma4_body('call:f{"a":"x\\"y",<|"|>b c<|"|>:1}') == ToolCall("f", {"a": 'x"y', "b c": 1})
