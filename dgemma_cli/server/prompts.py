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
from dgemma_cli.server.request_images import RequestImage
from dgemma_cli.server.truncation import fit_chat, fit_tokens

# A generous bound on the characters one token covers: longer text cannot fit num_ctx tokens (docs/server.md).
PROMPT_CHARS_PER_TOKEN = 64


@dataclass(frozen=True)
class ChatPrompt:
    messages: list[dict]  # the Modelfile's SYSTEM and MESSAGEs first (`chat_prompt`)
    truncate: bool = True  # drop the oldest messages to fit (Ollama's /api/chat); False: a 400 when it does not fit

    @property
    def images(self) -> list[RequestImage]:
        """The conversation's images in prompt order (a message's `images`, request_images.RequestImage)."""
        return [image for m in self.messages for image in m.get("images") or ()]

    @property
    def kept_images(self) -> int:
        """Images truncation may not drop: the latest message's (older messages' go with their message)."""
        return len(self.messages[-1].get("images") or ()) if self.messages else 0

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

        # room for the latest message's images; older ones that survive truncation are counted by the canvas plan
        budget = runner.context_length - runner.canvas_length - image_room(runner, self.kept_images)
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
    images: tuple[RequestImage, ...] = ()  # before the prompt's text, in order

    @property
    def kept_images(self) -> int:
        """Cutting the prompt's start may not drop an image."""
        return len(self.images)

    def check_size(self, num_ctx: int) -> None:
        check_text_size(num_ctx, [self.text, self.system])

    def ids(self, runner: Any, thinking: bool | None, tools: list[dict] | None) -> list[int]:
        user = {"role": "user", "content": self.text, **({"images": list(self.images)} if self.images else {})}
        if self.raw:
            text = with_image_markers(user, runner, parts=False)["content"]
        else:
            messages = ([{"role": "system", "content": self.system}] if self.system else []) + [user]
            text = render(runner, messages, thinking, self.template)
        ids = list(self.context) + runner.tokenize(text)
        budget = runner.context_length - runner.canvas_length - image_room(runner, len(self.images))
        return fit_tokens(ids, budget) if self.truncate else ids


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


def image_room(runner: Any, count: int) -> int:
    """Positions a prompt's images take beyond their one marker token each (boi, soft tokens, eoi: at most
    `runner.image_positions`)."""
    return count * max(0, getattr(runner, "image_positions", 0) - 1)


def with_image_markers(message: dict, runner: Any, parts: bool) -> dict:
    """A message whose `images` become one image marker each, where they go (`image_places`: offsets into the
    text; none given: before it, as Ollama places them). With `parts` the content becomes the content-part list a
    template that renders images reads (`{"type": "image"}`, `{"type": "text", ...}`); otherwise the marker is the
    image token's text, spliced into the content."""
    images = message.get("images") or ()
    plain = {k: v for k, v in message.items() if k not in ("images", "image_places")}
    if not images:
        return plain
    text = plain.get("content") or ""
    places = list(message.get("image_places") or [0] * len(images))
    pieces: list[dict] = []
    last = 0
    for place in places:
        if text[last:place]:
            pieces.append({"type": "text", "text": text[last:place]})
        pieces.append({"type": "image"})
        last = place
    if text[last:]:
        pieces.append({"type": "text", "text": text[last:]})
    if parts:
        return {**plain, "content": pieces}
    marker = runner.image_marker
    return {**plain, "content": "".join(marker if p["type"] == "image" else p["text"] for p in pieces)}


def prompt_images(ids: list[int], images: list[RequestImage], runner: Any, kept: int) -> list[RequestImage]:
    """The images whose markers are in the final ids: the last ones when truncation dropped older messages. Fewer
    than the `kept` ones (the latest message's) means the images themselves do not fit: a 400, never an answer
    about an image the model did not see. More markers than images (image-token text in a message) is a 400."""
    if not images:
        return []
    marker_id = getattr(runner, "image_token_id", None)
    count = sum(1 for token in ids if token == marker_id)
    if count > len(images):
        raise RequestError(f"the prompt holds {count} image tokens but the request has {len(images)} image(s)")
    if count < kept:
        room = len(ids) + image_room(runner, kept)
        raise RequestError(f"prompt with {kept} image(s) (up to {room} positions) leaves no room for a diffusion "
                           f"canvas ({runner.canvas_length} tokens) within the context window "
                           f"({runner.context_length} tokens)")
    return images[len(images) - count:]


def render(runner: Any, messages: list[dict], thinking: bool | None, template: ChatTemplate | None = None,
           tools: list[dict] | None = None) -> str:
    """The prompt text of `messages`, through the model's template or a per-request `template`. Every failure to
    render is a 400 with one line (the renderers raise only ChatTemplateError): a render over a limit names the limit,
    any other failure is `template error: ...`, the model's template or the request's alike (a template's branches
    follow the conversation). Images become markers first (`with_image_markers`): content parts for a model
    template that renders them (Gemma 4's), the marker text otherwise."""
    if any(m.get("images") for m in messages):
        parts = template is None and bool(getattr(runner, "renders_image_parts", False))
        messages = [with_image_markers(m, runner, parts) for m in messages]
    try:
        if template is not None:
            return render_prompt(template, messages, thinking, runner.special_tokens, tools)
        return runner.render_chat(messages, thinking, tools) if tools else runner.render_chat(messages, thinking)
    except RequestError:
        raise
    except ChatTemplateBudgetError as exc:
        raise RequestError(str(exc)) from None
    except ChatTemplateError as exc:
        raise RequestError(f"template error: {exc.detail}"[:300]) from None


def no_room_error(prompt_tokens: int, canvas: int, n_ctx: int) -> RequestError:
    return RequestError(
        f"prompt ({prompt_tokens} tokens) leaves no room for a diffusion canvas ({canvas} tokens) "
        f"within the context window ({n_ctx} tokens)"
    )
