"""instructor's TOOLS mode (`tool_choice` names the function), unchanged, against `dgemma serve` on the random-weight
tiny-a model: every answer must be a call that validates as the response model.

    pip install --no-deps instructor docstring-parser && python bench/clients/instructor_tools.py [--seeds 20]

A script rather than a test: instructor 1.17 pins `jiter<0.15` while the openai client the suite pins needs
`jiter>=0.16`, so the test extra cannot hold both; with `--no-deps` instructor runs on the newer jiter. Prints one line
per request and a summary; exits non-zero unless every answer validated.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

from server_harness import ServeProcess  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    import instructor
    import ollama
    import openai
    from pydantic import BaseModel, Field

    from dgemma_convert import convert

    class Weather(BaseModel):  # no numeric bounds: structured output does not enforce them (docs/generation.md)
        city: str = Field(max_length=20)
        days: int

    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--seeds", type=int, default=20)
    seeds = args.parse_args(argv).seeds
    valid = 0
    with tempfile.TemporaryDirectory() as tmp:
        gguf = Path(tmp) / "tiny-a.gguf"
        convert(REPO / "tests" / "fixtures" / "tiny-a", gguf, "f32", threads=2)
        with ServeProcess(Path(tmp) / "models", {"DGEMMA_NOPRUNE": "1"}) as server:
            setup = ollama.Client(host=server.url)
            setup.create(model="tiny", files={"tiny-a.gguf": setup.create_blob(gguf)}, parameters={"diffusion_steps": 2})
            client = instructor.from_openai(openai.OpenAI(base_url=server.url + "/v1", api_key="unused",
                                                          max_retries=0), mode=instructor.Mode.TOOLS)
            for seed in range(seeds):
                try:
                    weather = client.chat.completions.create(
                        model="tiny", response_model=Weather, max_retries=0, max_tokens=64, seed=seed,
                        messages=[{"role": "user", "content": "Paris, 3 days?"}])
                    valid += 1
                    print(f"seed {seed}: {weather!r}")
                except Exception as exc:  # noqa: BLE001 - counted and shown
                    print(f"seed {seed}: FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
    print(f"instructor TOOLS mode: {valid}/{seeds} answers validated")
    return 0 if valid == seeds else 1


if __name__ == "__main__":
    sys.exit(main())
