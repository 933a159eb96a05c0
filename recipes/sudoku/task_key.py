"""Write the task marker into the Sudoku GGUF: `diffusion.task = "sudoku"` (dgemma_engine.tasks.TASK_KEY).

    python recipes/sudoku/task_key.py                      # modelfiles/sudoku.gguf in place, and its digest in
                                                           # checkpoint/bundle.json and tests/goldens/sudoku.json
    python recipes/sudoku/task_key.py --gguf other.gguf    # another file (bundle.py calls mark() after converting)

The key is what makes dgemma's server run every request to the model as the Sudoku task (rule checker,
self-correction, tries under symmetries of the puzzle; dgemma_cli/server/tasks.py). `dgemma convert` writes what a
transformers checkpoint holds and a checkpoint has no such field, so the recipe adds it afterwards: the file is
rewritten with the `gguf` package, every key/value and every tensor's bytes as they were, the key added (or set).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
GGUF_PATH = REPO / "modelfiles" / "sudoku.gguf"
BUNDLE_JSON = HERE / "checkpoint" / "bundle.json"
GOLDENS_JSON = REPO / "tests" / "goldens" / "sudoku.json"


def mark(path: Path) -> None:
    """Rewrite `path` with TASK_KEY set to the Sudoku task (written to a temporary file, then renamed over it)."""
    import gguf
    from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata, get_field_data

    from dgemma_engine.tasks import SUDOKU, TASK_KEY

    reader = gguf.GGUFReader(str(path), "r")
    tmp = path.with_name(path.name + ".task-tmp")
    writer = gguf.GGUFWriter(str(tmp), arch=get_field_data(reader, gguf.Keys.General.ARCHITECTURE),
                             endianess=reader.endianess)
    alignment = get_field_data(reader, gguf.Keys.General.ALIGNMENT)
    if alignment is not None:
        writer.data_alignment = alignment
    try:
        copy_with_new_metadata(reader, writer, {TASK_KEY: MetadataDetails(gguf.GGUFValueType.STRING, SUDOKU)}, [])
        del reader  # its memory map must close before the file is replaced
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, default=GGUF_PATH)
    args = ap.parse_args()
    mark(args.gguf)
    if args.gguf.resolve() == GGUF_PATH.resolve():  # the shipped file: its provenance records its digest
        digest = hashlib.sha256(args.gguf.read_bytes()).hexdigest()
        bundle = json.loads(BUNDLE_JSON.read_text())
        bundle["gguf_sha256"], bundle["gguf_bytes"] = digest, args.gguf.stat().st_size
        BUNDLE_JSON.write_text(json.dumps(bundle, indent=2) + "\n")
        # the goldens are transformers' answers on the checkpoint, which the key does not change: only the digest
        # they name (tests/reference/make_sudoku_goldens.py writes bundle.json's) follows the file
        goldens = json.loads(GOLDENS_JSON.read_text())
        goldens["gguf_sha256"] = digest
        GOLDENS_JSON.write_text(json.dumps(goldens, indent=1) + "\n")
        print(json.dumps({"gguf_sha256": digest, "gguf_bytes": bundle["gguf_bytes"]}))


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    main()
