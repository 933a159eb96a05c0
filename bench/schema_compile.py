"""First-compile time of structured output at the released vocabulary size (V = 262,144), cold and cached.

    python3 bench/schema_compile.py [--vocab 262144] [--json out.json]

A compile needs only the vocabulary, so the model here is a GGUF that holds just the tokenizer keys: a synthetic
Gemma-style vocabulary (the released special tokens at their ids, the 256 byte tokens, then generated subword
pieces: syllable words with and without the "▁" space mark, capitalised and upper-case forms, numbers, punctuation
runs, whitespace runs and CJK characters). For "any JSON object" and a 6-field schema it times the server's path
(dgemma_cli/server/schema_compiler.py): cold (empty cache: the vocabulary read from the GGUF, the compile in its
child), again in the same process (memory cache), and in a new compiler over the same cache folder (a restart: the
disk cache). The cold compiles run without the request limit, to measure them.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import resource
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "reference"))
from tokenizer_trainer import BYTE_TOKENS, SPECIAL_IDS  # noqa: E402  (the released special ids)

SIX_FIELDS = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "email": {"type": "string"},
    "active": {"type": "boolean"}, "score": {"type": "number"}, "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "age", "email", "active", "score", "tags"]}
CONSONANTS = "b c d f g h j k l m n p r s t v w x z ch sh th st tr pr br gr pl cl qu".split()
VOWELS = "a e i o u y ae ai ea ee ie io oo ou".split()
PUNCTUATION = list('{}[]":,.;!?()\'-_/\\@#$%^&*+=<>|`~')
TYPE_NORMAL, TYPE_CONTROL, TYPE_BYTE = 1, 3, 6


def synthetic_vocabulary(size: int, seed: int = 0) -> tuple[list[str], list[int]]:
    """`size` distinct tokens and their GGUF token types, laid out as the released vocabulary's first ids."""
    rng = random.Random(seed)
    tokens: list[str | None] = [None] * size
    types = [TYPE_NORMAL] * size
    for token_id, text in SPECIAL_IDS.items():
        tokens[token_id], types[token_id] = text, TYPE_CONTROL
    free = (i for i in range(size) if tokens[i] is None)
    for text in BYTE_TOKENS:
        token_id = next(free)
        tokens[token_id], types[token_id] = text, TYPE_BYTE
    pieces = ["".join(p) for n in (1, 2, 3) for p in itertools.product(PUNCTUATION, repeat=n)][:4000]
    pieces += [str(n) for n in range(1000)] + ["▁" * n for n in range(1, 33)]
    pieces += ["\n" * n for n in range(1, 9)] + ["\t" * n for n in range(1, 9)]
    pieces += [chr(c) for c in range(0x4E00, 0x4E00 + 8000)]
    seen = set(tokens) | set(pieces)
    while len(pieces) < size:
        word = "".join(rng.choice(CONSONANTS) + rng.choice(VOWELS) for _ in range(rng.choice((1, 1, 2, 2, 2, 3, 3, 4))))
        word = word[:-1] if rng.random() < 0.4 else word
        word = ("▁" + word) if rng.random() < 0.45 else word
        word = word.capitalize() if rng.random() < 0.15 else word.upper() if rng.random() < 0.02 else word
        if word not in seen:
            seen.add(word)
            pieces.append(word)
    rng.shuffle(pieces)
    rest = iter(pieces)
    return [t if t is not None else next(rest) for t in tokens], types


def write_vocabulary_gguf(path: Path, tokens: list[str], types: list[int]) -> None:
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "diffusion-gemma")
    writer.add_tokenizer_model("gemma4")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_eos_token_id(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


async def timed(compiler, gguf: Path, schema) -> tuple[float, float]:
    """Wall seconds of one `automaton` call and CPU seconds of the compile children it ran (the limit counts
    these; on a busy machine the wall time of a child at the lowest priority is mostly waiting)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    await compiler.automaton(gguf, schema)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime + after.ru_stime) - (children.ru_utime + children.ru_stime)


async def measure(gguf: Path, cache: Path) -> dict[str, tuple[float, float]]:
    from dgemma_cli.server.schema_compiler import SchemaCompiler

    unlimited = 3600.0
    first = SchemaCompiler(cache, unlimited)
    results = {}
    started, cpu = time.perf_counter(), time.process_time()
    await first.vocabulary(gguf)  # timed apart from the compiles: done once per model, in this process
    results["vocabulary read (GGUF keys, token map, digest)"] = (time.perf_counter() - started,
                                                                  time.process_time() - cpu)
    for label, schema in (("json", None), ("6-field schema", SIX_FIELDS)):
        results[f"{label}: cold"] = await timed(first, gguf, schema)
        results[f"{label}: memory cache"] = await timed(first, gguf, schema)
    restarted = SchemaCompiler(cache, unlimited)
    await restarted.vocabulary(gguf)
    for label, schema in (("json", None), ("6-field schema", SIX_FIELDS)):
        results[f"{label}: disk cache (restart)"] = await timed(restarted, gguf, schema)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=262144)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        gguf = Path(tmp) / "vocabulary.gguf"
        tokens, types = synthetic_vocabulary(args.vocab)
        write_vocabulary_gguf(gguf, tokens, types)
        results = asyncio.run(measure(gguf, Path(tmp) / "cache"))
        sizes = {p.name: p.stat().st_size for p in (Path(tmp) / "cache").rglob("*.npz")}
    print(f"{'V = ' + str(args.vocab):48s} {'wall':>8s}   {'CPU':>9s}  (the compile child's; the vocabulary's here)")
    for label, (wall, cpu) in results.items():
        print(f"{label:48s} {wall:8.2f} s {cpu:9.2f} s")
    print("cache files:", ", ".join(f"{size / 2**20:.1f} MiB" for size in sorted(sizes.values())))
    print(f"largest compile child: {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20:.1f} GiB resident")
    if args.json:
        args.json.write_text(json.dumps({"vocab": args.vocab, "wall_and_child_cpu_seconds": results,
                                         "cache_bytes": sorted(sizes.values())}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
