"""Helpers for the server tests: a controllable fake runner, fake models in a tmp store, and two ways to run the
server (in-process uvicorn thread for fault injection; `dgemma serve` subprocess for client conformance)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from dgemma_engine.events import CanvasEvent, DoneEvent, GenerationStats, StepEvent

REPO = Path(__file__).resolve().parent.parent
TOKEN_OFFSET = 1000  # fake token id = ord(char) + offset, clear of the stop ids {1, 50, 106}
FAKE_IMAGE_MARKER = "\u25a3"  # the fake runner's image token: one character, shown in `last_prompt`
EOS = 1


@dataclass
class FakeBehaviour:
    """Knobs shared by every runner a factory makes (tests flip them while the server runs)."""

    answer: str = "The quick brown fox jumps over the lazy dog."
    steps: int = 3
    step_delay: float = 0.0
    load_delay: float = 0.0
    canvas_length: int = 8
    crash_at_step: int | None = None
    has_thinking: bool = True
    tools: bool = True  # the fake template renders tools (Gemma 4's call syntax is parsed from `answer`)
    loads: int = 0
    closes: int = 0
    generations: int = 0
    cancelled_at: list[float] = field(default_factory=list)  # saw the cancel flag between steps
    finished_at: list[float] = field(default_factory=list)  # the generation loop ended (any way)
    loaded_at: list[float] = field(default_factory=list)
    last_prompt: list[str] = field(default_factory=list)
    last_sampler: list[Any] = field(default_factory=list)
    last_images: list[list] = field(default_factory=list)  # the images each generation received
    image_positions: int = 18  # a model with a projector: 16 soft tokens + boi + eoi per image


class FakeRunner:
    """One character per token; each canvas commits `canvas_length` characters of `answer`, then EOS."""

    def __init__(self, behaviour: FakeBehaviour, local_model: Any, num_ctx: int):
        self.b = behaviour
        if behaviour.load_delay:
            time.sleep(behaviour.load_delay)
        behaviour.loads += 1
        behaviour.loaded_at.append(time.perf_counter())
        self.canvas_length = behaviour.canvas_length
        self.context_length = num_ctx
        self.size = 1234
        self.size_vram = 0
        self.special_tokens = None
        self.metadata: dict[str, Any] = {"general.architecture": "diffusion-gemma"}
        self.has_thinking = behaviour.has_thinking
        from dgemma_engine.chat.tool_calls import FORMATS

        self.tool_format = FORMATS[0] if behaviour.tools else None
        # vision as a model with a projector has it: one marker character (one fake token) per image
        vision = getattr(local_model, "projector", None) is not None
        self.image_marker = FAKE_IMAGE_MARKER if vision else None
        self.image_token_id = ord(FAKE_IMAGE_MARKER) + TOKEN_OFFSET if vision else None
        self.image_positions = behaviour.image_positions if vision else 0
        self.renders_image_parts = False

    def render_chat(self, messages: list[dict], think: bool | None, tools: list[dict] | None = None) -> str:
        """`<role>content` per message (a call in history as `<call:NAME>`, a tool result's name as `<tool:NAME>`),
        the offered tools' names first."""
        text = "".join(f"<tools:{t.get('function', t).get('name')}>" for t in tools or [])
        for m in messages:
            role = f"tool:{m['name']}" if m["role"] == "tool" and m.get("name") else m["role"]
            text += f"<{role}>{m.get('content', '')}"
            text += "".join(f"<call:{c['function']['name']}>" for c in m.get("tool_calls") or [])
        return text + ("<think>" if think else "") + "<assistant>"

    def tokenize(self, text: str) -> list[int]:
        return [ord(c) + TOKEN_OFFSET for c in text]

    def detokenize(self, ids: list[int]) -> str:
        return "".join(chr(i - TOKEN_OFFSET) for i in ids if i >= TOKEN_OFFSET)

    def generate(self, prompt_ids, sampler, max_new_tokens, cancel, constraint=None, images=None):
        self.b.last_images.append(list(images or []))
        try:
            yield from self._generate(prompt_ids, sampler, max_new_tokens, cancel)
        finally:
            self.b.finished_at.append(time.perf_counter())

    def _generate(self, prompt_ids, sampler, max_new_tokens, cancel):
        b = self.b
        b.generations += 1
        b.last_prompt.append(self.detokenize(prompt_ids))
        b.last_sampler.append(sampler)
        C = self.canvas_length
        answer = [ord(c) + TOKEN_OFFSET for c in b.answer] + [EOS]
        started = time.perf_counter()
        committed = 0
        steps_per_canvas = []
        for canvas in range(max_new_tokens // C):
            ids = answer[canvas * C : (canvas + 1) * C]
            ids += [0] * (C - len(ids))
            for step in range(sampler.max_steps if b.steps is None else min(b.steps, sampler.max_steps)):
                if cancel is not None and cancel.is_set():
                    b.cancelled_at.append(time.perf_counter())
                    yield DoneEvent("cancelled", self._stats(prompt_ids, started, steps_per_canvas, committed))
                    return
                if b.crash_at_step is not None and step == b.crash_at_step:
                    raise RuntimeError("simulated native crash in /secret/path/engine.c")
                if b.step_delay:
                    time.sleep(b.step_delay)
                yield StepEvent(canvas, step + 1, sampler.max_steps, ids, 0.5, 1)  # steps are 1-based
            steps_per_canvas.append(step + 1)
            text_ids = ids[: ids.index(EOS)] if EOS in ids else ids  # as the contract: ids stop before EOS
            committed += len(text_ids)
            yield CanvasEvent(canvas, text_ids, self.detokenize(text_ids), step + 1)
            if EOS in ids:
                yield DoneEvent("eos", self._stats(prompt_ids, started, steps_per_canvas, committed))
                return
        yield DoneEvent("length", self._stats(prompt_ids, started, steps_per_canvas, committed))

    def _stats(self, prompt_ids, started, steps_per_canvas, committed) -> GenerationStats:
        elapsed = time.perf_counter() - started
        return GenerationStats(len(prompt_ids), 0.001, len(steps_per_canvas), steps_per_canvas, committed, elapsed,
                               committed / elapsed if elapsed else 0.0)

    def close(self) -> None:
        self.b.closes += 1


class FakeFactory:
    """Makes FakeRunners that share one FakeBehaviour."""

    def __init__(self, behaviour: FakeBehaviour):
        self.behaviour = behaviour

    def __call__(self, local_model: Any, num_ctx: int) -> FakeRunner:
        return FakeRunner(self.behaviour, local_model, num_ctx)


def fake_factory(behaviour: FakeBehaviour) -> FakeFactory:
    return FakeFactory(behaviour)


class FakeSchemaCompiler:
    """The schema compiler of a server with fake runners: their answers are scripted, so a format is accepted and
    ignored (the fake models' GGUFs have no vocabulary that could write JSON)."""

    async def automaton(self, gguf_path, schema):
        return {"schema": schema}

    async def vocabulary(self, gguf_path):
        return None  # none: a format built over the vocabulary (a required tool call) is a stand-in too

    def precompile(self, model) -> None:
        pass

    def with_store_compile(self, produce, stored_gguf):
        return produce

    async def close(self) -> None:
        pass


# ---- models in a tmp store ------------------------------------------------------------------------------------------

SMALL_GGUF_MAX_STEPS = 12  # the small GGUF's default step count, which requests without diffusion_steps get


def write_small_gguf(path: Path, arch: str = "diffusion-gemma", chat_template: str | None = None) -> Path:
    """A loadable tiny GGUF (store checks, `/api/show`, `create`): canvas 8, context 4096, 12 steps."""
    from store_helpers import write_tiny_gguf

    return write_tiny_gguf(path, arch, canvas_length=8, chat_template=chat_template, context_length=4096,
                           eb_max_steps=SMALL_GGUF_MAX_STEPS)


def add_model(store, name: str, gguf: Path, parameters: dict | None = None, system: str | None = None,
              family: str = "diffusion-gemma", template: str | None = None) -> None:
    """Register `gguf` under `name` directly through the store API (no create pipeline needed)."""
    from dgemma_cli.store import (CONFIG_MEDIA_TYPE, MEDIA_MODEL, MEDIA_PARAMS, MEDIA_SYSTEM, MEDIA_TEMPLATE, Layer,
                                  build_manifest, canonical_json)

    digest, size, _ = store.import_file(gguf)
    layers = [Layer(MEDIA_MODEL, digest, size)]
    if parameters:
        layers.append(Layer(MEDIA_PARAMS, *store.write_blob(canonical_json(parameters))))
    if system:
        layers.append(Layer(MEDIA_SYSTEM, *store.write_blob(system.encode())))
    if template:
        layers.append(Layer(MEDIA_TEMPLATE, *store.write_blob(template.encode())))
    config = {"model_format": "gguf", "model_family": family, "model_families": [family], "model_type": "136",
              "file_type": "F32", "architecture": "amd64", "os": "linux"}
    if template:
        config["template_format"] = "jinja"  # as create marks Jinja templates (docs/compat.md#template-policy)
    config_digest, config_size = store.write_blob(canonical_json(config))
    store.write_manifest(name, build_manifest(Layer(CONFIG_MEDIA_TYPE, config_digest, config_size), layers))


def add_vision_model(store, name: str, gguf: Path, projector: Path) -> None:
    """Register `gguf` with a vision projector layer (`store_helpers.write_tiny_projector`) under `name`."""
    from dgemma_cli.store import (CONFIG_MEDIA_TYPE, MEDIA_MODEL, MEDIA_PROJECTOR, Layer, build_manifest,
                                  canonical_json)

    digest, size, _ = store.import_file(gguf)
    proj_digest, proj_size, _ = store.import_file(projector)
    layers = [Layer(MEDIA_MODEL, digest, size), Layer(MEDIA_PROJECTOR, proj_digest, proj_size)]
    config = {"model_format": "gguf", "model_family": "diffusion-gemma", "model_families": ["diffusion-gemma"]}
    config_digest, config_size = store.write_blob(canonical_json(config))
    store.write_manifest(name, build_manifest(Layer(CONFIG_MEDIA_TYPE, config_digest, config_size), layers))


# ---- running the server -------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_up(url: str, timeout: float = 20.0, process: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=1.0) as client:
        while time.monotonic() < deadline:
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"dgemma serve exited with {process.returncode}")
            try:
                if client.head(url + "/").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.02)
    raise RuntimeError("server did not come up")


class InProcessServer:
    """create_app(...) served by uvicorn in a background thread on a free loopback port."""

    def __init__(self, config, store, runner_factory):
        import uvicorn

        from dgemma_cli.server.app import create_app

        self.port = free_port()
        config.host = type(config.host)("http", "127.0.0.1", self.port)
        self.url = f"http://127.0.0.1:{self.port}"
        schemas = FakeSchemaCompiler() if isinstance(runner_factory, FakeFactory) else None
        self.app = create_app(config, store, runner_factory, schemas)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "InProcessServer":
        self.thread.start()
        wait_until_up(self.url)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


class ServeProcess:
    """`python -m dgemma_cli.main serve` with DGEMMA_HOST on a free loopback port and the given environment."""

    def __init__(self, models_dir: Path, extra_env: dict[str, str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**os.environ, "DGEMMA_HOST": f"127.0.0.1:{self.port}", "DGEMMA_MODELS": str(models_dir),
                    "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), **(extra_env or {})}
        for var in ("DGEMMA_API_KEY", "OLLAMA_HOST", "OLLAMA_API_KEY"):
            if extra_env is None or var not in extra_env:
                self.env.pop(var, None)
        self.log_path = models_dir.parent / f"serve-{self.port}.log"
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> "ServeProcess":
        self.log = open(self.log_path, "wb")
        self.process = subprocess.Popen([sys.executable, "-m", "dgemma_cli.main", "serve"], env=self.env,
                                        stdout=self.log, stderr=subprocess.STDOUT, cwd=str(REPO))
        try:
            wait_until_up(self.url, timeout=60, process=self.process)
        except RuntimeError:
            self.__exit__()
            raise RuntimeError("dgemma serve did not start:\n" + self.log_path.read_text(errors="replace"))
        return self

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")

    def __exit__(self, *exc) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


def ndjson(response: httpx.Response) -> list[dict]:
    return [json.loads(line) for line in response.text.splitlines() if line.strip()]
