"""What the bench-mid scripts share: where things are (all inside the repository) and the model/GGUF arguments.

The scripts run as `python3 bench/<name>.py`, so this folder is on `sys.path` and they `import common`.
Built models and converted GGUFs go to `bench/work/` (ignored by git; bench-mid is ~1.6 GB in fp32).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "bench" / "configs"  # bench-mid.json and the released generation_config.json
WORK = REPO / "bench" / "work"
BENCH_MODEL = WORK / "bench-mid"  # what make_bench_model.py builds
GGUF_DIR = WORK / "gguf"


def bench_parser(doc: str) -> argparse.ArgumentParser:
    """The arguments every bench-mid comparison takes: the checkpoint, the GGUF types converted from it (into
    --gguf-dir), the thread count, whether to skip transformers, and where to write the JSON report."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=BENCH_MODEL, help="bench-mid HF folder")
    ap.add_argument("--gguf-dir", type=Path, default=GGUF_DIR)
    ap.add_argument("--types", default="f32,q8_0,q4_k_m")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--json", type=Path)
    return ap


def model_vocab_size(model: Path) -> int:
    """The checkpoint's vocabulary size; exits with a hint when the checkpoint has not been built yet."""
    if not model.is_dir():
        sys.exit(f"{model} not found: run bench/make_bench_model.py first")
    return json.loads((model / "config.json").read_text())["text_config"]["vocab_size"]
