"""Train the bundled Sudoku DiffusionGemma on CPU with transformers' own DiffusionGemmaForBlockDiffusion.

Objective (uniform-state diffusion, as the model family was trained): corrupt each canvas position to a uniformly random
token with probability t ~ U(0, 1); cross-entropy on the clean canvas; on half the examples the decoder is
self-conditioned on the tempered logits of a detached first pass.

    python recipes/sudoku/train.py --out /tmp/sudoku-hf --steps 4000 --seed 0

Needs torch==2.13.0 and transformers==5.23.0 (pip install ".[reference]"). Reproducible from --seed (same thread count).
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
from transformers import (DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion, DiffusionGemmaGenerationConfig,
                          EntropyBoundSamplerConfig)

sys.path.insert(0, str(Path(__file__).parent))
import puzzles  # noqa: E402
import vocab  # noqa: E402

IMAGE_IDS = dict(image_token_id=vocab.VOCAB_SIZE, boi_token_id=vocab.VOCAB_SIZE + 1, eoi_token_id=vocab.VOCAB_SIZE + 2)
VOCAB_WITH_IMAGE = vocab.VOCAB_SIZE + 3  # three image placeholders that text never uses


def build_config() -> DiffusionGemmaConfig:
    text = dict(
        vocab_size=VOCAB_WITH_IMAGE, hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
        num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, global_head_dim=64, num_global_key_value_heads=1,
        num_experts=4, top_k_experts=2, sliding_window=256, max_position_embeddings=1024,
        pad_token_id=vocab.PAD, eos_token_id=vocab.EOS, bos_token_id=vocab.BOS,
    )
    vision = dict(model_type="gemma4_vision", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2, head_dim=16, global_head_dim=16, patch_size=4,
                  pooling_kernel_size=2)
    return DiffusionGemmaConfig(text_config=text, vision_config=vision, canvas_length=81, **IMAGE_IDS)


def generation_config(max_steps: int = 48, t_min: float = 0.4, t_max: float = 0.8, entropy_bound: float = 0.1,
                      confidence_threshold: float = 0.005, stability_threshold: int = 1) -> DiffusionGemmaGenerationConfig:
    """One canvas of 81 cells; the released sampler values unless given (tune.py picks the bundled model's)."""
    return DiffusionGemmaGenerationConfig(
        max_new_tokens=81, max_denoising_steps=max_steps,
        sampler_config=EntropyBoundSamplerConfig(entropy_bound=entropy_bound), t_min=t_min, t_max=t_max,
        stability_threshold=stability_threshold, confidence_threshold=confidence_threshold, pad_token_id=vocab.PAD)


def make_batch(rng: random.Random, pool: list[list[int]], size: int,
               clues: tuple[int, int] = (22, 50)) -> tuple[torch.Tensor, torch.Tensor]:
    prompts, answers = [], []
    for _ in range(size):
        solution = puzzles.random_symmetry(rng.choice(pool), rng)
        keep = set(rng.sample(range(81), rng.randint(*clues)))
        puzzle = puzzles.to_text([d if i in keep else 0 for i, d in enumerate(solution)])
        prompts.append(vocab.prompt_ids(puzzle))
        answers.append(vocab.answer_ids(puzzles.to_text(solution)))
    return torch.tensor(prompts), torch.tensor(answers)


def training_step(model, prompts, answers, gen: torch.Generator, clean_weight: float = 1.0) -> torch.Tensor:
    """The loss of one batch. `clean_weight` < 1 lowers the weight of positions the corruption left intact (copying
    them is learned early), so the gradient goes to the cells the model must infer."""
    batch, n = answers.shape
    vocab_size = model.config.text_config.vocab_size
    t = torch.rand(batch, 1, generator=gen)
    corrupt = torch.rand(batch, n, generator=gen) < t
    noisy = torch.where(corrupt, torch.randint(0, vocab_size, (batch, n), generator=gen), answers)
    use_sc = torch.rand(batch, generator=gen) < 0.5
    temperature = 0.4 + 0.4 * torch.rand(batch, 1, 1, generator=gen)  # inference feeds logits / T, T in [t_min, t_max]
    sc_logits = torch.zeros(batch, n, vocab_size)
    if use_sc.any():
        with torch.no_grad():
            first = model(input_ids=prompts[use_sc], decoder_input_ids=noisy[use_sc]).logits
        sc_logits[use_sc] = first / temperature[use_sc]
    out = model(input_ids=prompts, decoder_input_ids=noisy, self_conditioning_logits=sc_logits,
                self_conditioning_mask=use_sc)
    losses = torch.nn.functional.cross_entropy(out.logits.reshape(-1, vocab_size), answers.reshape(-1), reduction="none")
    weights = torch.where(corrupt, 1.0, clean_weight).reshape(-1)
    return (losses * weights).sum() / weights.sum()


@torch.no_grad()
def evaluate(model, cases: list[tuple[str, str]], max_steps: int, seed: int) -> dict:
    model.eval()
    torch.manual_seed(seed)
    prompts = torch.tensor([vocab.prompt_ids(p) for p, _ in cases])
    out = model.generate(prompts, generation_config=generation_config(max_steps))
    grids = [vocab.ids_to_grid(row[82:].tolist()) for row in out.sequences]
    model.train()
    solved = sum(puzzles.is_valid_solution(p, g) for (p, _), g in zip(cases, grids))
    return {"solved": solved, "total": len(cases)}


def save(model, out: Path) -> None:
    model.save_pretrained(out)
    vocab.write_tokenizer(out)
    generation_config().save_pretrained(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--max-minutes", type=float, default=120.0, help="stop early (and save) past this wall time")
    ap.add_argument("--stop-at", type=int, help="save and stop at this step (the schedule still spans --steps)")
    ap.add_argument("--clues", type=int, nargs=2, default=(22, 50), metavar=("MIN", "MAX"),
                    help="clues per training puzzle, uniform in [MIN, MAX]")
    ap.add_argument("--clean-weight", type=float, default=1.0, help="loss weight of uncorrupted positions")
    ap.add_argument("--pool", type=int, default=500, help="solved grids the training puzzles are drawn from "
                    "(each seen under a random symmetry)")
    ap.add_argument("--init-from", type=Path, help="continue from a saved --out folder (weights and training log; "
                    "fresh optimizer with a short warmup, cosine from --lr over --steps more steps)")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    log = open(args.out / "train_log.jsonl", "w")
    first_step, running = 1, None
    if args.init_from:
        model = DiffusionGemmaForBlockDiffusion.from_pretrained(args.init_from, dtype=torch.float32,
                                                                attn_implementation="eager")
        previous = [json.loads(line) for line in (args.init_from / "train_log.jsonl").read_text().splitlines()]
        saved = [r for r in previous if "eval_medium_16" in r][-1]  # the weights are those of the last save
        for record in previous[:previous.index(saved) + 1]:  # one continuous curve in the log
            log.write(json.dumps(record) + "\n")
        first_step, running = saved["step"] + 1, saved["loss"]
    else:
        model = DiffusionGemmaForBlockDiffusion._from_config(build_config(), attn_implementation="eager")
    model.set_experts_implementation("eager")  # the grouped expert path is ~4x slower on CPU
    model.train()
    pool = [puzzles.random_solution(rng) for _ in range(args.pool)]
    eval_cases = puzzles.puzzle_set("medium", 50, seed=10_000)  # disjoint from bench seeds
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = max(1, min(200 if not args.init_from else 20, args.steps // 10))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) * (
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps))))
    start = time.time() - 60 * (saved["minutes"] if args.init_from else 0)  # minutes continue too
    last_step = first_step + args.steps - 1
    for step in range(first_step, last_step + 1):
        prompts, answers = make_batch(rng, pool, args.batch, tuple(args.clues))
        loss = training_step(model, prompts, answers, gen, args.clean_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        running = loss.item() if running is None else 0.98 * running + 0.02 * loss.item()
        minutes = (time.time() - start) / 60
        record = {"step": step, "loss": round(running, 4), "minutes": round(minutes, 2)}
        stop = minutes > args.max_minutes or step == args.stop_at
        if step % args.eval_every == 0 or step == last_step or stop:
            record["eval_medium_16"] = evaluate(model, eval_cases, 16, seed=step)
            save(model, args.out)
        if step % 50 == 0 or "eval_medium_16" in record:
            print(json.dumps(record), flush=True)
            log.write(json.dumps(record) + "\n")
            log.flush()
        if stop:
            break
    save(model, args.out)


if __name__ == "__main__":
    main()
