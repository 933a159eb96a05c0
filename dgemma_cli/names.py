"""Model names with Ollama's grammar: `[scheme://][host/][namespace/]model[:tag]`.

Mirrors `ollama/ollama: types/model/name.go` (docs/compat.md#names-and-store): defaults `registry.ollama.ai`, `library`,
`latest`, `https`; per-part character sets and length limits; a display form that drops the default host and
namespace but always shows the tag. A name that fails validation can never become a path component, which is what
keeps manifest paths inside the store.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from dgemma_cli.errors import DgemmaError

DEFAULT_HOST = "registry.ollama.ai"
DEFAULT_NAMESPACE = "library"
DEFAULT_TAG = "latest"
DEFAULT_SCHEME = "https"

# First character of every part, then the part's own alphabet and maximum length (ASCII only: re.ASCII). Ollama allows
# hosts of 350 characters, but each part is a file or folder name in the store and file systems cap those at 255
# bytes (ENAMETOOLONG), so a longer host could never be stored, looked up or pulled (a DNS name has at most 253
# characters, a port adds 6): it is refused here, with every other invalid name.
MAX_PART_BYTES = 255
_HOST_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:-]{0,254}", re.ASCII)
_NAMESPACE_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]{0,79}", re.ASCII)
_MODEL_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,79}", re.ASCII)
_TAG_RE = _MODEL_RE
# The longest valid name: `https://` + host/namespace/model:tag. Longer text is refused before any parsing.
MAX_NAME_CHARS = len("https://") + MAX_PART_BYTES + 3 * 80 + 3


class InvalidNameError(DgemmaError):
    """The one message for every invalid name, so callers cannot probe the filesystem through error texts."""

    status = 400

    def __init__(self) -> None:
        super().__init__("invalid model name")


@dataclass(frozen=True)
class ModelName:
    host: str
    namespace: str
    model: str
    tag: str
    scheme: str = DEFAULT_SCHEME

    @classmethod
    def parse(cls, text: str) -> "ModelName":
        """Parse and validate a name, filling defaults; raises InvalidNameError ("invalid model name")."""
        if not isinstance(text, str):
            raise InvalidNameError()
        rest = text.strip()
        if len(rest) > MAX_NAME_CHARS:
            raise InvalidNameError()
        scheme = DEFAULT_SCHEME
        if "://" in rest:
            scheme, rest = rest.split("://", 1)
            if scheme not in ("http", "https"):
                raise InvalidNameError()
        if "@" in rest:  # `@digest` references are not supported in v1
            raise InvalidNameError()
        tag = DEFAULT_TAG
        colon, slash = rest.rfind(":"), rest.rfind("/")
        if colon > slash:  # a ':' before the last '/' belongs to a host's port, not a tag
            rest, tag = rest[:colon], rest[colon + 1 :]
        parts = rest.split("/")
        if len(parts) == 1:
            host, namespace, model = DEFAULT_HOST, DEFAULT_NAMESPACE, parts[0]
        elif len(parts) == 2:
            host, (namespace, model) = DEFAULT_HOST, parts
        elif len(parts) == 3:
            host, namespace, model = parts
        else:
            raise InvalidNameError()
        name = cls(host=host, namespace=namespace, model=model, tag=tag, scheme=scheme)
        if not name.is_valid():
            raise InvalidNameError()
        return name

    def is_valid(self) -> bool:
        return bool(
            _HOST_RE.fullmatch(self.host)
            and _NAMESPACE_RE.fullmatch(self.namespace)
            and _MODEL_RE.fullmatch(self.model)
            and _TAG_RE.fullmatch(self.tag)
        )

    @property
    def display(self) -> str:
        """Shortest form: `m:latest`, `ns/m:latest`, `hf.co/user/repo:Q4_K_M`."""
        if self.host.lower() != DEFAULT_HOST:
            prefix = f"{self.host}/{self.namespace}/"
        elif self.namespace.lower() != DEFAULT_NAMESPACE:
            prefix = f"{self.namespace}/"
        else:
            prefix = ""
        return f"{prefix}{self.model}:{self.tag}"

    @property
    def full(self) -> str:
        """`registry.ollama.ai/library/m:latest`: the form used in capability errors."""
        return f"{self.host}/{self.namespace}/{self.model}:{self.tag}"

    @property
    def parts(self) -> tuple[str, str, str, str]:
        """Path components of the manifest: host, namespace, model, tag."""
        return (self.host, self.namespace, self.model, self.tag)

    def key(self) -> tuple[str, ...]:
        """Case-insensitive identity (names match case-insensitively, docs/compat.md#names-and-store)."""
        return tuple(p.lower() for p in self.parts)

    def __str__(self) -> str:
        return self.display
