"""`dgemma_engine.images.decode_image`: formats, orientation, transparency, and each hostile case refused with one
line before its pixels are decoded."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dgemma_engine.images import MAX_IMAGE_BYTES, ImageError, decode_image
import image_samples as samples


def test_png_round_trip_is_exact():
    pixels = samples.gradient(24, 16)
    out = decode_image(samples.encoded(Image.fromarray(pixels)))
    assert out.dtype == np.uint8 and out.shape == (16, 24, 3)
    assert np.array_equal(out, pixels)


@pytest.mark.parametrize("fmt", ["JPEG", "WEBP", "GIF"])
def test_other_formats_decode_to_rgb(fmt):
    out = decode_image(samples.encoded(Image.fromarray(samples.gradient(24, 16)), fmt))
    assert out.shape == (16, 24, 3) and out.dtype == np.uint8


def test_grayscale_and_palette_become_rgb():
    gray = Image.fromarray(np.arange(64, dtype=np.uint8).reshape(8, 8), "L")
    out = decode_image(samples.encoded(gray))
    assert out.shape == (8, 8, 3) and np.array_equal(out[..., 0], out[..., 2])
    assert out[1, 2, 0] == 10


def test_alpha_is_composited_onto_white_as_transformers_does():
    out = decode_image(samples.transparent_png())
    assert out[0, 0].tolist() == [255, 255, 255]  # fully transparent red -> white
    assert out[0, 7].tolist() == [0, 0, 255]


def test_palette_transparency_is_composited_onto_white():
    image = Image.new("P", (4, 4), 1)
    image.putpalette([0, 0, 0, 200, 10, 10] + [0] * 762)
    data = samples.encoded(image, transparency=1)
    assert decode_image(data)[0, 0].tolist() == [255, 255, 255]


@pytest.mark.parametrize("orientation,shape", [(1, (16, 24, 3)), (3, (16, 24, 3)), (6, (24, 16, 3)), (8, (24, 16, 3))])
def test_exif_orientation_is_applied(orientation, shape):
    out = decode_image(samples.jpeg_with_orientation(orientation))
    assert out.shape == shape
    plain = decode_image(samples.jpeg_with_orientation(1)).astype(int)
    if orientation == 3:  # rotated 180 degrees
        assert np.abs(out.astype(int) - plain[::-1, ::-1]).mean() < 8
    if orientation == 6:  # rotate 90 degrees clockwise to display: the first row becomes the last column
        assert np.abs(out.astype(int) - np.rot90(plain, -1)).mean() < 8


def test_animation_gives_its_first_frame():
    out = decode_image(samples.animated_gif())
    assert out.shape == (8, 8, 3) and out[0, 0].tolist() == [255, 0, 0]


@pytest.mark.parametrize("name", sorted(samples.hostile_images()))
def test_hostile_images_are_refused_with_one_line(name):
    with pytest.raises(ImageError) as info:
        decode_image(samples.hostile_images()[name])
    message = str(info.value)
    assert message and "\n" not in message and len(message) < 300
    assert message.startswith(("invalid image", "image too large"))
    assert info.value.status == 400 and isinstance(info.value, ValueError)


def test_huge_header_is_refused_as_too_large():
    with pytest.raises(ImageError, match=r"^image too large"):
        decode_image(samples.png_with_header(50_000, 50_000))


def test_wrong_format_names_the_accepted_ones():
    with pytest.raises(ImageError, match="not a PNG, JPEG, WebP or GIF image"):
        decode_image(samples.hostile_images()["tiff"])


def test_byte_cap_is_checked_before_parsing():
    with pytest.raises(ImageError, match=rf"image too large: {MAX_IMAGE_BYTES + 1} bytes"):
        decode_image(b"\x89PNG" + b"\x00" * (MAX_IMAGE_BYTES - 3))


def test_non_bytes_are_refused():
    with pytest.raises(ImageError):
        decode_image("iVBORw0KGgo=")  # type: ignore[arg-type]


def test_huge_header_png_keeps_memory_bounded():
    """A 50,000 x 50,000 PNG header (7.5 GB of RGB) is refused from its header: the process grows by a few MB."""
    script = textwrap.dedent("""
        import resource, sys
        sys.path.insert(0, %r)
        import image_samples
        from dgemma_engine.images import ImageError, decode_image
        data = image_samples.png_with_header(50_000, 50_000)
        decode_image(image_samples.png())  # warm: imports and plugins loaded before measuring
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        for _ in range(20):
            try:
                decode_image(data)
            except ImageError:
                pass
            else:
                raise SystemExit("not refused")
        print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before)
    """) % str(Path(__file__).resolve().parent)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    grown_kib = int(result.stdout.strip())
    assert grown_kib < 16 * 1024, f"RSS grew by {grown_kib} KiB"
