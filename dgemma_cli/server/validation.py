"""Request validation shared by the native and the OpenAI API: one rule set, one wording (docs/server.md).

Every JSON body is parsed by `parse_body` (through `routing.CheckedRoute`), before the request models see it, so the
same rules hold for every field of every endpoint:
- numbers: integers within 64 bits, other numbers finite doubles (`1e400` or a 400-digit integer would otherwise
  overflow wherever it is converted) → `invalid value for max_tokens: number out of range`;
- strings (values and keys): valid Unicode, i.e. no lone surrogate (`"\\udfff"` is legal JSON but no UTF-8 text)
  → `invalid Unicode in messages.0.content: lone surrogate U+DFFF`;
- nesting: at most `MAX_DEPTH` levels.
The other rules here are per field: float32 options, durations, message roles, the OpenAI `prompt`
list, model names. Pure Python (no web framework): the CLI's duration parsing uses it too.
"""
from __future__ import annotations

import json
import math
import re
from typing import Any

from dgemma_cli.errors import out_of_range
from dgemma_cli.server.errors import RequestError

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
FLOAT32_MAX = 3.4028234663852886e38
MAX_DEPTH = 100  # JSON levels; tool and format schemas nest a few dozen at most
CHAT_ROLES = ("system", "user", "assistant", "tool")
ROLE_ALIASES = {"developer": "system"}  # OpenAI's newer name for the system role
# Values in these top-level objects are named like every other option error does: by the option alone
# (`invalid value for temperature: ...`, not `options.temperature`).
OPTION_OBJECTS = ("options", "parameters")
_SURROGATE = re.compile("[\ud800-\udfff]")
_MAX_INT_DIGITS = len(str(INT64_MIN))


# ---- the body rules -------------------------------------------------------------------------------------------------

class _OutOfRange:
    """What the parser leaves where a number does not fit: the walk then names the field."""


_OUT_OF_RANGE = _OutOfRange()


def _parse_int(text: str) -> int | _OutOfRange:
    if len(text) > _MAX_INT_DIGITS:  # also keeps Python's 4300-digit conversion limit out of reach
        return _OUT_OF_RANGE
    value = int(text)
    return value if INT64_MIN <= value <= INT64_MAX else _OUT_OF_RANGE


def _parse_float(text: str) -> float | _OutOfRange:
    value = float(text)
    return value if math.isfinite(value) else _OUT_OF_RANGE


def _parse_constant(name: str) -> float | _OutOfRange:
    """`NaN` stays a number for the fields to refuse as before; `Infinity` is out of range like `1e400`."""
    return math.nan if name == "NaN" else _OUT_OF_RANGE


def lone_surrogate(text: str) -> str | None:
    """`U+DFFF` for the first lone surrogate in `text`, else None."""
    if text.isascii():
        return None
    match = _SURROGATE.search(text)
    return None if match is None else f"U+{ord(match.group()):04X}"


def invalid_unicode(field: str, code_point: str) -> RequestError:
    shown = field.encode("utf-8", "backslashreplace").decode()  # a key may be the bad string itself
    return RequestError(f"invalid Unicode in {shown}: lone surrogate {code_point}")


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _broken_rule(item: Any) -> str | None:
    """The code point of a lone surrogate in a string, "range" for a number out of range, else None."""
    if isinstance(item, str):
        return lone_surrogate(item)
    return "range" if item is _OUT_OF_RANGE else None


def _raise_for(path: str, broken: str) -> None:
    path = path or "body"
    raise out_of_range(path) if broken == "range" else invalid_unicode(path, broken)


def check_tree(value: Any) -> None:
    """Walk a parsed body and apply the body rules. Iterative, and a path is only built for containers and for the
    value that broke a rule: a body of millions of numbers costs one pass and no copies."""
    broken = _broken_rule(value)
    if broken is not None:
        _raise_for("", broken)
    pending: list[tuple[str, Any, int]] = [("", value, 1)] if isinstance(value, dict | list) else []
    while pending:
        path, container, depth = pending.pop()
        if depth > MAX_DEPTH:
            raise RequestError(f"request body nested too deeply (more than {MAX_DEPTH} levels)")
        entries = container.items() if isinstance(container, dict) else enumerate(container)
        for key, child in entries:
            if isinstance(key, str) and (broken := lone_surrogate(key)) is not None:
                _raise_for(_join(path, key), broken)
            if isinstance(child, dict | list):
                bare = depth == 1 and key in OPTION_OBJECTS and isinstance(child, dict)
                pending.append(("" if bare else _join(path, key), child, depth + 1))
            elif (broken := _broken_rule(child)) is not None:
                _raise_for(_join(path, key), broken)


def parse_body(body: bytes) -> Any:
    """The JSON body under the body rules. Malformed JSON raises `json.JSONDecodeError` (FastAPI's `invalid JSON`
    answer); a broken rule raises RequestError."""
    try:
        value = json.loads(body, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_parse_constant)
    except RecursionError:
        raise RequestError(f"request body nested too deeply (more than {MAX_DEPTH} levels)") from None
    except UnicodeDecodeError:
        raise RequestError("invalid JSON: the body is not UTF-8 text") from None
    check_tree(value)
    return value


# ---- per-field rules ------------------------------------------------------------------------------------------------

def check_float32(field: str, value: float) -> float:
    """Options typed float32 (as in Ollama) must fit one."""
    if abs(value) > FLOAT32_MAX:
        raise out_of_range(field)
    return value


def chat_role(role: str) -> str:
    """The one role check of /api/chat and /v1/chat/completions: the role in lower case, aliases resolved."""
    role = role.lower()
    role = ROLE_ALIASES.get(role, role)
    if role not in CHAT_ROLES:
        raise RequestError(f"invalid message role {role!r}")
    return role


def single_prompt(prompt: str | list[str]) -> str:
    """OpenAI's completion `prompt`: a string, or a list of exactly one (batches are not supported)."""
    if isinstance(prompt, str):
        return prompt
    if len(prompt) != 1:
        raise RequestError(f"prompt must be a string or a list of one string (got a list of {len(prompt)})")
    return prompt[0]


def check_name_text(text: str | None) -> None:
    """A model name (or `from`) with a NUL byte is no name, nor a path anyone may open."""
    if text is not None and "\x00" in text:
        raise RequestError("invalid model name")
