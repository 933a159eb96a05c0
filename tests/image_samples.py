"""Small images made in code for the image tests: valid ones of each format, hostile ones (a huge PNG header,
truncated and corrupt files) and costly ones (a valid PNG of a few hundred kilobytes that takes a second and more to
decode). Shared by test_images.py, the server tests and the fuzzer."""
from __future__ import annotations

import functools
import io
import struct
import zlib

import numpy as np
from PIL import Image


def encoded(image: Image.Image, fmt: str = "PNG", **save_args) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **save_args)
    return out.getvalue()


def gradient(width: int = 24, height: int = 16) -> np.ndarray:
    """A uint8 RGB image whose pixels tell their position (so a flip or rotation shows)."""
    y, x = np.mgrid[0:height, 0:width]
    return np.stack([x * 255 // max(1, width - 1), y * 255 // max(1, height - 1), (x + y) % 256], -1).astype(np.uint8)


def png(width: int = 24, height: int = 16) -> bytes:
    return encoded(Image.fromarray(gradient(width, height)))


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png_with_header(width: int, height: int, idat: bytes | None = None) -> bytes:
    """A PNG whose IHDR claims `width` x `height` (8-bit RGB), with a tiny IDAT: a few hundred bytes on the wire."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    body = idat if idat is not None else zlib.compress(b"\x00" * 1024)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", body) + _chunk(b"IEND", b"")


@functools.cache
def big_white_png(side: int = 5792) -> bytes:
    """A valid white `side` x `side` RGB PNG. At 5792 it is 112 KB, just under MAX_IMAGE_PIXELS (33,554,432), and
    decoding it takes about 1.5 s and 100 MB: sixteen in one request are the decompression-heavy image attack."""
    row = b"\x00" + b"\xff" * (3 * side)  # filter type 0, then white pixels
    deflate = zlib.compressobj(9)
    idat = b"".join(deflate.compress(row) for _ in range(side)) + deflate.flush()
    return png_with_header(side, side, idat)


def jpeg_with_orientation(orientation: int, width: int = 24, height: int = 16) -> bytes:
    image = Image.fromarray(gradient(width, height))
    exif = Image.Exif()
    exif[0x0112] = orientation  # Orientation
    return encoded(image, "JPEG", quality=95, exif=exif.tobytes())


def transparent_png() -> bytes:
    """Left half fully transparent red, right half opaque blue."""
    rgba = np.zeros((8, 8, 4), np.uint8)
    rgba[:, :4] = (255, 0, 0, 0)
    rgba[:, 4:] = (0, 0, 255, 255)
    return encoded(Image.fromarray(rgba, "RGBA"))


def animated_gif() -> bytes:
    frames = [Image.new("RGB", (8, 8), colour) for colour in ((255, 0, 0), (0, 255, 0), (0, 0, 255))]
    return encoded(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=50, loop=0)


def hostile_images() -> dict[str, bytes]:
    """Named bytes that `decode_image` must refuse with one line each."""
    good = png()
    return {
        "empty": b"",
        "text": b"this is not an image at all",
        "pdf": b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n1 0 obj<<>>endobj\n",
        "tiff": encoded(Image.fromarray(gradient()), "TIFF"),
        "truncated png": good[: len(good) // 2],
        "png bad crc": good[:20] + bytes([good[20] ^ 0xFF]) + good[21:],
        "png bad idat": png_with_header(16, 16, idat=b"\x78\x9c" + b"\xff" * 40),
        "huge png header": png_with_header(50_000, 50_000),
        "zero-size png": png_with_header(0, 10),
        "truncated jpeg": encoded(Image.fromarray(gradient()), "JPEG")[:200],
        "random": bytes(np.random.default_rng(7).integers(0, 256, 4096, dtype=np.uint8)),
    }
