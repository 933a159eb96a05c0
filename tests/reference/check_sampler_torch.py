"""Cross-check the C sampler against transformers' own sampler classes on synthetic logits (needs torch).

Not a test (CI has no torch): a development check that the torch-RNG mode consumes MT19937 exactly like
`DiffusionGemmaGenerationMixin._denoising_step` and takes the same decisions. Logits come from numpy, so torch's
global generator is used only by the sampler, as in generate().

    python3 tests/reference/check_sampler_torch.py [--vocab 512 --canvas 16 --steps 12 --canvases 3 --seeds 0,1,7,42]
"""
import argparse

import numpy as np
import torch
from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
    EntropyBoundSampler, EntropyBoundSamplerConfig, LinearTemperatureScheduleLogitsProcessor,
    StableAndConfidentStoppingCriteria)

from dgemma_engine.sampler import Sampler


def synthetic_logits(rng: np.random.Generator, C: int, V: int, sharpness: float) -> np.ndarray:
    """Softcapped logits with a spread of entropies: some rows nearly one-hot, some flat."""
    raw = rng.standard_normal((C, V)) * 2.0
    raw[np.arange(C), rng.integers(0, V, C)] += rng.uniform(0.0, sharpness, C)  # one peak per row
    return (30.0 * np.tanh(raw / 30.0)).astype(np.float32)


def run(seed: int, C: int, V: int, N: int, canvases: int, S: int, Cf: float, sharpness: float) -> tuple[int, int, int]:
    data = np.random.default_rng(seed + 1000)
    torch.manual_seed(seed)
    ref = EntropyBoundSampler(EntropyBoundSamplerConfig(entropy_bound=0.1), C, V, N)
    schedule = LinearTemperatureScheduleLogitsProcessor(0.4, 0.8, N)
    stopper = StableAndConfidentStoppingCriteria(S, Cf)
    ours = Sampler(C, V, max_steps=N, t_min=0.4, t_max=0.8, entropy_bound=0.1, confidence_threshold=Cf,
                   stability_threshold=S, seed=seed, rng="torch", threads=2)
    steps_checked = mismatches = stops = 0
    for _ in range(canvases):
        canvas = ref.initialize_canvas(1, "cpu")
        mine = ours.begin_canvas()
        assert (canvas[0].numpy() == mine).all(), "init canvas differs"
        stopper.reset()
        for cur_step in range(N, 0, -1):
            raw = synthetic_logits(data, C, V, sharpness)
            z = schedule(None, torch.from_numpy(raw)[None], torch.tensor(cur_step, dtype=torch.int32))
            probs = torch.softmax(z, dim=-1, dtype=torch.float32)
            drawn = torch.multinomial(probs.view(-1, V), 1).view(1, C)
            argmax = torch.argmax(z, dim=-1)
            accepted = ref.accept_canvas(canvas, drawn, z, cur_step)
            canvas = ref.renoise_canvas(accepted, cur_step)
            stop = bool(stopper(argmax, z)[0])
            got = ours.step(raw)
            steps_checked += 1
            same = ((got.canvas == canvas[0].numpy()).all() and (got.argmax == argmax[0].numpy()).all()
                    and (got.accepted == ref.accepted_token_mask[0].numpy()).all() and got.stop == stop)
            if not same:
                mismatches += 1
                print(f"seed {seed} step {cur_step}: mismatch; accepted ref {ref.accepted_token_mask[0].sum()} "
                      f"ours {got.n_accepted}; drawn diff at {np.nonzero(drawn[0].numpy() != got.canvas)[0][:8]}")
                canvas = torch.from_numpy(got.canvas.astype(np.int64))[None]  # continue from ours
            if stop:
                stops += 1
                break
            if got.finished:
                break
    return steps_checked, mismatches, stops


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--canvas", type=int, default=16)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--canvases", type=int, default=3)
    ap.add_argument("--seeds", default="0,1,7,42")
    ap.add_argument("--stability", type=int, default=0)
    ap.add_argument("--confidence", type=float, default=0.3)
    ap.add_argument("--sharpness", type=float, default=12.0)
    a = ap.parse_args()
    total = bad = early = 0
    for seed in (int(s) for s in a.seeds.split(",")):
        n, m, k = run(seed, a.canvas, a.vocab, a.steps, a.canvases, a.stability, a.confidence, a.sharpness)
        total, bad, early = total + n, bad + m, early + k
    print(f"{total} steps checked, {bad} mismatching, {early} adaptive stops")


if __name__ == "__main__":
    main()
