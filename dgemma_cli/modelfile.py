"""Modelfiles: Ollama's grammar (the state machine of `ollama/ollama: parser/parser.go`), typed PARAMETERs including
the diffusion sampler options, and the printer behind `show --modelfile` (docs/compat.md#modelfile).

`parse_modelfile(text)` returns a `Modelfile`: the semantic content (last FROM/TEMPLATE/SYSTEM win, LICENSE and
MESSAGE accumulate, `stop` accumulates) with typed parameters. `format_modelfile` prints one in canonical order, and
parse∘format∘parse == parse.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from typing import Any

from dgemma_cli import env
from dgemma_cli.errors import DgemmaError, out_of_range
from dgemma_engine import settings
from dgemma_engine.settings import setting_for_option

COMMANDS = ("from", "license", "template", "system", "adapter", "draft", "renderer", "parser", "parameter", "message",
            "requires")
ROLES = ("system", "user", "assistant")

ERR_COMMAND = (
    'command must be one of "from", "license", "template", "system", "adapter", "draft", "renderer", '
    '"parser", "parameter", "message", or "requires"'
)
ERR_ROLE = 'message role must be one of "system", "user", or "assistant"'

# PARAMETER names and types come from dgemma_engine.settings: the sampler table and the options table (`stop` is the
# only list).
DEPRECATED_PARAMS = {
    "penalize_newline", "low_vram", "f16_kv", "logits_all", "vocab_only", "use_mlock", "mirostat", "mirostat_tau",
    "mirostat_eta",
}
_BOOL_WORDS = {"1": True, "t": True, "T": True, "true": True, "TRUE": True, "True": True,
               "0": False, "f": False, "F": False, "false": False, "FALSE": False, "False": False}
_SEMVER_RE = re.compile(r"v?(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(-[0-9A-Za-z.-]+)?(\+[0-9A-Za-z.-]+)?", re.ASCII)


class ModelfileError(DgemmaError):
    status = 400


@dataclass(frozen=True)
class Command:
    name: str  # lower-case instruction; "model" for FROM as Ollama names it
    args: str
    role: str | None = None  # MESSAGE role
    param: str | None = None  # PARAMETER name


@dataclass
class Modelfile:
    froms: list[str] = field(default_factory=list)
    template: str | None = None
    system: str | None = None
    adapters: list[str] = field(default_factory=list)  # every ADAPTER line, applied in order
    licenses: list[str] = field(default_factory=list)
    messages: list[dict[str, str]] = field(default_factory=list)
    parameters: dict[str, Any] = field(default_factory=dict)
    requires: str | None = None
    extras: dict[str, str] = field(default_factory=dict)  # RENDERER / PARSER / DRAFT: stored, ignored at inference
    commands: list[Command] = field(default_factory=list, compare=False)
    warnings: list[str] = field(default_factory=list, compare=False)

    @property
    def adapter(self) -> str | None:
        """The last ADAPTER (Ollama keeps only that one; dgemma applies all of them, docs/compat.md)."""
        return self.adapters[-1] if self.adapters else None

    @property
    def from_(self) -> str | None:
        """The last FROM (the base model name, or a path the CLI resolves)."""
        return self.froms[-1] if self.froms else None


# ---- grammar -------------------------------------------------------------------------------------------------------

_NIL, _NAME, _VALUE, _PARAMETER, _MESSAGE, _COMMENT = range(6)


class _UnexpectedEOF(Exception):
    pass


def _is_alpha(c: str) -> bool:
    return ("a" <= c <= "z") or ("A" <= c <= "Z")


def _is_space(c: str) -> bool:
    return c in " \t"


def _is_newline(c: str) -> bool:
    return c == "\n"


def unquote(s: str) -> tuple[str, bool]:
    """Strip one level of `\"\"\"…\"\"\"` or `"…"`; ok=False while the quote is still open."""
    if s.startswith('"""'):
        if len(s) >= 6 and s.endswith('"""'):
            return s[3:-3], True
        return "", False
    if s.startswith('"'):
        if len(s) >= 2 and s.endswith('"'):
            return s[1:-1], True
        return "", False
    return s, True


def _next_state(c: str, state: int) -> tuple[int, str | None]:
    """parser.go's parseRuneForState: (next state, rune to keep)."""
    if state == _NIL:
        if c == "#":
            return _COMMENT, None
        if _is_space(c) or _is_newline(c):
            return _NIL, None
        return _NAME, c
    if state == _NAME:
        if _is_alpha(c):
            return _NAME, c
        if _is_space(c):
            return _VALUE, None
        raise ValueError(ERR_COMMAND)
    if state == _VALUE:
        if _is_newline(c) or _is_space(c):
            return _NIL, c
        return _VALUE, c
    if state == _PARAMETER:
        if _is_alpha(c) or c.isascii() and c.isdigit() or c == "_":
            return _PARAMETER, c
        if _is_space(c):
            return _VALUE, None
        raise _UnexpectedEOF()
    if state == _MESSAGE:
        if _is_alpha(c):
            return _MESSAGE, c
        if _is_space(c):
            return _VALUE, None
        raise _UnexpectedEOF()
    # _COMMENT
    return (_NIL, None) if _is_newline(c) else (_COMMENT, None)


def _decode(data: str | bytes) -> str:
    if isinstance(data, bytes):
        if data.startswith((b"\xff\xfe", b"\xfe\xff")):
            data = data.decode("utf-16")
        else:
            data = data.decode("utf-8-sig", errors="replace")
    data = data.lstrip("\ufeff")
    return data.replace("\r\n", "\n").replace("\r", "\n")  # one line per CRLF (Ollama counts two)


def parse_commands(data: str | bytes) -> list[Command]:
    """Tokenise a Modelfile into commands exactly as Ollama's parser does (errors carry 1-based line numbers)."""
    text = _decode(data)
    commands: list[Command] = []
    state, line, buf = _NIL, 1, []
    name, role, param = "", None, None

    def error(msg: str) -> ModelfileError:
        return ModelfileError(f"(line {line}): {msg}")

    for c in text:
        if _is_newline(c):
            line += 1
        try:
            nxt, keep = _next_state(c, state)
        except _UnexpectedEOF:
            raise ModelfileError("unexpected EOF: " + "".join(buf)) from None
        except ValueError as exc:
            raise error(str(exc)) from None

        if nxt != state:
            if state == _NAME:
                word = "".join(buf)
                lower = word.lower()
                if lower not in COMMANDS:
                    raise error(ERR_COMMAND)
                if lower == "parameter":
                    nxt = _PARAMETER
                elif lower == "message":
                    nxt = _MESSAGE
                name = "model" if lower == "from" else lower
            elif state == _PARAMETER:
                param = "".join(buf)
            elif state == _MESSAGE:
                role = "".join(buf)
                if role not in ROLES:
                    raise error(ERR_ROLE)
            elif state == _VALUE:
                value, ok = unquote("".join(buf).strip(" \t\n"))
                if not ok or _is_space(c):
                    buf.append(c)  # still inside the value: spaces, and newlines of an open quote, are kept
                    continue
                commands.append(Command(name, value, role, param))
                role = param = None
            buf = []
            state = nxt

        if keep is not None and keep.isprintable():
            buf.append(keep)

    if state == _VALUE:
        value, ok = unquote("".join(buf).strip(" \t\n"))
        if not ok:
            raise ModelfileError("unexpected EOF")
        commands.append(Command(name, value, role, param))
    elif state not in (_NIL, _COMMENT):
        raise ModelfileError("unexpected EOF")
    return commands


# ---- typing --------------------------------------------------------------------------------------------------------

def parameter_type(name: str) -> type | None:
    """The type of a PARAMETER (int, float, bool or list), None for an unknown name."""
    setting = setting_for_option(name)
    if setting is not None:
        return setting.type
    row = settings.option_setting(name)
    return row.type if row is not None else None


def parse_parameter(name: str, value: str) -> Any:
    """Type one PARAMETER value (also used by the REPL's `/set parameter`)."""
    kind = parameter_type(name)
    if kind is int:
        try:
            return int(value, 10)
        except ValueError:
            raise ModelfileError(f"invalid int value [{value}]") from None
    if kind is float:
        try:
            number = float(value)
        except ValueError:
            raise ModelfileError(f"invalid float value [{value}]") from None
        if not math.isfinite(number):
            raise ModelfileError(f"invalid float value [{value}]")
        return number
    if kind is bool:
        if value not in _BOOL_WORDS:
            raise ModelfileError(f"invalid bool value [{value}]")
        return _BOOL_WORDS[value]
    if kind is list:
        return value
    raise ModelfileError(f"unknown parameter '{name}'")


_TYPE_WORDS = {int: "integer", float: "float32", bool: "boolean", list: "array"}


def type_word(kind: type) -> str:
    """What the type errors call a type (docs/compat.md#options-typing)."""
    return _TYPE_WORDS[kind]


def typed_value(name: str, value: Any) -> Any:
    """A JSON value (request option, REST create parameter, pulled params layer) as PARAMETER `name` holds it, else
    `option "top_k" must be of type integer`; an integral JSON number is an int. `name` must be known."""
    kind = parameter_type(name)
    if not _has_type(value, kind):
        raise ModelfileError(f'option "{name}" must be of type {_TYPE_WORDS[kind]}')
    if kind is bool:
        return value
    if kind is list:
        return list(value)
    if kind is int:
        value = int(value)
        if not settings.INT64_MIN <= value <= settings.INT64_MAX:
            raise out_of_range(name)
        return value
    value = float(value)
    if abs(value) > settings.FLOAT32_MAX:
        raise out_of_range(name)
    return value


def _has_type(value: Any, kind: type | None) -> bool:
    if kind is bool:
        return isinstance(value, bool)
    if kind is list:
        return isinstance(value, list) and all(isinstance(item, str) for item in value)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    if isinstance(value, float) and not math.isfinite(value):
        return False
    return kind is not int or not isinstance(value, float) or value.is_integer()


def typed_parameters(params: Any, *, unknown: str = "refuse") -> dict[str, Any]:
    """PARAMETERs given as JSON (REST create, a params layer, a stored model), typed: `None` values, empty lists and
    Ollama's deprecated names are dropped; an unknown name is `unknown parameter 'foo'` (`unknown="refuse"`, what a Modelfile
    does) or dropped (`"drop"`: a request reading a stored model)."""
    if not isinstance(params, dict):
        raise ModelfileError("parameters must be an object")
    typed: dict[str, Any] = {}
    for name, value in params.items():
        if value is None or name in DEPRECATED_PARAMS:
            continue
        if not isinstance(name, str) or parameter_type(name) is None:
            if unknown == "drop":
                continue
            raise ModelfileError(f"unknown parameter '{name}'")
        value = typed_value(name, value)
        if value != []:  # an empty `stop` is no stop: a Modelfile cannot write one
            typed[name] = value
    return typed


def max_steps_cap() -> int:
    return env.MAX_STEPS.get_or_default()


def check_parameter_ranges(params: dict[str, Any]) -> None:
    """The ranges of dgemma_engine.settings (the options table, then the sampler settings) applied to typed
    PARAMETERs: at create, at pull and for a stored model's request.

    Message shape: `invalid value for diffusion_steps: 0 (must be between 1 and 256)`."""
    try:
        for name, value in params.items():
            settings.check_option(name, value)
        values = {s.field: params[s.option] for s in settings.SAMPLER_SETTINGS if s.option in params}
        settings.check_values(values, max_steps_cap=max_steps_cap())
    except settings.SettingError as exc:
        raise ModelfileError(str(exc)) from None


def check_parameters(params: Any) -> dict[str, Any]:
    """The one check of a model's PARAMETERs however they arrive (Modelfile, REST create, a pulled params layer):
    names, types, ranges, and values `show --modelfile` can print. Returns them typed."""
    typed = typed_parameters(params)
    for value in typed.get("stop", ()):
        quote(value)
    check_parameter_ranges(typed)
    return typed


MESSAGE_KEYS = ("role", "content")


def check_messages(messages: Any) -> list[dict[str, str]]:
    """The one check of a model's MESSAGEs (Modelfile, REST create `messages`, a pulled messages layer): objects
    with a Modelfile role and string content, nothing else (what `show --modelfile` prints)."""
    if not isinstance(messages, list):
        raise ModelfileError("messages must be a list of objects with \"role\" and \"content\"")
    checked = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise ModelfileError(f'{where}: a message is an object with "role" and "content"')
        extra = sorted(str(key) for key in message if key not in MESSAGE_KEYS)
        if extra:
            raise ModelfileError(f'{where}: a stored message has only "role" and "content", not "{extra[0]}"'[:200])
        if message.get("role") not in ROLES:
            raise ModelfileError(f"{where}: {ERR_ROLE}")
        content = message.get("content")
        if not isinstance(content, str):
            raise ModelfileError(f"{where}: message content must be a string")
        quote(content)
        checked.append({"role": message["role"], "content": content})
    return checked


MAX_REQUIRES = 64  # REQUIRES is a version such as 0.14.0; no real one comes near this


def check_requires(value: Any) -> str:
    if not isinstance(value, str) or len(value) > MAX_REQUIRES or not _SEMVER_RE.fullmatch(value):
        raise ModelfileError("requires must be a valid semver (e.g. 0.14.0)")
    return value


TEMPLATE_CHECK_MESSAGES = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hi"},
                           {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"}]


def check_jinja(text: str) -> None:
    """Test-render a Jinja chat template with the renderer inference uses (same sandbox, same time and size
    budget), so a template refused at run time for any conversation is refused here too
    (docs/compat.md#template-policy)."""
    from dgemma_engine.chat.jinja import ChatTemplateError, render_chat

    try:
        render_chat(text, TEMPLATE_CHECK_MESSAGES, bos_token="<bos>", eos_token="<eos>")
    except ChatTemplateError as exc:
        raise ModelfileError(f"template error: {exc.detail}"[:300]) from None


def check_template(text: Any) -> str:
    """The one check of a model's TEMPLATE (Modelfile, REST create, a pulled template layer)."""
    from dgemma_engine.chat.templates import check_template_source, template_format

    if not isinstance(text, str):
        raise ModelfileError("template must be a string")
    quote(text)
    check_template_source(text)  # size and nesting, Go or Jinja (budget.py): a one-line 400
    if template_format(text) == "jinja":
        check_jinja(text)
    return text


def checked_modelfile(mf: Modelfile) -> Modelfile:
    """A Modelfile (parsed, or built from a REST create request) checked by the same rules whichever way it came,
    so `show --modelfile` of what create stores always parses and creates again. Returns it with typed PARAMETERs
    and plain {role, content} MESSAGEs; raises ModelfileError (400)."""
    parameters = check_parameters(mf.parameters)
    messages = check_messages(mf.messages)
    if mf.requires is not None:
        check_requires(mf.requires)
    for text in (mf.system, *mf.licenses):
        if text is not None:
            quote(text)  # raises `value may not contain '"""'`
    if mf.template is not None:
        check_template(mf.template)
    return replace(mf, parameters=parameters, messages=messages)


def parse_modelfile(data: str | bytes) -> Modelfile:
    """Parse, type and assemble a Modelfile; raises ModelfileError with Ollama's messages."""
    commands = parse_commands(data)
    mf = Modelfile(commands=commands)
    for cmd in commands:
        if cmd.name == "model":
            mf.froms.append(cmd.args)
        elif cmd.name in ("template", "system"):
            setattr(mf, cmd.name, cmd.args)
        elif cmd.name == "adapter":
            mf.adapters.append(cmd.args)
        elif cmd.name == "license":
            mf.licenses.append(cmd.args)
        elif cmd.name == "message":
            mf.messages.append({"role": cmd.role or "", "content": cmd.args})
        elif cmd.name == "requires":
            mf.requires = check_requires(cmd.args)
        elif cmd.name == "parameter":
            name = cmd.param or ""
            if name in DEPRECATED_PARAMS:
                mf.warnings.append(f"warning: parameter {name} is deprecated")
                continue
            value = parse_parameter(name, cmd.args)
            if parameter_type(name) is list:
                mf.parameters.setdefault(name, []).append(value)
            else:
                mf.parameters[name] = value
        else:  # renderer, parser, draft
            mf.extras[cmd.name] = cmd.args
    if not mf.froms:
        raise ModelfileError("no FROM line")
    return mf


# ---- printing ------------------------------------------------------------------------------------------------------

def quote(value: str) -> str:
    """Quote a value only when the grammar needs it (docs/compat.md#round-trip); `\"\"\"` cannot be represented."""
    if '"""' in value:
        raise ModelfileError("value may not contain '\"\"\"'")
    if value == "":
        return '""'
    if "\n" in value or value != value.strip(" \t\n") or value.startswith('"'):
        return f'"""{value}"""' if '"' in value else f'"{value}"'
    return value


def format_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    return str(value)


def format_modelfile(mf: Modelfile, header: str | None = None, from_override: str | None = None) -> str:
    """Print in canonical order: FROM, TEMPLATE, SYSTEM, PARAMETERs (sorted), LICENSEs, MESSAGEs, then the rest."""
    lines = [header.rstrip("\n") + "\n"] if header else []
    froms = [from_override] if from_override is not None else mf.froms
    lines += [f"FROM {quote(f)}" for f in froms]
    if mf.template is not None:
        lines.append(f"TEMPLATE {quote(mf.template)}")
    if mf.system is not None:
        lines.append(f"SYSTEM {quote(mf.system)}")
    for key in sorted(mf.parameters):
        values = mf.parameters[key] if isinstance(mf.parameters[key], list) else [mf.parameters[key]]
        lines += [f"PARAMETER {key} {quote(format_value(v))}" for v in values]
    lines += [f"LICENSE {quote(text)}" for text in mf.licenses]
    lines += [f"MESSAGE {m['role']} {quote(m['content'])}" for m in mf.messages]
    lines += [f"ADAPTER {quote(adapter)}" for adapter in mf.adapters]
    if mf.requires is not None:
        lines.append(f"REQUIRES {mf.requires}")
    lines += [f"{k.upper()} {quote(v)}" for k, v in sorted(mf.extras.items())]
    return "\n".join(lines) + "\n"
