"""Fitting a chat into the context window the way Ollama does (docs/server.md, "Truncation").

A chat whose prompt plus one canvas does not fit `num_ctx` loses its oldest messages; system messages and the latest
message always stay. When those alone are still too long, the latest message keeps its end: tokens are cut from the
start of its content (the turn header before it, and everything after it, stay).

Cost is linear in the chat: the whole chat is rendered and tokenized once, each message's text is tokenized once to
estimate how many messages must go, and the exact cut is then found by rendering only candidate chats near that
estimate (each about the size of the context window).
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("dgemma.server")

RenderIds = Callable[[list[dict]], list[int]]  # messages -> prompt token ids (render + tokenize)
# A chat whose messages' own tokens exceed this many windows is not rendered whole (that alone can take the render
# budget of docs/server.md for a long history); below it the whole chat is rendered first, as it most likely fits.
WHOLE_RENDER_FACTOR = 2


@dataclass(frozen=True)
class FittedPrompt:
    ids: list[int]
    dropped_messages: int = 0
    dropped_tokens: int = 0  # cut from the start of the latest message


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
    chat = _Chat(messages, render_ids, budget, count_tokens)
    if not truncate or budget < 1 or chat.at_most_tokens() <= WHOLE_RENDER_FACTOR * budget \
            or sum(chat.weights) <= WHOLE_RENDER_FACTOR * budget:
        ids = chat.ids(0)
        if len(ids) <= budget:
            return FittedPrompt(ids)
        if not truncate or budget < 1:
            raise no_room(len(ids))
        low, guess = 0, chat.estimate(0)
    else:  # the messages' own text is far beyond the window: the whole chat is rendered only if it might fit after all
        low, guess = -1, chat.estimate(0, sum(chat.weights))
        if not chat.fits(guess):  # the estimate left out the template's own tokens: measure them once, guess again
            low, guess = guess, chat.estimate(guess)
    everything = len(chat.droppable)
    drop = _smallest_fitting(chat.fits, guess, everything, low)
    if drop == 0:
        return FittedPrompt(chat.ids(0))
    if drop is not None:
        fitted = FittedPrompt(chat.ids(drop), dropped_messages=drop)
    else:
        shortest = chat.ids(everything)
        tail = keep_latest_end(chat.kept(everything), shortest, render_ids, budget)
        fitted = FittedPrompt(tail, everything, len(shortest) - len(tail))
    log_truncation(fitted, len(messages), budget)
    return fitted


class _Chat:
    """The chat with its `drop` oldest droppable messages (neither system nor the latest) left out, rendered on
    demand, and each message's own token count (`weights`) for estimates."""

    def __init__(self, messages: list[dict], render_ids: RenderIds, budget: int, count_tokens: Callable[[str], int]):
        self.messages = messages
        self.render_ids = render_ids
        self.budget = budget
        self.count_tokens = count_tokens
        self.droppable = [i for i, m in enumerate(messages[:-1]) if m.get("role") != "system"]
        self._rendered: dict[int, list[int]] = {}

    @functools.cached_property
    def weights(self) -> list[int]:
        """Each message's own tokens (counted only when the chat may not fit: most chats fit by `at_most_tokens`)."""
        return [self.count_tokens(message_text(m)) for m in self.messages]

    def at_most_tokens(self) -> int:
        """A bound on the messages' own tokens without tokenizing: a token covers at least one UTF-8 byte, and a
        tokenizer may add a BOS and an EOS of its own."""
        return sum(len(message_text(m).encode("utf-8", "surrogatepass")) + 2 for m in self.messages)

    def kept(self, drop: int) -> list[dict]:
        gone = set(self.droppable[:drop])
        return [m for i, m in enumerate(self.messages) if i not in gone]

    def ids(self, drop: int) -> list[int]:
        if drop not in self._rendered:
            self._rendered[drop] = self.render_ids(self.kept(drop))
        return self._rendered[drop]

    def fits(self, drop: int) -> bool:
        return len(self.ids(drop)) <= self.budget

    def estimate(self, drop: int, tokens: int | None = None) -> int:
        """How many messages must go, from the size of the chat after `drop` (rendered, unless `tokens` is given):
        each further message counts its own tokens plus an equal share of what the template adds."""
        tokens = len(self.ids(drop)) if tokens is None else tokens
        dropped = self.droppable[:drop]
        kept_weight = sum(self.weights) - sum(self.weights[i] for i in dropped)
        overhead = max(0.0, (tokens - kept_weight) / (len(self.messages) - len(dropped)))
        excess = tokens - self.budget
        for count, index in enumerate(self.droppable[drop:], start=drop + 1):
            excess -= self.weights[index] + overhead
            if excess <= 0:
                return count
        return len(self.droppable)


def _smallest_fitting(fits: Callable[[int], bool], guess: int, most: int, low: int) -> int | None:
    """The smallest k in low+1..most with fits(k), for a monotone `fits` with fits(low) false (low -1: nothing is
    known): probe outwards from `guess` in doubling steps until the answer is bracketed, then bisect. None when not
    even `most` fits."""
    if most <= low:
        return None
    high = None  # low never fits, high fits
    guess = max(low + 1, min(guess, most))
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
                "messages and %d tokens of the latest one; %d tokens left", budget, fitted.dropped_messages,
                messages, fitted.dropped_tokens, len(fitted.ids))


def fit_tokens(ids: list[int], budget: int) -> list[int]:
    """A single prompt cut to its last `budget` tokens (logged)."""
    if len(ids) <= budget or budget < 1:
        return ids
    fitted = FittedPrompt(keep_end(ids, budget), dropped_tokens=len(ids) - budget)
    log_truncation(fitted, 1, budget)
    return fitted.ids
