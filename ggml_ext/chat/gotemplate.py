"""The safe subset of Go templates that Ollama Modelfiles use (docs/compat.md#template-policy rule 3).

Only `{{ .System }}`, `{{ .Prompt }}`, `{{ .Response }}`, `{{ if .X }}…{{ else }}…{{ end }}` and the `{{-`/`-}}`
whitespace trimming are understood; there are no functions, pipelines or `range`, so nothing a template says can do
more than place the three strings. Any other construct makes the whole template unsupported (the caller falls back).
"""
import re
from dataclasses import dataclass, field

from dgemma_engine.errors import DgemmaError

FIELDS = ("System", "Prompt", "Response")
_ACTION = re.compile(r"\{\{(-?)(.*?)(-?)\}\}", re.DOTALL)


class UnsupportedTemplate(DgemmaError):
    """The template uses a Go construct outside the safe subset."""


@dataclass
class _If:
    field: str
    then: list = field(default_factory=list)
    otherwise: list = field(default_factory=list)


def _tokens(template: str) -> list[tuple[str, str]]:
    """("text", s) and ("action", body) pieces, with `{{-` / `-}}` trimming applied to the neighbouring text."""
    pieces: list[tuple[str, str]] = []
    pos = 0
    trim_next = False
    for match in _ACTION.finditer(template):
        text = template[pos : match.start()]
        if trim_next:
            text = text.lstrip()
        if match.group(1) == "-":
            text = text.rstrip()
        pieces.append(("text", text))
        pieces.append(("action", match.group(2).strip()))
        trim_next = match.group(3) == "-"
        pos = match.end()
    tail = template[pos:]
    pieces.append(("text", tail.lstrip() if trim_next else tail))
    return pieces


def parse(template: str) -> list:
    """A tree of strings, field names (`.System`) and `_If` nodes; UnsupportedTemplate for anything else."""
    root: list = []
    stack: list[tuple[list, _If | None]] = [(root, None)]
    for kind, value in _tokens(template):
        body, node = stack[-1]
        if kind == "text":
            if value:
                body.append(value)
            continue
        field_match = re.fullmatch(r"\.(\w+)", value)
        if_match = re.fullmatch(r"if\s+\.(\w+)", value)
        if field_match and field_match.group(1) in FIELDS:
            body.append("." + field_match.group(1))
        elif if_match and if_match.group(1) in FIELDS:
            new = _If(if_match.group(1))
            body.append(new)
            stack.append((new.then, new))
        elif value == "else" and node is not None and body is node.then:
            stack[-1] = (node.otherwise, node)
        elif value == "end" and node is not None:
            stack.pop()
        else:
            raise UnsupportedTemplate(f"unsupported template action {{{{ {value[:40]} }}}}")
    if len(stack) != 1:
        raise UnsupportedTemplate("unterminated {{ if }}")
    return root


def _render(nodes: list, values: dict[str, str]) -> str:
    out = []
    for node in nodes:
        if isinstance(node, _If):
            out.append(_render(node.then if values.get(node.field) else node.otherwise, values))
        elif node.startswith(".") and node[1:] in FIELDS:
            out.append(values.get(node[1:], ""))
        else:
            out.append(node)
    return "".join(out)


def render_messages(template: str, messages: list[dict]) -> str:
    """Ollama's legacy rendering: one pass per user turn (System on the first, Response = the assistant reply),
    concatenated; the last pass has an empty Response, which is where the model continues."""
    tree = parse(template)
    system = "\n".join(m.get("content") or "" for m in messages if m.get("role") == "system")
    turns: list[dict[str, str]] = []
    for message in messages:
        role, content = message.get("role"), message.get("content") or ""
        if role in ("user", "tool"):
            turns.append({"Prompt": content, "Response": ""})
        elif role == "assistant":
            if not turns or turns[-1]["Response"]:
                turns.append({"Prompt": "", "Response": ""})
            turns[-1]["Response"] = content
    if not turns or turns[-1]["Response"]:
        turns.append({"Prompt": "", "Response": ""})
    parts = []
    for index, turn in enumerate(turns):
        parts.append(_render(tree, {"System": system if index == 0 else "", **turn}))
    return "".join(parts)
