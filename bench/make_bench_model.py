"""Build the 'bench-mid' benchmark checkpoint (random weights, fixed geometry) as a Hugging Face folder.

    python3 bench/make_bench_model.py [OUT_DIR] [--config bench/configs/bench-mid.json]

Default OUT_DIR: bench/work/bench-mid (ignored by git; ~1.6 GB fp32). Recipe (bench/configs/README.md):
drop `_comment`, `architectures`, `model_type` from the JSON, pass the rest to `DiffusionGemmaConfig`, instantiate
`DiffusionGemmaForBlockDiffusion` after `torch.manual_seed(0)`, `save_pretrained`, then add the released
`generation_config.json` and a Gemma-style BPE tokenizer with exactly `vocab_size` entries (plus the fixtures' chat
template). Needs torch==2.13.0 and transformers==5.23.0; takes about a minute or two on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from common import BENCH_MODEL, CONFIGS, REPO

sys.path.insert(0, str(REPO / "tests" / "reference"))

DEFAULT_CONFIG = CONFIGS / "bench-mid.json"
DEFAULT_GENERATION_CONFIG = CONFIGS / "generation_config.json"
DEFAULT_OUT = BENCH_MODEL
DROPPED_KEYS = ("_comment", "architectures", "model_type")


def load_bench_config(path: Path) -> dict:
    cfg = json.loads(path.read_text())
    for key in DROPPED_KEYS:
        cfg.pop(key, None)
    return cfg


def build(config_path: Path, generation_config_path: Path, out: Path) -> None:
    import torch
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    from tokenizer_trainer import ImageTokenIds, train_gemma_tokenizer

    cfg = load_bench_config(config_path)
    config = DiffusionGemmaConfig(**cfg)
    vocab_size = config.text_config.vocab_size
    image_ids = ImageTokenIds(image_token_id=config.image_token_id, boi_token_id=config.boi_token_id,
                              eoi_token_id=config.eoi_token_id)

    # Build into a sibling temp folder and rename at the end, so an interrupted run never leaves a half checkpoint.
    tmp = out.with_name(out.name + ".partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)

    tokenizer = train_gemma_tokenizer(vocab_size, image_ids,
                                      chat_template=(REPO / "tests/reference/chat_template.jinja").read_text())
    tokenizer.save_pretrained(tmp)

    torch.manual_seed(0)
    model = DiffusionGemmaForBlockDiffusion(config).eval()
    model.save_pretrained(tmp)
    del model
    shutil.copyfile(generation_config_path, tmp / "generation_config.json")

    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", type=Path, default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT})")
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="benchmark geometry JSON")
    parser.add_argument("--generation-config", type=Path, default=DEFAULT_GENERATION_CONFIG)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    build(args.config, args.generation_config, args.out)
    size = sum(p.stat().st_size for p in args.out.rglob("*") if p.is_file())
    print(f"wrote {args.out} ({size / 2**30:.2f} GiB)")


if __name__ == "__main__":
    main()
