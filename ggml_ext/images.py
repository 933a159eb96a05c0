"""Image bytes from a request or a file -> RGB pixels, with the caps that keep hostile input cheap (docs/server.md,
"Images").

`decode_image` accepts PNG, JPEG, WebP and GIF. Before any pixel is decoded it refuses a file over `MAX_IMAGE_BYTES`
and, from the header alone, an image over `MAX_IMAGE_PIXELS`; so a 50,000 x 50,000 PNG of a few kilobytes costs a
header read, not 7.5 GB. `read_header` is that first half alone (format and size, nothing decoded): what a caller
needs to count an image's cost before paying it, since a 112 KB PNG of 5792 x 5792 white pixels is under both caps
and still takes about a second and a half to decode. The pixels then follow what transformers does before Gemma 4's image processor sees an
image: EXIF orientation applied (`load_image` calls `ImageOps.exif_transpose`), transparency composited onto white
(`convert_to_rgb`), other modes converted to RGB. An animated image gives its first frame.

Every failure is an `ImageError`: one line, the client's fault, an HTTP 400.
"""
from __future__ import annotations

import io
import warnings
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from dgemma_engine.errors import DgemmaError

MAX_IMAGE_BYTES = 20 << 20  # an encoded image file; a request's JSON body is capped separately (32 MiB)
MAX_IMAGE_PIXELS = 1 << 25  # 33,554,432 (e.g. 8192 x 4096): about 100 MB of RGB at full size
FORMATS = ("PNG", "JPEG", "WEBP", "GIF")  # what Pillow may try: no other parser ever sees request bytes
FORMAT_NAMES = "PNG, JPEG, WebP or GIF"

# Pillow's own decompression-bomb guard, set explicitly to our cap, and its warning (emitted between 1x and 2x the
# cap) made an error, so no image over the cap is ever decoded even if a caller skips the header check below.
Image.MAX_IMAGE_PIXELS = MAX_IMAGE_PIXELS
warnings.filterwarnings("error", category=Image.DecompressionBombWarning)


class ImageError(DgemmaError, ValueError):
    """An image that cannot be used: too large, not an image, corrupt or truncated. The message is one line."""


@dataclass(frozen=True)
class ImageHeader:
    """What an image file's header says: its format (one of FORMATS) and its size as stored (before any EXIF
    rotation)."""

    format: str
    width: int
    height: int


def read_header(data: bytes) -> ImageHeader:
    """`data`'s format and size from its header alone (Pillow's open is lazy), refused as `decode_image` would refuse
    it before decoding: too many bytes, not one of the four formats, too many pixels. No pixel is decoded, so the cost
    does not depend on the image's size; corrupt pixel data is only found by `decode_image`."""
    image = _open(_checked_bytes(data))
    try:
        check_pixels(*image.size)
        return ImageHeader(str(image.format), int(image.size[0]), int(image.size[1]))
    finally:
        image.close()


def decode_image(data: bytes) -> np.ndarray:
    """`data` (an encoded image file) as uint8 RGB pixels [height, width, 3]."""
    image = _open(_checked_bytes(data))
    try:
        check_pixels(*image.size)
        return _rgb_pixels(image)
    finally:
        image.close()


def _checked_bytes(data: bytes) -> bytes:
    if not isinstance(data, bytes | bytearray | memoryview):
        raise ImageError("invalid image: expected bytes")
    if len(data) == 0:
        raise ImageError("invalid image: no data")
    if len(data) > MAX_IMAGE_BYTES:
        raise ImageError(f"image too large: {len(data)} bytes (at most {MAX_IMAGE_BYTES})")
    return data if isinstance(data, bytes) else bytes(data)


def check_pixels(width: int, height: int) -> None:
    if width <= 0 or height <= 0:
        raise ImageError(f"invalid image: its size is {width}x{height}")
    if width * height > MAX_IMAGE_PIXELS:
        raise ImageError(f"image too large: {width}x{height} pixels (at most {MAX_IMAGE_PIXELS} pixels)")


def _open(data: bytes) -> Image.Image:
    """The image's header, read lazily: no pixel data is decoded yet."""
    try:
        return Image.open(io.BytesIO(data), formats=FORMATS)
    except UnidentifiedImageError:
        raise ImageError(f"invalid image: not a {FORMAT_NAMES} image") from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise ImageError(f"image too large: more than {MAX_IMAGE_PIXELS} pixels") from None
    except Exception as exc:  # noqa: BLE001 - any parser failure on hostile bytes is a bad image, not a server fault
        raise ImageError(f"invalid image: {_reason(exc)}") from None


def _rgb_pixels(image: Image.Image) -> np.ndarray:
    try:
        image.seek(0)  # an animation's first frame
        image.load()
        oriented = ImageOps.exif_transpose(image)  # as transformers' load_image, before its processor
        check_pixels(*oriented.size)
        return np.asarray(_to_rgb(oriented), dtype=np.uint8).copy()
    except ImageError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise ImageError(f"image too large: more than {MAX_IMAGE_PIXELS} pixels") from None
    except MemoryError:
        raise ImageError("image too large: out of memory while decoding it") from None
    except Exception as exc:  # noqa: BLE001 - truncated or corrupt data, whatever the plugin raises
        raise ImageError(f"invalid image: {_reason(exc)}") from None


def _to_rgb(image: Image.Image) -> Image.Image:
    """transformers' convert_to_rgb: an image with an alpha band or a transparent colour is composited onto white."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def _reason(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or exc.__class__.__name__
    return text[:200]
