"""The safe subset of Go templates that Ollama Modelfiles use (docs/compat.md#template-policy rule 3).

Only `{{ .System }}`, `{{ .Prompt }}`, `{{ .Response }}`, `{{ if .X }}…{{ else }}…{{ end }}` and the `{{-`/`-}}`
whitespace trimming are understood; there are no functions, pipelines or `range`, so nothing a template says can do
more than place the three strings. Any other construct makes the whole template unsupported (the caller falls back).
The limits of budget.py hold here as for Jinja: the source's size and nesting (`check_limits`, before parsing) and
the rendered output, counted while it is produced.
"""
import re
from dataclasses import dataclass, field

from dgemma_engine.chat.budget import MAX_TEMPLATE_DEPTH, OutputBudget, check_source, too_deep
from dgemma_engine.errors import DgemmaError

FIELDS = ("System", "Prompt", "Response")
_ACTION = re.compile(r"\{\{(-?)(.*?)(-?)\}\}", re.DOTALL)
_OPENS = frozenset(("if", "range", "with", "block", "define"))  # Go actions closed by {{ end }}


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


def check_limits(template: str) -> None:
    """Any Go template (in the safe subset or not) within MAX_TEMPLATE_CHARS and MAX_TEMPLATE_DEPTH nested actions;
    ChatTemplateBudgetError (a one-line 400) otherwise."""
    check_source(template)
    depth = 0
    for match in _ACTION.finditer(template):
        word = match.group(2).strip().split(maxsplit=1)[:1]
        if word and word[0] in _OPENS:
            depth += 1
            if depth > MAX_TEMPLATE_DEPTH:
                raise too_deep()
        elif word == ["end"]:
            depth = max(depth - 1, 0)


def parse(template: str) -> list:
    """A tree of strings, field names (`.System`) and `_If` nodes; UnsupportedTemplate for anything else, and
    ChatTemplateBudgetError beyond the limits (`check_limits`)."""
    check_limits(template)
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


def _render(nodes: list, values: dict[str, str], out: OutputBudget) -> None:
    for node in nodes:  # recursion as deep as the {{ if }} nesting, which parse bounds
        if isinstance(node, _If):
            _render(node.then if values.get(node.field) else node.otherwise, values, out)
        elif node.startswith(".") and node[1:] in FIELDS:
            out.add(values.get(node[1:], ""))
        else:
            out.add(node)


def _text(content: object) -> str:
    """A message's content as text: content parts (`{"type": "text", "text": ...}`) joined, other values empty."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text") or "") for p in content if isinstance(p, dict))
    return ""


def render_messages(template: str, messages: list[dict]) -> str:
    """Ollama's legacy rendering: one pass per user turn (System on the first, Response = the assistant reply),
    concatenated; the last pass has an empty Response, which is where the model continues. The whole output is held
    to budget.py's MAX_OUTPUT_CHARS as it grows (ChatTemplateBudgetError)."""
    tree = parse(template)
    system = "\n".join(_text(m.get("content")) for m in messages if m.get("role") == "system")
    turns: list[dict[str, str]] = []
    for message in messages:
        role, content = message.get("role"), _text(message.get("content"))
        if role in ("user", "tool"):
            turns.append({"Prompt": content, "Response": ""})
        elif role == "assistant":
            if not turns or turns[-1]["Response"]:
                turns.append({"Prompt": "", "Response": ""})
            turns[-1]["Response"] = content
    if not turns or turns[-1]["Response"]:
        turns.append({"Prompt": "", "Response": ""})
    out = OutputBudget()
    for index, turn in enumerate(turns):
        _render(tree, {"System": system if index == 0 else "", **turn}, out)
    return out.text()
