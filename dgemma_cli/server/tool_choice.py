"""OpenAI's `tool_choice`, for /v1/chat/completions and /v1/responses alike (docs/server.md, "Tools").

- "auto" (or absent): the tools are offered; the model decides whether to call one.
- "none": the tools are left out of the prompt, so the answer is text (and the prompt as long as with no tools).
- "required", or a function by name (`{"type": "function", "function": {"name": …}}` in Chat Completions,
  `{"type": "function", "name": …}` in Responses; either shape on either route): the answer is one call, of any
  offered function or of the named one, guaranteed by the constrained decoder as structured output is: the template's
  call syntax with the function's parameter schema as the arguments (output_format.OutputFormat.calls).
- `{"type": "allowed_tools", "mode": "auto" | "required", "tools": [...]}` (in Chat Completions under
  `allowed_tools`): as "auto" or "required", over the listed functions only (the others are left out of the prompt).
Ollama's API has no `tool_choice`.
"""
from dataclasses import dataclass
from typing import Any

from dgemma_cli.server.errors import RequestError
from dgemma_cli.server.output_format import OutputFormat, checked_schema

MODES = ("auto", "none", "required")
NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # "auto" | "none" | "required"
    names: tuple[str, ...] | None = None  # the functions it allows (a named function: one); None: all
    named: bool = False  # a function by name (for the error wording)


def read_tool_choice(value: Any) -> ToolChoice:
    """The request's `tool_choice`, else a one-line 400."""
    if value is None:
        return ToolChoice("auto")
    if isinstance(value, str):
        if value not in MODES:
            raise RequestError(f"invalid tool_choice {value!r} (expected auto, none, required or a function)")
        return ToolChoice(value)
    kind = value.get("type")
    if kind == "function":
        return ToolChoice("required", (_function_name(value, "tool_choice"),), named=True)
    if kind == "allowed_tools":
        allowed = value.get("allowed_tools") if isinstance(value.get("allowed_tools"), dict) else value
        mode, tools = allowed.get("mode") or "auto", allowed.get("tools")
        if mode not in ("auto", "required") or not isinstance(tools, list) or not tools:
            raise RequestError("tool_choice of type allowed_tools needs mode auto or required and a list of tools")
        names = []
        for tool in tools:
            if not isinstance(tool, dict) or tool.get("type") != "function":
                raise RequestError("tool_choice allowed_tools: only function tools are supported")
            names.append(_function_name(tool, "tool_choice allowed_tools"))
        return ToolChoice(mode, tuple(names))
    raise RequestError(f"unsupported tool_choice type {kind!r} (only function tools are supported)")


def _function_name(value: dict, where: str) -> str:
    """The name of `{"type": "function", "function": {"name": …}}` or `{"type": "function", "name": …}`."""
    name = _function_of(value).get("name")
    if not isinstance(name, str) or not name:
        raise RequestError(f"{where} of type function needs the function's name")
    return name


def _function_of(tool: dict) -> dict:
    """A tool's function object: nested in Chat Completions' shape, the tool itself in the Responses API's."""
    return tool["function"] if isinstance(tool.get("function"), dict) else tool


def _tool_name(tool: dict) -> object:
    return _function_of(tool).get("name")


def function_tools(tools: list[dict] | None) -> list[dict] | None:
    """Tools in the shape chat templates read (`{type: "function", function: {name, description, parameters}}`),
    from either API's shape (the Responses API's are flat: `{type, name, description, parameters}`)."""
    if not tools:
        return None
    out = []
    for tool in tools:
        if tool.get("type") != "function":
            raise RequestError(f"unsupported tool type: {tool.get('type')!r} (only function tools are supported)")
        function = _function_of(tool)
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise RequestError("function tool missing required 'name' field")
        out.append({"type": "function", "function": {"name": name, "description": function.get("description") or "",
                                                     "parameters": function.get("parameters") or NO_PARAMETERS}})
    return out


def prompt_tools(tools: list[dict] | None, choice: ToolChoice) -> list[dict] | None:
    """The tools the prompt renders: none for "none" (the answer is text), else those the choice allows."""
    if not tools or choice.mode == "none":
        return None
    if choice.names is None or choice.named:  # a named function is called with the others in view, as OpenAI
        return tools
    return [tool for tool in tools if _tool_name(tool) in choice.names] or None


def call_format(model: Any, tools: list[dict] | None, choice: ToolChoice) -> OutputFormat | None:
    """The output format of an answer that must be a call ("required", a named function), else None. `tools` in
    either shape; a name that is not among them, or a call required with no tools, is a 400."""
    if choice.mode in ("auto", "none"):
        if choice.names is not None:
            _check_names(tools, choice)
        return None
    if not tools:
        raise RequestError(f"tool_choice {choice.names[0] if choice.named else choice.mode!r} needs tools: the "
                           "request has none")
    _check_names(tools, choice)
    functions = []
    for tool in tools:
        if tool.get("type") != "function":
            continue
        function = _function_of(tool)
        if choice.names is None or function.get("name") in choice.names:
            functions.append((function.get("name"), function.get("parameters") or NO_PARAMETERS))
    calls = []
    for name, parameters in functions:
        if not isinstance(name, str) or not name:
            raise RequestError("function tool missing required 'name' field")
        try:
            calls.append((name, checked_schema(parameters).schema))
        except RequestError as exc:
            raise RequestError(f"the parameters of tool {name!r}: {exc.message}") from None
    return OutputFormat(schema=None, calls=tuple(calls), model_label=model.quoted)


def _check_names(tools: list[dict] | None, choice: ToolChoice) -> None:
    offered = {_tool_name(tool) for tool in tools or []}
    for name in choice.names or ():
        if name not in offered:
            raise RequestError(f"tool_choice names function {name!r}, which is not among the request's tools")
