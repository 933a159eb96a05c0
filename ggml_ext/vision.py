"""Images in: the projector GGUF's vision encoder (C engine, ctypes) and the image preprocessing that feeds it.

    projector = Projector.load("mmproj.gguf")
    image = prepare_image(rgb, projector.geometry)   # rgb: uint8 [H, W, 3]
    embeddings = projector.encode(image)             # float32 [image.n_soft_tokens, n_embd_text]

`prepare_image` reproduces transformers' Gemma 4 image processor (`Gemma4ImageProcessorPil`, the one transformers
picks without torchvision): the aspect-ratio-preserving size whose sides are multiples of patch·pooling and whose
patch count fits max_soft_tokens·pooling², Pillow's BICUBIC resize of the uint8 image (skipped when the size already
fits), a rescale by 1/255 (float64 product, stored as float32), no mean/std normalisation, patches in raster order,
each flattened as (row, column, channel), and (x, y) patch positions. No padding rows: the engine takes the real
patches only. `Projector.encode` returns `embed_vision`'s output for those soft tokens (docs/engine.md#vision-encoder).
"""
from __future__ import annotations

import ctypes
import functools
import math
import os
import weakref
from dataclasses import dataclass

import numpy as np

from dgemma_engine._lib import load_library
from dgemma_engine.errors import EngineError

_ERR_LEN = 1024


@dataclass(frozen=True)
class VisionGeometry:
    """What image preprocessing needs from the projector file."""
    patch_size: int
    pooling_kernel_size: int
    max_soft_tokens: int
    n_embd_text: int


@dataclass(frozen=True)
class PreparedImage:
    patches: np.ndarray    # float32 [n_patches, 3·p·p], values in [0, 1] as the HF processor outputs them
    positions: np.ndarray  # int32 [n_patches, 2]: (x, y) of each patch, no padding rows
    n_soft_tokens: int


def target_size(height: int, width: int, geometry: VisionGeometry) -> tuple[int, int]:
    """(height, width) the processor resizes an image to (transformers' get_aspect_ratio_preserving_size)."""
    p, k = geometry.patch_size, geometry.pooling_kernel_size
    max_patches = geometry.max_soft_tokens * k * k
    target_px = max_patches * p * p
    factor = math.sqrt(target_px / (height * width))
    side = k * p
    target_h = int(math.floor(factor * height / side)) * side
    target_w = int(math.floor(factor * width / side)) * side
    max_side = (max_patches // (k * k)) * side
    if target_h == 0 and target_w == 0:
        raise EngineError(f"cannot fit a {width}x{height} image into {max_patches} patches of {p} px")
    if target_h == 0:  # a very wide image: one row of blocks
        target_h, target_w = side, min(int(math.floor(width / height)) * side, max_side)
    elif target_w == 0:  # a very tall one: one column
        target_w, target_h = side, min(int(math.floor(height / width)) * side, max_side)
    return target_h, target_w


def prepare_image(rgb: np.ndarray, geometry: VisionGeometry) -> PreparedImage:
    """An RGB image (uint8 [H, W, 3]) as the vision encoder's input."""
    from PIL import Image  # the decoder's dependency; the engine itself does not need it

    if not isinstance(rgb, np.ndarray) or rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3:
        raise EngineError("an image must be a uint8 array of shape [height, width, 3] (RGB)")
    height, width = rgb.shape[:2]
    if height < 1 or width < 1:
        raise EngineError(f"an image must have at least one pixel, got {width}x{height}")
    th, tw = target_size(height, width, geometry)
    if (th, tw) != (height, width):
        rgb = np.asarray(Image.fromarray(np.ascontiguousarray(rgb), "RGB").resize((tw, th), Image.Resampling.BICUBIC))
    pixels = (rgb.astype(np.float64) * (1 / 255)).astype(np.float32)
    p = geometry.patch_size
    rows, cols = th // p, tw // p
    patches = pixels.reshape(rows, p, cols, p, 3).transpose(0, 2, 1, 3, 4).reshape(rows * cols, p * p * 3)
    grid_x, grid_y = np.meshgrid(np.arange(cols, dtype=np.int32), np.arange(rows, dtype=np.int32), indexing="xy")
    positions = np.stack([grid_x, grid_y], axis=-1).reshape(rows * cols, 2)
    k2 = geometry.pooling_kernel_size ** 2
    return PreparedImage(np.ascontiguousarray(patches), np.ascontiguousarray(positions), rows * cols // k2)


class VisionHParamsC(ctypes.Structure):
    """Mirror of `dg_vision_hparams` in csrc/engine/engine.h, field by field (tests/test_c_bindings.py)."""

    _fields_ = [(name, ctypes.c_int32) for name in (
        "n_embd", "n_ff", "n_layer", "n_head", "n_head_kv", "head_dim", "patch_size", "pooling", "n_pos_table",
        "n_embd_text", "max_soft_tokens")]
    _fields_ += [("eps", ctypes.c_float), ("rope_base", ctypes.c_float)]
    _fields_ += [("has_standardize", ctypes.c_int32), ("has_clip", ctypes.c_int32)]


@dataclass(frozen=True)
class VisionHParams:
    n_embd: int
    n_ff: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    patch_size: int
    pooling: int
    n_pos_table: int
    n_embd_text: int
    max_soft_tokens: int
    eps: float
    rope_base: float
    has_standardize: bool
    has_clip: bool


@functools.cache
def _engine() -> ctypes.CDLL:
    lib = load_library("engine")
    P, I, S, C = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_char_p
    sigs = {
        "dg_vision_load": (P, [C, I, C, S]),
        "dg_vision_free": (None, [P]),
        "dg_vision_get_hparams": (ctypes.POINTER(VisionHParamsC), [P]),
        "dg_vision_hparams_size": (S, []),
        "dg_vision_encode_image": (I, [P, P, P, I, P, I, C, S]),
    }
    for name, (restype, argtypes) in sigs.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    if lib.dg_vision_hparams_size() != ctypes.sizeof(VisionHParamsC):
        raise EngineError("the engine library does not match its Python binding; rebuild dgemma")
    return lib


def _message(buf: ctypes.Array) -> str:
    return buf.value.decode("utf-8", "replace") or "unknown engine error"


class Projector:
    """A vision projector GGUF loaded by the C engine (memory-mapped, every key and tensor validated)."""

    def __init__(self, handle: int, path: str):
        self._handle = handle
        self.path = path
        c = _engine().dg_vision_get_hparams(handle).contents
        self.hparams = VisionHParams(**{name: getattr(c, name) for name, _ in VisionHParamsC._fields_})
        self.geometry = VisionGeometry(c.patch_size, c.pooling, c.max_soft_tokens, c.n_embd_text)
        self._finalizer = weakref.finalize(self, _engine().dg_vision_free, handle)

    @classmethod
    def load(cls, path: str, n_threads: int | None = None) -> "Projector":
        if n_threads is not None and n_threads < 1:
            raise EngineError(f"threads must be at least 1, got {n_threads}")
        err = ctypes.create_string_buffer(_ERR_LEN)
        handle = _engine().dg_vision_load(os.fsencode(str(path)), n_threads or os.cpu_count() or 1, err, _ERR_LEN)
        if not handle:
            raise EngineError(f"cannot load the projector {path}: {_message(err)}")
        return cls(handle, str(path))

    def encode(self, image: PreparedImage) -> np.ndarray:
        """`embed_vision(vision_tower(image))`: float32 [image.n_soft_tokens, n_embd_text]."""
        if self._handle is None:
            raise EngineError("the projector is closed")
        p = self.geometry.patch_size
        patches = np.ascontiguousarray(image.patches, dtype=np.float32)
        positions = np.ascontiguousarray(image.positions, dtype=np.int32)
        n = patches.shape[0] if patches.ndim == 2 else -1
        if patches.ndim != 2 or patches.shape[1] != 3 * p * p or positions.shape != (n, 2):
            raise EngineError(f"an image's patches must be [n, {3 * p * p}] with positions [n, 2]; got "
                              f"{list(patches.shape)} and {list(positions.shape)}")
        out = np.empty((max(image.n_soft_tokens, 0), self.geometry.n_embd_text), dtype=np.float32)
        err = ctypes.create_string_buffer(_ERR_LEN)
        got = _engine().dg_vision_encode_image(self._handle, patches.ctypes.data, positions.ctypes.data, n,
                                               out.ctypes.data, out.shape[0], err, _ERR_LEN)
        if got < 0:
            raise EngineError(_message(err))
        if got != image.n_soft_tokens:
            raise EngineError(f"the image makes {got} soft tokens, not the {image.n_soft_tokens} it claims")
        return out

    def close(self) -> None:
        if self._handle is not None:
            self._finalizer()
            self._handle = None

    def __enter__(self) -> "Projector":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def encode_image_files(projector_path: str | os.PathLike, paths, n_threads: int | None = None) -> list[np.ndarray]:
    """Image files through the projector (what `debug logits|generate --mmproj P --image IMG` feed the prompt): one
    float32 [n_soft, n_embd_text] array per file, in order."""
    from dgemma_engine.images import ImageError, decode_image

    embeddings = []
    with Projector.load(str(projector_path), n_threads=n_threads) as projector:
        for path in paths:
            try:
                data = open(path, "rb").read()
            except OSError as exc:
                raise EngineError(f"cannot read --image {path}: {exc.strerror or exc}") from None
            try:
                rgb = decode_image(data)
            except ImageError as exc:
                raise EngineError(f"--image {path}: {exc}") from None
            embeddings.append(projector.encode(prepare_image(rgb, projector.geometry)))
    return embeddings
