"""`dgemma debug generate`: one generation from token ids, printed as JSON in transformers' terms.

Output: {"sequence": [...prompt and generated ids...], "steps_per_canvas": [...], "timings": {"prefill_s": s,
"steps_s": [... one per denoising step ...], "host_bytes_per_step": n}} (in-process timers: bench/ reads them;
host_bytes_per_step: the mean bytes a step copied between the host and the devices, docs/engine.md#what-crosses). With --rng torch the sequence is
what `DiffusionGemmaForBlockDiffusion.generate(...).sequences[0]` returns for the same weights, prompt, seed and
sampler settings: whole canvases, the first EOS kept and pad after it (when the GGUF defines a pad id).
"""
from __future__ import annotations

import json
import math
import os
import sys
from typing import Any, Sequence, TextIO

from dgemma_engine.errors import EngineError
from dgemma_engine.generate import (CanvasEvent, DoneEvent, SamplerParams, StepEvent, eos_ids_from_metadata, generate,
                                    torch_compatible_sequence)
from dgemma_engine.gguf_keys import KEY_PADDING_ID
from dgemma_engine.image_prompt import as_marker_prompt, image_context_size, image_token_ids
from dgemma_engine.model import Context, Model
from dgemma_engine.settings import SettingError, check_values


def run_debug_generation(model: Model, prompt_ids: Sequence[int], params: SamplerParams, max_new_tokens: int,
                         eos_ids: Sequence[int] | None = None, pad_id: int | None = -1,
                         threads: int | None = None, timings: bool = False,
                         sample_on_device: bool | None = None, images: Sequence[Any] = ()) -> dict[str, Any]:
    """Generate on a loaded model; returns {"sequence", "steps_per_canvas"} (and "timings" when asked). eos_ids None:
    the GGUF's stop ids (eos_ids_from_metadata); pad_id -1: the GGUF's padding id (None: no padding after EOS).
    sample_on_device: as `generate` takes it (None: where the logits live decides). images: one float32
    [n_soft, n_embd] array per image marker; the sequence then starts with the expanded prompt, as transformers'."""
    if not prompt_ids:
        raise EngineError("--prompt-ids must not be empty")
    longest = 0
    marker_prompt = prompt_ids
    if len(images):
        expanded, longest = image_context_size(prompt_ids, images, model.metadata, model.hparams.n_embd)
        # generate() takes one marker per image; the prompt may hold each image's block as a processor writes it
        marker_prompt, _ = as_marker_prompt(prompt_ids, image_token_ids(model.metadata))
        prompt_ids = expanded.ids
    C = model.hparams.canvas_length
    if eos_ids is None:
        eos_ids = eos_ids_from_metadata(model.metadata)
    if pad_id == -1:
        pad = model.metadata.get(KEY_PADDING_ID)
        pad_id = int(pad) if pad is not None else None
    n_ctx = len(prompt_ids) + math.ceil(max_new_tokens / C) * C
    canvases: list[CanvasEvent] = []
    step_seconds: list[float] = []
    prefill_s = 0.0
    host_bytes_per_step = 0.0
    with Context(model, n_ctx=n_ctx, threads=threads, max_canvases=params.num_canvases,
                 max_image_tokens=longest) as ctx:
        for event in generate(ctx, marker_prompt, params, max_new_tokens=max_new_tokens, eos_ids=eos_ids,
                              threads=threads, sample_on_device=sample_on_device, images=images):
            match event:
                case CanvasEvent():
                    canvases.append(event)
                case StepEvent():
                    step_seconds.append(event.seconds)
                case DoneEvent():
                    prefill_s = event.stats.prompt_eval_s
                    host_bytes_per_step = event.stats.host_bytes_per_step
    result: dict[str, Any] = {"sequence": torch_compatible_sequence(prompt_ids, canvases, pad_id),
                              "steps_per_canvas": [ev.steps for ev in canvases]}
    if params.num_canvases > 1:  # which candidate each committed canvas was (absent for one: a fixed interface)
        result["candidates"] = [ev.candidate for ev in canvases]
    if timings:
        result["timings"] = {"prefill_s": prefill_s, "steps_s": step_seconds,
                             "host_bytes_per_step": round(host_bytes_per_step)}
    return result


def debug_generate(model: str | os.PathLike, prompt_ids: list[int], seed: int = 0, rng: str = "fast",
                   max_new_tokens: int = 256, steps: int | None = None, t_max: float | None = None,
                   t_min: float | None = None, entropy_bound: float | None = None,
                   confidence_threshold: float | None = None, stability_threshold: int | None = None,
                   threads: int | None = None, eos_ids: Sequence[int] | None = None,
                   out: TextIO | None = None, num_gpu: int | None = None, num_cpu_moe: int = 0,
                   num_canvases: int | None = None, self_cond_top_k: int | None = None, adapters: Sequence = (),
                   images: Sequence[Any] = ()) -> dict[str, Any]:
    """Load the GGUF (with LoRA `adapters` as `Model.load` takes them), generate, print the JSON line to `out`
    (stdout) and return it as a dict. `images`: as `run_debug_generation` takes them (debug.debug_images)."""
    if rng not in ("torch", "fast"):
        raise EngineError(f"--rng must be 'torch' or 'fast', got {rng!r}")
    if max_new_tokens < 1:
        raise EngineError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    if seed < 0:
        raise EngineError(f"--seed must be >= 0, got {seed}")
    with Model.load(model, threads=threads, num_gpu=num_gpu, num_cpu_moe=num_cpu_moe, adapters=adapters) as m:
        params = SamplerParams.from_metadata(
            m.metadata, max_steps=steps, t_min=t_min, t_max=t_max, entropy_bound=entropy_bound,
            confidence_threshold=confidence_threshold, stability_threshold=stability_threshold,
            num_canvases=num_canvases, self_cond_top_k=self_cond_top_k, seed=seed, rng=rng)
        _validate(params)
        result = run_debug_generation(m, prompt_ids, params, max_new_tokens, eos_ids=eos_ids, threads=threads,
                                      timings=True, images=images)
    stream = out if out is not None else sys.stdout
    stream.write(json.dumps(result) + "\n")
    stream.flush()
    return result


def _validate(p: SamplerParams) -> None:
    """transformers' ranges (DiffusionGemmaGenerationConfig.validate), in the one wording of dgemma_engine.settings."""
    try:
        check_values(p.setting_values(), reference=True)
    except SettingError as exc:
        raise EngineError(str(exc)) from None
