"""A model's vision projector file (the mmproj GGUF, llama.cpp's mtmd layout with `general.architecture` "clip"), as the
store, `create`, `show` and the server's request checks see it: read from its header alone (docs/store.md, "Vision
projectors"). Loading it to encode images is the engine's (`dgemma_engine.vision.Projector`)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dgemma_engine import gguf_keys
from dgemma_engine.arch import CLIP_ARCH, PROJECTOR_GEMMA4V

from dgemma_cli.errors import DgemmaError
from dgemma_cli.gguf_check import GGUFError, GGUFInfo, read_gguf_info


class ProjectorError(DgemmaError):
    status = 400


@dataclass(frozen=True)
class ProjectorInfo:
    """What a request check and `show` need: the soft-token budget of one image and the embedding widths."""

    path: Path
    max_soft_tokens: int  # an image becomes at most this many embeddings (plus its begin and end markers)
    n_embd_text: int  # the width of those embeddings: the text model's embedding length
    n_embd_vision: int  # the vision tower's own width
    parameter_count: int
    metadata: dict[str, Any]

    @property
    def positions_per_image(self) -> int:
        """Prompt positions one image takes at most: boi, the soft tokens, eoi."""
        return self.max_soft_tokens + 2


def is_projector(info: GGUFInfo) -> bool:
    return info.architecture == CLIP_ARCH


def projector_info(path: Path, label: str | None = None) -> ProjectorInfo:
    """A projector GGUF's header, checked: a gemma4v vision projector with a positive soft-token budget. Errors
    name the file by `label` (never a server path)."""
    name = label or Path(path).name
    try:
        info = read_gguf_info(path)
    except GGUFError as exc:
        raise ProjectorError(f"invalid projector {name}: not a GGUF file ({exc})") from None
    return projector_from(info, Path(path), name)


def projector_from(info: GGUFInfo, path: Path, name: str) -> ProjectorInfo:
    meta = info.metadata
    if not is_projector(info):
        raise ProjectorError(f'invalid projector {name}: its architecture is "{info.architecture or "unknown"}", '
                             f'not "{CLIP_ARCH}"')
    kind = meta.get(gguf_keys.KEY_CLIP_PROJECTOR_TYPE)
    if kind != PROJECTOR_GEMMA4V:
        raise ProjectorError(f'invalid projector {name}: projector type "{kind}" is not supported (only '
                             f'"{PROJECTOR_GEMMA4V}", Gemma 4\'s vision tower)')
    values = {}
    for key in (gguf_keys.KEY_VISION_MAX_SOFT_TOKENS, gguf_keys.KEY_VISION_PROJECTION_DIM,
                gguf_keys.KEY_VISION_EMBEDDING_LENGTH):
        value = meta.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= 1 << 20:
            raise ProjectorError(f"invalid projector {name}: {key} is missing or not a positive integer")
        values[key] = value
    return ProjectorInfo(path, values[gguf_keys.KEY_VISION_MAX_SOFT_TOKENS], values[gguf_keys.KEY_VISION_PROJECTION_DIM],
                         values[gguf_keys.KEY_VISION_EMBEDDING_LENGTH], info.parameter_count, meta)


def check_fits_model(projector: ProjectorInfo, model: GGUFInfo, name: str) -> None:
    """The projector's embeddings must be as wide as the text model's token embeddings, and one image (its markers,
    a prompt token and a canvas besides) must fit the model's context: else every request with an image is refused."""
    width = model.metadata.get(gguf_keys.KEY_EMBEDDING_LENGTH)
    if isinstance(width, int) and width != projector.n_embd_text:
        raise ProjectorError(f"projector {name} does not fit the model: it makes embeddings of {projector.n_embd_text} "
                             f"values, the model's are {width}")
    context = model.metadata.get(gguf_keys.for_arch(gguf_keys.KEY_CONTEXT_LENGTH, model.architecture))
    canvas = model.metadata.get(gguf_keys.KEY_CANVAS_LENGTH)
    if isinstance(context, int) and isinstance(canvas, int) and projector.positions_per_image + 1 + canvas > context:
        raise ProjectorError(f"projector {name} does not fit the model: an image takes up to "
                             f"{projector.positions_per_image} positions, and with a canvas of {canvas} tokens the "
                             f"model's context of {context} has no room for one")


def check_projector(path: Path, model: GGUFInfo | None, label: str | None = None) -> ProjectorInfo:
    """Everything a projector file must pass before the store keeps it: its header (`projector_info`), its fit to
    the model when known (`check_fits_model`), and the vision engine's own load (`dgemma_engine.vision.Projector`:
    every key in range, every tensor of its shape and type), which maps the file and allocates no weights; what
    passes here loads when a run loads the model. Errors name the file by `label` (never a server path)."""
    from dgemma_engine.errors import EngineError
    from dgemma_engine.vision import Projector

    name = label or Path(path).name
    info = projector_info(path, name)
    if model is not None:
        check_fits_model(info, model, name)
    try:
        Projector.load(str(path), n_threads=1).close()
    except EngineError as exc:
        detail = str(exc).replace(f"cannot load the projector {path}: ", "").replace(str(path), name)
        raise ProjectorError(f"invalid projector {name}: {detail}") from None
    return info
