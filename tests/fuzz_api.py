"""A bounded, seeded fuzz run against `dgemma serve` (issue 14): hostile API requests and mutated GGUF uploads.

    python tests/fuzz_api.py --cases 1000 [--seed 1] [--time-budget 900]

Starts `dgemma serve` as a subprocess on a loopback port (tests/server_harness.py ServeProcess) with the tiny
fixture model, then sends `cases` requests built from a valid body of every endpoint by one to three random
mutations (wrong types, huge numbers, surrogates, NULs, deep nesting, long strings, random keys, absurd options, bad
names and digests, JSON schemas whose compile never ends), absurd load-time options (num_thread 1000, num_ctx 0, …)
and settings a Modelfile refuses (role "wizard", a 10,000-character `requires`) at create and per request, which
must be a 4xx that stores nothing, plus mutated GGUFs (tests/gguf_mutator.py and random
byte corruption) uploaded with /api/blobs and used by /api/create, and hostile images (tests/image_samples.py) on
every API. It checks that
- no answer is a 5xx (nor a streamed `internal server error`), and every request is answered within a deadline;
- a generation whose format is a hostile schema (tests/json_schemas.py) gets a 4xx within the compile limit + slack;
- the server process stays alive (no signal, no exit);
- every model that create accepted and that still exists answers a generate with 200;
- the store is consistent at the end: every blob a manifest names exists, and no blob is left that nothing
  references other than uploads no model used (create over a model, copy over it and delete prune what only the old
  manifest had; DGEMMA_NOPRUNE=1 turns off only the startup prune, which has nothing to do in a fresh store).
Nothing leaves the machine: the server only listens on 127.0.0.1 and pulls can only name loopback hosts (a default
registry name would go to a closed loopback port). tests/test_fuzz_api.py runs a small size in CI.
"""
from __future__ import annotations

import argparse
import base64
import copy
import hashlib
import json
import random
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

import image_samples  # noqa: E402
from gguf_mutator import MUTANTS, PROJECTOR_MUTANTS, mutate  # noqa: E402
from json_schemas import HOSTILE_SCHEMAS, SCHEMAS  # noqa: E402
from server_harness import ServeProcess, free_port  # noqa: E402
from store_helpers import write_tiny_projector  # noqa: E402

FIXTURE = TESTS / "fixtures" / "tiny-a"
BASE_MODEL = "tiny"
# Small caps keep every generation short, so the run is bounded by the number of cases.
COMPILE_LIMIT_S = 1.0
SERVER_ENV = {"DGEMMA_NOPRUNE": "1", "DGEMMA_MAX_STEPS": "6", "DGEMMA_MAX_CANVASES": "2",
              "DGEMMA_PULL_RETRIES": "0", "DGEMMA_PULL_BACKOFF": "0",
              "DGEMMA_SCHEMA_COMPILE_TIMEOUT": f"{COMPILE_LIMIT_S:g}"}
HOSTILE_ANSWER_S = COMPILE_LIMIT_S + 8.0  # the compile child runs at the lowest priority on a shared machine
SMOKE_OPTIONS = {"num_predict": 16, "diffusion_steps": 2, "seed": 1}
MIRRORED_HOSTS = ("registry.ollama.ai", "hf.co", "huggingface.co")
# 5xx answers that are the contract, not a fault: push is not implemented; an unreachable registry is a bad gateway.
DOCUMENTED_5XX = {("/api/push", 501), ("/api/pull", 502), ("/api/create", 502)}


# ---- hostile values ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Raw:
    """JSON text put into the body as it is (numbers no float holds, nesting deeper than json.dumps can write)."""

    text: str


def encode(body: Any) -> bytes:
    """The body as JSON bytes; strings keep lone surrogates as `\\udfff` escapes, `Raw` values go in verbatim."""
    raws: list[str] = []

    def swap(value: Any) -> Any:
        if isinstance(value, Raw):
            raws.append(value.text)
            return f"\x00raw{len(raws) - 1}\x00"
        if isinstance(value, dict):
            return {swap(k) if isinstance(k, str) else k: swap(v) for k, v in value.items()}
        if isinstance(value, list):
            return [swap(v) for v in value]
        return value

    text = json.dumps(swap(body))  # ensure_ascii: surrogates and NULs become escapes
    for index, raw in enumerate(raws):
        text = text.replace(json.dumps(f"\x00raw{index}\x00"), raw)
    return text.encode()


NAMES = ["", " ", "a/b/c/d/e", "../../etc/passwd", "x:y:z", "tiny\x00", "\x00", "ti\udfffny", "TINY:LATEST",
         "fz-model", "fz-other:v1", "fz/ns/name", "127.0.0.1:9/library/x", "sha256:" + "0" * 64, "a" * 300,
         "http://fz-model", "fz-model@sha256:00", "-", ".", "fz model", "fz-\u00e9t\u00e9", "fz-\U0001F600"]
# Long names: a host past a file name's 255 bytes (Ollama's grammar allows 350) is an invalid name on every route; the
# longest valid host is stored, copied and deleted like any other name.
LONG_NAMES = ["h" * 256 + "/ns/m", "h" * 300 + "/library/fz-model", "1" * 250 + ":11434/ns/m", "h" * 350 + "/ns/m:t",
              "h" * 255 + "/ns/fz-long", "h" * 255 + "/" + "n" * 80 + "/" + "m" * 80 + ":" + "t" * 80, "fz-" + "x" * 400]
NAMES += LONG_NAMES
DIGESTS = ["sha256:" + "0" * 64, "sha256:" + "g" * 64, "sha256:", "sha256-" + "1" * 64, "../x", "sha256:" + "a" * 63,
           "md5:" + "0" * 32, "", "sha256:" + "0" * 64 + "\x00", "sha256:" + "F" * 64]
KNOWN_OPTIONS = ["temperature", "num_predict", "top_p", "min_p", "top_k", "seed", "num_ctx", "stop", "num_thread",
                 "diffusion_steps", "diffusion_t_max", "diffusion_t_min", "diffusion_entropy_bound",
                 "diffusion_confidence_threshold", "diffusion_stability_threshold", "diffusion_progress",
                 "diffusion_preview", "repeat_penalty", "num_batch", "use_mmap", "mirostat", "num_gpu", "num_cpu_moe",
                 "main_gpu", "num_parallel"]


class Hostile:
    """Random hostile values from one seeded generator."""

    def __init__(self, rng: random.Random):
        self.rng = rng

    def number(self) -> Any:
        r = self.rng
        return r.choice([
            Raw("1" + "0" * r.choice([19, 20, 40, 400])), Raw("-" + "9" * r.choice([19, 30, 400])),
            Raw("1e400"), Raw("-1e400"), Raw("Infinity"), Raw("-Infinity"), Raw("NaN"), Raw("9" * 5000),
            2**63, 2**63 - 1, -(2**63), 2**64, 2**31, -(2**31) - 1, 0, -1, 1, -0.0, 1e-320, 3.5e38, 1e39, 1e308,
            0.5, 1e9, -1e9, r.randint(-1000, 1000), r.uniform(-10, 10),
        ])

    def text(self) -> str:
        r = self.rng
        kind = r.randrange(8)
        if kind == 0:
            return "a\udfffb"
        if kind == 1:
            return "x\x00y"
        if kind == 2:
            return r.choice(NAMES)
        if kind == 3:
            size = r.choice([1_000, 100_000, 600_000, 2_000_000])
            return r.choice("xyz <>{}%") * size
        if kind == 4:
            return "".join(chr(r.randrange(1, 0x2FFFF)) for _ in range(r.randrange(1, 64)))  # surrogates included
        if kind == 5:
            return r.choice(["{{ range(100000)|list|length }}", "{% for x in range(10**9) %}x{% endfor %}",
                             "{{ .Prompt }}{{ .System", "{{ messages[0].content }}", "<|channel>thought",
                             "{% raw %}", "%s%s%s%n", "\\u0000", "\r\n\t\x1b[31m"])
        if kind == 6:
            return str(self.rng.random())
        return ""

    def nested(self) -> Raw:
        depth = self.rng.choice([50, 99, 101, 500, 1000, 5000, 100_000])
        open_, close = self.rng.choice([("[", "]"), ('{"a":', "}")])
        return Raw(open_ * depth + ("1" if open_ == "[" else "1") + close * depth)

    def schema(self) -> Any:
        """A JSON schema for `format`: a hostile one (its compile never ends), or one the tests compile."""
        if self.rng.random() < 0.5:
            return copy.deepcopy(self.rng.choice(list(HOSTILE_SCHEMAS.values())))
        return copy.deepcopy(self.rng.choice([s for s in SCHEMAS.values() if s is not None]))

    def options(self) -> dict[str, Any]:
        return {self.rng.choice(KNOWN_OPTIONS): self.value(shallow=True) for _ in range(self.rng.randrange(1, 6))}

    def value(self, shallow: bool = False) -> Any:
        r = self.rng
        kind = r.randrange(9 if shallow else 11)
        if kind in (0, 1):
            return self.number()
        if kind in (2, 3):
            return self.text()
        if kind == 4:
            return r.choice([True, False, None])
        if kind == 5:
            return [self.text() for _ in range(r.randrange(0, 4))]
        if kind == 6:
            return {self.text()[:20]: self.number() for _ in range(r.randrange(0, 3))}
        if kind == 7:
            return [self.number() for _ in range(r.randrange(0, 4))]
        if kind == 8:
            return r.choice([[], {}, [[]], [{}], {"role": "user"}])
        if kind == 9:
            return self.nested()
        return self.options()


# ---- requests ------------------------------------------------------------------------------------------------------

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
PROJECTOR_CASE = "projector: "  # a GGUF case naming a PROJECTOR_MUTANTS entry: created with the base model
VISION_MODEL = "fz-vision"  # the base model with a projector layer (the smallest runnable projector)


def image_requests(rng: random.Random) -> list[tuple[str, str, Any]]:
    """Requests carrying hostile images (truncated, corrupt, a 50,000 x 50,000 header, ...) on every API, to the
    model with a projector (each must be a 400 before any load), and a valid image to the text-only base model."""
    hostile = [base64.b64encode(data).decode() for data in image_samples.hostile_images().values()]
    valid = base64.b64encode(image_samples.png()).decode()
    bad = rng.choice(hostile)
    url = "data:image/png;base64," + bad
    return [
        ("POST", "/api/generate", {"model": VISION_MODEL, "prompt": "Hi", "images": [bad], "stream": False}),
        ("POST", "/api/generate", {"model": BASE_MODEL, "prompt": "Hi", "images": [valid], "stream": False}),
        ("POST", "/api/chat", {"model": VISION_MODEL, "stream": False,
                               "messages": [{"role": "user", "content": "Hi", "images": [valid, bad]}]}),
        ("POST", "/v1/chat/completions", {"model": VISION_MODEL, "max_tokens": 16, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Hi"},
                                         {"type": "image_url", "image_url": {"url": url}}]}]}),
        ("POST", "/v1/responses", {"model": VISION_MODEL, "max_output_tokens": 16, "input": [
            {"role": "user", "content": [{"type": "input_image", "image_url": url}]}]}),
        *costly_image_requests(),
    ]


def costly_image_requests() -> list[tuple[str, str, Any]]:
    """Sixteen valid 5792 x 5792 white PNGs (112 KB each, seconds to decode): 16 x 66 positions cannot fit the
    model's 1024 whatever num_ctx says, so each is a 400 from the headers alone, before any pixel is decoded."""
    big = base64.b64encode(image_samples.big_white_png()).decode()
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + big}}
    return [
        ("POST", "/api/chat", {"model": VISION_MODEL, "stream": False, "options": {"num_ctx": 1_000_000},
                               "messages": [{"role": "user", "content": "Hi", "images": [big] * 16}]}),
        ("POST", "/v1/chat/completions", {"model": VISION_MODEL, "max_tokens": 16,
                                          "messages": [{"role": "user", "content": [part] * 16}]}),
    ]


def base_requests(gguf_digest: str) -> list[tuple[str, str, Any]]:
    """A valid request of every endpoint: (method, path, JSON body or None)."""
    gen = {"model": BASE_MODEL, "prompt": "Hi", "stream": False, "options": dict(SMOKE_OPTIONS)}
    return [
        ("POST", "/api/generate", gen),
        ("POST", "/api/generate", {**gen, "stream": True, "raw": True, "keep_alive": "5m"}),
        ("POST", "/api/chat", {"model": BASE_MODEL, "messages": MESSAGES, "stream": False,
                               "options": dict(SMOKE_OPTIONS)}),
        ("POST", "/api/chat", {"model": BASE_MODEL, "messages": MESSAGES, "stream": True, "think": False,
                               "options": dict(SMOKE_OPTIONS), "truncate": True}),
        ("POST", "/api/show", {"model": BASE_MODEL, "verbose": False}),
        ("POST", "/api/create", {"model": "fz-model", "from": BASE_MODEL, "system": "S", "stream": False,
                                 "parameters": {"seed": 3, "num_predict": 16}}),
        ("POST", "/api/create", {"model": "fz-files", "files": {"m.gguf": gguf_digest}, "stream": False,
                                 "template": "{{ messages[0].content }}"}),
        ("POST", "/api/copy", {"source": BASE_MODEL, "destination": "fz-copy"}),
        ("DELETE", "/api/delete", {"model": "fz-copy"}),
        ("POST", "/api/pull", {"model": "127.0.0.1:9/library/x", "stream": False, "insecure": True}),
        ("POST", "/api/embed", {"model": BASE_MODEL, "input": "x"}),
        ("POST", "/api/push", {"model": "fz-model"}),
        ("GET", "/api/tags", None), ("GET", "/api/ps", None), ("GET", "/api/version", None), ("GET", "/", None),
        ("POST", "/v1/chat/completions", {"model": BASE_MODEL, "messages": MESSAGES, "max_tokens": 16, "seed": 1}),
        ("POST", "/v1/chat/completions", {"model": BASE_MODEL, "messages": MESSAGES, "max_tokens": 16,
                                          "stream": True, "stream_options": {"include_usage": True}}),
        ("POST", "/v1/completions", {"model": BASE_MODEL, "prompt": "Hi", "max_tokens": 16, "temperature": 0}),
        ("POST", "/v1/embeddings", {"model": BASE_MODEL, "input": "x"}),
        ("GET", "/v1/models", None), ("GET", f"/v1/models/{BASE_MODEL}", None),
        ("HEAD", f"/api/blobs/{gguf_digest}", None),
    ]


NAME_FIELDS = ("model", "name", "from", "source", "destination")
PROTECTED = (BASE_MODEL, f"{BASE_MODEL}:latest", VISION_MODEL, f"{VISION_MODEL}:latest")


def _paths(body: Any, prefix: tuple = ()) -> list[tuple]:
    """Every key path into a body (dict keys and list indices)."""
    out = []
    if isinstance(body, dict):
        for key, value in body.items():
            out.append(prefix + (key,))
            out += _paths(value, prefix + (key,))
    elif isinstance(body, list):
        for index, value in enumerate(body):
            out.append(prefix + (index,))
            out += _paths(value, prefix + (index,))
    return out


def _set(body: Any, path: tuple, value: Any) -> None:
    for key in path[:-1]:
        body = body[key]
    body[path[-1]] = value


def mutate_body(rng: random.Random, hostile: Hostile, body: Any) -> Any:
    """One random mutation of a JSON body (a copy): a field's value, a removed or added key, or another body."""
    kind = rng.randrange(10)
    if kind == 0 or not isinstance(body, dict):
        return rng.choice([[], "x", 1, None, Raw("{"), Raw('{"model": "tiny",}'), Raw("\"\\udfff\""),
                           hostile.nested(), {"model": BASE_MODEL, **{hostile.text()[:30]: hostile.value()}}])
    body = copy.deepcopy(body)
    paths = _paths(body)
    if kind == 1 and paths:
        path = rng.choice(paths)
        parent = body
        for key in path[:-1]:
            parent = parent[key]
        if isinstance(parent, dict):
            parent.pop(path[-1], None)
        return body
    if kind == 2:
        body[hostile.text()[:40] or "k"] = hostile.value()
        return body
    if kind == 3:
        body["options"] = hostile.options()
        return body
    if kind == 4:
        field_name = rng.choice(NAME_FIELDS)
        body[field_name] = rng.choice(NAMES)
        return body
    if kind == 5:
        schema = hostile.schema()
        if "messages" in body and "think" not in body:  # an OpenAI chat completion
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "fuzz", "schema": schema}}
        else:
            body["format"] = schema
        return body
    if paths:
        _set(body, rng.choice(paths), hostile.value())
    return body


def hostile_generation(path: str, body: Any) -> bool:
    """Whether the body asks for a generation in a format whose compile never ends (its answer must be a 4xx)."""
    if not isinstance(body, dict):
        return False
    if path == "/v1/chat/completions":
        response_format = body.get("response_format")
        json_schema = response_format.get("json_schema") if isinstance(response_format, dict) else None
        schema = json_schema.get("schema") if isinstance(json_schema, dict) else None
    elif path in ("/api/generate", "/api/chat"):
        schema = body.get("format")
        text = body.get("prompt") if path == "/api/generate" else body.get("messages")
        if not text:  # no prompt: a load or unload, which ignores the format
            return False
    else:
        return False
    return any(schema == hostile for hostile in HOSTILE_SCHEMAS.values())


def _leaves_the_machine(name: Any) -> bool:
    """Whether a pull of `name` could reach a host other than loopback or the closed loopback mirrors."""
    from dgemma_cli.errors import DgemmaError
    from dgemma_cli.names import ModelName

    if not isinstance(name, str):
        return False
    try:
        host = ModelName.parse(name).host.lower()
    except DgemmaError:
        return False
    return host.rsplit(":", 1)[0] not in ("127.0.0.1", "localhost", *MIRRORED_HOSTS)


def is_safe(path: str, body: Any) -> bool:
    """Never delete or overwrite the base model; never name a registry a pull (or create's pull of a missing
    `from`) could reach off the machine."""
    if not isinstance(body, dict):
        return True
    if path in ("/api/delete", "/api/create") and any(n in PROTECTED for n in (body.get("model"), body.get("name"))):
        return False
    if path == "/api/copy" and body.get("destination") in PROTECTED:
        return False
    if path == "/api/pull":
        return not any(_leaves_the_machine(body.get(f)) for f in ("model", "name"))
    if path == "/api/create":
        return not _leaves_the_machine(body.get("from"))
    return True


# ---- GGUF mutants --------------------------------------------------------------------------------------------------

def corrupt(rng: random.Random, data: bytes) -> bytes:
    """Random byte-level damage of a valid GGUF: flips, a truncation, or a huge count."""
    out = bytearray(data)
    end = len(out)
    kind = rng.randrange(4)
    if kind == 0:
        for _ in range(rng.randrange(1, 8)):
            out[rng.randrange(4, end)] = rng.randrange(256)
    elif kind == 1:
        out = out[: rng.randrange(0, len(out))]
    elif kind == 2:
        offset = rng.choice([8, 16])  # tensor count, metadata count
        out[offset : offset + 8] = rng.choice([b"\xff" * 8, b"\x00" * 8, (1 << 40).to_bytes(8, "little")])
    else:
        start = rng.randrange(24, end - 8)
        out[start : start + 8] = rng.randbytes(8)
    return bytes(out)


# ---- the run -------------------------------------------------------------------------------------------------------

@dataclass
class FuzzReport:
    requests: int = 0
    statuses: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    gguf_cases: int = 0
    gguf_accepted: int = 0
    models_checked: int = 0
    hostile_formats: int = 0  # generations asked for in a hostile schema's format
    image_cases: int = 0  # requests built from a body with images (image_requests)
    template_cases: int = 0  # hostile templates (template_case)
    load_option_cases: int = 0  # absurd load-time options and Modelfile-refused settings (load_option_case)
    blobs_checked: int = 0  # blobs the store's manifests reference at the end (check_store)
    seconds: float = 0.0
    stopped_early: bool = False

    def summary(self) -> str:
        histogram = ", ".join(f"{status}: {count}" for status, count in sorted(self.statuses.items()))
        return (f"{self.requests} requests in {self.seconds:.1f} s ({histogram}); GGUF uploads {self.gguf_cases}, "
                f"accepted by create {self.gguf_accepted}; accepted models that generated: {self.models_checked}; "
                f"generations in a hostile format: {self.hostile_formats}; with images: {self.image_cases}; "
                f"hostile templates: {self.template_cases}; "
                f"absurd load-time options and settings: {self.load_option_cases}; "
                f"referenced blobs checked: {self.blobs_checked}; "
                f"failures: {len(self.failures)}" + (" (stopped at the time budget)" if self.stopped_early else ""))


class Fuzzer:
    def __init__(self, server: ServeProcess, report: FuzzReport, deadline: float):
        self.server = server
        self.report = report
        self.client = httpx.Client(base_url=server.url, timeout=deadline)
        self.accepted: set[str] = set()  # models create answered 200 for (checked at the end)
        self.uploaded: set[str] = set()  # digests /api/blobs took (kept unreferenced until a startup prune)

    def send(self, method: str, path: str, content: bytes | None, label: str,
             within: float | None = None) -> httpx.Response | None:
        """The answer (None when there was none); a failure when it is a 5xx, or comes after `within` seconds or is
        not a 4xx when `within` is given."""
        report = self.report
        report.requests += 1
        started = time.monotonic()
        try:
            response = self.client.request(method, path, content=content)
        except httpx.TimeoutException:
            report.failures.append(f"{label}: no answer within {self.client.timeout.read} s")
            report.statuses["timeout"] += 1
            return None
        except httpx.HTTPError as exc:
            report.failures.append(f"{label}: {type(exc).__name__} after {time.monotonic() - started:.1f} s")
            report.statuses["connection error"] += 1
            return None
        report.statuses[response.status_code] += 1
        seconds = time.monotonic() - started
        if within is not None and (seconds > within or not 400 <= response.status_code < 500):
            report.failures.append(f"{label}: {response.status_code} after {seconds:.1f} s (expected a 4xx within "
                                   f"{within:g} s)")
        if response.status_code >= 500 and (path, response.status_code) not in DOCUMENTED_5XX:
            report.failures.append(f"{label}: {response.status_code} {response.text[:200]}")
        elif "internal server error" in response.text:
            report.failures.append(f"{label}: streamed internal error {response.text[-200:]}")
        if self.server.process.poll() is not None:
            report.failures.append(f"{label}: server exited with {self.server.process.returncode}")
        return response

    def note_create(self, body: Any, response: httpx.Response | None) -> None:
        if response is None or response.status_code != 200 or not isinstance(body, dict):
            return
        name = body.get("model") or body.get("name")
        if isinstance(name, str):
            self.accepted.add(name)

    def upload(self, data: bytes, label: str) -> str | None:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        response = self.send("POST", f"/api/blobs/{digest}", data, label + " upload")
        if response is not None and response.status_code in (200, 201):
            self.uploaded.add(digest)
            return digest
        return None

    def gguf_case(self, rng: random.Random, fixture: Path, scratch: Path, index: int, names: list[str]) -> None:
        self.report.gguf_cases += 1
        files = {}  # the other files of the create: the base model, for a projector mutant
        if index < len(names) and names[index].startswith(PROJECTOR_CASE):
            name = names[index].removeprefix(PROJECTOR_CASE)
            label = f"projector mutant {name!r}"
            data = mutate(self.projector, scratch / "mmproj.gguf", name, PROJECTOR_MUTANTS).read_bytes()
            files = {"model.gguf": self.base_digest}
        elif index < len(names):
            label = f"gguf mutant {names[index]!r}"
            data = mutate(fixture, scratch / "mutant.gguf", names[index]).read_bytes()
        else:
            label = f"gguf corruption #{index}"
            data = corrupt(rng, fixture.read_bytes())
        digest = self.upload(data, label)
        if digest is None:
            return
        body = {"model": f"fz-gguf-{index}", "files": {**files, "mmproj.gguf" if files else "model.gguf": digest},
                "stream": rng.random() < 0.3}
        response = self.send("POST", "/api/create", encode(body), label + " create")
        ok = response is not None and response.status_code == 200 and '"error"' not in response.text
        if ok:
            self.report.gguf_accepted += 1
            self.accepted.add(body["model"])

    def sweep_long_names(self, bases: list[tuple[str, str, Any]]) -> None:
        """LONG_NAMES (the random draws pick them rarely) on /api/show and /v1/models each, and in turn in every name
        field of every base request; then a copy over a model that has layers of its own, which must leave none of
        them behind (check_store)."""
        for name in LONG_NAMES:
            self.send("GET", f"/v1/models/{name}", None, f"long name {name[:12]}... on /v1/models")
            self.send("POST", "/api/show", encode({"model": name}), f"long name {name[:12]}... on /api/show")
        fields = [(method, path, body, f) for method, path, body in bases if isinstance(body, dict)
                  for f in NAME_FIELDS if f in body]
        for index, (method, path, body, field_name) in enumerate(fields):
            name = LONG_NAMES[index % len(LONG_NAMES)]
            mutated = {**body, field_name: name}
            if not is_safe(path, mutated):
                continue
            response = self.send(method, path, encode(mutated),
                                 f"long name {name[:12]}... ({len(name)}) as {field_name} of {path}")
            if path in ("/api/create", "/api/copy"):
                self.note_create(mutated if path == "/api/create" else {"model": mutated["destination"]}, response)
        victim = {"model": "fz-victim", "from": BASE_MODEL, "system": "only fz-victim has this", "stream": False,
                  "parameters": {"seed": 9}}
        self.send("POST", "/api/create", encode(victim), "copy over a model: its create")
        self.send("POST", "/api/copy", encode({"source": BASE_MODEL, "destination": "fz-victim"}),
                  "copy over a model")

    def check_accepted_models(self) -> None:
        tags = self.client.get("/api/tags").json()["models"]
        present = {m["name"] for m in tags} | {m["name"].removesuffix(":latest") for m in tags}
        for name in sorted(self.accepted):
            if name not in present:
                continue  # deleted or renamed later in the run
            body = {"model": name, "prompt": "Hi", "stream": False, "options": dict(SMOKE_OPTIONS)}
            response = self.send("POST", "/api/generate", encode(body), f"generate on accepted model {name!r}")
            self.report.models_checked += 1
            if response is not None and response.status_code != 200:
                self.report.failures.append(f"accepted model {name!r} does not run: {response.status_code} "
                                            f"{response.text[:200]}")

    def check_store(self, models: Path) -> None:
        """Every blob a manifest names exists; every file in blobs/ is referenced or an upload (see the docstring)."""
        from dgemma_cli.store import Store

        store = Store(models)
        refs = store.referenced_digests()
        self.report.failures += [f"store: a manifest names the missing blob {d}" for d in sorted(refs)
                                 if not store.has_blob(d)]
        for path in sorted(store.blobs_dir.iterdir()):
            digest = "sha256:" + path.name.removeprefix("sha256-")
            if digest not in refs and digest not in self.uploaded:
                self.report.failures.append(f"store: blobs/{path.name[:40]} is left with nothing referencing it")
        self.report.blobs_checked = len(refs)


# ---- hostile templates (issue 36) ----------------------------------------------------------------------------------

TEMPLATE_SHARE = 0.03  # of the cases
TEMPLATE_ANSWER_S = 10.0  # each is refused before it renders much; a shared machine gets slack
_DEEP = 5000


def hostile_templates(rng: random.Random) -> dict[str, str]:
    """Templates over one of the limits of ggml_ext/chat/budget.py: source size (a little over, 1 MB, 8 MB), nesting
    (Go actions with and without trimming, `range`/`with` outside the safe subset, Jinja blocks, brackets, `not`,
    `else`, operator and filter chains, loops deeper than Python compiles) and output (the prompt placed 10,080 times:
    over 4,000,000 characters)."""
    size = rng.choice([131_073, 1_000_000, 8_000_000])
    return {
        f"Go of {size} characters": "{{ .Prompt }}" + "x" * (size - 13),
        f"Jinja of {size} characters": "{% for m in messages %}{{ m.content }}{% endfor %}" + "x" * size,
        "Go ifs 5,000 deep": "{{ if .Prompt }}" * _DEEP + "{{ .Prompt }}" + "{{ end }}" * _DEEP,
        "Go trimmed ifs 5,000 deep": "{{- if .System -}}" * 3000 + "{{- end }}" * 3000,
        "Go range/with 5,000 deep": "{{range .Messages}}{{with .Content}}" * 2500 + "{{end}}{{end}}" * 2500,
        "Jinja ifs 5,000 deep": "{%if messages%}" * _DEEP + "x" + "{%endif%}" * _DEEP,
        "Jinja brackets 5,000 deep": "{{ messages and " + "(" * _DEEP + "1" + ")" * _DEEP + " }}",
        "Jinja not chain": "{{ " + "not " * _DEEP + "messages }}",
        "Jinja else chain": "{{ messages and " + "1 if messages else " * _DEEP + "2 }}",
        "Jinja operator chain": "{{ messages and " + " + ".join(["1"] * _DEEP) + " }}",
        "Jinja filter chain": "{{ messages" + "|first" * _DEEP + " }}",
        "Jinja loops 30 deep": "{% for m in messages %}" * 30 + "x" + "{% endfor %}" * 30,
        "Go output over the budget": "{{ .Prompt }}" * 10_080,
        "Jinja output over the budget": "{% for i in range(10080) %}{{ messages[0].content }}{% endfor %}",
    }


def template_case(fuzzer: "Fuzzer", rng: random.Random, case: int) -> None:
    """One hostile template, as a per-request `template` of /api/generate or as /api/create's `template`: a 4xx
    within TEMPLATE_ANSWER_S, and create stores nothing."""
    name, template = rng.choice(sorted(hostile_templates(rng).items()))
    fuzzer.report.template_cases += 1
    label = f"case {case}: hostile template {name!r}"
    if "output" in name or rng.random() < 0.5:
        body = {"model": BASE_MODEL, "prompt": "y" * 399, "template": template, "stream": rng.random() < 0.5,
                "options": dict(SMOKE_OPTIONS)}
        fuzzer.send("POST", "/api/generate", encode(body), label + " on /api/generate", within=TEMPLATE_ANSWER_S)
        return
    body = {"model": "fz-template", "from": BASE_MODEL, "template": template, "stream": rng.random() < 0.5}
    fuzzer.send("POST", "/api/create", encode(body), label + " on /api/create", within=TEMPLATE_ANSWER_S)
    tags = fuzzer.client.get("/api/tags").json()["models"]
    if any(m["name"].startswith("fz-template") for m in tags):
        fuzzer.report.failures.append(f"{label}: create stored the model")


# ---- absurd load-time options and settings a Modelfile refuses (issue 36) ----------------------------------------

LOAD_OPTION_SHARE = 0.03  # of the cases
LOAD_OPTION_ANSWER_S = 5.0  # a range check: refused before any model loads
ABSURD_LOAD_OPTIONS = {"num_thread": [1000, 100_000, 2**31, -1], "num_ctx": [0, -5, 2**40], "num_batch": [0, 2**40],
                       "num_gpu": [-2, 2**31], "num_cpu_moe": [-2, 2**31], "main_gpu": [-1, 100_000],
                       "num_parallel": [0, 10**6]}
REFUSED_SETTINGS = [{"messages": [{"role": "wizard", "content": "x"}]}, {"messages": [{"role": "user", "content": 1}]},
                    {"requires": "1.2.3-" + "a" * 9994}, {"requires": "x" * 10_000}, {"parameters": {"tfs_z": 1}},
                    {"parameters": {"stop": ['a"""b']}}]


def load_option_case(fuzzer: "Fuzzer", rng: random.Random, case: int) -> None:
    """An absurd load-time option in /api/create `parameters` or in a request's `options`, or a setting a Modelfile
    refuses in /api/create: a 4xx within LOAD_OPTION_ANSWER_S, and create stores nothing (a stored num_thread 1000
    aborted the engine at the next generate)."""
    name = rng.choice(sorted(ABSURD_LOAD_OPTIONS))
    option = {name: rng.choice(ABSURD_LOAD_OPTIONS[name])}
    fuzzer.report.load_option_cases += 1
    kind = rng.randrange(3)
    if kind == 0 and name != "num_parallel":  # num_parallel is a PARAMETER only: a request ignores it
        body = {"model": BASE_MODEL, "prompt": "Hi", "stream": rng.random() < 0.5,
                "options": {**SMOKE_OPTIONS, **option}}
        fuzzer.send("POST", "/api/generate", encode(body), f"case {case}: option {option} on /api/generate",
                    within=LOAD_OPTION_ANSWER_S)
        return
    fields = {"parameters": option} if kind != 2 else rng.choice(REFUSED_SETTINGS)
    body = {"model": "fz-load", "from": BASE_MODEL, "stream": rng.random() < 0.5, **copy.deepcopy(fields)}
    label = f"case {case}: create with {encode(fields)[:80]!r}"
    fuzzer.client.request("DELETE", "/api/delete", json={"model": "fz-load"})  # one wrong answer is one failure
    fuzzer.send("POST", "/api/create", encode(body), label, within=LOAD_OPTION_ANSWER_S)
    if any(m["name"].startswith("fz-load") for m in fuzzer.client.get("/api/tags").json()["models"]):
        fuzzer.report.failures.append(f"{label}: create stored the model")


def convert_fixture(out: Path) -> Path:
    from dgemma_convert import convert

    convert(FIXTURE, out, "f32", threads=2)
    return out


def run(cases: int, seed: int = 1, gguf: Path | None = None, time_budget: float = 900.0, deadline: float = 60.0,
        gguf_share: float = 0.08, workdir: Path | None = None) -> FuzzReport:
    """Fuzz a fresh `dgemma serve` with `cases` mutated requests (about `gguf_share` of them GGUF uploads)."""
    rng = random.Random(seed)
    hostile = Hostile(rng)
    report = FuzzReport()
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        work = Path(tmp)
        gguf = gguf or convert_fixture(work / "tiny-a-f32.gguf")
        started = time.monotonic()
        with ServeProcess(work / "models", SERVER_ENV | _offline_registry()) as server:
            fuzzer = Fuzzer(server, report, deadline)
            base_digest = fuzzer.upload(gguf.read_bytes(), "fixture")
            create = {"model": BASE_MODEL, "files": {"tiny-a.gguf": base_digest}, "stream": False}
            assert fuzzer.send("POST", "/api/create", encode(create), "base create").status_code == 200
            projector = write_tiny_projector(work / "mmproj.gguf", n_embd_text=_embedding_length(gguf),
                                             max_soft_tokens=64)  # 66 positions: 16 images overflow 1024
            vision = {"model": VISION_MODEL, "stream": False, "files": {
                "tiny-a.gguf": base_digest, "mmproj.gguf": fuzzer.upload(projector.read_bytes(), "projector")}}
            assert fuzzer.send("POST", "/api/create", encode(vision), "vision create").status_code == 200
            bases = base_requests(base_digest)
            fuzzer.sweep_long_names(bases)
            mutant_names = sorted(MUTANTS) + [PROJECTOR_CASE + name for name in sorted(PROJECTOR_MUTANTS)]
            fuzzer.projector, fuzzer.base_digest = projector, base_digest  # what projector mutants start from
            rng.shuffle(mutant_names)
            gguf_index = 0
            for case in range(cases):
                if time.monotonic() - started > time_budget:
                    report.stopped_early = True
                    break
                if rng.random() < TEMPLATE_SHARE:
                    template_case(fuzzer, rng, case)
                    continue
                if rng.random() < LOAD_OPTION_SHARE:
                    load_option_case(fuzzer, rng, case)
                    continue
                if rng.random() < gguf_share:
                    fuzzer.gguf_case(rng, gguf, work, gguf_index, mutant_names)
                    gguf_index += 1
                    continue
                with_images = image_requests(rng)
                method, path, body = rng.choice(bases + with_images)
                report.image_cases += any(body is base for _, _, base in with_images)
                if method in ("GET", "HEAD"):
                    if rng.random() < 0.5:
                        path = path.rsplit("/", 1)[0] + "/" + _path_segment(rng)
                    fuzzer.send(method, path, None, f"case {case}: {method} {path[:80]}")
                    continue
                for _ in range(rng.randrange(1, 4)):
                    body = mutate_body(rng, hostile, body)
                if not is_safe(path, body):
                    continue
                hostile_format = hostile_generation(path, body)
                report.hostile_formats += hostile_format
                response = fuzzer.send(method, path, encode(body), f"case {case}: {method} {path} "
                                                                  f"{encode(body)[:160]!r}",
                                       within=HOSTILE_ANSWER_S if hostile_format else None)
                if path in ("/api/create", "/api/copy"):
                    fuzzer.note_create(body if path == "/api/create" else {"model": body.get("destination")}
                                       if isinstance(body, dict) else None, response)
            fuzzer.check_accepted_models()
            fuzzer.check_store(work / "models")
            if server.process.poll() is not None:
                report.failures.append(f"server exited with {server.process.returncode}")
        report.seconds = time.monotonic() - started
    return report


def _embedding_length(gguf: Path) -> int:
    from dgemma_cli.gguf_check import read_gguf_info
    from dgemma_engine.gguf_keys import KEY_EMBEDDING_LENGTH

    return int(read_gguf_info(gguf).metadata[KEY_EMBEDDING_LENGTH])


def _path_segment(rng: random.Random) -> str:
    return rng.choice(DIGESTS + ["%ED%B3%BF", "%00", "..%2F..%2Fetc", "a" * 5000, "tiny%00", "%F0%9F%98%80",
                                 "sha256:" + "0" * 64, "%FF%FE"]).replace("\x00", "%00")


def _offline_registry() -> dict[str, str]:
    """The default registry hosts go to a closed loopback port, so a pull of an ordinary name stays on the machine."""
    dead = f"http://127.0.0.1:{free_port()}"
    return {"DGEMMA_REGISTRY_MIRRORS": ",".join(f"{host}={dead}" for host in MIRRORED_HOSTS)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--time-budget", type=float, default=900.0, help="seconds; the run stops after this")
    parser.add_argument("--deadline", type=float, default=60.0, help="seconds one request may take")
    args = parser.parse_args(argv)
    report = run(args.cases, args.seed, time_budget=args.time_budget, deadline=args.deadline)
    print(report.summary())
    for failure in report.failures[:50]:
        print("FAIL", failure)
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
