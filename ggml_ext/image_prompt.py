"""Images in a prompt, on the text side (docs/engine.md#prefill-with-images).

A prompt carries ONE image-token id (`<|image|>`) per image where the image goes; `expand_image_markers` turns each
marker into `<|image>`, `<|image|>` × n_soft, `<image|>` (what Gemma 4's processor writes) and records where that
image's embeddings go. The engine encodes those rows with the embeddings (float32 [n_soft, n_embd], the projector's
`embed_vision` output as it comes, not scaled by √H) in place of the tokens' scaled embeddings, bidirectionally within
each image's soft tokens.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from dgemma_engine import gguf_keys
from dgemma_engine.errors import EngineError

IMAGE_TOKEN, BOI_TOKEN, EOI_TOKEN = "<|image|>", "<|image>", "<image|>"


@dataclass(frozen=True)
class ImageTokens:
    """Ids of the image placeholders in a model's vocabulary."""

    image: int  # <|image|>: the marker in a prompt, and each soft-token row
    boi: int    # <|image>: opens an image
    eoi: int    # <image|>: closes it


@dataclass(frozen=True)
class ImageSpan:
    """One image's soft-token rows in an expanded prompt: rows first .. first + len(embeddings) − 1."""

    first: int
    embeddings: np.ndarray  # float32 [n_soft, n_embd], C-contiguous


@dataclass(frozen=True)
class ImagePrompt:
    ids: list[int]                 # the expanded prompt
    spans: tuple[ImageSpan, ...]   # one per image, in prompt order


def image_token_ids(metadata: dict[str, Any]) -> ImageTokens:
    """The placeholders' ids, found by their token strings in the GGUF's vocabulary."""
    tokens = list(metadata.get(gguf_keys.KEY_TOKENS) or ())
    found = {}
    for name in (IMAGE_TOKEN, BOI_TOKEN, EOI_TOKEN):
        try:
            found[name] = tokens.index(name)
        except ValueError:
            raise EngineError(f"this model takes no images: its vocabulary has no {name} token") from None
    return ImageTokens(image=found[IMAGE_TOKEN], boi=found[BOI_TOKEN], eoi=found[EOI_TOKEN])


def _embeddings(image: Any, k: int, n_embd: int) -> np.ndarray:
    arr = np.asarray(image)
    if arr.ndim != 2 or arr.shape[0] < 1 or arr.shape[1] != n_embd:
        raise EngineError(f"image {k}: embeddings must be float32 [n_soft, {n_embd}], got shape {list(arr.shape)}")
    if not np.issubdtype(arr.dtype, np.floating):
        raise EngineError(f"image {k}: embeddings must be floating point, got {arr.dtype}")
    arr = np.ascontiguousarray(arr, dtype=np.float32)
    if not np.isfinite(arr).all():
        raise EngineError(f"image {k}: embeddings contain NaN or infinity")
    return arr


def expand_image_markers(prompt_ids: Sequence[int], images: Sequence[Any], tokens: ImageTokens,
                         n_embd: int) -> ImagePrompt:
    """Each marker in `prompt_ids` -> boi, image × n_soft, eoi, with images[k] (float32 [n_soft, n_embd]) for the
    k-th marker. Raises EngineError when the counts differ, or a prompt already holds an expanded image."""
    prompt = [int(t) for t in prompt_ids]
    if any(t in (tokens.boi, tokens.eoi) for t in prompt):
        raise EngineError(f"the prompt already holds {BOI_TOKEN}/{EOI_TOKEN}: give one {IMAGE_TOKEN} per image")
    markers = sum(t == tokens.image for t in prompt)
    if markers != len(images):
        raise EngineError(f"the prompt has {markers} image marker(s) ({IMAGE_TOKEN}) but {len(images)} image(s) "
                          "were given")
    ids: list[int] = []
    spans: list[ImageSpan] = []
    for t in prompt:
        if t != tokens.image:
            ids.append(t)
            continue
        rows = _embeddings(images[len(spans)], len(spans), n_embd)
        ids.append(tokens.boi)
        spans.append(ImageSpan(first=len(ids), embeddings=rows))
        ids += [tokens.image] * rows.shape[0] + [tokens.eoi]
    return ImagePrompt(ids=ids, spans=tuple(spans))


def as_marker_prompt(prompt_ids: Sequence[int], tokens: ImageTokens) -> tuple[list[int], list[int | None]]:
    """A prompt as an image processor writes it (boi, image × n, eoi per image) back to one marker per image, with
    each block's n (None for an image given as one marker already). A block that is not boi, image × n ≥ 1, eoi is an
    error."""
    prompt = [int(t) for t in prompt_ids]
    ids: list[int] = []
    counts: list[int | None] = []
    i = 0
    while i < len(prompt):
        t = prompt[i]
        if t == tokens.boi:
            j = i + 1
            while j < len(prompt) and prompt[j] == tokens.image:
                j += 1
            if j == i + 1 or j == len(prompt) or prompt[j] != tokens.eoi:
                raise EngineError(f"the prompt's image block at position {i} is not {BOI_TOKEN}, {IMAGE_TOKEN} × n, "
                                  f"{EOI_TOKEN}")
            ids.append(tokens.image)
            counts.append(j - i - 1)
            i = j + 1
            continue
        if t == tokens.eoi:
            raise EngineError(f"the prompt has {EOI_TOKEN} at position {i} without its {BOI_TOKEN}")
        ids.append(t)
        if t == tokens.image:
            counts.append(None)
        i += 1
    return ids, counts


def check_image_counts(counts: Sequence[int | None], images: Sequence[Any]) -> None:
    """Each expanded block of a prompt (as_marker_prompt) holds as many image tokens as its image has soft tokens."""
    for k, (n, image) in enumerate(zip(counts, images)):
        rows = np.shape(image)[0] if np.ndim(image) else 0
        if n is not None and n != rows:
            raise EngineError(f"image {k} has {rows} soft tokens but its block in the prompt holds {n} "
                              f"{IMAGE_TOKEN} tokens")


def read_image_embeds(paths: Sequence[str | os.PathLike]) -> list[np.ndarray]:
    """`--image-embeds X.npy` files (debug commands): one float32 [n_soft, n_embd] array each, in order."""
    arrays = []
    for path in paths:
        try:
            arrays.append(np.load(path, allow_pickle=False))
        except (OSError, ValueError) as exc:
            raise EngineError(f"cannot read --image-embeds {path}: {exc}") from None
    return arrays


def image_context_size(prompt_ids: Sequence[int], images: Sequence[Any], metadata: dict[str, Any],
                       n_embd: int) -> tuple[ImagePrompt, int]:
    """The expanded prompt and the longest image (soft tokens): what a context for this prompt must hold. The prompt
    holds one marker per image, or each image's whole block as a processor writes it (checked against the image)."""
    tokens = image_token_ids(metadata)
    markers, counts = as_marker_prompt(prompt_ids, tokens)
    check_image_counts(counts, images)
    expanded = expand_image_markers(markers, images, tokens, n_embd)
    return expanded, max((s.embeddings.shape[0] for s in expanded.spans), default=0)
