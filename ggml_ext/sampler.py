"""ctypes binding of the C entropy-bound sampler (`csrc/sampler/`): one `Sampler` per generation.

The C side does all per-token work (tempered softmax, entropy, argmax, categorical draw over the full vocabulary,
entropy-bound acceptance, renoise, stability history, stop decision), multi-threaded over canvas rows; or, when the
engine reduced the logits on the device (`step_reduced`, fast mode), the per-row work is the engine's and the C side
does the rest. This module only checks shapes and moves small [C]-sized arrays.
"""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import numpy as np

from dgemma_engine._lib import load_library
from dgemma_engine.errors import EngineError

RNG_MODES = {"fast": 0, "torch": 1}


class ParamsC(ctypes.Structure):
    """Mirror of `dg_sampler_params` in csrc/sampler/sampler.h, field by field (tests/test_c_bindings.py)."""

    _fields_ = [
        ("max_steps", ctypes.c_int32),
        ("t_min", ctypes.c_double),
        ("t_max", ctypes.c_double),
        ("entropy_bound", ctypes.c_double),
        ("confidence_threshold", ctypes.c_double),
        ("stability_threshold", ctypes.c_int32),
        ("greedy", ctypes.c_int32),
    ]


class StepInfoC(ctypes.Structure):
    """Mirror of `dg_step_info` in csrc/sampler/sampler.h (tests/test_c_bindings.py)."""

    _fields_ = [
        ("step", ctypes.c_int32),
        ("remaining", ctypes.c_int32),
        ("temperature", ctypes.c_float),
        ("mean_entropy", ctypes.c_float),
        ("n_accepted", ctypes.c_int32),
        ("stable", ctypes.c_int32),
        ("confident", ctypes.c_int32),
        ("stop", ctypes.c_int32),
        ("exhausted", ctypes.c_int32),
    ]


def _native() -> ctypes.CDLL:
    lib = load_library("sampler")
    if not getattr(lib, "_dgemma_typed", False):
        lib.dg_sampler_create.restype = ctypes.c_void_p
        lib.dg_sampler_create.argtypes = [
            ctypes.c_int32, ctypes.c_int32, ctypes.POINTER(ParamsC), ctypes.c_int32, ctypes.c_uint64,
            ctypes.c_int32, ctypes.c_char_p, ctypes.c_int32,
        ]
        lib.dg_sampler_free.restype = None
        lib.dg_sampler_free.argtypes = [ctypes.c_void_p]
        lib.dg_sampler_begin_canvas.restype = ctypes.c_int32
        lib.dg_sampler_begin_canvas.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        lib.dg_sampler_step.restype = ctypes.c_int32
        lib.dg_sampler_step.argtypes = [
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
            ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(StepInfoC),
        ]
        lib.dg_sampler_draw_inputs.restype = ctypes.c_int32
        lib.dg_sampler_draw_inputs.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_float)]
        lib.dg_sampler_step_reduced.restype = ctypes.c_int32
        lib.dg_sampler_step_reduced.argtypes = [ctypes.c_void_p] + [ctypes.c_void_p] * 8 + [ctypes.POINTER(StepInfoC)]
        lib.dg_sampler_reopen.restype = ctypes.c_int32
        lib.dg_sampler_reopen.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        lib.dg_sampler_temperature.restype = ctypes.c_float
        lib.dg_sampler_temperature.argtypes = [ctypes.c_int32, ctypes.c_int32, ctypes.c_double, ctypes.c_double]
        lib._dgemma_typed = True
    return lib


def temperature(remaining: int, max_steps: int, t_min: float, t_max: float) -> float:
    """The linear schedule's temperature for `remaining` steps left out of `max_steps` (fp32, as transformers)."""
    return float(_native().dg_sampler_temperature(remaining, max_steps, t_min, t_max))


@dataclass(frozen=True)
class StepResult:
    """What one denoising step decided. Arrays are fresh copies of length C."""

    canvas: np.ndarray        # int32: the next decoder input (accepted positions sampled, the rest fresh noise)
    argmax: np.ndarray        # int32: argmax of the processed logits (the canvas committed if this is the last step)
    sampled: np.ndarray       # int32: the categorical draw of every position (kept where accepted)
    entropy: np.ndarray       # float32: per-position entropy (nats) of the processed logits
    accepted: np.ndarray      # bool: positions that kept their sampled token
    step: int                 # steps executed in this canvas, this one included
    temperature: float        # T of this step (the next step's self-conditioning temperature)
    mean_entropy: float
    n_accepted: int
    stable: bool
    confident: bool
    stop: bool                # the adaptive stop fired (stable and confident)
    exhausted: bool           # the canvas used its last allowed step

    @property
    def finished(self) -> bool:
        return self.stop or self.exhausted


def default_threads() -> int:
    return max(1, min(len(os.sched_getaffinity(0)), 64))


class Sampler:
    """Entropy-bound sampler state for one generation: random stream, step counter, argmax history."""

    def __init__(self, canvas_length: int, n_vocab: int, *, max_steps: int, t_min: float, t_max: float,
                 entropy_bound: float, confidence_threshold: float, stability_threshold: int, seed: int,
                 rng: str = "fast", greedy: bool = False, threads: int | None = None):
        if rng not in RNG_MODES:
            raise EngineError(f"unknown rng mode {rng!r} (expected 'torch' or 'fast')")
        if seed < 0:
            raise EngineError(f"seed must be >= 0, got {seed}")
        self.canvas_length = int(canvas_length)
        self.n_vocab = int(n_vocab)
        self.max_steps = int(max_steps)
        params = ParamsC(int(max_steps), float(t_min), float(t_max), float(entropy_bound),
                         float(confidence_threshold), int(stability_threshold), int(bool(greedy)))
        err = ctypes.create_string_buffer(256)
        self._lib = _native()
        # torch.manual_seed keeps seed mod 2^64 and MT19937 uses its low 32 bits; the fast stream uses all 64.
        self._handle = self._lib.dg_sampler_create(
            self.canvas_length, self.n_vocab, ctypes.byref(params), RNG_MODES[rng], int(seed) % (1 << 64),
            int(threads or default_threads()), err, len(err))
        if not self._handle:
            raise EngineError(f"invalid sampler settings: {err.value.decode(errors='replace')}")
        C = self.canvas_length
        self._canvas = np.zeros(C, np.int32)
        self._argmax = np.zeros(C, np.int32)
        self._sampled = np.zeros(C, np.int32)
        self._entropy = np.zeros(C, np.float32)
        self._accepted = np.zeros(C, np.uint8)

    def begin_canvas(self) -> np.ndarray:
        """Draw a new canvas's initial tokens (uniform over the whole vocabulary) and reset the per-canvas state."""
        self._check_open()
        self._lib.dg_sampler_begin_canvas(self._handle, self._canvas.ctypes.data)
        return self._canvas.copy()

    def step(self, logits: np.ndarray | int) -> StepResult:
        """One step on raw softcapped logits: a float32 [C, V] array, or the address of such a C-contiguous
        buffer (the engine's logits, read in place)."""
        self._check_open()
        if isinstance(logits, np.ndarray):
            if logits.dtype != np.float32 or logits.shape != (self.canvas_length, self.n_vocab):
                raise EngineError(f"logits must be float32 [{self.canvas_length}, {self.n_vocab}], "
                                  f"got {logits.dtype} {list(logits.shape)}")
            logits = np.ascontiguousarray(logits)
            address = logits.ctypes.data
        else:
            address = int(logits)
            if address == 0:
                raise EngineError("logits buffer address is null")
        info = StepInfoC()
        rc = self._lib.dg_sampler_step(self._handle, address, self.n_vocab, self._canvas.ctypes.data,
                                       self._argmax.ctypes.data, self._sampled.ctypes.data, self._entropy.ctypes.data,
                                       self._accepted.ctypes.data, ctypes.byref(info))
        if rc != 0:
            raise EngineError("sampler step without an active canvas (call begin_canvas first)")
        return self._result(info)

    def draw_inputs(self) -> tuple[np.ndarray, float]:
        """Fast mode: what the next step's draw needs when the logits are reduced elsewhere (the engine's sampling
        step, `Context.step_reduced`): one uniform per row (float32, below 1) and the step's temperature."""
        self._check_open()
        uniforms = np.zeros(self.canvas_length, np.float32)
        temperature = ctypes.c_float()
        if self._lib.dg_sampler_draw_inputs(self._handle, uniforms.ctypes.data, ctypes.byref(temperature)) != 0:
            raise EngineError("draw inputs need fast RNG mode and an active canvas")
        return uniforms, float(temperature.value)

    def step_reduced(self, argmax, entropy, draw) -> StepResult:
        """One step from per-row reductions made elsewhere: each row's argmax, entropy (nats) and draw at the
        uniforms of `draw_inputs`; acceptance, renoise, history and the stop decision as `step`."""
        self._check_open()
        C = self.canvas_length
        rows = [np.ascontiguousarray(a, dtype=t) for a, t in ((argmax, np.int32), (entropy, np.float32),
                                                               (draw, np.int32))]
        if any(r.shape != (C,) for r in rows):
            raise EngineError(f"reductions must have {C} rows")
        info = StepInfoC()
        rc = self._lib.dg_sampler_step_reduced(self._handle, rows[0].ctypes.data, rows[1].ctypes.data,
                                               rows[2].ctypes.data, self._canvas.ctypes.data,
                                               self._argmax.ctypes.data, self._sampled.ctypes.data,
                                               self._entropy.ctypes.data, self._accepted.ctypes.data,
                                               ctypes.byref(info))
        if rc == -2:
            raise EngineError("a reduced row names a token outside the vocabulary")
        if rc != 0:
            raise EngineError("sampler step without an active canvas (call begin_canvas first)")
        return self._result(info)

    def _result(self, info: StepInfoC) -> StepResult:
        return StepResult(
            canvas=self._canvas.copy(), argmax=self._argmax.copy(), sampled=self._sampled.copy(),
            entropy=self._entropy.copy(),
            accepted=self._accepted.astype(bool), step=info.step, temperature=float(info.temperature),
            mean_entropy=float(info.mean_entropy), n_accepted=info.n_accepted, stable=bool(info.stable),
            confident=bool(info.confident), stop=bool(info.stop), exhausted=bool(info.exhausted))

    def reopen(self, canvas: np.ndarray, reset: np.ndarray) -> np.ndarray | None:
        """Continue a finished canvas (self-correction): `canvas` with the `reset` positions (bool [C]) redrawn as
        fresh noise; the step counter and temperature schedule go on and the stop needs S new stable steps. None when
        the canvas has no steps left."""
        self._check_open()
        tokens = np.ascontiguousarray(canvas, dtype=np.int32).copy()
        mask = np.ascontiguousarray(reset, dtype=np.uint8)
        if tokens.shape != (self.canvas_length,) or mask.shape != (self.canvas_length,):
            raise EngineError(f"reopen needs a canvas and a reset mask of length {self.canvas_length}")
        left = self._lib.dg_sampler_reopen(self._handle, tokens.ctypes.data, mask.ctypes.data)
        if left < 0:
            raise EngineError("reopen without a canvas (call begin_canvas first)")
        return tokens if left > 0 else None

    def _check_open(self) -> None:
        if not self._handle:
            raise EngineError("sampler is closed")

    def close(self) -> None:
        if getattr(self, "_handle", None):
            self._lib.dg_sampler_free(self._handle)
            self._handle = None

    def __enter__(self) -> "Sampler":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()
