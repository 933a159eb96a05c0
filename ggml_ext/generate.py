"""Block-diffusion generation loop (docs/model.md#sampler-loop) on an engine `Context`, as a generator of typed events.

    params = SamplerParams.from_metadata(model.metadata, seed=42)
    for event in generate(ctx, prompt_ids, params, max_new_tokens=256, tokenizer=tok):
        match event:
            case StepEvent():   ...   # one denoising step: live "draft" (argmax canvas), entropy, accepted count
            case CanvasEvent(): ...   # a committed canvas: ids up to the first EOS, its stream-safe text
            case DoneEvent():   ...   # why it ended, timings

Per canvas: C uniform tokens, then up to N steps (decoder step -> sampler), the first without self-conditioning and
each later one self-conditioned on the previous step's logits / T_prev (kept inside the engine). A canvas ends when
the argmax canvas is stable and confident, or after N steps; its last argmax canvas is committed. A canvas containing
an EOS id ends generation; otherwise it is appended to the cache by one causal encoder pass (never a re-prefill).

num_canvases > 1: that many candidates with independent noise (candidate k draws from seed + k * CANDIDATE_SEED_STRIDE;
candidate 0 is the single-canvas run) are denoised together, one batched decoder step over the shared cache per step,
and finished candidates leave the batch. With a task checker the first candidate to finish that passes it is
committed at once; otherwise, once all have finished, the one with the lowest final mean entropy. With a checker and
self-correction, a finished candidate that breaks a rule has those positions renoised and goes on denoising while it
has steps left (docs/generation.md, "Candidate canvases").
"""
from __future__ import annotations

import math
import secrets
import threading
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Generator, Iterator, Sequence

import numpy as np

from dgemma_engine.errors import EngineError
from dgemma_engine.events import CanvasEvent, DoneEvent, Event, GenerationStats, StepEvent
from dgemma_engine.image_prompt import expand_image_markers, image_token_ids
from dgemma_engine.sampler import Sampler
from dgemma_engine.settings import SamplerParams  # re-exported: callers import it from here
from dgemma_engine import gguf_keys

if TYPE_CHECKING:
    from dgemma_engine.constrained import CanvasConstraint
    from dgemma_engine.sampler import StepResult
    from dgemma_engine.tasks import CanvasChecker

CANDIDATE_SEED_STRIDE = 1_000_003  # candidate k of a generation samples with seed + k * stride

# Stop ids of the released model (<eos>, <turn|>, <|tool_response>); GGUF files do not store them (see
# eos_ids_from_metadata).
RELEASED_EOS_IDS = (1, 106, 50)
RELEASED_EOS_TOKENS = ("<eos>", "<turn|>", "<|tool_response>")


def eos_ids_from_metadata(metadata: dict[str, Any]) -> tuple[int, ...]:
    """Stop ids for a GGUF. GGUF files store a single `tokenizer.ggml.eos_token_id`; the released model stops on
    {1 <eos>, 106 <turn|>, 50 <|tool_response>} (its generation_config.json). Rule: if the vocabulary has exactly
    those tokens at those ids (the released Gemma 4 tokenizer), use the released set; otherwise the file's eos id
    plus the ids of any tokens named `<turn|>` / `<|tool_response>` (a Gemma-4-style vocabulary laid out
    differently)."""
    tokens = metadata.get(gguf_keys.KEY_TOKENS)
    tokens = list(tokens) if tokens is not None else []
    if len(tokens) > max(RELEASED_EOS_IDS) and all(
            tokens[i] == name for i, name in zip(RELEASED_EOS_IDS, RELEASED_EOS_TOKENS)):
        return RELEASED_EOS_IDS
    ids: list[int] = []
    eos = metadata.get(gguf_keys.KEY_EOS_ID)
    if eos is not None:
        ids.append(int(eos))
    for name in RELEASED_EOS_TOKENS[1:]:
        if name in tokens:
            ids.append(tokens.index(name))
    return tuple(dict.fromkeys(ids))


# --------------------------------------------------------------------------------------------------------------
# The loop


@dataclass
class _Candidate:
    index: int
    sampler: Sampler
    canvas: np.ndarray
    result: StepResult | None = None
    logits: np.ndarray | None = None   # its last step's logits, kept when the batch moves on (structured output)
    failed: bool = False               # finished and broke the checker's rules


def _sample_on_device(ctx: Any, params: SamplerParams, constraint: Any, choice: bool | None) -> bool:
    """Whether the steps reduce their logits in the graph (Context.step_reduced) instead of handing them to the C
    sampler: fast RNG only (torch mode consumes the stream over every logit), never for structured output (it decodes
    the last step's logits). None: when the logits live on a device, where copying them out costs more than the step
    (docs/engine.md#sampling-on-the-device); on the CPU the C sampler is faster."""
    if params.rng != "fast" or constraint is not None or not hasattr(ctx, "step_reduced"):
        return False
    return bool(ctx.logits_on_device) if choice is None else choice


def _denoise(ctx: Any, candidates: list[_Candidate], b: int, params: SamplerParams, cancel: threading.Event | None,
             checker: CanvasChecker | None, self_correct: bool, keep_logits: bool, on_device: bool = False
             ) -> Generator[StepEvent, None, tuple[_Candidate, Any] | None]:
    """Denoise one canvas position's candidates; yields a StepEvent per (batched) decoder step and returns the
    chosen candidate with its last logits (None when the steps sample on the device), or None when cancelled."""
    C = candidates[0].canvas.shape[0]
    active = list(candidates)
    finished: list[_Candidate] = []
    prev_temperature = None
    while True:
        if cancel is not None and cancel.is_set():
            return None
        step_start = time.perf_counter()
        batch = active[0].canvas if len(active) == 1 else np.stack([c.canvas for c in active])
        if on_device:
            inputs = [c.sampler.draw_inputs() for c in active]  # every candidate is at the same step: one T
            red = ctx.step_reduced(batch, inputs[0][1], np.concatenate([u for u, _ in inputs]),
                                   sc_temperature=prev_temperature)
            logits = None
            for i, cand in enumerate(active):
                rows = slice(i * C, (i + 1) * C)
                cand.result = cand.sampler.step_reduced(red.argmax[rows], red.entropy[rows], red.draw[rows])
        else:
            logits = ctx.step(batch, sc_temperature=prev_temperature)
            if len(active) == 1:
                active[0].result = active[0].sampler.step(logits)
            else:  # each sampler reads its candidate's rows in place
                address, canvas_bytes = ctx.logits_address(), 4 * C * logits.shape[1]
                for i, cand in enumerate(active):
                    cand.result = cand.sampler.step(address + i * canvas_bytes)
        lead = min(active, key=lambda c: c.result.mean_entropy) if len(active) > 1 else active[0]
        r = lead.result
        yield StepEvent(b, r.step, params.max_steps, r.argmax.tolist(), r.mean_entropy, r.n_accepted,
                        r.accepted.tolist(), time.perf_counter() - step_start, len(active))
        still: list[_Candidate] = []
        for i, cand in enumerate(active):
            r = cand.result
            if not r.finished:
                cand.canvas = r.canvas
                still.append(cand)
                continue
            bad = checker.violations(r.argmax.tolist()) if checker is not None else []
            if checker is not None and not bad:
                return cand, None if logits is None else logits[i * C:(i + 1) * C]
            if bad and self_correct:
                reset = np.zeros(C, bool)
                reset[bad] = True
                reopened = cand.sampler.reopen(r.argmax, reset)
                if reopened is not None:
                    cand.canvas = reopened
                    still.append(cand)
                    continue
            cand.failed = bool(bad)
            if keep_logits:  # a view while this step's logits stay put; a copy when the batch goes on
                rows = logits[i * C:(i + 1) * C]
                cand.logits = rows if len(candidates) == 1 else np.array(rows)
            finished.append(cand)
        if not still:
            best = min(finished, key=lambda c: (c.result.mean_entropy, c.index))
            return best, best.logits
        if len(still) < len(active):
            ctx.keep_canvases([c in still for c in active])
        active = still
        prev_temperature = lead.result.temperature  # the same step of every candidate: the same temperature


def generate(ctx: Any, prompt_ids: Sequence[int], params: SamplerParams | None = None, max_new_tokens: int = 256,
             eos_ids: Sequence[int] | None = RELEASED_EOS_IDS, tokenizer: Any = None,
             cancel: threading.Event | None = None, threads: int | None = None,
             constraint: CanvasConstraint | None = None, checker: CanvasChecker | None = None,
             self_correct: bool = True, sample_on_device: bool | None = None,
             images: Sequence[np.ndarray] = (), hidden_ids: frozenset[int] = frozenset()) -> Iterator[Event]:
    """Generate after `prompt_ids` (appended to whatever `ctx` has cached). Yields StepEvent per step, CanvasEvent
    per committed canvas and one final DoneEvent. The token budget is in whole canvases: ceil(max_new_tokens / C).
    `cancel` is checked between steps. Raises EngineError on unusable input (nothing to condition on, a prompt that
    leaves no room for a diffusion canvas). With a `constraint` (structured output), each committed canvas is its
    constrained MAP decode of the last step's logits instead of the argmax canvas (docs/generation.md, "Structured
    output"). `checker`: the task's rules (dgemma_engine.tasks), used to choose among candidates and, with
    `self_correct`, to renoise positions that break them. `sample_on_device`: reduce each step's logits in the graph
    (True), hand them to the C sampler (False), or choose by where they live (None; see _sample_on_device).
    `images`: one float32 [n_soft, n_embd] array (the projector's output) per image marker in `prompt_ids`; each
    marker is expanded to boi, image × n_soft, eoi (dgemma_engine.image_prompt) and the prompt is encoded with them.
    `hidden_ids`: token ids that write nothing in the events' text (dgemma_engine.chat.answer_text); the ids stay."""
    params = params or SamplerParams()
    model = ctx.model
    C = int(model.hparams.canvas_length)
    V = int(model.hparams.n_vocab)
    prompt = [int(t) for t in prompt_ids]
    image_spans: tuple = ()
    if len(images):
        expanded = expand_image_markers(prompt, images, image_token_ids(model.metadata), int(model.hparams.n_embd))
        prompt, image_spans = expanded.ids, expanded.spans
    if max_new_tokens < 1:
        raise EngineError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if not prompt and ctx.n_past == 0:
        raise EngineError("empty prompt: nothing to condition the first canvas on")
    if ctx.n_past + len(prompt) + C > ctx.n_ctx:
        raise EngineError(f"prompt ({ctx.n_past + len(prompt)} tokens) leaves no room for a diffusion canvas "
                          f"({C} tokens) within the context window ({ctx.n_ctx} tokens)")
    n_candidates = int(params.num_canvases)
    held = getattr(ctx, "max_canvases", 1)
    if not 1 <= n_candidates <= held:
        raise EngineError(f"num_canvases {n_candidates} needs a context made for that many canvases "
                          f"(this one holds {held})")
    seed = params.seed if params.seed is not None else secrets.randbits(63)
    eos = frozenset(int(t) for t in (eos_ids or ()))
    n_canvases = math.ceil(max_new_tokens / C)
    decoder = tokenizer.stream_decoder(hide=hidden_ids) if tokenizer is not None else None
    on_device = _sample_on_device(ctx, params, constraint, sample_on_device)
    if hasattr(ctx, "self_cond_top_k"):
        ctx.self_cond_top_k = int(params.self_cond_top_k)

    samplers = [Sampler(C, V, max_steps=params.max_steps, t_min=params.t_min, t_max=params.t_max,
                        entropy_bound=params.entropy_bound, confidence_threshold=params.confidence_threshold,
                        stability_threshold=params.stability_threshold,
                        seed=(seed + k * CANDIDATE_SEED_STRIDE) % (1 << 63), rng=params.rng, greedy=params.greedy,
                        threads=threads)
                for k in range(n_candidates)]
    try:
        start = time.perf_counter()
        if image_spans:
            ctx.encode_images(prompt, image_spans)
        elif prompt:
            ctx.encode(prompt)
        denoise_start = time.perf_counter()
        stats = GenerationStats(prompt_tokens=len(prompt), prompt_eval_s=denoise_start - start, canvases=0,
                                steps_per_canvas=[], committed_tokens=0, denoise_s=0.0, tokens_per_s=0.0, seed=seed)

        transfers = getattr(ctx, "transfers", None)  # engine contexts count what their steps copy
        transfers_before = transfers() if transfers else None

        def finish(reason: str) -> DoneEvent:
            elapsed = time.perf_counter() - denoise_start
            rate = stats.committed_tokens / elapsed if elapsed > 0 else 0.0
            per_step = (transfers() - transfers_before).bytes_per_step if transfers else 0.0
            return DoneEvent(reason, replace(stats, denoise_s=elapsed, tokens_per_s=rate, host_bytes_per_step=per_step))

        for b in range(n_canvases):
            candidates = [_Candidate(k, s, s.begin_canvas()) for k, s in enumerate(samplers)]
            chosen = yield from _denoise(ctx, candidates, b, params, cancel, checker, self_correct,
                                         keep_logits=constraint is not None, on_device=on_device)
            if chosen is None:
                yield finish("cancelled")
                return
            cand, logits = chosen
            result = cand.result
            # canvases that may follow this one: the budget's, and the context's (this canvas is encoded first, and
            # each later one is denoised over the cache plus itself)
            canvases_after = min(n_canvases - 1 - b, (ctx.n_ctx - ctx.n_past - C) // C)
            if constraint is None:
                committed = result.argmax.tolist()
            else:  # the value must stay closable within what may follow, so the last canvas closes it
                committed = constraint.commit(logits, tokens_after=canvases_after * C)
            hits = [i for i, t in enumerate(committed) if t in eos]
            eos_position = hits[0] if hits else None
            ids = committed[:eos_position] if hits else committed
            last = bool(hits) or canvases_after == 0
            text = ""
            if decoder is not None:
                text = decoder.feed(ids) + (decoder.flush() if last else "")
            stats = replace(stats, canvases=b + 1, steps_per_canvas=stats.steps_per_canvas + [result.step],
                            committed_tokens=stats.committed_tokens + len(ids))
            checked = None if checker is None else not cand.failed  # its verdict on the argmax canvas
            yield CanvasEvent(b, ids, text, result.step, committed, eos_position, cand.index, checked)
            if hits:
                yield finish("eos")
                return
            if canvases_after == 0:  # the budget is spent, or the next canvas would not fit: no point encoding this one
                yield finish("length" if b == n_canvases - 1 else "context")
                return
            ctx.encode(committed)
    finally:
        for s in samplers:
            s.close()


def torch_compatible_sequence(prompt_ids: Sequence[int], canvases: Sequence[CanvasEvent],
                              pad_id: int | None) -> list[int]:
    """What transformers' generate(...).sequences holds: prompt + whole committed canvases; in the canvas with the
    first EOS, the EOS is kept and every later position becomes pad (when a pad id is defined)."""
    seq = [int(t) for t in prompt_ids]
    for ev in canvases:
        canvas = list(ev.canvas)
        if ev.eos_position is not None and pad_id is not None:
            canvas[ev.eos_position + 1:] = [pad_id] * (len(canvas) - ev.eos_position - 1)
        seq += canvas
    return seq
