"""Cost of `dgemma run --visual` per denoising step, on a real generation.

Streams one generation with preview chunks from the dgemma server at DGEMMA_HOST (or an in-process one), feeding the
live view a terminal-like console (output discarded), throttled as in the CLI and unthrottled (every step drawn).
Reports the server's step time and the view's handler time per step, so the overhead is a ratio on the same run.

    python bench/live_view_overhead.py MODEL [PROMPT] [--seed N]
"""
from __future__ import annotations

import argparse
import io
import time

from rich.console import Console

from dgemma_cli import wire
from dgemma_cli.local_server import connect
from dgemma_cli.live_view import LiveView


def run_once(client, model: str, prompt: str, seed: int, max_fps: float | None) -> dict:
    console = Console(file=io.StringIO(), force_terminal=True, width=120, height=40)
    body = wire.GenerateRequest(model=model, prompt=prompt, options={"seed": seed, "diffusion_preview": True})
    started = time.perf_counter()
    final = None
    with LiveView(console, max_fps=max_fps) as view:
        for chunk in client.generate_stream(body):
            if chunk.get("done"):
                final = chunk
            elif wire.progress_of(chunk) is not None:
                view.on_progress(wire.progress_of(chunk))
            else:
                view.on_text(chunk.get("response", ""), chunk.get("thinking", ""))
    wall = time.perf_counter() - started
    steps = max(1, view.steps_seen)
    eval_s = (final or {}).get("eval_duration", 0) / 1e9
    return {"steps": view.steps_seen, "frames": view.frames_drawn, "wall_s": wall,
            "step_ms": eval_s / steps * 1e3, "view_ms_per_step": view.handler_seconds / steps * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("prompt", nargs="?", default="Tell me a story about a lighthouse.")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    with connect() as client:
        client.generate({"model": args.model, "prompt": ""})  # load first: timings below are steps only
        for label, fps in (("throttled 12/s", 12.0), ("every step", None)):
            r = run_once(client, args.model, args.prompt, args.seed, fps)
            print(f"{label:>15}: {r['steps']} steps, {r['frames']} frames, server step {r['step_ms']:.2f} ms, "
                  f"view {r['view_ms_per_step']:.3f} ms/step ({100 * r['view_ms_per_step'] / max(r['step_ms'], 1e-9):.1f}% "
                  f"of a step)")


if __name__ == "__main__":
    main()
