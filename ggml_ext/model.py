"""Python binding of the C engine (`dgemma_engine._engine`, ctypes): load a GGUF, encode, run decoder steps.

    m = Model.load("model.gguf")                 # memory-mapped, every tensor validated
    m = Model.load("model.gguf", adapters=[("lora.gguf", 1.0)])  # LoRA adapters (dgemma_engine.adapters)
    ctx = Context(m, n_ctx=4096)
    ctx.encode(prompt_ids)                       # causal prefill into the K/V cache
    raw = ctx.step(canvas_ids)                   # first step of a canvas: no self-conditioning
    raw = ctx.step(canvas_ids, sc_temperature=t) # later steps: SC from the previous step's logits / t, inside the engine
    ctx.encode(committed_canvas)                 # commit a finished canvas

`step` returns a read-only view of engine memory, valid until the next step.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import os
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence, Union

import numpy as np

from dgemma_engine._lib import load_library
from dgemma_engine.errors import EngineError
from dgemma_engine.image_prompt import ImageSpan

log = logging.getLogger("dgemma.engine")

_ERR_LEN = 1024
MAX_LAYERS = 512  # DG_MAX_LAYERS in engine.h
# Context.step_profiled's classes of nodes, in dg_profile_class's order (engine.h)
PROFILE_CLASSES = ("experts", "dense", "attention", "lm_head", "self_cond", "other")
AdapterSpec = Union[str, os.PathLike, tuple]  # a path, or (path, scale): see dgemma_engine.adapters


class HParamsC(ctypes.Structure):
    """Mirror of `dg_hparams` in csrc/engine/engine.h, field by field (tests/test_c_bindings.py holds them equal)."""

    _fields_ = [(name, ctypes.c_int32) for name in (
        "n_vocab", "n_embd", "n_layer", "n_head", "n_ff", "n_ff_exp", "n_expert", "n_expert_used", "canvas_length",
        "sliding_window", "n_ctx_train", "head_dim_full", "head_dim_swa")]
    _fields_ += [(name, ctypes.c_float) for name in ("rms_eps", "logit_softcap", "rope_base_full", "rope_base_swa")]
    _fields_ += [(name, ctypes.c_int32) for name in ("has_self_cond", "has_output", "split_experts", "has_enc_scale")]
    _fields_ += [("is_sliding", ctypes.c_uint8 * MAX_LAYERS), ("n_head_kv", ctypes.c_int32 * MAX_LAYERS)]


@dataclass(frozen=True)
class HParams:
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_ff: int
    n_ff_exp: int
    n_expert: int
    n_expert_used: int
    canvas_length: int
    sliding_window: int
    n_ctx_train: int
    rms_eps: float
    logit_softcap: float
    head_dim_full: int
    head_dim_swa: int
    rope_base_full: float
    rope_base_swa: float
    layer_sliding: tuple[bool, ...]   # per layer: sliding-window attention (else full)
    layer_n_head_kv: tuple[int, ...]
    layer_head_dim: tuple[int, ...]
    has_self_cond: bool
    has_output: bool                  # untied LM head in the file
    split_experts: bool
    has_enc_scale: bool

    @classmethod
    def _from_c(cls, c: HParamsC) -> HParams:
        n = c.n_layer
        sliding = tuple(bool(c.is_sliding[i]) for i in range(n))
        return cls(
            n_vocab=c.n_vocab, n_embd=c.n_embd, n_layer=n, n_head=c.n_head, n_ff=c.n_ff, n_ff_exp=c.n_ff_exp,
            n_expert=c.n_expert, n_expert_used=c.n_expert_used, canvas_length=c.canvas_length,
            sliding_window=c.sliding_window, n_ctx_train=c.n_ctx_train, rms_eps=c.rms_eps,
            logit_softcap=c.logit_softcap, head_dim_full=c.head_dim_full, head_dim_swa=c.head_dim_swa,
            rope_base_full=c.rope_base_full, rope_base_swa=c.rope_base_swa, layer_sliding=sliding,
            layer_n_head_kv=tuple(c.n_head_kv[i] for i in range(n)),
            layer_head_dim=tuple(c.head_dim_swa if s else c.head_dim_full for s in sliding),
            has_self_cond=bool(c.has_self_cond), has_output=bool(c.has_output),
            split_experts=bool(c.split_experts), has_enc_scale=bool(c.has_enc_scale),
        )


@functools.cache
def _engine() -> ctypes.CDLL:
    lib = load_library("engine")
    P, I, S, F, C = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_float, ctypes.c_char_p
    sigs = {
        "dg_model_load": (P, [C, I, C, S]),
        "dg_model_free": (None, [P]),
        "dg_model_hparams": (ctypes.POINTER(HParamsC), [P]),
        "dg_model_gguf": (P, [P]),
        "dg_model_warnings": (C, [P]),
        "dg_model_file_size": (S, [P]),
        "dg_hparams_size": (S, []),
        "dg_model_check": (I, [C, C, S]),
        # lora.c: GGUF LoRA adapters (docs/gguf.md#lora-adapters)
        "dg_model_load_adapters": (I, [P, ctypes.POINTER(C), ctypes.POINTER(F), I, C, S]),
        "dg_adapter_check": (I, [C, C, C, S]),
        "dg_model_n_adapters": (I, [P]),
        "dg_context_new_multi": (P, [P, I, I, I, C, S]),
        "dg_context_new_images": (P, [P, I, I, I, I, C, S]),
        "dg_context_free": (None, [P]),
        "dg_context_n_past": (I, [P]),
        "dg_context_reset": (None, [P]),
        "dg_context_encode": (I, [P, P, I, C, S]),
        "dg_context_encode_images": (I, [P, P, I, P, I, P, C, S]),
        "dg_context_step_canvases": (P, [P, P, I, I, I, F, C, S]),
        "dg_context_step_profiled": (P, [P, P, I, I, F, P, C, S]),
        "dg_context_step_reduced": (I, [P, P, I, I, I, F, F, P, P, P, P, C, S]),
        "dg_context_logits_on_host": (I, [P]),
        "dg_context_set_self_cond_top_k": (I, [P, I, C, S]),
        "dg_context_keep_canvases": (I, [P, P, I, C, S]),
        "dg_context_set_self_cond": (I, [P, P, I, C, S]),
        "dg_context_logits": (P, [P]),
        "dg_context_logits_rows": (I, [P]),
        "dg_context_transfers": (None, [P, ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64),
                                        ctypes.POINTER(ctypes.c_int64)]),
        "dg_context_soft_embedding": (I, [P, P, I, P, C, S]),
        "dg_context_step_report": (C, [P]),
        # devices.c: per-layer placement (the registry and RPC servers: dgemma_engine.devices)
        "dg_model_offload": (I, [P, I, I, C, S]),
        "dg_model_unit_device": (I, [P, I, I]),
        "dg_model_n_devices": (I, [P]),
        "dg_model_device_name": (C, [P, I]),
        "dg_model_device_weight_bytes": (S, [P, I]),
        # ggml's GGUF reader (resolved through the engine's dependency on libggml-base)
        "gguf_get_n_kv": (ctypes.c_int64, [P]),
        "gguf_get_key": (C, [P, ctypes.c_int64]),
        "gguf_get_kv_type": (I, [P, ctypes.c_int64]),
        "gguf_get_arr_type": (I, [P, ctypes.c_int64]),
        "gguf_get_arr_n": (S, [P, ctypes.c_int64]),
        "gguf_get_arr_data": (P, [P, ctypes.c_int64]),
        "gguf_get_arr_str": (C, [P, ctypes.c_int64, S]),
        "gguf_get_val_str": (C, [P, ctypes.c_int64]),
        "gguf_get_val_data": (P, [P, ctypes.c_int64]),
    }
    for name, (restype, argtypes) in sigs.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    if lib.dg_hparams_size() != ctypes.sizeof(HParamsC):
        raise EngineError("the engine library does not match its Python binding; rebuild dgemma")
    return lib


def _error(buf: ctypes.Array) -> str:
    return buf.value.decode("utf-8", "replace") or "unknown engine error"


# GGUF value types (gguf.h) -> numpy dtypes; 7 = bool, 8 = string, 9 = array
_GGUF_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
               7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


def _read_metadata(lib: ctypes.CDLL, g: int) -> dict:
    """Every GGUF key/value: scalars as Python values, numeric arrays as numpy, string arrays as lists of str."""
    out: dict = {}
    for i in range(lib.gguf_get_n_kv(g)):
        key = lib.gguf_get_key(g, i).decode("utf-8", "replace")
        t = lib.gguf_get_kv_type(g, i)
        if t == _STRING:
            out[key] = lib.gguf_get_val_str(g, i).decode("utf-8", "replace")
        elif t == _ARRAY:
            at, n = lib.gguf_get_arr_type(g, i), lib.gguf_get_arr_n(g, i)
            if at == _STRING:
                get = lib.gguf_get_arr_str
                out[key] = [get(g, i, j).decode("utf-8", "replace") for j in range(n)]
            elif at in _GGUF_NUMPY:
                dtype = np.dtype(_GGUF_NUMPY[at])
                data = ctypes.string_at(lib.gguf_get_arr_data(g, i), n * dtype.itemsize) if n else b""
                out[key] = np.frombuffer(data, dtype=dtype).copy()
        elif t in _GGUF_NUMPY:
            dtype = np.dtype(_GGUF_NUMPY[t])
            value = np.frombuffer(ctypes.string_at(lib.gguf_get_val_data(g, i), dtype.itemsize), dtype=dtype)[0]
            out[key] = value.item()
    return out


def _default_threads(threads: int | None) -> int:
    if threads is None:
        return os.cpu_count() or 1
    if threads < 1:
        raise EngineError(f"threads must be at least 1, got {threads}")
    return int(threads)


class _Closeable:
    """Native handles: usable as context managers, and freed at garbage collection if never closed."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


@dataclass(frozen=True)
class Placement:
    """Where a loaded model's weights went (docs/engine.md#devices). Device 0 is the CPU."""

    devices: tuple[str, ...]          # ggml device names, "CPU" first
    layer_device: tuple[int, ...]     # per layer
    expert_device: tuple[int, ...]    # per layer: its routed experts
    output_device: int                # final norm, LM head, logits, self-conditioning
    device_bytes: tuple[int, ...]     # weights copied to each device ([0]: 0, the CPU reads the mapped file)

    @property
    def offloaded_layers(self) -> int:
        """Units on an accelerator, counted like llama.cpp's -ngl (the output is one)."""
        return sum(d != 0 for d in self.layer_device) + (self.output_device != 0)

    def describe(self) -> str:
        """One line per device for the startup log: which layers (and experts) went where."""
        lines = []
        for d, name in enumerate(self.devices):
            layers = [i for i, x in enumerate(self.layer_device) if x == d]
            experts = [i for i, x in enumerate(self.expert_device) if x == d and self.layer_device[i] != d]
            parts = [f"layers {_ranges(layers)}" if layers else "no layers"]
            if experts:
                parts.append(f"experts of layers {_ranges(experts)}")
            if self.output_device == d:
                parts.append("output")
            lines.append(f"{name}: {', '.join(parts)}" + (f" ({self.device_bytes[d] / 2**20:.1f} MiB)" if d else ""))
        return "; ".join(lines)


def _ranges(ids: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    out, start = [], None
    for i, x in enumerate(ids):
        if start is None:
            start = x
        if i + 1 == len(ids) or ids[i + 1] != x + 1:
            out.append(f"{start}-{x}" if x != start else f"{x}")
            start = None
    return ",".join(out)


class Model(_Closeable):
    """A memory-mapped DiffusionGemma GGUF. Use `Model.load`."""

    def __init__(self, handle: int, path: Path, threads: int):
        self._handle = handle
        self.path = path
        self.threads = threads
        self._contexts: weakref.WeakSet[Context] = weakref.WeakSet()
        self.hparams = HParams._from_c(_engine().dg_model_hparams(handle).contents)
        self.file_size = _engine().dg_model_file_size(handle)
        text = (_engine().dg_model_warnings(handle) or b"").decode("utf-8", "replace")
        self.warnings = [w for w in text.split("\n") if w]
        for w in self.warnings:
            log.warning("%s: %s", path.name, w)

    @classmethod
    def load(cls, path: str | os.PathLike, threads: int | None = None, name: str | None = None,
             num_gpu: int | None = None, num_cpu_moe: int = 0, adapters: Sequence[AdapterSpec] = ()) -> Model:
        """`name`: what errors call the model (a stored model's name rather than its `sha256-…` blob file).
        `num_gpu`: layers on the accelerators, llama.cpp's -ngl (None or < 0: as many as fit; 0: CPU only);
        `num_cpu_moe`: the first N layers keep their routed experts on the CPU (docs/engine.md#devices). The RPC
        servers of DGEMMA_RPC are added first. `adapters`: LoRA adapters, each a GGUF LoRA file's path or (path,
        scale), applied at run time (docs/gguf.md#lora-adapters)."""
        from dgemma_engine import adapters as adapter_files
        from dgemma_engine import devices

        path = Path(path)
        threads = _default_threads(threads)
        if not path.is_file():
            raise EngineError(f"model file not found: {name or path}")
        devices.add_rpc_servers_from_env()
        err = ctypes.create_string_buffer(_ERR_LEN)
        handle = _engine().dg_model_load(os.fsencode(path), threads, err, _ERR_LEN)
        if not handle:
            raise EngineError(f"cannot load {name or path.name}: {_error(err)}")
        if adapters:
            try:
                _load_adapters(handle, adapter_files.gguf_adapters(adapters))
            except BaseException:
                _engine().dg_model_free(handle)
                raise
        ngl = -1 if num_gpu is None or num_gpu < 0 else int(num_gpu)
        if _engine().dg_model_offload(handle, ngl, int(num_cpu_moe), err, _ERR_LEN) != 0:
            _engine().dg_model_free(handle)
            raise EngineError(f"cannot load {name or path.name}: {_error(err)}")
        model = cls(handle, path, threads)
        if len(model.placement.devices) > 1:
            log.info("%s: %s", name or path.name, model.placement.describe())
        return model

    @functools.cached_property
    def placement(self) -> Placement:
        lib, h = _engine(), self._require()
        n_layer = self.hparams.n_layer
        n_dev = lib.dg_model_n_devices(h)
        return Placement(
            devices=tuple(lib.dg_model_device_name(h, d).decode() for d in range(n_dev)),
            layer_device=tuple(lib.dg_model_unit_device(h, i, 0) for i in range(n_layer)),
            expert_device=tuple(lib.dg_model_unit_device(h, i, 1) for i in range(n_layer)),
            output_device=lib.dg_model_unit_device(h, n_layer, 0),
            device_bytes=tuple(lib.dg_model_device_weight_bytes(h, d) for d in range(n_dev)),
        )

    @staticmethod
    def check(path: str | os.PathLike) -> None:
        """Make every check `load` makes on the file (header, metadata, each tensor's name, type and shape) without
        allocating the weights. Raises EngineError with the reason a load would fail, the path left out of it."""
        path = Path(path)
        err = ctypes.create_string_buffer(_ERR_LEN)
        if not _engine().dg_model_check(os.fsencode(path), err, _ERR_LEN):
            raise EngineError(_error(err).replace(f"'{path}'", "the file").replace(str(path), "the file"))

    @staticmethod
    def check_adapter(model_path: str | os.PathLike, adapter_path: str | os.PathLike) -> None:
        """Make every check loading the GGUF LoRA file `adapter_path` onto the model at `model_path` makes (the
        adapter's header, metadata, and each tensor's name, type and shape against the model's weights), allocating
        neither. Raises EngineError with the reason, the paths left out of it."""
        err = ctypes.create_string_buffer(_ERR_LEN)
        if not _engine().dg_adapter_check(os.fsencode(Path(model_path)), os.fsencode(Path(adapter_path)), err,
                                          _ERR_LEN):
            text = _error(err)
            for p in (str(model_path), str(adapter_path)):
                text = text.replace(f"'{p}'", "the file").replace(p, "the file")
            raise EngineError(text)

    @property
    def n_adapters(self) -> int:
        return _engine().dg_model_n_adapters(self._require())

    @functools.cached_property
    def metadata(self) -> dict:
        return _read_metadata(_engine(), _engine().dg_model_gguf(self._require()))

    def _require(self) -> int:
        if not self._handle:
            raise EngineError("the model is closed")
        return self._handle

    def close(self) -> None:
        for ctx in list(self._contexts):  # a context must never outlive the weights it points into
            ctx.close()
        if self._handle:
            _engine().dg_model_free(self._handle)
            self._handle = None



@dataclass(frozen=True)
class Reductions:
    """What a sampling step (Context.step_reduced) returns per canvas row."""

    argmax: np.ndarray   # int32
    entropy: np.ndarray  # float32, nats, of the tempered distribution
    draw: np.ndarray     # int32: the inverse-CDF draw at the row's uniform


@dataclass(frozen=True)
class Transfers:
    """What a context's decoder steps copied between the host and the devices (Context.transfers)."""

    to_device: int     # bytes written to device memory (device to device included)
    from_device: int   # bytes read back to host memory
    steps: int         # decoder steps counted

    def __sub__(self, other: Transfers) -> Transfers:
        return Transfers(self.to_device - other.to_device, self.from_device - other.from_device,
                         self.steps - other.steps)

    @property
    def bytes_per_step(self) -> float:
        return (self.to_device + self.from_device) / self.steps if self.steps else 0.0


@dataclass(frozen=True)
class CpuFallback:
    """A kind of computing node the scheduler ran on the CPU while accelerators were in use."""

    op: str      # ggml's op name (a unary op by its own name)
    reason: str  # "custom op (a CPU kernel)", "no accelerator supports it" or "weights or inputs on the CPU"
    nodes: int


@dataclass(frozen=True)
class StepReport:
    """Where the last decoder step ran (Context.step_report; docs/engine.md#what-runs-where)."""

    splits: int  # the scheduler's graph splits: runs of consecutive nodes on one device
    cpu_fallbacks: tuple[CpuFallback, ...]


def _load_adapters(handle: int, files: Sequence[tuple[Path, float, str]]) -> None:
    """Fold the GGUF LoRA files (path, scale, name for errors) into the model before its weights are placed."""
    lib = _engine()
    n = len(files)
    paths = (ctypes.c_char_p * n)(*(os.fsencode(p) for p, _, _ in files))
    scales = (ctypes.c_float * n)(*(float(s) for _, s, _ in files))
    err = ctypes.create_string_buffer(_ERR_LEN)
    failed = lib.dg_model_load_adapters(handle, paths, scales, n, err, _ERR_LEN)
    if failed:
        which = files[failed - 1][2] if failed <= n else "the adapters"
        raise EngineError(f"cannot load adapter {which}: {_error(err)}")


def _token_array(ids, n_vocab: int, what: str) -> np.ndarray:
    arr = np.asarray(ids)
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise EngineError(f"{what} must be a 1-D sequence of integer token ids")
    arr = arr.astype(np.int64, copy=False)
    if arr.size and (arr.min() < 0 or arr.max() >= n_vocab):
        raise EngineError(f"{what} contain a token id outside the vocabulary [0, {n_vocab})")
    return np.ascontiguousarray(arr, dtype=np.int32)


class Context(_Closeable):
    """K/V cache + decoder state for one sequence. `max_canvases`: the most candidate canvases one step may denoise
    together (num_canvases); each beyond the first costs one canvas of cache scratch and of logits.
    `max_image_tokens`: the most soft tokens one image may have (an image is encoded in one pass, so the sliding-window
    caches keep room for that many rows; 0: text only, images up to one pass of the text path fit)."""

    def __init__(self, model: Model, n_ctx: int = 4096, threads: int | None = None, max_canvases: int = 1,
                 max_image_tokens: int = 0):
        self.model = model
        self._n_vocab = model.hparams.n_vocab
        threads = _default_threads(threads if threads is not None else model.threads)
        err = ctypes.create_string_buffer(_ERR_LEN)
        self._handle = _engine().dg_context_new_images(model._require(), int(n_ctx), threads, int(max_canvases),
                                                       int(max_image_tokens), err, _ERR_LEN)
        if not self._handle:
            raise EngineError(f"cannot create a context: {_error(err)}")
        self.n_ctx = int(n_ctx)
        self.max_canvases = int(max_canvases)
        self.max_image_tokens = int(max_image_tokens)
        self._sc_top_k = 0
        model._contexts.add(self)

    def _require(self) -> int:
        if not self._handle:
            raise EngineError("the context is closed")
        return self._handle

    @property
    def n_past(self) -> int:
        return _engine().dg_context_n_past(self._require())

    def encode(self, ids) -> None:
        """Causal encoder pass over `ids` at positions n_past..; appends their K/V to the cache."""
        arr = _token_array(ids, self._n_vocab, "token ids")
        err = ctypes.create_string_buffer(_ERR_LEN)
        if _engine().dg_context_encode(self._require(), arr.ctypes.data, arr.size, err, _ERR_LEN) != 0:
            raise EngineError(_error(err))

    def encode_images(self, ids, spans: Sequence[ImageSpan]) -> None:
        """`encode` where the rows of each span take its embeddings (float32 [rows, n_embd]) instead of their tokens'
        scaled embeddings and attend bidirectionally within the span (dgemma_engine.image_prompt makes the spans)."""
        arr = _token_array(ids, self._n_vocab, "token ids")
        n_embd = self.model.hparams.n_embd
        pairs = np.zeros((len(spans), 2), dtype=np.int32)
        rows = []
        for k, span in enumerate(spans):
            emb = np.asarray(span.embeddings)
            if emb.ndim != 2 or emb.shape[0] < 1 or emb.shape[1] != n_embd:
                raise EngineError(f"image {k}: embeddings must be float32 [n_soft, {n_embd}], got shape "
                                  f"{list(emb.shape)}")
            pairs[k] = (span.first, emb.shape[0])
            rows.append(np.ascontiguousarray(emb, dtype=np.float32))
        embd = np.ascontiguousarray(np.concatenate(rows) if rows else np.zeros((0, n_embd), np.float32))
        err = ctypes.create_string_buffer(_ERR_LEN)
        if _engine().dg_context_encode_images(self._require(), arr.ctypes.data, arr.size, pairs.ctypes.data,
                                              len(spans), embd.ctypes.data, err, _ERR_LEN) != 0:
            raise EngineError(_error(err))

    def commit(self, ids) -> None:
        """Append a finished canvas to the cache: an encoder pass at its positions (same as `encode`)."""
        self.encode(ids)

    def step(self, canvas_ids, sc_temperature: float | None = None) -> np.ndarray:
        """One decoder step; float32 [len(canvas_ids), n_vocab] softcapped raw logits (read-only view).

        sc_temperature None: first step of a canvas, no self-conditioning. Otherwise the self-conditioning input is
        the previous step's raw logits divided by sc_temperature.

        A 2-D `canvas_ids` [N, C] denoises N candidate canvases in one step (each sees the cached context and its own
        rows only); the logits are then [N * C, n_vocab], canvas after canvas."""
        candidates = np.asarray(canvas_ids)
        n_canvases = candidates.shape[0] if candidates.ndim == 2 else 1
        if candidates.ndim == 2:
            if n_canvases < 1:
                raise EngineError("a step needs at least one canvas")
            candidates = candidates.reshape(-1)
        arr = _token_array(candidates, self._n_vocab, "canvas ids")
        use_sc = sc_temperature is not None
        inv_temp = 0.0
        if use_sc:
            t = float(sc_temperature)
            if not (np.isfinite(t) and t > 0):
                raise EngineError(f"sc_temperature must be positive and finite, got {sc_temperature}")
            inv_temp = 1.0 / t
        err = ctypes.create_string_buffer(_ERR_LEN)
        ptr = _engine().dg_context_step_canvases(self._require(), arr.ctypes.data, arr.size, n_canvases, int(use_sc),
                                                 inv_temp, err, _ERR_LEN)
        if not ptr:
            raise EngineError(_error(err))
        return self._view(ptr, arr.size)

    @property
    def self_cond_top_k(self) -> int:
        """Self-conditioning from each row's k most probable tokens, renormalised (0: all of them, exact; k at least
        the vocabulary is the same). Set it before the steps it should apply to (docs/engine.md#self-conditioning)."""
        return self._sc_top_k

    @self_cond_top_k.setter
    def self_cond_top_k(self, k: int) -> None:
        err = ctypes.create_string_buffer(_ERR_LEN)
        if _engine().dg_context_set_self_cond_top_k(self._require(), int(k), err, _ERR_LEN) != 0:
            raise EngineError(_error(err))
        self._sc_top_k = int(k)

    @property
    def logits_on_device(self) -> bool:
        """The logits buffers live on the output's device (not in host memory): a plain step copies its logits to
        the host, a sampling step (`step_reduced`) does not."""
        return not _engine().dg_context_logits_on_host(self._require())

    def step_reduced(self, canvas_ids, temperature: float, uniforms, sc_temperature: float | None = None
                     ) -> Reductions:
        """A sampling step (fast RNG mode, docs/engine.md#sampling-on-the-device): the decoder step, then per canvas
        row in the graph, on the output's device: the tempered probabilities softmax(logits / temperature), kept
        there as the next step's self-conditioning input, the argmax, the entropy and the inverse-CDF draw at
        `uniforms` (one in [0, 1) per row). Only those three numbers per row come back; the logits are not kept
        (`logits()` has none after it). `canvas_ids` and `sc_temperature` as in `step` (the latter only matters after
        a plain step; after a sampling step the probabilities are read as they are)."""
        candidates = np.asarray(canvas_ids)
        n_canvases = candidates.shape[0] if candidates.ndim == 2 else 1
        arr = _token_array(candidates.reshape(-1), self._n_vocab, "canvas ids")
        u = np.ascontiguousarray(uniforms, dtype=np.float32)
        if u.shape != (arr.size,):
            raise EngineError(f"a sampling step needs one uniform per canvas row ({arr.size}), got {u.shape}")
        t = float(temperature)
        if not (np.isfinite(t) and t > 0):
            raise EngineError(f"temperature must be positive and finite, got {temperature}")
        sc_inv = 0.0 if sc_temperature is None else 1.0 / float(sc_temperature)
        out = Reductions(np.zeros(arr.size, np.int32), np.zeros(arr.size, np.float32), np.zeros(arr.size, np.int32))
        err = ctypes.create_string_buffer(_ERR_LEN)
        rc = _engine().dg_context_step_reduced(self._require(), arr.ctypes.data, arr.size, n_canvases,
                                               int(sc_temperature is not None), sc_inv, 1.0 / t, u.ctypes.data,
                                               out.argmax.ctypes.data, out.entropy.ctypes.data, out.draw.ctypes.data,
                                               err, _ERR_LEN)
        if rc != 0:
            raise EngineError(_error(err))
        return out

    def step_profiled(self, canvas_ids, sc_temperature: float | None = None) -> dict[str, float]:
        """`step` on one canvas, computed node by node: seconds spent per class of node (PROFILE_CLASSES). Slower
        than `step` by the per-node synchronisation; for benchmarks."""
        arr = _token_array(np.asarray(canvas_ids).reshape(-1), self._n_vocab, "canvas ids")
        inv_temp = 0.0 if sc_temperature is None else 1.0 / float(sc_temperature)
        seconds = np.zeros(len(PROFILE_CLASSES), dtype=np.float64)
        err = ctypes.create_string_buffer(_ERR_LEN)
        ptr = _engine().dg_context_step_profiled(self._require(), arr.ctypes.data, arr.size,
                                                 int(sc_temperature is not None), inv_temp, seconds.ctypes.data, err,
                                                 _ERR_LEN)
        if not ptr:
            raise EngineError(_error(err))
        return dict(zip(PROFILE_CLASSES, seconds.tolist()))

    def keep_canvases(self, keep) -> None:
        """After a step over N candidates: keep those with keep[k] true (their logits move to the front, in order) so
        the next, self-conditioned step can run on them alone."""
        mask = np.ascontiguousarray(np.asarray(keep, dtype=bool), dtype=np.uint8)
        err = ctypes.create_string_buffer(_ERR_LEN)
        if _engine().dg_context_keep_canvases(self._require(), mask.ctypes.data, mask.size, err, _ERR_LEN) < 0:
            raise EngineError(_error(err))

    def _view(self, ptr: int, rows: int) -> np.ndarray:
        buf = (ctypes.c_float * (rows * self._n_vocab)).from_address(ptr)
        view = np.frombuffer(buf, dtype=np.float32).reshape(rows, self._n_vocab)
        view.flags.writeable = False
        return view

    def set_self_cond_logits(self, raw) -> None:
        """Replace the stored "previous step's raw logits" ([rows, n_vocab] float32)."""
        arr = np.asarray(raw)
        if arr.ndim != 2 or arr.shape[1] != self._n_vocab or not np.issubdtype(arr.dtype, np.floating):
            raise EngineError(f"self-conditioning logits must be float [rows, {self._n_vocab}], got {arr.dtype} {arr.shape}")
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if not np.isfinite(arr).all():
            raise EngineError("self-conditioning logits must be finite")
        err = ctypes.create_string_buffer(_ERR_LEN)
        if _engine().dg_context_set_self_cond(self._require(), arr.ctypes.data, arr.shape[0], err, _ERR_LEN) != 0:
            raise EngineError(_error(err))

    def logits_address(self) -> int:
        """Address of the float32 [rows, n_vocab] logits of the last step (for the C sampler, zero copy)."""
        ptr = _engine().dg_context_logits(self._require())
        if not ptr:
            raise EngineError("no logits: no step has run, or the last one sampled on the device and kept none")
        return ptr

    def logits(self) -> np.ndarray:
        """Read-only view of the last step's logits."""
        ptr = self.logits_address()
        return self._view(ptr, _engine().dg_context_logits_rows(self._handle))

    def transfers(self) -> Transfers:
        """Bytes the decoder steps of this context copied between the host and the devices so far, and the steps
        counted (docs/engine.md#what-crosses). All zero when every unit is on the CPU."""
        to_dev, from_dev, steps = ctypes.c_uint64(), ctypes.c_uint64(), ctypes.c_int64()
        _engine().dg_context_transfers(self._require(), ctypes.byref(to_dev), ctypes.byref(from_dev),
                                       ctypes.byref(steps))
        return Transfers(to_dev.value, from_dev.value, steps.value)

    def step_report(self) -> StepReport:
        """The scheduler's splits of the last decoder step and the nodes it left on the CPU (none reported when every
        unit is on the CPU). Raises before any step."""
        text = _engine().dg_context_step_report(self._require()).decode()
        if not text:
            raise EngineError("no decoder step has run in this context")
        head, *rows = text.splitlines()
        fallbacks = tuple(CpuFallback(op, reason, int(n)) for op, reason, n in (r.split("\t") for r in rows))
        return StepReport(int(head.split("\t")[1]), fallbacks)

    def _soft_embedding(self, probs: np.ndarray) -> np.ndarray:
        """probs [n, n_vocab] · token embedding through the engine's self-conditioning graph (tests only)."""
        probs = np.ascontiguousarray(probs, dtype=np.float32)
        out = np.empty((probs.shape[0], self.model.hparams.n_embd), np.float32)
        err = ctypes.create_string_buffer(_ERR_LEN)
        if _engine().dg_context_soft_embedding(self._require(), probs.ctypes.data, probs.shape[0], out.ctypes.data,
                                               err, _ERR_LEN) != 0:
            raise EngineError(_error(err))
        return out

    def reset(self) -> None:
        """Empty the cache (n_past = 0) and forget the previous logits."""
        _engine().dg_context_reset(self._require())

    def close(self) -> None:
        if self._handle:
            _engine().dg_context_free(self._handle)
            self._handle = None

