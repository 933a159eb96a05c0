"""A request's prompt, from what its route decoded to the token ids the model reads (docs/compat.md#chat, #generate).

Two kinds: `ChatPrompt` (a conversation: /api/chat, /v1/chat/completions, /v1/completions, /v1/responses) and
`GeneratePrompt` (/api/generate: raw text, or a system and a user turn, after earlier `context` ids). Each checks its
size before any model is loaded or any image decoded (`check_size`: text and images that cannot fit the window
whatever the text tokenizes to) and turns into ids once the runner is there (`ids`): rendered through the model's chat
template, or a request's own, and fitted to the window (truncation.py).

The window is the context the runner loads (`Window`, `model_window`: the request's num_ctx capped by the model's
trained context, as `loaded_context` decides for the runner too), and whether a prompt leaves room for a canvas is
decided in one place, `prompt_budget`, before the load (with a lower bound of the text's tokens) and after it (with
the real ids).
"""
from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from dgemma_engine.chat.jinja import ChatTemplateBudgetError, ChatTemplateError
from dgemma_engine.chat.templates import ChatTemplate, render_prompt

from dgemma_cli.errors import DgemmaError
from dgemma_cli.server.errors import RequestError
from dgemma_cli.server.request_images import RequestImage, image_positions
from dgemma_cli.server.truncation import fit_chat, fit_tokens

# A generous bound on the characters one token covers: longer text cannot fit num_ctx tokens (docs/server.md).
PROMPT_CHARS_PER_TOKEN = 64


@dataclass(frozen=True)
class Window:
    """The context a request's prompt and canvases share, as the runner has (or will have) it loaded: a runner has the
    same three attributes, so `prompt_budget` takes either."""

    context_length: int  # positions the runner's context holds
    canvas_length: int  # one diffusion canvas
    image_positions: int = 0  # one image at most: boi, the projector's soft tokens, eoi (0: no vision)
    num_ctx: int | None = None  # what the request asked for (the message says when the model capped it)


def loaded_context(num_ctx: int, n_ctx_train: int) -> int:
    """The context a runner loads for a request's num_ctx: the model's trained context caps it."""
    return max(1, min(int(num_ctx), int(n_ctx_train)))


def model_window(model: Any, num_ctx: int) -> Window:
    """The window the runner for `model` (a ResolvedModel) holds at `num_ctx`, from the GGUF's and the projector's
    headers, without loading anything."""
    try:
        n_ctx_train, canvas = _gguf_window(str(model.local.gguf_path))
    except DgemmaError as exc:
        raise RequestError(f"{model.full}: {exc}", 500) from None
    return Window(loaded_context(num_ctx, n_ctx_train), canvas, image_positions(model), num_ctx)


@functools.lru_cache(maxsize=16)
def _gguf_window(gguf_path: str) -> tuple[int, int]:
    """(trained context, canvas length) from a model's GGUF header; cached by path, since store blobs are
    content-addressed and never change."""
    from dgemma_cli.gguf_check import GGUFError, read_gguf_info
    from dgemma_engine.gguf_keys import KEY_CANVAS_LENGTH, KEY_CONTEXT_LENGTH

    metadata = read_gguf_info(gguf_path).metadata
    values = [metadata.get(KEY_CONTEXT_LENGTH), metadata.get(KEY_CANVAS_LENGTH)]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in values):
        raise GGUFError(f"invalid GGUF: {KEY_CONTEXT_LENGTH} or {KEY_CANVAS_LENGTH} is missing")
    return values[0], values[1]


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

    def check_size(self, window: Window) -> None:
        """With truncation only what must stay counts: the system messages and the last message, and its images. The
        images' room is checked with no text at all then: truncation may cut even the latest message's text
        (truncation.keep_latest_end)."""
        last = len(self.messages) - 1
        kept = [m for i, m in enumerate(self.messages) if not self.truncate or i == last or m.get("role") == "system"]
        texts = [text for m in kept for text in (m.get("content"), m.get("thinking"))]
        images = self.kept_images if self.truncate else len(self.images)
        check_prompt_size(window, texts, images, [] if self.truncate else texts)

    def ids(self, runner: Any, thinking: bool | None, tools: list[dict] | None) -> list[int]:
        def render_ids(kept: list[dict]) -> list[int]:
            return runner.tokenize(render(runner, kept, thinking, tools=tools))

        def no_room(tokens: int) -> RequestError:
            kept = self.kept_images
            return no_room_error(tokens + image_room(runner, kept), runner.canvas_length, runner.context_length, kept)

        # room for the latest message's images; older ones that survive truncation are counted by the canvas plan
        budget = prompt_budget(runner, self.kept_images)
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

    def check_size(self, window: Window) -> None:
        """The images come before the prompt's text, so cutting the start (truncation) drops them before the text:
        the text always stays with them; the system prompt only without truncation."""
        texts = [self.text, self.system]
        check_prompt_size(window, texts, len(self.images), [self.text] if self.truncate else texts)

    def ids(self, runner: Any, thinking: bool | None, tools: list[dict] | None) -> list[int]:
        user = {"role": "user", "content": self.text, **({"images": list(self.images)} if self.images else {})}
        if self.raw:
            text = with_image_markers(user, runner, parts=False)["content"]
        else:
            messages = ([{"role": "system", "content": self.system}] if self.system else []) + [user]
            text = render(runner, messages, thinking, self.template)
        ids = list(self.context) + runner.tokenize(text)
        budget = prompt_budget(runner, len(self.images))
        return fit_tokens(ids, budget) if self.truncate else ids


Prompt = ChatPrompt | GeneratePrompt


def chat_prompt(local_model: Any, messages: list[dict], truncate: bool = True) -> ChatPrompt:
    """The request's messages after the Modelfile's MESSAGEs; the model's SYSTEM leads unless the request starts with
    its own system message."""
    preset = [dict(m) for m in local_model.messages or []]
    if local_model.system and not (messages and messages[0]["role"] == "system"):
        preset.insert(0, {"role": "system", "content": local_model.system})
    return ChatPrompt(preset + messages, truncate)


def check_prompt_size(window: Window, texts: Iterable[str | None], images: int,
                      staying: Iterable[str | None] = ()) -> None:
    """Before any rendering, load or image decode: `texts` that cannot fit the window whatever they tokenize to, and
    images whose positions, with the least the text that must stay with them (`staying`) can take and one canvas,
    are more than the window holds."""
    size = sum(len(text) for text in texts if text)
    n_ctx = window.context_length
    limit = PROMPT_CHARS_PER_TOKEN * n_ctx
    if size > limit:
        raise RequestError(f"prompt too long: {size} characters cannot fit a context window of {n_ctx} tokens "
                           f"(at most {limit} characters)")
    least_text = -(-sum(len(text) for text in staying if text) // PROMPT_CHARS_PER_TOKEN)
    if images and least_text + images > prompt_budget(window, images):  # each image's marker is one prompt id
        per_image = window.image_positions
        prompt = f", the prompt at least {least_text}" if least_text else ""
        capped = window.num_ctx is not None and window.num_ctx > n_ctx
        asked = f"num_ctx {window.num_ctx}, this model's at most {n_ctx}" if capped else "num_ctx"
        raise RequestError(f"{images} image{'s need' if images > 1 else ' needs'} {images * per_image} tokens "
                           f"({per_image} each){prompt} and a diffusion canvas {window.canvas_length} more; the "
                           f"model's context holds {n_ctx} tokens ({asked})")


def prompt_budget(window: Any, images: int) -> int:
    """THE room decision: the most prompt ids (one marker per image) that leave room for one diffusion canvas in
    `window` (a Window, or a runner: the same attributes), each image counted at its most positions."""
    return window.context_length - window.canvas_length - image_room(window, images)


def image_room(window: Any, count: int) -> int:
    """Positions a prompt's images take beyond their one marker token each (boi, soft tokens, eoi: at most
    `window.image_positions`)."""
    return count * max(0, getattr(window, "image_positions", 0) - 1)


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
        raise no_room_error(len(ids) + image_room(runner, kept), runner.canvas_length, runner.context_length, kept)
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


def no_room_error(prompt_tokens: int, canvas: int, n_ctx: int, images: int = 0) -> RequestError:
    """`prompt_tokens`: the prompt's positions, each image counted at its most."""
    prompt = (f"prompt with {images} image(s) (up to {prompt_tokens} positions)" if images
              else f"prompt ({prompt_tokens} tokens)")
    return RequestError(f"{prompt} leaves no room for a diffusion canvas ({canvas} tokens) within the context window "
                        f"({n_ctx} tokens)")
