"""The Vercel AI SDK's default OpenAI provider (`@ai-sdk/openai`, Responses API, `store: true`) against `dgemma serve`.

    (cd bench/clients/vercel && npm install) && python bench/clients/vercel_ai_sdk.py

A check rather than a timing: the client needs Node, so it lives here and not in the pytest suite. It converts the
tiny-a fixture, serves it on a loopback port, and runs bench/clients/vercel/check.mjs: a second turn (earlier items
sent as `item_reference`s), the same streamed, and a two-step tool loop (`toolChoice: "required"`, then `"none"`).
Exits with the script's status; prints its JSON lines.
"""
from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

from server_harness import ServeProcess  # noqa: E402

SCRIPT_DIR = Path(__file__).resolve().parent / "vercel"


def main() -> int:
    import httpx

    from dgemma_convert import convert

    if not (SCRIPT_DIR / "node_modules" / "@ai-sdk" / "openai").is_dir():
        print(f"run `npm install` in {SCRIPT_DIR} first", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        gguf = root / "tiny-a.gguf"
        convert(REPO / "tests" / "fixtures" / "tiny-a", gguf, "f32", threads=2)
        with ServeProcess(root / "models", {"DGEMMA_NOPRUNE": "1"}) as server:
            with httpx.Client(base_url=server.url, timeout=120) as http:
                digest = "sha256:" + __import__("hashlib").sha256(gguf.read_bytes()).hexdigest()
                http.post(f"/api/blobs/{digest}", content=gguf.read_bytes()).raise_for_status()
                http.post("/api/create", json={"model": "tiny", "files": {"tiny-a.gguf": digest},
                                               "parameters": {"diffusion_steps": 4}, "stream": False}
                          ).raise_for_status()
            proc = subprocess.run(["node", "check.mjs", server.url, "tiny"], cwd=SCRIPT_DIR, text=True,
                                  capture_output=True, timeout=600)
            print(proc.stdout, end="")
            if proc.returncode != 0:
                print(proc.stderr, file=sys.stderr)
                print(server.logs()[-3000:], file=sys.stderr)
            return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
