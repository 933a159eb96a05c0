"""Structured output at the released vocabulary and canvas (V = 262,144, C = 256): the time a format adds per committed
canvas, the constrained decode alone (the plain dynamic program against the fast decode, on the same logits), and
the compile times.

    python3 bench/structured_vocab.py [--runs 5] [--steps 2] [--threads 2] [--outtype q8_0] [--skip-reference]
                                      [--json out.json]
    python3 bench/structured_vocab.py --first-request [--runs 3] [--steps 2] [--outtype q8_0] [--json out.json]

The model: 2 layers, hidden 256, random weights written without torch (tests/synthetic_checkpoint.py), with a
synthetic Gemma-style vocabulary of 262,144 tokens (bench/schema_compile.py: the released special ids, the byte
tokens, punctuation runs, numbers, whitespace runs, CJK characters and generated words), canvas 256; built into
bench/work/structured-v262k/ and converted once to `--outtype`. Small layers on purpose: the LM head and the
vocabulary are the released size, so what a format adds is measured against a canvas that is cheap.

Compile times go through the server's path (dgemma_cli/server/schema_compiler.py: the vocabulary read from the GGUF,
the compile in its child, the decoder's index), cold and after a restart (the disk cache), for "any JSON object"
(`format: "json"`) and a 6-field schema. Then, interleaved per seed, one-canvas generations without a format, with
"json" and with the 6-field schema (`--steps` denoising steps, same seeds), each timed to its committed canvas; the
added time per canvas is the constrained median minus the free one, from the same run. On the logits of the last
constrained canvases, the decode alone: best_canvas (fast) against best_canvas_reference (the plain program), which
must return the same canvas; `--skip-reference` leaves the plain program out (it takes about half a minute per canvas
for "json"). With it, one canvas per format is also generated end to end with the plain program (the "before").

`--first-request` measures what a user sees instead, through the CLI and `dgemma serve`: `dgemma create` of the model
into an empty store (its in-process server; each status line timed, so the time the "any JSON object" compile adds to
the create is the span of its `compiling structured output` line), then, `--runs` times and interleaved, a fresh
`dgemma serve` whose first request is `/api/generate` with `format: "json"`, and a fresh one whose first request is the
same without a format (one canvas: num_predict 255, `--steps` steps, the same seed). Both include the model's load;
the difference is what the format adds to the first request after a start. After the json-first request the same
server answers the request again without and with the format (warm: the per-canvas cost alone).
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

import common
from schema_compile import SIX_FIELDS, synthetic_vocabulary

sys.path.insert(0, str(common.REPO / "tests"))
from synthetic_checkpoint import text_config, write_synthetic_checkpoint  # noqa: E402

VOCAB = 262_144
CANVAS = 256
NAME = "structured-v262k"


def write_tokenizer(folder: Path) -> None:
    """tokenizer.json (a byte-fallback BPE holding the synthetic vocabulary, no merges) and its config."""
    tokens, types = synthetic_vocabulary(VOCAB)
    control = [i for i, t in enumerate(types) if t == 3]
    added = [{"id": i, "content": tokens[i], "special": True, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False} for i in control]
    tokenizer = {"version": "1.0", "added_tokens": added, "normalizer": None, "pre_tokenizer": None,
                 "decoder": {"type": "Sequence", "decoders": []},
                 "model": {"type": "BPE", "byte_fallback": True, "vocab": {t: i for i, t in enumerate(tokens)},
                           "merges": []}}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<bos>", "eos_token": "<eos>", "unk_token": "<unk>", "pad_token": "<pad>",
         "mask_token": "<mask>"}))
    (folder / "chat_template.jinja").write_text("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}")


def build_model(outtype: str, threads: int) -> Path:
    """The checkpoint and its GGUF under bench/work/ (reused when there)."""
    ckpt = common.WORK / NAME
    gguf = common.WORK / f"{NAME}-{outtype}.gguf"
    if gguf.exists():
        return gguf
    if not (ckpt / "config.json").exists():
        with tempfile.TemporaryDirectory() as tmp:
            write_tokenizer(Path(tmp))
            write_synthetic_checkpoint(ckpt, text_config(vocab_size=VOCAB), dtype="BF16", fast=True,
                                       tokenizer_from=Path(tmp))
        cfg = json.loads((ckpt / "config.json").read_text())
        cfg["canvas_length"] = CANVAS
        (ckpt / "config.json").write_text(json.dumps(cfg, indent=1))
    from dgemma_convert import convert

    started = time.perf_counter()
    convert(ckpt, gguf, outtype, threads=threads)
    print(f"converted {ckpt.name} to {outtype} in {time.perf_counter() - started:.1f} s")
    return gguf


# ---- compile times -------------------------------------------------------------------------------------------------

async def timed(compiler, gguf: Path, schema) -> dict:
    """Wall seconds of one `automaton` call (as a request waits for it) and CPU seconds of its compile child."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    automaton = await compiler.automaton(gguf, schema)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"wall_s": wall, "child_cpu_s": (after.ru_utime + after.ru_stime) - (children.ru_utime + children.ru_stime),
            "states": automaton.n_states, "edges": int(len(automaton.src)), "automaton": automaton}


async def compile_times(gguf: Path, cache: Path) -> dict:
    from dgemma_cli.server.schema_compiler import SchemaCompiler

    out = {}
    for phase in ("cold", "disk cache (restart)"):
        compiler = SchemaCompiler(cache, 3600.0)  # no request limit: measured, not refused
        started = time.perf_counter()
        await compiler.vocabulary(gguf)
        out[f"vocabulary read, {phase}"] = {"wall_s": time.perf_counter() - started}
        for label, schema in (("json", None), ("6-field schema", SIX_FIELDS)):
            out[f"{label}, {phase}"] = await timed(compiler, gguf, schema)
        await compiler.close()
    return out


# ---- canvases ------------------------------------------------------------------------------------------------------

def one_canvas(ctx, model, tokenizer, prompt, params, seed: int, threads: int, automaton=None):
    """Seconds to the committed canvas, the commit's own seconds and the logits it decoded (None without a format)."""
    from dgemma_engine.constrained import CanvasConstraint
    from dgemma_engine.events import CanvasEvent
    from dgemma_engine.generate import eos_ids_from_metadata, generate

    class Recording(CanvasConstraint):
        def commit(self, logits, tokens_after):
            started = time.perf_counter()
            ids = super().commit(logits, tokens_after)
            self.commit_s = time.perf_counter() - started
            # the engine's buffer, intact until its next step: copied once the canvas is timed
            self.logits, self.tokens_after, self.state_before = logits, tokens_after, self.automaton.initial
            return ids

    C = model.hparams.canvas_length
    ctx.reset()
    constraint = Recording(automaton) if automaton is not None else None
    started = time.perf_counter()
    for event in generate(ctx, prompt, replace(params, seed=seed), max_new_tokens=C,
                          eos_ids=eos_ids_from_metadata(model.metadata), tokenizer=tokenizer, threads=threads,
                          constraint=constraint):
        if isinstance(event, CanvasEvent):
            seconds = time.perf_counter() - started
            if constraint is not None:
                constraint.logits = np.array(constraint.logits)
            return seconds, constraint
    raise RuntimeError("no canvas")


# ---- the first request after a start, on a model made with `dgemma create` ----------------------------------------

def timed_lines(command: list[str], env: dict) -> tuple[list[tuple[float, str]], float]:
    """Run `command`; each line it prints (stdout and stderr) with the seconds since the start when it came, and the
    whole run's seconds."""
    import subprocess

    started = time.perf_counter()
    child = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=common.REPO)
    lines = [(time.perf_counter() - started, raw.decode(errors="replace").rstrip()) for raw in child.stdout]
    if child.wait() != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n" + "\n".join(text for _, text in lines))
    return lines, time.perf_counter() - started


def dgemma_create(models: Path, gguf: Path) -> dict:
    """`dgemma create v262k -f Modelfile` with no server running (the CLI serves the store in-process)."""
    import os

    from server_harness import free_port

    folder = models.parent / "modelfile"
    folder.mkdir(exist_ok=True)
    (folder / "Modelfile").write_text(f"FROM {gguf}\n")
    env = {**os.environ, "DGEMMA_MODELS": str(models), "DGEMMA_HOST": f"127.0.0.1:{free_port()}",
           "PYTHONPATH": os.pathsep.join([str(common.REPO), os.environ.get("PYTHONPATH", "")])}
    lines, total = timed_lines([sys.executable, "-m", "dgemma_cli.main", "create", "v262k", "-f",
                                str(folder / "Modelfile")], env)
    from dgemma_cli.server.schema_compiler import STORE_STATUS

    at = {text: seconds for seconds, text in lines}
    compile_s = at["success"] - at[STORE_STATUS] if STORE_STATUS in at else 0.0
    return {"create_s": total, "compile_s": compile_s, "lines": [f"{s:7.2f} s  {t}" for s, t in lines]}


def first_requests(models: Path, rounds: int, steps: int) -> dict:
    import httpx

    from server_harness import ServeProcess

    body = {"model": "v262k", "prompt": "Answer in JSON.", "stream": False,
            "options": {"num_predict": CANVAS - 1, "diffusion_steps": steps, "seed": 1}}
    json_body = {**body, "format": "json"}
    out: dict[str, list[float]] = {"json first": [], "free first": [], "free warm": [], "json warm": []}

    def ask(client, request) -> float:
        started = time.perf_counter()
        answer = client.post("/api/generate", json=request)
        seconds = time.perf_counter() - started
        if answer.status_code != 200:
            raise RuntimeError(answer.text)
        if "format" in request:
            json.loads(answer.json()["response"])  # it parses
        return seconds

    for _ in range(rounds):
        for first in ("json", "free"):
            with ServeProcess(models, {"DGEMMA_NOPRUNE": "1"}) as server, \
                    httpx.Client(base_url=server.url, timeout=3600) as client:
                out[f"{first} first"].append(ask(client, json_body if first == "json" else body))
                if first == "json":
                    out["free warm"].append(ask(client, body))
                    out["json warm"].append(ask(client, json_body))
    return out


def first_request_main(args) -> int:
    gguf = build_model(args.outtype, args.threads)
    report: dict = {"cpu": common.cpu_description(), "model": str(gguf), "steps": args.steps, "runs": args.runs}
    print(report["cpu"])
    with tempfile.TemporaryDirectory() as tmp:
        models = Path(tmp) / "models"
        created = dgemma_create(models, gguf)
        print("\n".join(created.pop("lines")))
        again = dgemma_create(models, gguf)  # the file is there: the step only finds it
        again.pop("lines")
        report["create"] = {"first": created, "again": again}
        print(f"dgemma create: {created['create_s']:.2f} s, of which compiling structured output "
              f"{created['compile_s']:.2f} s; again (cached) {again['create_s']:.2f} s, that step "
              f"{again['compile_s']:.2f} s")
        cached = sorted((models / "cache" / "automata").rglob("*.npz"))
        print("cache files:", ", ".join(f"{p.stat().st_size / 2**20:.1f} MiB" for p in cached))
        times = first_requests(models, args.runs, args.steps)
    report["request_s"] = times
    medians = {label: statistics.median(t) for label, t in times.items()}
    report["median_s"] = medians
    print(f"\nfirst request after a fresh `dgemma serve` (model load included; C = {CANVAS}, {args.steps} steps, "
          f"medians of {args.runs}, interleaved)")
    for label, seconds in medians.items():
        print(f"  {label:12s} {seconds:7.2f} s   {' '.join(f'{t:.2f}' for t in times[label])}")
    print(f"  added by format json to the first request: {medians['json first'] - medians['free first']:+.2f} s; "
          f"warm, per canvas: {medians['json warm'] - medians['free warm']:+.2f} s")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--outtype", default="q8_0")
    parser.add_argument("--skip-reference", action="store_true")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--first-request", action="store_true",
                        help="time `dgemma create` and the first request after a start, with and without format json")
    args = parser.parse_args()
    if args.first_request:
        return first_request_main(args)

    from dgemma_engine import constrained
    from dgemma_engine.generate import SamplerParams
    from dgemma_engine.model import Context, Model
    from dgemma_engine.tokenizer import Tokenizer

    gguf = build_model(args.outtype, args.threads)
    report: dict = {"cpu": common.cpu_description(), "model": str(gguf), "steps": args.steps, "runs": args.runs}
    print(report["cpu"])
    with tempfile.TemporaryDirectory() as tmp:
        compiles = asyncio.run(compile_times(gguf, Path(tmp) / "cache"))
    automata = {"json": compiles["json, cold"].pop("automaton"),
                "6-field schema": compiles["6-field schema, cold"].pop("automaton")}
    for row in compiles.values():
        row.pop("automaton", None)
    report["compile"] = compiles
    for label, row in compiles.items():
        extra = f"  child CPU {row['child_cpu_s']:6.2f} s  {row['states']} states {row['edges']:,} edges" \
            if "child_cpu_s" in row else ""
        print(f"{label:40s} {row['wall_s']:7.2f} s{extra}")
    for label, automaton in automata.items():  # the decoder's index alone, on a fresh copy of the automaton
        fresh = dataclasses.replace(automaton)
        started = time.perf_counter()
        index = constrained.decode_index(fresh)
        seconds = time.perf_counter() - started
        report.setdefault("index", {})[label] = {
            "build_s": seconds, "runs": len(index.run_src), "sets": index.n_sets, "large_sets": len(index.big_tokens),
            "small_set_tokens": int(len(index.small_tokens))}
        print(f"decoder index, {label:26s} {seconds:7.2f} s  {len(index.run_src)} runs, {index.n_sets} token sets "
              f"({len(index.big_tokens)} large, {len(index.small_tokens):,} tokens in the small ones)")

    model = Model.load(str(gguf), threads=args.threads)
    tokenizer = Tokenizer.from_metadata(model.metadata)
    prompt = tokenizer.encode("Answer in JSON.")
    params = replace(SamplerParams.from_metadata(model.metadata, seed=0), max_steps=args.steps)
    C, V = model.hparams.canvas_length, model.hparams.n_vocab
    assert (C, V) == (CANVAS, VOCAB), (C, V)
    times: dict[str, list[float]] = {"free": [], **{label: [] for label in automata}}
    commits: dict[str, list[float]] = {label: [] for label in automata}
    last: dict = {}
    with Context(model, n_ctx=len(prompt) + 2 * C, threads=args.threads) as ctx:
        one_canvas(ctx, model, tokenizer, prompt, params, 0, args.threads)  # warm-up
        for seed in range(args.runs):
            times["free"].append(one_canvas(ctx, model, tokenizer, prompt, params, seed, args.threads)[0])
            for label, automaton in automata.items():
                seconds, constraint = one_canvas(ctx, model, tokenizer, prompt, params, seed, args.threads, automaton)
                times[label].append(seconds)
                commits[label].append(constraint.commit_s)
                last[label] = constraint
        if not args.skip_reference:  # the "before": one canvas per format with the plain program
            fast = constrained.best_canvas
            constrained.best_canvas = constrained.best_canvas_reference
            try:
                before = {label: one_canvas(ctx, model, tokenizer, prompt, params, 0, args.threads, automaton)[0]
                          for label, automaton in automata.items()}
            finally:
                constrained.best_canvas = fast
    model.close()

    free = statistics.median(times["free"])
    report["canvas_s"] = {label: statistics.median(t) for label, t in times.items()}
    report["canvas_s_all"] = times
    print(f"\none canvas (C = {C}, V = {V:,}, {args.steps} steps, {args.threads} threads; medians of {args.runs})")
    print(f"  no format          {free:7.3f} s")
    for label in automata:
        median = report["canvas_s"][label]
        print(f"  {label:18s} {median:7.3f} s  added {median - free:+.3f} s per canvas "
              f"(the commit itself {statistics.median(commits[label]):.3f} s)")
        report.setdefault("added_s", {})[label] = median - free
        report.setdefault("commit_s", {})[label] = statistics.median(commits[label])
    if not args.skip_reference:
        print("  before (the plain program, seed 0):")
        for label, seconds in before.items():
            print(f"  {label:18s} {seconds:7.3f} s  added {seconds - times['free'][0]:+.3f} s "
                  f"(against seed 0 without a format)")
        report["before_canvas_s"] = before

    print("\nthe decode alone, on the last constrained canvas's logits")
    for label, constraint in last.items():
        automaton = automata[label]
        args_ = (constraint.logits, automaton, constraint.state_before, constraint.tokens_after)
        fast_s = []
        for _ in range(5):
            started = time.perf_counter()
            got = constrained.best_canvas(*args_)
            fast_s.append(time.perf_counter() - started)
        row = {"fast_s": statistics.median(fast_s)}
        line = f"  {label:18s} fast {row['fast_s']:.3f} s"
        if not args.skip_reference:
            started = time.perf_counter()
            expected = constrained.best_canvas_reference(*args_)
            row["reference_s"] = time.perf_counter() - started
            row["same_canvas"] = got == expected
            line += f"  plain program {row['reference_s']:.2f} s  same canvas: {row['same_canvas']}"
            if got != expected:
                print(line)
                print("MISMATCH", got, expected)
                return 1
        report.setdefault("decode", {})[label] = row
        print(line)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
