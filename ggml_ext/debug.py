"""Fixed-interface debugging entry points (`dgemma debug logits|generate`); external checks rely on them."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Sequence

import numpy as np

from dgemma_engine.errors import EngineError
from dgemma_engine.image_prompt import image_context_size, read_image_embeds
from dgemma_engine.model import Context, Model


def debug_images(image_embeds: Sequence[str | os.PathLike] = (), mmproj: str | os.PathLike | None = None,
                 image_files: Sequence[str | os.PathLike] = (), threads: int | None = None) -> list[np.ndarray]:
    """The images of a debug command, one float32 [n_soft, n_embd] array each: `--image-embeds` files as they are,
    or `--image` files through the `--mmproj` projector."""
    if image_files and image_embeds:
        raise EngineError("give --image-embeds or --mmproj with --image, not both")
    if image_files and not mmproj:
        raise EngineError("--image needs --mmproj (the projector GGUF)")
    if mmproj and not image_files:
        raise EngineError("--mmproj needs at least one --image")
    if image_files:
        from dgemma_engine.vision import encode_image_files

        return encode_image_files(mmproj, image_files, threads)
    return read_image_embeds(image_embeds)


def debug_logits(model: str | os.PathLike, prompt_ids: list[int], canvas_ids: list[int],
                 sc_logits: str | os.PathLike | None, sc_temperature: float, out: str | os.PathLike,
                 threads: int | None = None, adapters: Sequence = (), num_gpu: int | None = None,
                 num_cpu_moe: int = 0, images: Sequence[np.ndarray] = ()) -> None:
    """Write float32 [len(canvas_ids), vocab]: the softcapped logits of one decoder step after encoding the prompt.

    With `sc_logits` (an .npy of the previous step's *raw* logits) the step is self-conditioned on them, tempered by
    `sc_temperature` inside the engine; without it the step is the first of a canvas. `adapters`, `num_gpu`,
    `num_cpu_moe`: as `Model.load` takes them (the placement, so parity is checked per placement). `images`
    (debug_images): one float32 [n_soft, n_embd] array per image of the prompt, which holds a marker or the image's
    whole block (boi, image × n, eoi) for each (docs/engine.md#prefill-with-images)."""
    if not canvas_ids:
        raise EngineError("--canvas-ids must not be empty")
    with Model.load(model, threads=threads, adapters=adapters, num_gpu=num_gpu, num_cpu_moe=num_cpu_moe) as m:
        previous = _load_sc_logits(sc_logits, len(canvas_ids), m.hparams.n_vocab) if sc_logits else None
        expanded, longest = (image_context_size(prompt_ids, images, m.metadata, m.hparams.n_embd) if images
                             else (None, 0))
        n_prompt = len(expanded.ids) if expanded else len(prompt_ids)
        with Context(m, n_ctx=n_prompt + len(canvas_ids), threads=threads, max_image_tokens=longest) as ctx:
            if expanded:
                ctx.encode_images(expanded.ids, expanded.spans)
            else:
                ctx.encode(prompt_ids)
            if previous is not None:
                ctx.set_self_cond_logits(previous)
                logits = ctx.step(canvas_ids, sc_temperature=sc_temperature)
            else:
                logits = ctx.step(canvas_ids)
            _save_atomically(Path(out), np.array(logits, dtype=np.float32))


def _load_sc_logits(path: str | os.PathLike, rows: int, n_vocab: int) -> np.ndarray:
    try:
        arr = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise EngineError(f"cannot read --sc-logits {path}: {exc}") from None
    if arr.ndim == 3 and arr.shape[0] == 1:  # a batch of one, as transformers records it
        arr = arr[0]
    if arr.shape != (rows, n_vocab):
        raise EngineError(f"--sc-logits has shape {arr.shape}, expected ({rows}, {n_vocab})")
    return arr


def _save_atomically(out: Path, arr: np.ndarray) -> None:
    """Write through a temporary file in the same folder, so a failure never leaves a half-written output."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, arr, allow_pickle=False)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def debug_generate(*args, **kwargs):
    """`dgemma debug generate` (implemented by the generation loop in debug_generate.py)."""
    from dgemma_engine.debug_generate import debug_generate as impl

    return impl(*args, **kwargs)
