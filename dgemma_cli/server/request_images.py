"""A request's images, from the wire to the engine (docs/server.md, "Images").

Routes read the payloads (`from_base64`: Ollama's `images`; `from_data_url`: OpenAI's `image_url` and the Responses
API's `input_image`), with Ollama's wording for what it refuses. `checked_images` then decodes each image once in a
worker thread, so a corrupt or oversized image is a 400 before the request queues, and checks the request's limits
against the model (a text-only model, too many images, images that cannot fit `num_ctx`), all before a generation
slot is taken. The request keeps the encoded bytes, not the pixels: a queued request holds at most its JSON body's
worth of memory. The runner decodes them again and encodes them with the model's projector (`encode_images`).
"""
from __future__ import annotations

import asyncio
import base64
import binascii
from dataclasses import dataclass
from typing import Any

import numpy as np
from dgemma_engine.images import MAX_IMAGE_BYTES, ImageError, decode_image

from dgemma_cli.errors import DgemmaError
from dgemma_cli.server.errors import RequestError

DATA_URL_TYPES = ("jpeg", "jpg", "png", "webp", "gif")  # data:image/<type>;base64,...
INVALID_IMAGE_INPUT = "invalid image input"  # Ollama's wording for a data URL it cannot read
REMOTE_URL_REFUSED = "image URLs are not currently supported, please use base64 encoded data instead"


@dataclass(frozen=True)
class RequestImage:
    """One image of a request: its encoded bytes (checked to decode) and its size."""

    data: bytes
    width: int
    height: int

    def pixels(self) -> np.ndarray:
        """uint8 RGB [height, width, 3]."""
        return decode_image(self.data)


def from_base64(text: Any) -> bytes:
    """Ollama's `images` entry: standard base64 (line breaks ignored, as Go's decoder does), capped before decoding."""
    if not isinstance(text, str):
        raise RequestError("invalid image: expected a base64 string")
    text = text.replace("\r", "").replace("\n", "")
    if len(text) // 4 * 3 > MAX_IMAGE_BYTES + 3:  # the decoded size, known before decoding anything
        raise RequestError(f"image too large: more than {MAX_IMAGE_BYTES} bytes")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError("invalid image: not valid base64") from None


def from_data_url(url: Any) -> bytes:
    """An OpenAI `image_url` (or Responses `image_url`): a base64 `data:` URL of a JPEG, PNG, WebP or GIF, or
    `data:;base64,` as Ollama accepts. Remote URLs are refused and never fetched."""
    if not isinstance(url, str):
        raise RequestError(INVALID_IMAGE_INPUT)
    if url.startswith(("http://", "https://")):
        raise RequestError(REMOTE_URL_REFUSED)
    head, comma, payload = url.partition(",")
    if not comma or not head.startswith("data:") or not head.endswith(";base64"):
        raise RequestError(INVALID_IMAGE_INPUT)
    media_type = head[len("data:"):-len(";base64")].lower()
    if media_type and media_type not in {f"image/{kind}" for kind in DATA_URL_TYPES}:
        raise RequestError(INVALID_IMAGE_INPUT)
    try:
        return from_base64(payload)
    except RequestError as exc:
        raise RequestError(INVALID_IMAGE_INPUT if "base64" in str(exc) else str(exc)) from None


def url_of(part: dict, key: str = "image_url") -> Any:
    """The URL of an `image_url` part: `{"image_url": {"url": ...}}` or `{"image_url": "..."}`."""
    value = part.get(key)
    return value.get("url") if isinstance(value, dict) else value


async def checked_images(payloads: list[bytes]) -> list[RequestImage]:
    """Each payload decoded once (in a thread): a bad image is a 400 naming which one."""
    return await asyncio.to_thread(lambda: [_checked(i, data) for i, data in enumerate(payloads)])


def _checked(index: int, data: bytes) -> RequestImage:
    try:
        pixels = decode_image(data)
    except ImageError as exc:
        raise RequestError(f"image {index + 1}: {exc}") from None
    return RequestImage(data, int(pixels.shape[1]), int(pixels.shape[0]))


async def decoded_message_images(model: Any, messages: list[dict], max_images: int) -> None:
    """Each message's `images` (payload bytes, in place) checked against the model and the count limit first, then
    decoded: `RequestImage`s."""
    payloads = [data for m in messages for data in m.get("images") or ()]
    if not payloads:
        return
    check_image_limits(model, len(payloads), max_images)
    images = iter(await checked_images(payloads))
    for message in messages:
        if message.get("images"):
            message["images"] = [next(images) for _ in message["images"]]


def check_image_limits(model: Any, count: int, max_images: int, num_ctx: int | None = None) -> None:
    """Before any slot: a text-only model (Ollama's error), too many images, and (given `num_ctx`) images that
    cannot fit the window. Each image takes at most its projector's soft-token budget plus its begin and end
    markers."""
    if count == 0:
        return
    projector = getattr(model.local, "projector", None)
    if projector is None:
        raise RequestError(f"{model.full} does not support vision")
    if count > max_images:
        raise RequestError(f"too many images: {count} (at most {max_images} per request, DGEMMA_MAX_IMAGES)")
    if num_ctx is None:
        return
    from dgemma_cli.projector import projector_info

    try:
        info = projector_info(projector)
    except DgemmaError as exc:
        raise RequestError(f"{model.full}: {exc}", 500) from None
    positions = count * info.positions_per_image
    if positions >= num_ctx:
        raise RequestError(f"{count} image(s) take up to {positions} positions ({info.positions_per_image} each), "
                           f"more than the context window ({num_ctx} tokens, num_ctx)")


def encode_images(projector: Any, images: list[RequestImage]) -> list[np.ndarray]:
    """THE one place images become the embeddings the text model reads: each image's pixels, prepared as Gemma 4's
    image processor does, through the projector (`dgemma_engine.vision`): float32 [n_soft, n_embd] per image."""
    from dgemma_engine.vision import prepare_image

    return [projector.encode(prepare_image(image.pixels(), projector.geometry)) for image in images]
