"""F16 / BF16 / Q8_0 / Q4_K_M files of the fixtures against the F32 file: top-1 agreement and mean KL divergence.

Both engines replay the same recorded decoder calls (teacher-forced canvases and self-conditioning inputs, see
test_engine.py); the reference is the F32 GGUF's logits, the metric is over every canvas row of every call.

Bounds. Weight rounding moves these small random models' logits a lot (weights ×4 from init; ggml also rounds
activations to the weight's dot-product type: F16, Q8_0, Q8_K). Measured on g1_seed0 with the fixtures of
tests/reference/make_fixtures.py (top-1 agreement, mean KL in nats; 1 thread):

    tiny-a  f16 0.993 8.0e-5 | bf16 0.941 7.1e-4 | q8_0 0.786 1.0e-2 | q4_k_m 0.547 4.6e-2
    tiny-b  f16 0.993 2.9e-3 | bf16 0.957 8.1e-3 | q8_0 0.873 4.2e-2 | q4_k_m 0.658 2.3e-1

(Q4_K_M on these widths is mostly the Q5_0 fallback: K-quants need rows of 256.) The bounds below leave ~15 %
(at most 0.05 absolute for F16) on agreement and ~2× on KL for thread-count and platform rounding; a broken quantised
path (wrong block layout, wrong expert rows) lands near chance: top-1 ≈ 1/vocab ≈ 0.3 %, KL of several nats.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dgemma_engine.model import Context, Model

FIXTURES = Path(__file__).parent / "fixtures"

# (fixture, outtype): (minimum top-1 agreement, maximum mean KL in nats)
BOUNDS = {
    ("tiny-a", "f16"): (0.95, 2e-4),
    ("tiny-a", "bf16"): (0.85, 1.5e-3),
    ("tiny-a", "q8_0"): (0.67, 2e-2),
    ("tiny-a", "q4_k_m"): (0.46, 0.1),
    ("tiny-b", "f16"): (0.95, 6e-3),
    ("tiny-b", "bf16"): (0.85, 1.6e-2),
    ("tiny-b", "q8_0"): (0.75, 8e-2),
    ("tiny-b", "q4_k_m"): (0.56, 0.46),
}


def replay_logits(path: Path, run: dict[str, np.ndarray]) -> np.ndarray:
    with Model.load(path, threads=1) as m, Context(m, n_ctx=len(run["seq"]) + m.hparams.canvas_length,
                                                    threads=1) as ctx:
        ctx.encode(run["prompt"])
        out = []
        for i in range(len(run["pos"])):
            start = int(run["pos"][i][0])
            if start != ctx.n_past:
                ctx.encode(run["seq"][ctx.n_past:start])
            if run["has_sc"][i]:
                ctx.set_self_cond_logits(run["raw"][i - 1])
                out.append(ctx.step(run["canvas"][i], sc_temperature=float(run["T"][i - 1])).copy())
            else:
                out.append(ctx.step(run["canvas"][i]).copy())
        return np.array(out)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


@pytest.fixture(scope="module")
def f32_logits(gguf_path):
    cache = {}

    def get(name: str) -> tuple[dict, np.ndarray]:
        if name not in cache:
            with np.load(FIXTURES / name / "golden" / "g1_seed0.npz") as z:
                run = {k: z[k] for k in z.files}
            cache[name] = run, replay_logits(gguf_path(name, "f32"), run)
        return cache[name]

    return get


@pytest.mark.parametrize("name, outtype", list(BOUNDS))
def test_quantized_logits_agree_with_f32(gguf_path, f32_logits, name, outtype):
    run, ref = f32_logits(name)
    q = replay_logits(gguf_path(name, outtype), run)
    lp, lq = log_softmax(ref), log_softmax(q)
    kl = (np.exp(lp) * (lp - lq)).sum(axis=-1)
    top1 = float((ref.argmax(-1) == q.argmax(-1)).mean())
    min_top1, max_kl = BOUNDS[(name, outtype)]
    print(f"{name} {outtype}: top-1 {top1:.3f}, mean KL {kl.mean():.2e}, max KL {kl.max():.2e}")
    assert top1 >= min_top1 and kl.mean() <= max_kl, f"top-1 {top1:.3f} (min {min_top1}), mean KL {kl.mean():.2e}"
    assert not np.array_equal(q, ref)  # the file really is quantised
