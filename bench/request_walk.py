"""Walk one `/api/chat` request from its route to the denoising loop, as a reader of the code would follow it.

    python bench/request_walk.py [--endpoint /api/chat] [--show]

It serves the tiny-a fixture (converted to F32) in-process with the real runner, sends one non-streaming request, and
profiles every thread while the request runs. The reader's position is the product file of the innermost frame that
is one of the request path's files (the server's modules, the chat-template selection and the engine's generation
loop). Each change of position is a *stop*; a stop at a file that was visited and left before is a *return*. The
walk ends when the denoising loop (`dgemma_engine.generate.generate`) first runs. Run it on two checkouts (put each on
PYTHONPATH through a shim of the import names) to compare their shapes.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

# the files a request passes through on its way to the loop, by path suffix (so the script reads any checkout)
PATH_FILES = ("dgemma_cli/server/", "chat/templates.py", "chat/gotemplate.py")
LOOP = ("generate.py", "generate")  # (file suffix, function): where the walk ends


def on_path(filename: str) -> str | None:
    name = filename.replace("\\", "/")
    for marker in PATH_FILES:
        at = name.rfind(marker)
        if at >= 0:
            return name[at:] if marker.endswith("/") else marker
    return None


class Walk:
    """Stops in order: each call from one path file into another (a coroutine resumed at an `await` is not a call);
    a *return* is a stop at a file the walk has been to before. Coming back from a call is not counted: the reader
    just reads on where they were."""

    def __init__(self, route: str):
        self.route = route  # the route handler's function name: the walk starts when it is called
        self.stops: list[str] = []
        self.names: list[str] = []  # the function called at each stop
        self.started = False
        self.done = threading.Event()
        self.lock = threading.Lock()
        self.active = False
        self.frames: set[int] = set()  # frames seen starting (a later "call" of one is a resumption)
        self.keep: list = []  # keeps those frames alive, so that their ids stay unique during the walk

    def profile(self, frame, event, arg):
        if not self.active or self.done.is_set() or event != "call":
            return
        code = frame.f_code
        with self.lock:
            if event == "call":
                if id(frame) in self.frames:
                    return  # a coroutine or generator resumed
                self.frames.add(id(frame))
                self.keep.append(frame)
                if code.co_name == LOOP[1] and code.co_filename.endswith(LOOP[0]) and "dgemma_cli" not in code.co_filename:
                    self.done.set()
                    return
                where = on_path(code.co_filename)
                if not self.started:
                    if code.co_name != self.route or where is None:
                        return
                    self.started = True
                    self.stops.append(where)
                    self.names.append(code.co_name)
                elif where is not None and where != (position(frame.f_back) or self.stops[-1]):
                    self.stops.append(where)  # (a task or thread the walk starts goes on where the reader is)
                    self.names.append(code.co_name)

    def summary(self) -> dict:
        seen: set[str] = set()
        returns = 0
        for where in self.stops:
            returns += where in seen
            seen.add(where)
        visits: dict[str, int] = {}
        for where in self.stops:
            visits[where] = visits.get(where, 0) + 1
        return {"stops": len(self.stops), "returns": returns, "files": len(seen),
                "visits": dict(sorted(visits.items(), key=lambda kv: -kv[1])), "walk": [f"{where}:{name}" for where, name in zip(self.stops, self.names)],
                "reached_loop": self.done.is_set()}


def position(frame) -> str | None:
    """The path file of the innermost frame on the stack that is in one (None: called from elsewhere)."""
    while frame is not None:
        where = on_path(frame.f_code.co_filename)
        if where is not None:
            return where
        frame = frame.f_back
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--endpoint", default="/api/chat", choices=["/api/chat", "/api/generate",
                                                                    "/v1/chat/completions"])
    parser.add_argument("--show", action="store_true", help="print the walk, one stop a line")
    args = parser.parse_args(argv)

    import httpx
    from server_harness import InProcessServer, add_model

    from dgemma_cli.server.config import ServerConfig
    from dgemma_cli.store import Store
    from dgemma_convert.converter import convert

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        gguf = root / "tiny-a.gguf"
        convert(REPO / "tests" / "fixtures" / "tiny-a", gguf, "f32")
        store = Store(root / "models")
        add_model(store, "tiny", gguf)
        config = ServerConfig.from_env({"DGEMMA_MODELS": str(store.root)})
        from dgemma_cli.server.app import EngineRunner

        messages = [{"role": "user", "content": "Hello"}]
        options = {"num_predict": 8, "diffusion_steps": 2, "seed": 1}
        bodies = {
            "/api/chat": {"model": "tiny", "messages": messages, "options": options, "stream": False},
            "/api/generate": {"model": "tiny", "prompt": "Hello", "options": options, "stream": False},
            "/v1/chat/completions": {"model": "tiny", "messages": messages, "max_tokens": 8, "seed": 1},
        }
        walk = Walk(route={"/api/chat": "chat", "/api/generate": "generate",
                          "/v1/chat/completions": "chat_completions"}[args.endpoint])
        threading.setprofile(walk.profile)  # every thread the server starts from here on (loop, workers)
        try:
            with InProcessServer(config, store, EngineRunner) as server, \
                    httpx.Client(base_url=server.url, timeout=120) as client:
                client.post("/api/generate", json={"model": "tiny"}).raise_for_status()  # loaded: no load in the walk
                client.post(args.endpoint, json=bodies[args.endpoint]).raise_for_status()  # warm: lazy imports done
                walk.active = True
                client.post(args.endpoint, json=bodies[args.endpoint]).raise_for_status()
                walk.active = False
        finally:
            threading.setprofile(None)
    report = walk.summary()
    if not args.show:
        report.pop("walk")
    print(json.dumps(report, indent=2))
    return 0 if report["reached_loop"] else 1


if __name__ == "__main__":
    sys.exit(main())
