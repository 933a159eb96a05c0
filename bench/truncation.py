"""Time the server's chat truncation on long histories of short messages (docs/server.md, "Truncation").

    python bench/truncation.py [--counts 250,500,1000,2000,20000] [--limit 0.5]

In process, through the path `/api/chat` takes before any denoising (`prompts.ChatPrompt.ids`): the tiny fixture model
(tests/fixtures/tiny-a, converted to a temporary GGUF) loaded in the engine runner, its Gemma-4-style Jinja template
rendered in the budgeted sandbox and its tokenizer. Each chat is a system prompt, alternating user/assistant turns and
a latest user message, far beyond the 1,024-token window. Prints one JSON line per size and fails if 2,000 messages
take longer than `--limit` seconds (best of three runs).
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "tests" / "fixtures" / "tiny-a"


def chat(n: int) -> list[dict]:
    turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"short message number {i}"}
             for i in range(n - 2)]
    return [{"role": "system", "content": "You are brief."}, *turns, {"role": "user", "content": "And now?"}]


def load_runner(workdir: Path):
    from dgemma_cli.server.runner import EngineRunner
    from dgemma_convert import convert

    gguf = workdir / "tiny-a.gguf"
    convert(FIXTURE, gguf, "f32", threads=1)
    local = SimpleNamespace(name="tiny", gguf_path=gguf, template=None, config={}, parameters={})
    return EngineRunner(local, num_ctx=8192, threads=1)


def time_one(runner, messages: list[dict], repeats: int) -> tuple[float, int]:
    from dgemma_cli.server.prompts import ChatPrompt

    best, ids = float("inf"), []
    for _ in range(repeats):
        started = time.perf_counter()
        ids = ChatPrompt(messages).ids(runner, None, None)
        best = min(best, time.perf_counter() - started)
    return best, len(ids)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--counts", default="250,500,1000,2000,20000")
    ap.add_argument("--limit", type=float, default=0.5, help="seconds allowed for 2,000 messages")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    logging.getLogger("dgemma.server").setLevel(logging.ERROR)  # one truncation line per run is noise here

    with tempfile.TemporaryDirectory() as tmp:
        runner = load_runner(Path(tmp))
        try:
            results = {}
            for n in (int(c) for c in args.counts.split(",")):
                seconds, tokens = time_one(runner, chat(n), args.repeats)
                results[n] = seconds
                print(json.dumps({"messages": n, "seconds": round(seconds, 4), "prompt_tokens": tokens,
                                  "context_length": runner.context_length, "canvas_length": runner.canvas_length}))
        finally:
            runner.close()
    if 2000 in results and results[2000] >= args.limit:
        print(f"FAIL: 2,000 messages took {results[2000]:.3f} s (limit {args.limit} s)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
