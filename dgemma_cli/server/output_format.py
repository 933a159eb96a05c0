"""Structured output requests: Ollama's `format`, OpenAI's `response_format` and the Responses API's `text.format`,
all read into one `OutputFormat` (docs/generation.md, "Structured output"; docs/server.md); and an answer that must
be a tool call (`tool_choice`, server/tool_choice.py), which is structured output too.

A schema is checked here, in the request (a 400 before any model load); it is compiled against the model's
vocabulary before the request queues for the model (server/schema_compiler.py, `compiled`).
"""
import asyncio
import json
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from dgemma_cli.server.errors import RequestError

MAX_SCHEMA_CHARS = 65536
CALL_AUTOMATA = 8  # tool-call automata kept in memory (each about the size of its functions' argument automata)
CALL_SYNTAXES = 16  # models whose tool-call syntax and marker tokens are known


@dataclass(frozen=True)
class OutputFormat:
    schema: dict[str, Any] | None  # None: any JSON object (`format: "json"`, `json_object`)
    # non-empty: the answer is one tool call of one of these functions, (name, parameters schema), in the template's
    # syntax; `schema` is then unused
    calls: tuple[tuple[str, dict[str, Any]], ...] = ()
    model_label: str = ""  # the model as the request named it, for "does not support tools"


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


# ---- compiling a format for a model ------------------------------------------------------------------------------

_call_automata: OrderedDict[tuple, Any] = OrderedDict()
_call_syntaxes: OrderedDict[tuple, Any] = OrderedDict()


async def compiled(schemas: Any, local_model: Any, output_format: OutputFormat) -> Any:
    """The TokenAutomaton of `output_format` for the model (`schemas`: the server's SchemaCompiler); ConstraintError
    (one line) when it cannot be made."""
    if not output_format.calls:
        return await schemas.automaton(local_model.gguf_path, output_format.schema)
    from dgemma_engine.automata import schema_key
    from dgemma_engine.chat.call_constraint import call_automaton
    from dgemma_engine.constrained import ConstraintError, decode_index

    syntax = await asyncio.to_thread(call_syntax, local_model)
    if syntax is None:
        raise ConstraintError(f"{output_format.model_label} does not support tools")
    fmt, begin_id, end_id = syntax
    path = local_model.gguf_path
    vocabulary = await schemas.vocabulary(path)
    if vocabulary is None:  # a test server's stand-in compiler: its scripted answers follow no automaton
        return {"calls": output_format.calls}
    key = (vocabulary.digest, fmt.name, begin_id, end_id,
           tuple((name, schema_key(parameters)) for name, parameters in output_format.calls))
    if key in _call_automata:
        _call_automata.move_to_end(key)
        return _call_automata[key]
    arguments: dict[str, Any] = {}  # one automaton per distinct schema (compiled and cached as structured output)
    for name, parameters in output_format.calls:
        if schema_key(parameters) not in arguments:
            arguments[schema_key(parameters)] = await schemas.automaton(path, parameters)
    functions = [(name, arguments[schema_key(parameters)]) for name, parameters in output_format.calls]
    automaton = await asyncio.to_thread(call_automaton, fmt, functions, vocabulary.token_map, vocabulary.stop_ids,
                                        begin_id, end_id)
    await asyncio.to_thread(decode_index, automaton)
    _call_automata[key] = automaton
    while len(_call_automata) > CALL_AUTOMATA:
        _call_automata.popitem(last=False)
    return automaton


def call_syntax(local_model: Any) -> tuple[Any, int | None, int | None] | None:
    """The tool-call syntax the model's chat template teaches (dgemma_engine.chat.tool_calls.ToolCallFormat) and the
    token of each of its markers (None: the vocabulary has no such token; the marker is spelled in text), read from
    the GGUF's metadata without loading the model; None when the template declares no tools. Known once per model
    file and template."""
    from dgemma_engine import gguf_keys
    from dgemma_engine.chat.templates import select_template, tool_format_of

    from dgemma_cli.gguf_check import read_gguf_info

    key = (os.fspath(local_model.gguf_path), getattr(local_model, "template", None),
           (getattr(local_model, "config", None) or {}).get("template_format"))
    if key in _call_syntaxes:
        _call_syntaxes.move_to_end(key)
        return _call_syntaxes[key]
    metadata = read_gguf_info(local_model.gguf_path, keep_arrays=frozenset({gguf_keys.KEY_TOKENS})).metadata
    fmt = tool_format_of(select_template(local_model, metadata))
    syntax = None
    if fmt is not None:
        ids = {str(token): i for i, token in reversed(list(enumerate(metadata.get(gguf_keys.KEY_TOKENS) or [])))}
        syntax = (fmt, ids.get(fmt.begin), ids.get(fmt.end))
    _call_syntaxes[key] = syntax
    while len(_call_syntaxes) > CALL_SYNTAXES:
        _call_syntaxes.popitem(last=False)
    return syntax
