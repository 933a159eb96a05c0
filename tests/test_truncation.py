"""Ollama-style truncation (dgemma_cli/server/truncation.py): the same chats as dropping the oldest message one render
at a time, at linear cost; the latest message keeps its end; `truncate: false` keeps the error."""
import time

import pytest
from hypothesis import given, settings, strategies as st

from dgemma_cli.server.prompts import ChatPrompt
from dgemma_cli.server.truncation import fit_chat
from server_harness import FakeBehaviour, FakeRunner

HEADER, GENERATION_PROMPT = 2, 3


class CountingRenderer:
    """Two header tokens per message, one token per content character, three for the generation prompt; counts calls."""

    def __init__(self):
        self.renders = 0
        self.rendered_messages = 0

    def __call__(self, messages):
        self.renders += 1
        self.rendered_messages += len(messages)
        ids = []
        for m in messages:
            ids += [-1, -2] + [ord(c) for c in m["content"]]
        return ids + [-3] * GENERATION_PROMPT


def no_room(tokens):
    return ValueError(f"no room for {tokens}")


def drop_one_at_a_time(messages, render, budget):
    """The quadratic reference: re-render after each dropped message."""
    messages = list(messages)
    while True:
        ids = render(messages)
        if len(ids) <= budget:
            return ids
        droppable = [i for i, m in enumerate(messages[:-1]) if m["role"] != "system"]
        if not droppable:
            return None
        del messages[droppable[0]]


chats = st.lists(st.tuples(st.sampled_from(["system", "user", "assistant", "tool"]), st.integers(0, 40)),
                 min_size=1, max_size=40)


@settings(max_examples=300, deadline=None)
@given(chat=chats, budget=st.integers(1, 400), scale=st.sampled_from([0.3, 1.0, 3.0]))
def test_same_result_as_dropping_one_message_at_a_time(chat, budget, scale):
    """Whatever the per-message estimate is off by (`scale`), the kept chat is the longest fitting suffix."""
    messages = [{"role": role, "content": "x" * size} for role, size in chat]
    render = CountingRenderer()
    expected = drop_one_at_a_time(messages, render, budget)
    if expected is None:  # system messages and the latest alone are too long: cut, never more than the budget
        assert len(fit_chat(messages, render, lambda t: int(len(t) * scale), budget, True, no_room).ids) == budget
    else:
        assert fit_chat(messages, render, lambda t: int(len(t) * scale), budget, True, no_room).ids == expected


def test_system_messages_and_the_latest_stay():
    messages = ([{"role": "system", "content": "S" * 5}] + [{"role": "user", "content": f"old{i:03d}"} for i in range(50)]
                + [{"role": "system", "content": "T"}, {"role": "user", "content": "latest"}])
    fitted = fit_chat(messages, CountingRenderer(), len, 60, True, no_room)
    text = "".join(chr(i) for i in fitted.ids if i > 0)
    assert text.startswith("SSSSS") and text.endswith("Tlatest") and "old049" in text and "old000" not in text
    assert len(fitted.ids) <= 60 and fitted.dropped_tokens == 0 and fitted.dropped_messages > 40


def test_an_over_long_latest_message_keeps_its_end_and_the_system_prompt():
    messages = [{"role": "system", "content": "SYS"}, {"role": "user", "content": "a" * 10},
                {"role": "user", "content": "".join(str(i % 10) for i in range(100))}]
    fitted = fit_chat(messages, CountingRenderer(), len, 40, True, no_room)
    assert len(fitted.ids) == 40 and fitted.dropped_messages == 1 and fitted.dropped_tokens == 100 + 2 + 5 + 3 - 40
    assert fitted.ids[:7] == [-1, -2] + [ord(c) for c in "SYS"] + [-1, -2]  # system turn and the header kept
    assert "".join(chr(i) for i in fitted.ids if i > 0).endswith("56789")  # the message's end kept
    assert fitted.ids[-3:] == [-3] * 3  # the generation prompt kept


def test_truncate_false_and_no_budget_raise():
    messages = [{"role": "user", "content": "x" * 50}, {"role": "user", "content": "y"}]
    with pytest.raises(ValueError, match="no room for 58"):
        fit_chat(messages, CountingRenderer(), len, 20, False, no_room)
    with pytest.raises(ValueError, match="no room"):
        fit_chat(messages, CountingRenderer(), len, 0, True, no_room)


def test_cost_is_linear_in_the_chat():
    """2,000 short messages: one full render, then a few renders of about the window's size (not 2,000 renders)."""
    messages = [{"role": "system", "content": "s"}] + [{"role": "user", "content": f"m{i}"} for i in range(2000)]
    render = CountingRenderer()
    fitted = fit_chat(messages, render, len, 200, True, no_room)
    assert len(fitted.ids) <= 200 and render.renders <= 8
    assert render.rendered_messages <= len(messages) + 8 * 60


def test_chat_prompt_through_a_runner_keeps_system_and_latest():
    runner = FakeRunner(FakeBehaviour(canvas_length=8), None, 256)
    messages = ([{"role": "system", "content": "Be brief."}] + [{"role": "user", "content": f"turn {i}"} for i in range(300)]
                + [{"role": "user", "content": "the latest"}])
    started = time.perf_counter()
    text = runner.detokenize(ChatPrompt(messages).ids(runner, None, None))
    assert time.perf_counter() - started < 1.0
    assert text.startswith("<system>Be brief.<user>turn") and text.endswith("<user>the latest<assistant>")
    assert len(text) <= 256 - 8 and "turn 0<" not in text
