"""Fitting a chat into the context window the way Ollama does (docs/server.md, "Truncation").

A chat whose prompt plus one canvas does not fit `num_ctx` loses its oldest messages; system messages and the latest
message always stay. When those alone are still too long, the latest message keeps its end: tokens are cut from the
start of its content (the turn header before it, and everything after it, stay).

Cost is linear in the chat: the whole chat is rendered and tokenized once, each message's text is tokenized once to
estimate how many messages must go, and the exact cut is then found by rendering only candidate chats near that
estimate (each about the size of the context window).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("dgemma.server")

RenderIds = Callable[[list[dict]], list[int]]  # messages -> prompt token ids (render + tokenize)


@dataclass(frozen=True)
class FittedPrompt:
    ids: list[int]
    dropped_messages: int = 0
    dropped_tokens: int = 0  # cut from the start of the latest message
    original_tokens: int = 0


def message_text(message: dict[str, Any]) -> str:
    """The text a message contributes to a prompt, as far as it can be known without the template."""
    content = message.get("content")
    if isinstance(content, list):  # content parts
        content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    parts = [str(content or ""), str(message.get("thinking") or "")]
    if message.get("tool_calls"):
        parts.append(repr(message["tool_calls"]))
    return "".join(parts)


def fit_chat(messages: list[dict], render_ids: RenderIds, count_tokens: Callable[[str], int], budget: int,
             truncate: bool, no_room: Callable[[int], Exception]) -> FittedPrompt:
    """Prompt ids of at most `budget` tokens (`no_room(tokens)` is raised when that is impossible or not wanted)."""
    ids = render_ids(messages)
    if len(ids) <= budget:
        return FittedPrompt(ids, original_tokens=len(ids))
    if not truncate or budget < 1:
        raise no_room(len(ids))
    chat = _Droppable(messages, render_ids, budget, ids)
    drop = _smallest_fitting(chat.fits, chat.estimate(len(ids), count_tokens), len(chat.droppable))
    if drop is not None:
        fitted = FittedPrompt(chat.ids(drop), dropped_messages=drop, original_tokens=len(ids))
    else:
        everything = len(chat.droppable)
        shortest = chat.ids(everything)
        tail = keep_latest_end(chat.kept(everything), shortest, render_ids, budget)
        fitted = FittedPrompt(tail, everything, len(shortest) - len(tail), len(ids))
    log_truncation(fitted, len(messages), budget)
    return fitted


class _Droppable:
    """The chat with its k oldest droppable messages (neither system nor the latest) left out, rendered on demand."""

    def __init__(self, messages: list[dict], render_ids: RenderIds, budget: int, full: list[int]):
        self.messages = messages
        self.render_ids = render_ids
        self.budget = budget
        self.droppable = [i for i, m in enumerate(messages[:-1]) if m.get("role") != "system"]
        self._rendered: dict[int, list[int]] = {0: full}  # the whole chat, known to be too long

    def kept(self, drop: int) -> list[dict]:
        gone = set(self.droppable[:drop])
        return [m for i, m in enumerate(self.messages) if i not in gone]

    def ids(self, drop: int) -> list[int]:
        if drop not in self._rendered:
            self._rendered[drop] = self.render_ids(self.kept(drop))
        return self._rendered[drop]

    def fits(self, drop: int) -> bool:
        return drop > 0 and len(self.ids(drop)) <= self.budget

    def estimate(self, total: int, count_tokens: Callable[[str], int]) -> int:
        """How many messages must go if each costs its text's tokens plus an equal share of the template's."""
        weights = [count_tokens(message_text(m)) for m in self.messages]
        overhead = max(0.0, (total - sum(weights)) / len(self.messages))
        excess = total - self.budget
        for drop, index in enumerate(self.droppable, start=1):
            excess -= weights[index] + overhead
            if excess <= 0:
                return drop
        return len(self.droppable)


def _smallest_fitting(fits: Callable[[int], bool], guess: int, most: int) -> int | None:
    """The smallest k in 1..most with fits(k), for a monotone `fits` with fits(0) false: probe outwards from `guess`
    in doubling steps until the answer is bracketed, then bisect. None when not even `most` fits."""
    if most < 1:
        return None
    low, high = 0, None  # low never fits, high fits
    guess = max(1, min(guess, most))
    step = 1
    if fits(guess):
        high = guess
        while high - step > low:
            if not fits(high - step):
                low = high - step
                break
            high -= step
            step *= 2
    else:
        low = guess
        while high is None:
            probe = min(low + step, most)
            if fits(probe):
                high = probe
            elif probe == most:
                return None
            else:
                low, step = probe, step * 2
    while high - low > 1:
        middle = (low + high) // 2
        if fits(middle):
            high = middle
        else:
            low = middle
    return high


def keep_latest_end(kept: list[dict], ids: list[int], render_ids: RenderIds, budget: int) -> list[int]:
    """`ids` (the system messages and the latest message) cut to `budget` tokens from the start of the latest
    message's content; if the part before that content is itself too long, simply the last `budget` tokens."""
    try:
        head = render_ids(kept[:-1] + [{**kept[-1], "content": ""}])
    except Exception:  # noqa: BLE001  (a template may refuse an empty message: fall back to the plain cut)
        head = []
    prefix = 0
    for a, b in zip(head, ids):
        if a != b:
            break
        prefix += 1
    if prefix < budget:
        return ids[:prefix] + ids[len(ids) - (budget - prefix):]
    return keep_end(ids, budget)


def keep_end(ids: list[int], budget: int) -> list[int]:
    return ids[len(ids) - budget:] if len(ids) > budget else list(ids)


def log_truncation(fitted: FittedPrompt, messages: int, budget: int) -> None:
    log.warning("truncating the prompt to fit the context window (%d tokens for the prompt): dropped %d of %d "
                "messages and %d tokens of the latest message (%d -> %d tokens)", budget, fitted.dropped_messages,
                messages, fitted.dropped_tokens, fitted.original_tokens, len(fitted.ids))


def fit_tokens(ids: list[int], budget: int) -> list[int]:
    """A single prompt cut to its last `budget` tokens (logged)."""
    if len(ids) <= budget or budget < 1:
        return ids
    fitted = FittedPrompt(keep_end(ids, budget), dropped_tokens=len(ids) - budget, original_tokens=len(ids))
    log_truncation(fitted, 1, budget)
    return fitted.ids
