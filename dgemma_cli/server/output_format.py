"""Structured output requests: Ollama's `format`, OpenAI's `response_format` and the Responses API's `text.format`,
all read into one `OutputFormat` (docs/generation.md, "Structured output"; docs/server.md).

A schema is checked here, in the request (a 400 before any model load); it is compiled against the model's
vocabulary before the request queues for the model (server/schema_compiler.py).
"""
import json
from dataclasses import dataclass
from typing import Any

from dgemma_cli.server.errors import RequestError

MAX_SCHEMA_CHARS = 65536


@dataclass(frozen=True)
class OutputFormat:
    schema: dict[str, Any] | None  # None: any JSON object (`format: "json"`, `json_object`)


ANY_OBJECT = OutputFormat(None)


def checked_schema(schema: Any) -> OutputFormat:
    """A JSON schema object the compiler supports, else a one-line 400."""
    from dgemma_engine.constrained import ConstraintError, schema_regex

    if not isinstance(schema, dict):
        raise RequestError("invalid JSON schema in format: the schema must be a JSON object")
    if len(json.dumps(schema)) > MAX_SCHEMA_CHARS:
        raise RequestError(f"invalid JSON schema in format: longer than {MAX_SCHEMA_CHARS} characters")
    try:
        schema_regex(schema)
    except ConstraintError as exc:
        raise RequestError(str(exc).splitlines()[0]) from None
    return OutputFormat(schema)


def ollama_format(value: str | dict | None) -> OutputFormat | None:
    """`format`: absent, "" or {} (no constraint), "json" (any object) or a JSON schema."""
    if value in (None, "", {}):
        return None
    if value == "json":
        return ANY_OBJECT
    if isinstance(value, str):
        raise RequestError(f'invalid format: "{value}"; expected "json" or a valid JSON Schema object')
    return checked_schema(value)


def openai_format(kind: str, schema: Any) -> OutputFormat | None:
    """`response_format` / `text.format`: "text" (none), "json_object" (any object) or "json_schema" with its schema
    (without one: any object)."""
    kind = kind.strip().lower()
    if kind == "text":
        return None
    if kind == "json_object" or (kind == "json_schema" and schema is None):
        return ANY_OBJECT
    if kind == "json_schema":
        return checked_schema(schema)
    raise RequestError(f"unsupported response format type {kind!r} (expected text, json_object or json_schema)")
