"""Write a DiffusionGemma GGUF of a bench geometry with random weights, straight to the file: no checkpoint, no fp32 copy.

    python bench/random_gguf.py OUT.gguf [--config bench/configs/bench-real6.json] [--layers 30] [--outtype q4_k_m]

For timing and memory checks at the released size (30 layers: about 15 GB at Q4_K_M, 27 GB at Q8_0), where writing a
bf16 checkpoint first (52 GB) and converting it would take far longer than the measurement. The converter plans the
file from a header-only checkpoint folder (the geometry's config.json, a synthetic tokenizer with the exact vocabulary
size, the released generation_config.json), so names, shapes, types and metadata are exactly what `dgemma convert`
writes; only the weights differ. Quantized blocks are random bytes whose FP16 block scales are set to a small
constant (random scale bits could be NaN or infinite), so every weight is finite and of the size real ones have;
float tensors are small random normals. `--layers` repeats the geometry's layer pattern (five sliding layers, one
full-attention layer) and ends on a full-attention layer, as the released model does.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import common

# Offsets of the FP16 scale fields inside one block of each type (ggml's block layouts), and the value they get:
# about 0.02 for the largest weight of a block, as trained weights are.
SCALE_FIELDS = {"Q8_0": (0,), "Q5_0": (0,), "Q4_0": (0,), "IQ4_NL": (0,), "IQ4_XS": (0,),
                "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
SCALE = {"Q8_0": 2e-4, "Q5_0": 1.3e-3, "Q4_0": 2.7e-3, "IQ4_NL": 1.6e-4, "IQ4_XS": 1.6e-4,
         "Q4_K": 2e-5, "Q5_K": 1e-5, "Q6_K": 5e-5}
CHUNK_BYTES = 64 << 20


def header_only_checkpoint(config: Path, layers: int | None, folder: Path) -> Path:
    """config.json, tokenizer and generation config of `config`'s geometry: what the converter plans from."""
    sys.path.insert(0, str(common.REPO / "tests"))
    from synthetic_checkpoint import write_config, write_synthetic_tokenizer

    raw = json.loads(config.read_text())
    text = dict(raw["text_config"])
    if layers is not None:
        pattern = text["layer_types"]
        text["layer_types"] = [pattern[i % len(pattern)] for i in range(layers - 1)] + ["full_attention"]
        text["num_hidden_layers"] = layers
    write_config(folder, text, canvas_length=raw.get("canvas_length", 256))
    write_synthetic_tokenizer(folder, text["vocab_size"])
    (folder / "generation_config.json").write_text((common.CONFIGS / "generation_config.json").read_text())
    return folder


def random_tensor(ggml_type, nbytes: int, rng: np.random.Generator):
    """The tensor's bytes, chunk by chunk."""
    from gguf import GGML_QUANT_SIZES

    name = ggml_type.name
    if name in ("F32", "F16"):
        dtype = np.float32 if name == "F32" else np.float16
        count = nbytes // np.dtype(dtype).itemsize
        for start in range(0, count, CHUNK_BYTES // 4):
            yield (rng.standard_normal(min(CHUNK_BYTES // 4, count - start), dtype=np.float32) * 0.02).astype(dtype)
        return
    if name not in SCALE_FIELDS:
        raise SystemExit(f"random_gguf: no random blocks for {name} (add its scale fields)")
    block = GGML_QUANT_SIZES[ggml_type][1]
    scale = np.frombuffer(np.float16(SCALE[name]).tobytes(), dtype=np.uint8)
    blocks_per_chunk = max(1, CHUNK_BYTES // block)
    total = nbytes // block
    for start in range(0, total, blocks_per_chunk):
        n = min(blocks_per_chunk, total - start)
        chunk = np.frombuffer(rng.bytes(n * block), dtype=np.uint8).reshape(n, block).copy()
        for offset in SCALE_FIELDS[name]:
            chunk[:, offset:offset + 2] = scale
        yield chunk


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--config", type=Path, default=common.CONFIGS / "bench-real6.json")
    parser.add_argument("--layers", type=int, help="layers to write (default: the config's)")
    parser.add_argument("--outtype", default="q4_k_m")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from dgemma_convert.converter import plan, write_gguf

    started = time.perf_counter()
    rng = np.random.default_rng(args.seed)
    with tempfile.TemporaryDirectory(prefix="dgemma-random-gguf-") as tmp:
        p = plan(header_only_checkpoint(args.config, args.layers, Path(tmp)), args.outtype)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_gguf(args.out, p.metadata, p.tensors, lambda t: random_tensor(t.ggml_type, t.nbytes, rng))
    seconds = time.perf_counter() - started
    print(json.dumps({"out": str(args.out), "layers": p.config.n_layer, "outtype": args.outtype,
                      "bytes": args.out.stat().st_size, "seconds": round(seconds, 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
