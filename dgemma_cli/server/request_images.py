"""A request's images, from the wire to the engine (docs/server.md, "Images").

Routes read the payloads (`from_base64`: Ollama's `images`; `from_data_url`: OpenAI's `image_url` and the Responses
API's `input_image`), with Ollama's wording for what it refuses, and `read_images` / `read_message_images` check what
costs nothing to check: a text-only model, too many images, and each image's header (its format and size, refusing a
decompression bomb by its pixel count). No pixel is decoded there. `generation.start` then checks that the images fit
the context the runner loads (prompts.py, `check_size`) and only then decodes each image once in a worker thread
(`check_decodable`), so a corrupt image is a 400 before the request queues, and sixteen 5792 x 5792 PNGs that cannot fit
cost sixteen header reads, not 24 s of decoding. The request keeps the encoded bytes, not the pixels: a queued
request holds at most its JSON body's worth of memory. The runner decodes them again and encodes them with the
model's projector (`encode_images`).
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from dgemma_engine.images import MAX_IMAGE_BYTES, ImageError, decode_image, read_header

from dgemma_cli.errors import DgemmaError
from dgemma_cli.server.errors import RequestError

DATA_URL_TYPES = ("jpeg", "jpg", "png", "webp", "gif")  # data:image/<type>;base64,...
INVALID_IMAGE_INPUT = "invalid image input"  # Ollama's wording for a data URL it cannot read
REMOTE_URL_REFUSED = "image URLs are not currently supported, please use base64 encoded data instead"


@dataclass(frozen=True)
class RequestImage:
    """One image of a request: its encoded bytes and what their header says (its size as stored, before any EXIF
    rotation). Its pixels are decoded only once the request is known to have room for it (`check_decodable`)."""

    data: bytes
    width: int
    height: int
    format: str = ""

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


def read_images(model: Any, payloads: list[bytes], max_images: int) -> list[RequestImage]:
    """A request's image payloads, refused for a text-only model and checked against the count limit before any
    header is read, then each one's header read (a bad one is a 400 naming which)."""
    check_image_limits(model, len(payloads), max_images)
    return [_read(i, data) for i, data in enumerate(payloads)]


def read_message_images(model: Any, messages: list[dict], max_images: int) -> None:
    """Each message's `images` (payload bytes, in place) as `RequestImage`s (`read_images`, over all messages)."""
    payloads = [data for m in messages for data in m.get("images") or ()]
    if not payloads:
        return
    images = iter(read_images(model, payloads, max_images))
    for message in messages:
        if message.get("images"):
            message["images"] = [next(images) for _ in message["images"]]


def _read(index: int, data: bytes) -> RequestImage:
    try:
        header = read_header(data)
    except ImageError as exc:
        raise RequestError(f"image {index + 1}: {exc}") from None
    return RequestImage(data, header.width, header.height, header.format)


async def check_decodable(images: list[RequestImage]) -> None:
    """Each image decoded once, in a thread, and dropped: a corrupt or truncated one is a 400 naming which. Called
    after the room check, so only images the request can use are decoded."""
    def check() -> None:
        for index, image in enumerate(images):
            try:
                decode_image(image.data)
            except ImageError as exc:
                raise RequestError(f"image {index + 1}: {exc}") from None

    if images:
        await asyncio.to_thread(check)


def supports_vision(local: Any, runner: Any = None) -> bool:
    """THE vision capability: a stored model (store.LocalModel) has it with a projector layer, which is what
    `/api/show` lists and what lets a request carry images; once loaded, only if its vocabulary has the image token
    too (`runner.image_marker`, runner.EngineRunner._load_vision)."""
    if getattr(local, "projector", None) is None:
        return False
    return runner is None or runner.image_marker is not None


def no_vision(name: str) -> RequestError:
    """Ollama's words for images sent to a model without vision."""
    return RequestError(f"{name} does not support vision")


def check_vision(model: Any, runner: Any = None) -> None:
    """A request with images, refused for a model (a services.ResolvedModel, loaded as `runner` when given) that
    does not support vision."""
    if not supports_vision(model.local, runner):
        raise no_vision(model.full)


def check_image_limits(model: Any, count: int, max_images: int) -> None:
    """Before any header is read: a text-only model (Ollama's error) and too many images."""
    if count == 0:
        return
    check_vision(model)
    if count > max_images:
        raise RequestError(f"too many images: {count} (at most {max_images} per request, DGEMMA_MAX_IMAGES)")


def image_positions(model: Any) -> int:
    """Prompt positions one image of `model` takes at most (its projector's soft tokens, boi and eoi), read from the
    projector's header (cached: store blobs never change); 0 for a text-only model."""
    if not supports_vision(model.local):
        return 0
    try:
        return _projector_positions(str(model.local.projector))
    except DgemmaError as exc:
        raise RequestError(f"{model.full}: {exc}", 500) from None


@functools.lru_cache(maxsize=16)
def _projector_positions(path: str) -> int:
    from dgemma_cli.projector import projector_info

    return projector_info(Path(path)).positions_per_image


def encode_images(projector: Any, images: list[RequestImage]) -> list[np.ndarray]:
    """THE one place images become the embeddings the text model reads: each image's pixels, prepared as Gemma 4's
    image processor does, through the projector (`dgemma_engine.vision`): float32 [n_soft, n_embd] per image."""
    from dgemma_engine.vision import prepare_image

    return [projector.encode(prepare_image(image.pixels(), projector.geometry)) for image in images]
