"""Which chat template a model renders with, and rendering a conversation through it (docs/compat.md#template-policy).

A model's template is a Jinja TEMPLATE layer, else its GGUF's `tokenizer.chat_template`, else a Go TEMPLATE in the
safe subset (gotemplate.py), else the bare prompt; Go templates never reach Jinja. Both kinds are held to the limits
of budget.py (`check_template_source` where a template enters: create, pull, a request's own `template`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from dgemma_engine import gguf_keys
from dgemma_engine.chat import gotemplate
from dgemma_engine.chat.budget import ChatTemplateBudgetError, ChatTemplateError
from dgemma_engine.chat.jinja import compile_template, render_chat
from dgemma_engine.chat.tool_calls import format_for_template

log = logging.getLogger("dgemma.engine")


@dataclass(frozen=True)
class ChatTemplate:
    kind: str  # "jinja" | "go" | "none"
    text: str = ""


def template_format(text: str) -> str:
    """How a Modelfile TEMPLATE is read: Jinja when it has Jinja statements or loops over `messages`, else Go."""
    return "jinja" if "{%" in text or "messages" in text else "go"


def check_template_source(text: str) -> None:
    """A template where it enters the store or a request (create, pull, a request's own `template`), either kind:
    its size and nesting within budget.py's limits, else ChatTemplateBudgetError (a one-line 400). Only the limits: a
    Jinja syntax error is reported where the template is test-rendered or rendered, and a Go template outside the safe
    subset is kept verbatim and ignored at run time (docs/compat.md#template-policy)."""
    if template_format(text) != "jinja":
        gotemplate.check_limits(text)
        return
    try:
        compile_template(text)  # parsing is what measures the nesting; the renders that follow reuse the compile
    except ChatTemplateBudgetError:
        raise
    except ChatTemplateError:
        pass


def select_template(local_model: Any, metadata: dict) -> ChatTemplate:
    """docs/compat.md#template-policy: a Jinja TEMPLATE layer, else the GGUF's `tokenizer.chat_template`, else a Go
    TEMPLATE in the safe subset, else the bare prompt. Go templates are never given to Jinja."""
    jinja = jinja_template_text(local_model, metadata)
    if jinja:
        return ChatTemplate("jinja", jinja)
    template = getattr(local_model, "template", None) or None
    if template:
        try:
            gotemplate.parse(template)
            return ChatTemplate("go", template)
        except (gotemplate.UnsupportedTemplate, ChatTemplateError) as exc:  # a model stored before the limits
            log.warning("ignoring the model's Go template: %s", exc)
    return ChatTemplate("none")


def tool_format_of(template: ChatTemplate) -> Any:
    """The tool-call syntax of a Jinja template that declares tools (tool_calls.py), else None."""
    return format_for_template(template.text) if template.kind == "jinja" else None


def jinja_template_text(local_model: Any, metadata: dict) -> str | None:
    """The Jinja template a model renders with, if any: its Jinja TEMPLATE layer, else the GGUF's chat template."""
    template = getattr(local_model, "template", None) or None
    config = getattr(local_model, "config", None) or {}
    if template and config.get("template_format") == "jinja":
        return template
    chat_template = metadata.get(gguf_keys.KEY_CHAT_TEMPLATE)
    return str(chat_template) if chat_template else None


def render_prompt(template: ChatTemplate, messages: list[dict], think: bool | None,
                  special_tokens: dict[str, str] | None = None, tools: list[dict] | None = None) -> str:
    """`special_tokens`: bos_token, eos_token, ... as HF passes them to templates (`{{ bos_token }}` starts a prompt).
    `tools` reach Jinja templates only (as transformers' apply_chat_template(tools=...) passes them)."""
    if template.kind == "jinja":
        return render_chat(template.text, messages, add_generation_prompt=True, enable_thinking=bool(think),
                           tools=tools or None, **(special_tokens or {}))
    if template.kind == "go":
        return gotemplate.render_messages(template.text, messages)
    return "\n".join(str(m.get("content") or "") for m in messages)  # rule 4: the bare prompt
