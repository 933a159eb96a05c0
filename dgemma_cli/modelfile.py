"""Modelfiles: Ollama's grammar (the state machine of `ollama/ollama: parser/parser.go`), typed PARAMETERs including
the diffusion sampler options, and the printer behind `show --modelfile` (docs/compat.md#modelfile).

`parse_modelfile(text)` returns a `Modelfile`: the semantic content (last FROM/TEMPLATE/SYSTEM win, LICENSE and
MESSAGE accumulate, `stop` accumulates) with typed parameters. `format_modelfile` prints one in canonical order, and
parse∘format∘parse == parse.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from dgemma_cli import env
from dgemma_cli.errors import DgemmaError
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

# PARAMETER types (docs/compat.md#options-typing); the sampler settings' types come from dgemma_engine.settings. `stop`
# is the only list.
INT_PARAMS = {
    "num_ctx", "num_batch", "num_gpu", "main_gpu", "num_thread", "num_predict", "seed", "top_k", "repeat_last_n",
    "num_keep", "draft_num_predict", "num_cpu_moe", "num_parallel",
}
FLOAT_PARAMS = {
    "temperature", "top_p", "min_p", "typical_p", "repeat_penalty", "presence_penalty", "frequency_penalty",
}
BOOL_PARAMS = {"use_mmap", "diffusion_progress", "diffusion_preview"}
LIST_PARAMS = {"stop"}
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

def parse_parameter(name: str, value: str) -> Any:
    """Type one PARAMETER value (also used by the REPL's `/set parameter`)."""
    setting = setting_for_option(name)
    if name in INT_PARAMS or setting is not None and setting.type is int:
        try:
            return int(value, 10)
        except ValueError:
            raise ModelfileError(f"invalid int value [{value}]") from None
    if name in FLOAT_PARAMS or setting is not None and setting.type is float:
        try:
            number = float(value)
        except ValueError:
            raise ModelfileError(f"invalid float value [{value}]") from None
        if not math.isfinite(number):
            raise ModelfileError(f"invalid float value [{value}]")
        return number
    if name in BOOL_PARAMS:
        if value not in _BOOL_WORDS:
            raise ModelfileError(f"invalid bool value [{value}]")
        return _BOOL_WORDS[value]
    if name in LIST_PARAMS:
        return value
    raise ModelfileError(f"unknown parameter '{name}'")


def max_steps_cap() -> int:
    return env.MAX_STEPS.get_or_default()


# Load-time PARAMETERs with a range of their own: each generation slot holds a K/V context, so the count is bounded.
LOAD_PARAM_RANGES = {"num_parallel": (1, 64)}


def check_parameter_ranges(params: dict[str, Any]) -> None:
    """The sampler settings' ranges (dgemma_engine.settings) and LOAD_PARAM_RANGES, applied at create to the
    PARAMETERs given.

    Message shape: `invalid value for diffusion_steps: 0 (must be between 1 and 256)`."""
    for name, (low, high) in LOAD_PARAM_RANGES.items():
        if name in params and not low <= params[name] <= high:
            raise ModelfileError(f"invalid value for {name}: {params[name]} (must be between {low} and {high})")
    values = {s.field: params[s.option] for s in settings.SAMPLER_SETTINGS if s.option in params}
    try:
        settings.check_values(values, max_steps_cap=max_steps_cap())
    except settings.SettingError as exc:
        raise ModelfileError(str(exc)) from None


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
            if not _SEMVER_RE.fullmatch(cmd.args):
                raise ModelfileError("requires must be a valid semver (e.g. 0.14.0)")
            mf.requires = cmd.args
        elif cmd.name == "parameter":
            name = cmd.param or ""
            if name in DEPRECATED_PARAMS:
                mf.warnings.append(f"warning: parameter {name} is deprecated")
                continue
            value = parse_parameter(name, cmd.args)
            if name in LIST_PARAMS:
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
