"""Sampling steps (`Context.step_reduced`) against plain steps and the C sampler, on one loaded model: shared by
tests/test_engine_sampling.py (the CPU) and tests/device_check.py (placements on an RPC device). Everything returned
is plain JSON, so a subprocess can report it.
"""
from __future__ import annotations

import numpy as np

from dgemma_engine.model import Context, Model
from dgemma_engine.sampler import Sampler

SEPARATION = 1e-4  # a row's uniform at least this far (in probability) from both ends of its token's CDF interval


def _sampler(model: Model, seed: int) -> Sampler:
    return Sampler(model.hparams.canvas_length, model.hparams.n_vocab, max_steps=12, t_min=0.4, t_max=0.8,
                   entropy_bound=0.1, confidence_threshold=0.005, stability_threshold=1, seed=seed, threads=1)


def _separated_draws(logits: np.ndarray, temperature: float, uniforms: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The inverse-CDF draw of each row in float64 at the float uniforms the engine got, and whether the row's
    target lies SEPARATION away from its token's interval ends (where float rounding of the CDF cannot move it)."""
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max(axis=1, keepdims=True))
    cdf = np.cumsum(p / p.sum(axis=1, keepdims=True), axis=1)
    draws, separated = [], []
    for row, u in zip(cdf, uniforms.astype(np.float64)):
        d = int(np.searchsorted(row, u, side="right"))
        lo = row[d - 1] if d > 0 else 0.0
        draws.append(min(d, len(row) - 1))
        separated.append(u - lo > SEPARATION and row[min(d, len(row) - 1)] - u > SEPARATION)
    return np.array(draws), np.array(separated)


def reduced_vs_host(model: Model, prompt: list[int], steps: int = 4, seed: int = 3, threads: int = 1) -> dict:
    """The same canvases through plain steps + the C sampler (context A) and sampling steps (context B), step by
    step, then one plain self-conditioned step on each: per step the argmax agreement, the largest entropy error, the
    draws on well-separated rows, and the acceptance; then the largest |Δlogits| of that last step (B reads the
    probabilities its sampling step left, A tempers its logits)."""
    n_ctx = len(prompt) + model.hparams.canvas_length
    out: dict = {"steps": []}
    with Context(model, n_ctx=n_ctx, threads=threads) as a, Context(model, n_ctx=n_ctx, threads=threads) as b:
        a.encode(prompt)
        b.encode(prompt)
        host, dev = _sampler(model, seed), _sampler(model, seed)
        canvas = host.begin_canvas()
        dev.begin_canvas()
        prev = None
        for _ in range(steps):
            logits = a.step(canvas, sc_temperature=prev)
            r_host = host.step(logits)
            uniforms, temperature = dev.draw_inputs()
            red = b.step_reduced(canvas, temperature, uniforms, sc_temperature=prev)
            r_dev = dev.step_reduced(red.argmax, red.entropy, red.draw)
            want, separated = _separated_draws(np.asarray(logits), temperature, uniforms)
            entropy_error = np.abs(red.entropy - r_host.entropy) / np.maximum(1.0, r_host.entropy)
            out["steps"].append({
                "temperature": [temperature, r_host.temperature],
                "argmax_equal": float(np.mean(red.argmax == r_host.argmax)),
                "entropy_max_error": float(entropy_error.max()),
                "separated": float(separated.mean()),
                "draws_equal_separated": bool(np.all(red.draw[separated] == want[separated])),
                "host_draws_equal_separated": bool(np.all(r_host.sampled[separated] == want[separated])),
                "accepted_equal": bool(np.all(r_dev.accepted == r_host.accepted)),
            })
            prev = r_host.temperature
            canvas = r_host.canvas
        after_plain = np.array(a.step(canvas, sc_temperature=prev))
        after_sampling = np.array(b.step(canvas, sc_temperature=prev))
        out["next_step_max_diff"] = float(np.abs(after_plain - after_sampling).max())
        out["transfers"] = vars(b.transfers())
    return out


def kept_candidate(model: Model, prompt: list[int], sampling: bool = True, seed: int = 5, threads: int = 1) -> float:
    """Two candidate canvases in one step (a sampling step, else a plain one), the first dropped (keep_canvases moves
    the second's probabilities or logits to the front, on the device where they live), then a self-conditioned step
    of the survivor: against the survivor's canvas denoised alone. Returns the largest |Δlogits| of that step."""
    C = model.hparams.canvas_length
    n_ctx = len(prompt) + C
    rng = np.random.default_rng(seed)
    first, second = rng.integers(0, model.hparams.n_vocab, (2, C))
    nxt = rng.integers(0, model.hparams.n_vocab, C)
    uniforms = rng.random(2 * C).astype(np.float32)

    def step(ctx: Context, canvas: np.ndarray, u: np.ndarray) -> None:
        if sampling:
            ctx.step_reduced(canvas, 0.7, u)
        else:
            ctx.step(canvas)

    with Context(model, n_ctx=n_ctx, threads=threads, max_canvases=2) as both, \
            Context(model, n_ctx=n_ctx, threads=threads) as alone:
        both.encode(prompt)
        alone.encode(prompt)
        step(both, np.stack([first, second]), uniforms)
        both.keep_canvases([False, True])
        together = np.array(both.step(nxt, sc_temperature=0.7))
        step(alone, second, uniforms[C:])
        single = np.array(alone.step(nxt, sc_temperature=0.7))
    return float(np.abs(together - single).max())
