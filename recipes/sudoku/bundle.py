"""Bundle a trained Sudoku checkpoint as the model dgemma ships: HF checkpoint -> `dgemma convert` -> GGUF.

    python recipes/sudoku/bundle.py --checkpoint /work/sudoku-run2/hf-anneal
    python recipes/sudoku/bundle.py --checkpoint recipes/sudoku/checkpoint   # in place: after a vocab.py template change

1. Export `recipes/sudoku/checkpoint/` (committed): the weights rounded to float16, config, generation config,
   tokenizer files and the training log. This is "the bundled checkpoint": the goldens
   (tests/reference/make_sudoku_goldens.py) and `bench/sudoku.py` run transformers on exactly these weights.
2. Convert it with `dgemma convert --outtype f32` from a folder named `dgemma-sudoku` (the converter takes
   `general.name` from the folder name) -> `modelfiles/sudoku.gguf`, then write the task marker
   `diffusion.task = "sudoku"` into it (task_key.py): the server runs the model as the Sudoku task by that key.
3. Check the GGUF: name, task, vocabulary size, canvas length.

Why f32: the model has 2.3 M parameters, so f32 is 6.6 MB (f16 3.3 MB, q8_0 1.8 MB) — all "a few MB". The f32 file
holds the exported (f16-rounded) weights exactly and ggml then computes in f32 like transformers does, so dgemma's
torch-RNG runs agree with transformers' puzzle by puzzle as closely as two independent forwards can; ggml's f16
products would also round the activations to f16, and f32 runs faster here (its GEMM and the engine's tiled expert
kernel; 12 vs 15 ms per denoising step at one thread). `--outtype f16|q8_0` make the smaller files for comparisons.

Why three extra tokens: the checkpoint's embedding has 828 rows (825 Sudoku tokens + the 3 image ids the architecture
needs), and the converter keeps one row per tokenizer token. Naming the image ids in the tokenizer keeps all 828 rows,
so the engine draws its random canvas tokens over the same 828 ids as transformers does (torch-RNG agreement).

Needs numpy, safetensors and tokenizers (no torch). Reruns with the same checkpoint give byte-identical outputs.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

sys.path.insert(0, str(Path(__file__).parent))
import task_key
import vocab

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
CHECKPOINT_DIR = HERE / "checkpoint"
GGUF_PATH = REPO / "modelfiles" / "sudoku.gguf"
GENERAL_NAME = "dgemma-sudoku"  # = dgemma_cli.sudoku.MODEL_GENERAL_NAME
OUTTYPE = "f32"
# ids 825..827 in train.IMAGE_IDS order (image, begin-of-image, end-of-image); text never contains them
IMAGE_TOKENS = ["<image_soft_token>", "<start_of_image>", "<end_of_image>"]
CHECKPOINT_FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                    "tokenizer_config.json", "chat_template.jinja"]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def training_log_until_save(source: Path) -> list[dict]:
    """train.py's log up to the record of the step whose weights are saved (it saves exactly where it evaluates; the
    log runs on every 50 steps past that while training continues)."""
    log = source / "train_log.jsonl"
    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()] if log.is_file() else []
    saved = [i for i, r in enumerate(records) if any(k.startswith("eval_") for k in r)]
    return records[:saved[-1] + 1] if saved else []


def export_checkpoint(source: Path, out: Path) -> None:
    """Weights as float16 (the f32 GGUF holds exactly these values), the configs, and the 828-token tokenizer."""
    tensors = load_file(str(source / "model.safetensors"))
    halves = {}
    for name, array in sorted(tensors.items()):
        if array.dtype.kind != "f":
            raise SystemExit(f"unexpected non-float tensor {name} ({array.dtype})")
        half = array.astype(np.float16)
        if not np.isfinite(half).all():  # a weight beyond f16's range would silently become inf
            raise SystemExit(f"tensor {name} does not fit float16")
        halves[name] = half
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    save_file(halves, str(out / "model.safetensors"), metadata={"format": "pt"})

    config = json.loads((source / "config.json").read_text())
    config["dtype"] = "float16"
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    shutil.copyfile(source / "generation_config.json", out / "generation_config.json")
    write_tokenizer(out, int(config["text_config"]["vocab_size"]))
    records = training_log_until_save(source)  # the training curve, as evidence for the README's table
    if records:
        (out / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def generation_config(source: Path) -> dict:
    """The training run's generation config with the sampler settings tune.py chose (sampler.json), if any."""
    gen = json.loads((source / "generation_config.json").read_text())
    tuned = HERE / "sampler.json"
    if tuned.is_file():
        for name, value in json.loads(tuned.read_text())["settings"].items():
            if name == "entropy_bound":
                gen["sampler_config"]["entropy_bound"] = value
            else:  # t_min, t_max, confidence_threshold: top-level fields of the same name
                gen[name] = value
    return gen


def sampler_settings(gen: dict) -> dict:
    """The sampler values of a generation_config.json, named as dgemma's SamplerParams (and train.generation_config)."""
    return {"max_steps": gen["max_denoising_steps"], "t_min": gen["t_min"], "t_max": gen["t_max"],
            "entropy_bound": gen["sampler_config"]["entropy_bound"],
            "confidence_threshold": gen["confidence_threshold"], "stability_threshold": gen["stability_threshold"]}


def write_tokenizer(out: Path, vocab_size: int) -> None:
    from tokenizers import AddedToken, Tokenizer

    vocab.write_tokenizer(out)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in IMAGE_TOKENS])
    ids = [tok.token_to_id(t) for t in IMAGE_TOKENS]
    if ids != list(range(vocab.VOCAB_SIZE, vocab.VOCAB_SIZE + len(IMAGE_TOKENS))) or tok.get_vocab_size() != vocab_size:
        raise SystemExit(f"tokenizer does not match the embedding: image ids {ids}, {tok.get_vocab_size()} tokens "
                         f"for vocab_size {vocab_size}")
    tok.save(str(out / "tokenizer.json"))


def convert(checkpoint: Path, gguf: Path, outtype: str) -> None:
    """`dgemma convert` from a real folder named `dgemma-sudoku` (its name becomes general.name)."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / GENERAL_NAME
        folder.mkdir()
        for name in CHECKPOINT_FILES:
            (folder / name).symlink_to(checkpoint.resolve() / name)
        cmd = [sys.executable, "-m", "dgemma_cli.main", "convert", str(folder), "--outfile", str(gguf),
               "--outtype", outtype, "--threads", "1"]
        subprocess.run(cmd, check=True)
    task_key.mark(gguf)


def check_gguf(gguf: Path, vocab_size: int) -> dict:
    from dgemma_engine.gguf_keys import KEY_FILE_TYPE, KEY_NAME
    from dgemma_engine.model import Model

    with Model.load(str(gguf), threads=1) as model:
        name = model.metadata.get(KEY_NAME)
        if name != GENERAL_NAME:
            raise SystemExit(f"{gguf}: general.name is {name!r}, expected {GENERAL_NAME!r}")
        from dgemma_engine.tasks import SUDOKU, task_name

        if task_name(model.metadata) != SUDOKU:
            raise SystemExit(f"{gguf}: no task marker {SUDOKU!r} (task_key.py)")
        if model.hparams.n_vocab != vocab_size or model.hparams.canvas_length != 81:
            raise SystemExit(f"{gguf}: vocabulary {model.hparams.n_vocab} / canvas {model.hparams.canvas_length}, "
                             f"expected {vocab_size} / 81")
        return {"n_vocab": model.hparams.n_vocab, "file_type": int(model.metadata[KEY_FILE_TYPE])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, required=True, help="train.py's --out folder")
    ap.add_argument("--out-checkpoint", type=Path, default=CHECKPOINT_DIR)
    ap.add_argument("--out-gguf", type=Path, default=GGUF_PATH)
    ap.add_argument("--outtype", default=OUTTYPE, help="GGUF type (f32 is what ships; f16/q8_0 for comparisons)")
    args = ap.parse_args()

    if args.checkpoint.resolve() != args.out_checkpoint.resolve():
        export_checkpoint(args.checkpoint, args.out_checkpoint)
    # the template is vocab.py's: re-bundling in place after a template change only changes tokenizer.chat_template
    (args.out_checkpoint / "chat_template.jinja").write_text(vocab.CHAT_TEMPLATE)
    gen = generation_config(args.out_checkpoint)  # idempotent: re-bundling in place applies sampler.json again
    (args.out_checkpoint / "generation_config.json").write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")
    convert(args.out_checkpoint, args.out_gguf, args.outtype)
    config = json.loads((args.out_checkpoint / "config.json").read_text())
    info = check_gguf(args.out_gguf, int(config["text_config"]["vocab_size"]))
    records = training_log_until_save(args.out_checkpoint)
    record = records[-1] if records else {}
    provenance = {
        "training_step": record.get("step"), "training_minutes": record.get("minutes"),
        "checkpoint_sha256": sha256(args.out_checkpoint / "model.safetensors"),
        "gguf": args.out_gguf.name, "gguf_type": args.outtype, "gguf_sha256": sha256(args.out_gguf),
        "gguf_bytes": args.out_gguf.stat().st_size, **info,
        "sampler": sampler_settings(gen),
    }
    if args.out_checkpoint.resolve() == CHECKPOINT_DIR.resolve() and args.out_gguf.resolve() == GGUF_PATH.resolve():
        (args.out_checkpoint / "bundle.json").write_text(json.dumps(provenance, indent=2) + "\n")
    print(json.dumps(provenance))


if __name__ == "__main__":
    main()
