"""End-to-end generation speed on bench-mid: dgemma (F32, Q8_0, Q4_K_M) against transformers generate(), one run.

    python3 bench/make_bench_model.py              # once: bench/work/bench-mid (HF, fp32)
    python3 bench/generate.py [--threads 2] [--steps 16] [--max-new-tokens 512] [--json out.json]

Same weights, prompt, seed and sampler settings for both (torch RNG mode for dgemma, so at F32 the two follow the
same trajectory until rounding-level differences meet a near-tie). Reported per engine: prompt eval time, denoising
time (end of prefill to last commit), committed tokens per second, steps per canvas; for transformers the same from
generate() (prefill timed by a hook on its encoder). Random weights are never confident, so every canvas runs all
`--steps` steps: the figures measure the per-step cost, which is what the adaptive stop multiplies.
Also: one sampler step alone (fast and torch RNG) next to one decoder step, on the same [C, V] logits.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

import common


def run_transformers(model_dir: Path, prompt: list[int], args) -> dict:
    import torch
    from transformers import (DiffusionGemmaForBlockDiffusion, DiffusionGemmaGenerationConfig,
                              EntropyBoundSamplerConfig)

    torch.set_num_threads(args.threads)
    model = DiffusionGemmaForBlockDiffusion.from_pretrained(model_dir, dtype=torch.float32).eval()
    cfg = DiffusionGemmaGenerationConfig(
        max_new_tokens=args.max_new_tokens, max_denoising_steps=args.steps, t_min=0.4, t_max=0.8,
        sampler_config=EntropyBoundSamplerConfig(entropy_bound=0.1), stability_threshold=1,
        confidence_threshold=0.005, eos_token_id=[1, 106, 50], pad_token_id=0)
    calls, prefill = [], []
    forward, encoder_forward = model.forward, model.model.encoder.forward

    def counting_forward(*a, **kw):
        if kw.get("decoder_input_ids") is not None:
            calls.append(kw.get("self_conditioning_logits") is None)
        return forward(*a, **kw)

    def timed_encoder(*a, **kw):
        start = time.perf_counter()
        out = encoder_forward(*a, **kw)
        if not prefill:
            prefill.append(time.perf_counter() - start)
        return out

    model.forward, model.model.encoder.forward = counting_forward, timed_encoder
    torch.manual_seed(args.seed)
    start = time.perf_counter()
    with torch.no_grad():
        seq = model.generate(torch.tensor([prompt]), generation_config=cfg).sequences[0].tolist()
    total = time.perf_counter() - start
    steps, canvas_steps = [], 0
    for first in calls:
        if first and canvas_steps:
            steps.append(canvas_steps)
            canvas_steps = 0
        canvas_steps += 1
    steps.append(canvas_steps)
    new = seq[len(prompt):]
    delivered = next((i for i, t in enumerate(new) if t in (1, 106, 50)), len(new))
    denoise = total - prefill[0]
    return {"engine": "transformers fp32", "prompt_eval_s": prefill[0], "denoise_s": denoise,
            "committed_tokens": delivered, "tokens_per_s": delivered / denoise, "steps_per_canvas": steps,
            "sequence": seq}


def run_dgemma(gguf: Path, prompt: list[int], args) -> dict:
    from dgemma_engine.generate import CanvasEvent, DoneEvent, SamplerParams, generate, torch_compatible_sequence
    from dgemma_engine.model import Context, Model

    with Model.load(gguf, threads=args.threads) as m:
        C = m.hparams.canvas_length
        n_ctx = len(prompt) + -(-args.max_new_tokens // C) * C
        params = SamplerParams(max_steps=args.steps, seed=args.seed, rng="torch")
        with Context(m, n_ctx=n_ctx, threads=args.threads) as ctx:
            canvases, done = [], None
            for ev in generate(ctx, prompt, params, max_new_tokens=args.max_new_tokens, eos_ids=(1, 106, 50),
                               threads=args.threads):
                if isinstance(ev, CanvasEvent):
                    canvases.append(ev)
                elif isinstance(ev, DoneEvent):
                    done = ev
        s = done.stats
        return {"engine": f"dgemma {gguf.stem.split('-')[-1]}", "prompt_eval_s": s.prompt_eval_s,
                "denoise_s": s.denoise_s, "committed_tokens": s.committed_tokens, "tokens_per_s": s.tokens_per_s,
                "steps_per_canvas": s.steps_per_canvas,
                "sequence": torch_compatible_sequence(prompt, canvases, 0)}


def time_sampler_vs_step(gguf: Path, prompt: list[int], args) -> dict:
    """One decoder step (self-conditioned) and one sampler step on its logits, in each RNG mode."""
    from dgemma_engine.model import Context, Model
    from dgemma_engine.sampler import Sampler

    with Model.load(gguf, threads=args.threads) as m:
        C, V = m.hparams.canvas_length, m.hparams.n_vocab
        with Context(m, n_ctx=len(prompt) + C, threads=args.threads) as ctx:
            ctx.encode(prompt)
            canvas = np.random.default_rng(1).integers(0, V, C)
            ctx.step(canvas)
            start = time.perf_counter()
            logits = ctx.step(canvas, sc_temperature=0.8)
            step_s = time.perf_counter() - start
            out = {"decoder_step_s": step_s}
            for rng in ("fast", "torch"):
                sampler = Sampler(C, V, max_steps=48, t_min=0.4, t_max=0.8, entropy_bound=0.1,
                                  confidence_threshold=0.005, stability_threshold=1, seed=0, rng=rng,
                                  threads=args.threads)
                sampler.begin_canvas()
                start = time.perf_counter()
                for _ in range(3):
                    sampler.step(logits)
                out[f"sampler_{rng}_s"] = (time.perf_counter() - start) / 3
                sampler.close()
    return out


def main() -> None:
    ap = common.bench_parser(__doc__)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    vocab = common.model_vocab_size(args.model)
    prompt = [2] + np.random.default_rng(0).integers(10, vocab, args.prompt_tokens - 1).tolist()

    from dgemma_convert import convert

    args.gguf_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for outtype in args.types.split(","):
        path = args.gguf_dir / f"{args.model.name}-{outtype}.gguf"
        if not path.exists():
            convert(args.model, path, outtype, threads=args.threads)
        results.append(run_dgemma(path, prompt, args))
        results[-1]["sampler_vs_step"] = time_sampler_vs_step(path, prompt, args)
    if not args.skip_transformers:
        results.append(run_transformers(args.model, prompt, args))

    reference = results[-1] if not args.skip_transformers else None
    print(f"bench-mid, prompt {len(prompt)} tokens, {args.max_new_tokens} new tokens, {args.steps} steps max, "
          f"{args.threads} threads, seed {args.seed}")
    print(f"{'engine':<20}{'prefill s':>10}{'denoise s':>11}{'tokens':>8}{'tok/s':>8}{'vs HF':>7}  steps/canvas  "
          f"same tokens as HF")
    for r in results:
        ratio = r["tokens_per_s"] / reference["tokens_per_s"] if reference else float("nan")
        same = ""
        if reference is not None and r is not reference:
            a, b = r["sequence"][len(prompt):], reference["sequence"][len(prompt):]
            agree = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            same = f"{agree}/{len(b)}"
        print(f"{r['engine']:<20}{r['prompt_eval_s']:>10.2f}{r['denoise_s']:>11.2f}{r['committed_tokens']:>8}"
              f"{r['tokens_per_s']:>8.1f}{ratio:>7.2f}  {str(r['steps_per_canvas']):<13} {same}")
    for r in results:
        if "sampler_vs_step" in r:
            t = r["sampler_vs_step"]
            print(f"{r['engine']}: decoder step {t['decoder_step_s'] * 1e3:.0f} ms, sampler step fast "
                  f"{t['sampler_fast_s'] * 1e3:.1f} ms, torch {t['sampler_torch_s'] * 1e3:.1f} ms")
    if args.json:
        for r in results:
            r.pop("sequence")
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results},
                                        indent=1) + "\n")


if __name__ == "__main__":
    main()
