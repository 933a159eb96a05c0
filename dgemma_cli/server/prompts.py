"""A request's prompt, from what its route decoded to the token ids the model reads (docs/compat.md#chat, #generate).

Two kinds: `ChatPrompt` (a conversation: /api/chat, /v1/chat/completions, /v1/completions, /v1/responses) and
`GeneratePrompt` (/api/generate: raw text, or a system and a user turn, after earlier `context` ids). Each checks its
size before any model is loaded (`check_size`: text that cannot fit the window whatever it tokenizes to) and turns
into ids once the runner is there (`ids`): rendered through the model's chat template, or a request's own, and fitted
to the window (truncation.py).
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from dgemma_engine.chat.jinja import ChatTemplateBudgetError, ChatTemplateError
from dgemma_engine.chat.templates import ChatTemplate, render_prompt

from dgemma_cli.server.errors import RequestError
from dgemma_cli.server.truncation import fit_chat, fit_tokens

# A generous bound on the characters one token covers: longer text cannot fit num_ctx tokens (docs/server.md).
PROMPT_CHARS_PER_TOKEN = 64


@dataclass(frozen=True)
class ChatPrompt:
    messages: list[dict]  # the Modelfile's SYSTEM and MESSAGEs first (`chat_prompt`)
    truncate: bool = True  # drop the oldest messages to fit (Ollama's /api/chat); False: a 400 when it does not fit

    def check_size(self, num_ctx: int) -> None:
        """With truncation only what must stay counts: the system messages and the last message."""
        last = len(self.messages) - 1
        kept = [m for i, m in enumerate(self.messages) if not self.truncate or i == last or m.get("role") == "system"]
        check_text_size(num_ctx, [text for m in kept for text in (m.get("content"), m.get("thinking"))])

    def ids(self, runner: Any, thinking: bool | None, tools: list[dict] | None) -> list[int]:
        def render_ids(kept: list[dict]) -> list[int]:
            return runner.tokenize(render(runner, kept, thinking, tools=tools))

        def no_room(tokens: int) -> RequestError:
            return no_room_error(tokens, runner.canvas_length, runner.context_length)

        budget = runner.context_length - runner.canvas_length
        return fit_chat(list(self.messages), render_ids, lambda text: len(runner.tokenize(text)), budget,
                        self.truncate, no_room).ids


@dataclass(frozen=True)
class GeneratePrompt:
    text: str
    system: str | None = None
    raw: bool = False  # the text as it is, no template
    context: tuple[int, ...] = ()  # ids of an earlier answer's `context`, before the new text
    truncate: bool = True  # keep the prompt's end (Ollama's /api/generate); False: a 400 when it does not fit
    template: ChatTemplate | None = None  # a per-request `template`

    def check_size(self, num_ctx: int) -> None:
        check_text_size(num_ctx, [self.text, self.system])

    def ids(self, runner: Any, thinking: bool | None, tools: list[dict] | None) -> list[int]:
        if self.raw:
            text = self.text
        else:
            messages = ([{"role": "system", "content": self.system}] if self.system else []) + [
                {"role": "user", "content": self.text}
            ]
            text = render(runner, messages, thinking, self.template)
        ids = list(self.context) + runner.tokenize(text)
        return fit_tokens(ids, runner.context_length - runner.canvas_length) if self.truncate else ids


Prompt = ChatPrompt | GeneratePrompt


def chat_prompt(local_model: Any, messages: list[dict], truncate: bool = True) -> ChatPrompt:
    """The request's messages after the Modelfile's MESSAGEs; the model's SYSTEM leads unless the request starts with
    its own system message."""
    preset = [dict(m) for m in local_model.messages or []]
    if local_model.system and not (messages and messages[0]["role"] == "system"):
        preset.insert(0, {"role": "system", "content": local_model.system})
    return ChatPrompt(preset + messages, truncate)


def check_text_size(num_ctx: int, texts: Iterable[str | None]) -> None:
    """Text that cannot fit the context window whatever it tokenizes to is refused before any rendering."""
    size = sum(len(text) for text in texts if text)
    limit = PROMPT_CHARS_PER_TOKEN * num_ctx
    if size > limit:
        raise RequestError(f"prompt too long: {size} characters cannot fit a context window of {num_ctx} tokens "
                           f"(at most {limit} characters)")


def render(runner: Any, messages: list[dict], thinking: bool | None, template: ChatTemplate | None = None,
           tools: list[dict] | None = None) -> str:
    """The prompt text of `messages`, through the model's template or a per-request `template`. A request's own
    template that fails is the client's 400; the model's is a clean 500; a render over its budget is a 400 (the
    request's data drove it there)."""
    try:
        if template is not None:
            return render_prompt(template, messages, thinking, runner.special_tokens, tools)
        return runner.render_chat(messages, thinking, tools) if tools else runner.render_chat(messages, thinking)
    except RequestError:
        raise
    except ChatTemplateBudgetError as exc:
        raise RequestError(str(exc)) from None
    except ChatTemplateError as exc:
        if template is not None and template.from_request:
            raise RequestError(f"template error: {exc.detail}"[:300]) from None
        raise RequestError("failed to render chat template", 500) from None
    except Exception:  # noqa: BLE001 - jinja2 SecurityError, TemplateError, recursion, ...: no internals leave
        raise RequestError("failed to render chat template", 500) from None


def no_room_error(prompt_tokens: int, canvas: int, n_ctx: int) -> RequestError:
    return RequestError(
        f"prompt ({prompt_tokens} tokens) leaves no room for a diffusion canvas ({canvas} tokens) "
        f"within the context window ({n_ctx} tokens)"
    )
