"""Tool calls in model output: find them in the committed text and turn them into structured calls.

A chat template that declares tools also fixes how the model writes a call. Each such syntax is one `ToolCallFormat`
row in `FORMATS` (markers plus a body parser); `format_for_template` picks the row whose markers the template uses.
Gemma 4 writes `<|tool_call>call:NAME{key:value,...}<tool_call|>`, where strings are wrapped in the `<|"|>` token,
keys are bare and other values are JSON-like literals (docs/generation.md, "Tool calls").

`ToolCallStream` works on text as it is committed canvas by canvas: `feed` returns the plain text that is safe to show
and every call that has closed; a call still open (or a marker cut in two by a canvas boundary) is held back.

A row also says how a call is written (`head`: the text between the begin marker and the arguments), so a request
that must call a tool (`tool_choice`) can constrain the answer to the syntax (dgemma_engine.chat.call_constraint):
the arguments are then written as a JSON object, which the body parser reads as well.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable


class ToolCallParseError(ValueError):
    """A call whose body does not follow its format."""


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ToolCallFormat:
    name: str
    begin: str
    end: str
    parse_body: Callable[[str], ToolCall]
    head: Callable[[str], str]  # a call's text from the begin marker to its arguments (an object), for a function


# ---- Gemma 4 ---------------------------------------------------------------------------------------------------

_GEMMA_QUOTE = '<|"|>'
_NAME = re.compile(r"call:([\w.\-]+)")  # OpenAI's function names: letters, digits, `_` and `-`
_BARE_KEY = re.compile(r"[^:{}\[\],\s]+")
_LITERAL = re.compile(r"-?\d+(\.\d+)?([eE][+-]?\d+)?|true|false|null")


class _GemmaReader:
    """Recursive-descent reader of Gemma 4's argument values."""

    def __init__(self, text: str):
        self.text, self.pos = text, 0

    def fail(self, what: str) -> ToolCallParseError:
        return ToolCallParseError(f"{what} at offset {self.pos} of tool call arguments")

    def skip_space(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos].isspace():
            self.pos += 1

    def take(self, token: str) -> bool:
        self.skip_space()
        if self.text.startswith(token, self.pos):
            self.pos += len(token)
            return True
        return False

    def quoted_rest(self) -> str:
        """The text up to the closing `<|"|>` (the opening one is already taken)."""
        end = self.text.find(_GEMMA_QUOTE, self.pos)
        if end < 0:
            raise self.fail("unterminated string")
        out, self.pos = self.text[self.pos:end], end + len(_GEMMA_QUOTE)
        return out

    def json_string(self) -> str:
        try:
            out, self.pos = json.JSONDecoder().raw_decode(self.text, self.pos)
        except ValueError as exc:
            raise self.fail("bad string") from exc
        if not isinstance(out, str):
            raise self.fail("bad string")
        return out

    def value(self) -> Any:
        self.skip_space()
        if self.take(_GEMMA_QUOTE):
            return self.quoted_rest()
        if self.take("{"):
            return self.mapping()
        if self.take("["):
            return self.sequence()
        if self.text.startswith('"', self.pos):  # a JSON string, which some fine-tunes write
            return self.json_string()
        literal = _LITERAL.match(self.text, self.pos)
        if not literal:
            raise self.fail("expected a value")
        self.pos = literal.end()
        return json.loads(literal.group())

    def mapping(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.take("}"):
            return out
        while True:
            self.skip_space()
            if self.take(_GEMMA_QUOTE):
                key = self.quoted_rest()
            elif self.text.startswith('"', self.pos):  # a JSON key (a call written under tool_choice)
                key = self.json_string()
            else:
                match = _BARE_KEY.match(self.text, self.pos)
                if not match:
                    raise self.fail("expected a key")
                key, self.pos = match.group().strip('"'), match.end()
            if not self.take(":"):
                raise self.fail("expected ':'")
            out[key] = self.value()
            if self.take("}"):
                return out
            if not self.take(","):
                raise self.fail("expected ',' or '}'")

    def sequence(self) -> list[Any]:
        out: list[Any] = []
        if self.take("]"):
            return out
        while True:
            out.append(self.value())
            if self.take("]"):
                return out
            if not self.take(","):
                raise self.fail("expected ',' or ']'")


def parse_gemma4_body(body: str) -> ToolCall:
    """`call:NAME{...}` → ToolCall."""
    body = body.strip()
    name = _NAME.match(body)
    if not name:
        raise ToolCallParseError("tool call does not start with call:NAME")
    reader = _GemmaReader(body)
    reader.pos = name.end()
    arguments: dict[str, Any] = {}
    if reader.take("{"):
        arguments = reader.mapping()
    reader.skip_space()
    if reader.pos != len(body):
        raise reader.fail("unexpected text after the arguments")
    return ToolCall(name.group(1), arguments)


FORMATS: tuple[ToolCallFormat, ...] = (
    ToolCallFormat("gemma4", "<|tool_call>", "<tool_call|>", parse_gemma4_body, lambda name: f"call:{name}"),
)
# the control tokens a call is written with: an answer's text keeps them for the call parser (chat.answer_text)
CALL_TOKENS = frozenset({_GEMMA_QUOTE} | {f.begin for f in FORMATS} | {f.end for f in FORMATS})


def format_for_template(template: str | None) -> ToolCallFormat | None:
    """The tool-call syntax a chat template teaches its model, or None when it declares no tools."""
    if not template:
        return None
    return next((fmt for fmt in FORMATS if fmt.begin in template and fmt.end in template), None)


# ---- streaming -------------------------------------------------------------------------------------------------


def _held_prefix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker` (it may continue in the next piece)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class ToolCallStream:
    """Splits committed text into plain text and complete tool calls, piece by piece."""

    def __init__(self, fmt: ToolCallFormat):
        self.fmt = fmt
        self.pending = ""  # text not yet released: an open call or a possible marker start

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self.pending += text
        plain: list[str] = []
        calls: list[ToolCall] = []
        while True:
            start = self.pending.find(self.fmt.begin)
            if start < 0:
                keep = _held_prefix(self.pending, self.fmt.begin)
                plain.append(self.pending[:len(self.pending) - keep])
                self.pending = self.pending[len(self.pending) - keep:]
                break
            end = self.pending.find(self.fmt.end, start + len(self.fmt.begin))
            if end < 0:
                plain.append(self.pending[:start])
                self.pending = self.pending[start:]
                break
            plain.append(self.pending[:start])
            body = self.pending[start + len(self.fmt.begin):end]
            try:
                calls.append(self.fmt.parse_body(body))
            except ToolCallParseError:  # not a call after all: the user sees what the model wrote
                plain.append(self.pending[start:end + len(self.fmt.end)])
            self.pending = self.pending[end + len(self.fmt.end):]
        return "".join(plain), calls

    def finish(self) -> str:
        """What is left at the end: an unclosed call stays text (the model did not finish it)."""
        rest, self.pending = self.pending, ""
        return rest
