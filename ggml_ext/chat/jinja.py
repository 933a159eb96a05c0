"""Chat templates: render a GGUF's Jinja `tokenizer.chat_template` safely, as transformers' apply_chat_template does.

Templates come from model files and Modelfiles, i.e. from strangers, so they run in jinja2's
`ImmutableSandboxedEnvironment` (no attribute walking to Python internals, no mutation of inputs) within the size and
nesting limits of budget.py, with a time, size and output budget per render that no data-dependent branch can
escape. The helpers HF templates expect are provided with HF's semantics: `raise_exception`, `tojson` (no HTML
escaping, ensure_ascii off), `strftime_now`, `namespace` (no underscore names), `dict`, loop controls and the
`{% generation %}` block. Inputs are copied into plain JSON values.
"""
from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils

from dgemma_engine.chat.budget import (BudgetedSandbox, BudgetExceeded, ChatTemplateBudgetError, ChatTemplateError,
                                       OutputBudget, RenderBudget, active_budget, check_source)
from dgemma_engine.gguf_keys import KEY_BOS_ID, KEY_EOS_ID, KEY_MASK_ID, KEY_PADDING_ID, KEY_TOKENS, KEY_UNKNOWN_ID

_TEMPLATE_TOKENS = {"bos_token": KEY_BOS_ID, "eos_token": KEY_EOS_ID, "pad_token": KEY_PADDING_ID,
                    "unk_token": KEY_UNKNOWN_ID, "mask_token": KEY_MASK_ID}  # template variable -> GGUF id key


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (HF's assistant-mask marker): renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore-prefixed names (no route to dunder attributes)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # same signature trick as jinja2's Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


class _LimitedSandbox(BudgetedSandbox):
    """The budgeted immutable sandbox (budget.py) that also refuses, rather than hides, unsafe attributes."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        # jinja2 would return a silent Undefined (rendering as ""); an attempt to reach internals is an error here.
        raise jinja2.exceptions.SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__} is unsafe")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Dict:
    """`dict(...)` for templates without exposing the dict type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)


def compile_template(template: str) -> jinja2.Template:
    """The template compiled in the budgeted sandbox (cached), once its source is within MAX_TEMPLATE_CHARS and its
    nesting within MAX_TEMPLATE_DEPTH (budget.py); ChatTemplateError (a one-line 400) otherwise."""
    check_source(template)
    return _compile(template)


@functools.lru_cache(maxsize=16)  # a compiled template at MAX_TEMPLATE_CHARS holds about 4 MB
def _compile(template: str) -> jinja2.Template:
    env = _LimitedSandbox(trim_blocks=True, lstrip_blocks=True,
                          extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    env.globals["dict"] = _Dict()
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template syntax error (line {exc.lineno}): {exc.message}", exc) from None
    except (SyntaxError, RecursionError, MemoryError) as exc:  # Python's compiler on the generated module
        reason = exc.msg if isinstance(exc, SyntaxError) else type(exc).__name__
        raise ChatTemplateBudgetError(f"chat template is too complex to compile ({reason})") from None


def _plain(value: Any, depth: int = 0) -> Any:
    """A deep copy made of JSON types only: the template can never reach methods of caller objects."""
    if depth > 64:
        raise ChatTemplateError("chat input nested too deeply")
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, str):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _plain(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, depth + 1) for v in value]
    raise ChatTemplateError(f"chat input contains a {type(value).__name__}, not a JSON value")


def render_chat(template: str, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                enable_thinking: bool = False, tools: list[dict[str, Any]] | None = None, **extra: Any) -> str:
    """Render `messages` (role/content dicts, plus optional tool_calls, thinking, ...) with a Jinja chat template.

    Variables seen by the template: messages, tools (None when absent, as HF passes it), add_generation_prompt,
    enable_thinking, plus `extra` (bos_token, eos_token, ... see special_tokens; any other template kwargs)."""
    if not isinstance(template, str) or not template:
        raise ChatTemplateError("the model has no chat template (use raw mode)")
    compiled = compile_template(template)
    variables = _plain({"messages": list(messages), "tools": tools, "add_generation_prompt": add_generation_prompt,
                        "enable_thinking": enable_thinking, **extra})
    budget, output = RenderBudget.start(), OutputBudget()
    try:
        with active_budget(budget):
            for piece in compiled.generate(**variables):
                output.add(piece)
        if budget.exceeded is not None:  # raised inside a filter that swallowed it
            raise budget.exceeded
    except BudgetExceeded as exc:
        raise ChatTemplateBudgetError(str(exc)) from None
    except jinja2.exceptions.SecurityError as exc:
        raise ChatTemplateError(f"chat template refused by the sandbox: {exc}", exc) from None
    except jinja2.exceptions.TemplateError as exc:
        raise ChatTemplateError(f"chat template error: {exc}", exc) from None
    except ChatTemplateError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever a stranger's template makes Python raise is its failure
        raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}", exc) from None
    return output.text()


def special_tokens(metadata: dict[str, Any]) -> dict[str, str]:
    """bos_token, eos_token, ... as strings, from the GGUF's tokenizer ids (what HF passes to templates)."""
    tokens = metadata.get(KEY_TOKENS)
    tokens = list(tokens) if tokens is not None else []
    out = {}
    for name, key in _TEMPLATE_TOKENS.items():
        i = metadata.get(key)
        if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < len(tokens) and isinstance(tokens[i], str):
            out[name] = tokens[i]  # a malformed id or vocabulary simply gives the template no such token
    return out
