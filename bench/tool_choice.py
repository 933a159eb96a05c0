"""`tool_choice: "required"` and a named function through `dgemma serve`, on random-weight fixture models: the share
of seeded requests whose answer is one call that parses and validates against the function's schema.

    python3 bench/tool_choice.py [--model tiny-a] [--seeds 200] [--steps 2] [--json out.json]

For each API (Chat Completions, Responses), each choice ("required" over two tools, the function `get_time` by name)
and each way of answering (whole, streamed): `--seeds` requests with seeds 0..N-1 through the real `openai` client
(tests/tool_choice_checks.py, what tests/test_tool_choice.py checks on fewer seeds). Also "none": the prompt's length
against the same request without tools. The model is random, so nothing but the constrained decoder makes its answer
a call. A failing request is listed with its seed; the exit status is 1 when any failed.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))
from common import cpu_description  # noqa: E402
from tool_choice_checks import (CHAT_TOOLS, SCHEMAS, chat_call, forced_choices, responses_call)  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-a", help="fixture under tests/fixtures")
    parser.add_argument("--seeds", type=int, default=200)
    parser.add_argument("--steps", type=int, default=2, help="PARAMETER diffusion_steps of the served model")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    import jsonschema
    import ollama
    import openai
    from dgemma_convert import convert
    from server_harness import ServeProcess

    rows, failures = [], []
    with tempfile.TemporaryDirectory() as folder:
        gguf = Path(folder) / f"{args.model}.gguf"
        convert(ROOT / "tests" / "fixtures" / args.model, gguf, "f32", threads=2)
        with ServeProcess(Path(folder) / "models", {"DGEMMA_NOPRUNE": "1"}) as server:
            setup = ollama.Client(host=server.url)
            setup.create(model="tiny", files={gguf.name: setup.create_blob(gguf)},
                         parameters={"diffusion_steps": args.steps})
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
            for api, call in (("chat", chat_call), ("responses", responses_call)):
                for label, choice, names in forced_choices(api):
                    for stream in (False, True):
                        good, started = 0, time.perf_counter()
                        for seed in range(args.seeds):
                            try:
                                name, arguments, rest = call(client, choice, seed, stream)
                                assert name in names and rest == "", (name, rest)
                                jsonschema.validate(json.loads(arguments), SCHEMAS[name])
                                good += 1
                            except Exception as exc:  # noqa: BLE001 - counted and listed, the run goes on
                                failures.append(f"{api} {label} stream={stream} seed={seed}: {exc!r}"[:300])
                        seconds = time.perf_counter() - started
                        rows.append({"api": api, "choice": label, "stream": stream, "requests": args.seeds,
                                     "valid_calls": good, "seconds": round(seconds, 1)})
                        print(f"{api:9} {label:8} {'stream' if stream else 'whole':6} {good}/{args.seeds} valid "
                              f"calls ({seconds:.1f} s)", flush=True)
            messages = [{"role": "user", "content": "Weather in Paris?"}]
            usage = {kind: client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, seed=0,
                                                          **extra).usage.prompt_tokens
                     for kind, extra in (("no tools", {}), ("tools", {"tools": CHAT_TOOLS}),
                                         ("none", {"tools": CHAT_TOOLS, "tool_choice": "none"}))}
            print("prompt tokens:", usage)
    print("cpu:", cpu_description())
    for failure in failures:
        print("FAILED", failure)
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "rows": rows, "prompt_tokens": usage,
                                         "failures": failures, "cpu": cpu_description()}, indent=1))
    return 1 if failures or usage["none"] != usage["no tools"] else 0


if __name__ == "__main__":
    sys.exit(main())
