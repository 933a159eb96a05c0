"""The generation loop's events (`dgemma_engine.generate.generate` yields them), in a module of their own: pure data,
so the server can tell them apart by type without loading the engine.
"""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["CanvasEvent", "DoneEvent", "Event", "GenerationStats", "StepEvent"]


@dataclass(frozen=True)
class StepEvent:
    """One denoising step. argmax_ids: the current draft (what would be committed if the canvas ended here)."""

    canvas_index: int
    step: int                  # 1-based within the canvas
    max_steps: int
    argmax_ids: list[int]
    mean_entropy: float
    accepted: int              # positions that kept their sampled token
    accepted_mask: list[bool] | None = None   # which positions those are (the CLI's live view styles them)
    seconds: float = 0.0       # wall time of the step: the decoder pass and the sampler
    candidates: int = 1        # candidate canvases this step denoised together (the draft is the most certain one's)


@dataclass(frozen=True)
class CanvasEvent:
    """A committed canvas. ids/text stop before the first EOS; `canvas` is the whole committed argmax canvas."""

    canvas_index: int
    ids: list[int]
    text: str
    steps: int
    canvas: list[int] = field(default_factory=list)
    eos_position: int | None = None    # index in `canvas` of the first EOS id, if any
    candidate: int = 0                 # which of the num_canvases candidates was committed
    checked: bool | None = None        # a task checker's verdict on it (None: no checker)


@dataclass(frozen=True)
class GenerationStats:
    prompt_tokens: int
    prompt_eval_s: float
    canvases: int
    steps_per_canvas: list[int]
    committed_tokens: int      # tokens delivered (before the first EOS), over all canvases
    denoise_s: float           # end of prefill -> last commit (steps, sampling and commit passes)
    tokens_per_s: float        # committed_tokens / denoise_s
    seed: int = 0              # the seed actually used (drawn at random when SamplerParams.seed is None)
    host_bytes_per_step: float = 0.0  # mean bytes a decoder step copied between host and devices (0: CPU only)

    @property
    def steps(self) -> int:
        return sum(self.steps_per_canvas)


@dataclass(frozen=True)
class DoneEvent:
    reason: str                # "eos" | "length" | "context" | "cancelled"
    stats: GenerationStats


Event = StepEvent | CanvasEvent | DoneEvent
