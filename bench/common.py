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
CPU_FLAGS = ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512_vnni", "avx512bw", "avx512vl", "amx_int8")


def cpu_info() -> dict:
    """The CPU every report names: model, logical CPUs and the instruction sets the kernels dispatch on."""
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    lines = [line.partition(":") for line in info.splitlines()]
    name = next((v.strip() for k, _, v in lines if k.strip() == "model name"), "unknown")
    flags = next((set(v.split()) for k, _, v in lines if k.strip() == "flags"), set())
    return {"name": name, "cores": os.cpu_count(), "flags": [f for f in CPU_FLAGS if f in flags]}


def cpu_description() -> str:
    cpu = cpu_info()
    return f"{cpu['name']}, {cpu['cores']} CPUs, " + " ".join(cpu["flags"])


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


def build_synthetic(config: Path, out: Path, layers: int | None = None) -> Path:
    """A random-bf16 checkpoint of `config`'s geometry (bench/configs/*.json), written tensor by tensor without torch
    (tests/synthetic_checkpoint.py); `layers` keeps the pattern's first layers, ending on a full-attention one as every
    DiffusionGemma does. Reused when `out` exists."""
    if (out / "config.json").exists():
        return out
    sys.path.insert(0, str(REPO / "tests"))
    from synthetic_checkpoint import write_synthetic_checkpoint

    raw = json.loads(config.read_text())
    text = raw["text_config"]
    if layers is not None:
        text = {**text, "num_hidden_layers": layers,
                "layer_types": text["layer_types"][:layers - 1] + ["full_attention"]}
    write_synthetic_checkpoint(out, text, dtype="BF16", n_shards=max(1, text["num_hidden_layers"]), fast=True)
    cfg = json.loads((out / "config.json").read_text())
    cfg["canvas_length"] = raw.get("canvas_length", 256)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out
