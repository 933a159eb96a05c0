"""Image files named in a `dgemma run` prompt (one-shot and REPL), as Ollama's CLI finds them: a path that starts
with `/`, `./`, `~/` (or a Windows drive) and ends in an image extension, spaces escaped (`\\ `) or the whole path
quoted. Each file that exists is read, sniffed, sent as an image and cut out of the text ("Added image '...'"); a
match that is not a file stays text. Only for a model whose `show` lists the `vision` capability."""
from __future__ import annotations

import base64
import re
from dataclasses import dataclass, field
from pathlib import Path

from dgemma_cli.errors import DgemmaError

MAX_FILE_BYTES = 20 << 20  # the server refuses larger images (dgemma_engine.images.MAX_IMAGE_BYTES)
PATH_PATTERN = re.compile(r"(?:[a-zA-Z]:)?(?:\./|~/|/|\\)[\S\\ ]+?\.(?i:jpg|jpeg|png|webp|gif)\b")
ESCAPES = {"\\ ": " ", "\\(": "(", "\\)": ")", "\\[": "[", "\\]": "]", "\\{": "{", "\\}": "}", "\\$": "$",
           "\\&": "&", "\\;": ";", "\\'": "'", "\\\\": "\\", "\\*": "*", "\\?": "?", "\\~": "~"}
MAGIC = ((b"\x89PNG\r\n\x1a\n", "PNG"), (b"\xff\xd8\xff", "JPEG"), (b"GIF87a", "GIF"), (b"GIF89a", "GIF"))


class PromptImageError(DgemmaError):
    """A named file that cannot be sent: the one-line `Error:` of the CLI."""


@dataclass
class PromptWithImages:
    text: str
    images: list[str] = field(default_factory=list)  # base64, as the API's `images`
    added: list[str] = field(default_factory=list)  # the paths, as the user wrote them (escapes resolved)


def has_vision(show: dict) -> bool:
    """The model's `/api/show` lists the `vision` capability (it has a projector)."""
    return "vision" in (show.get("capabilities") or [])


def unescape(path: str) -> str:
    return re.sub(r"\\.", lambda m: ESCAPES.get(m.group(0), m.group(0)), path)


def extract_images(prompt: str) -> PromptWithImages:
    """The prompt without the image files it names, and those files' bytes (base64), in order."""
    result = PromptWithImages(prompt)
    for candidate in PATH_PATTERN.findall(prompt):
        path = unescape(candidate)
        file = Path(path).expanduser()
        if not file.is_file():
            continue
        result.images.append(base64.b64encode(read_image_file(file, path)).decode())
        result.added.append(path)
        for spelled in (f"'{path}'", f"'{candidate}'", f'"{path}"', f'"{candidate}"', candidate):
            result.text = result.text.replace(spelled, "")
    result.text = result.text.strip()
    return result


def read_image_file(file: Path, shown: str) -> bytes:
    """The file's bytes, after checking its size and that it starts like a PNG, JPEG, WebP or GIF."""
    try:
        size = file.stat().st_size
        if size > MAX_FILE_BYTES:
            raise PromptImageError(f"{shown}: file size exceeds maximum limit ({MAX_FILE_BYTES >> 20} MB)")
        with open(file, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise PromptImageError(f"couldn't read {shown}: {exc.strerror or exc}") from None
    if not (any(data.startswith(magic) for magic, _ in MAGIC) or (data[:4] == b"RIFF" and data[8:12] == b"WEBP")):
        raise PromptImageError(f"{shown}: invalid file type (not a PNG, JPEG, WebP or GIF image)")
    return data
