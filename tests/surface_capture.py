"""A recorded sample of dgemma's user-visible surface: CLI help, CLI error texts and REST responses.

`tests/reference/record_surface.py` writes it to `tests/goldens/surface.json`; `tests/test_surface.py` captures it again
and compares byte for byte, so a refactor that changes what a user sees fails. Values that differ between two runs of
the same code (durations, timestamps, response ids, temporary paths) are replaced by placeholders before comparing.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

from cli_helpers import in_process
from server_harness import ServeProcess, free_port

FIXTURES = Path(__file__).parent / "fixtures"
GOLDEN = Path(__file__).parent / "goldens" / "surface.json"

HELP_COMMANDS = [
    [], ["run"], ["ps"], ["stop"], ["serve"], ["pull"], ["create"], ["list"], ["show"], ["rm"], ["cp"],
    ["convert"], ["debug"], ["debug", "logits"], ["debug", "generate"],
]
FAST = {"diffusion_steps": 4, "seed": 7, "num_predict": 16}

# Modelfiles that `create` must refuse, one per validation rule.
BAD_MODELFILES = {
    "steps-zero": "FROM tiny\nPARAMETER diffusion_steps 0\n",
    "steps-huge": "FROM tiny\nPARAMETER diffusion_steps 100000\n",
    "t-min-negative": "FROM tiny\nPARAMETER diffusion_t_min -1\n",
    "t-max-below-t-min": "FROM tiny\nPARAMETER diffusion_t_min 0.5\nPARAMETER diffusion_t_max 0.2\n",
    "entropy-zero": "FROM tiny\nPARAMETER diffusion_entropy_bound 0\n",
    "confidence-zero": "FROM tiny\nPARAMETER diffusion_confidence_threshold 0\n",
    "stability-zero": "FROM tiny\nPARAMETER diffusion_stability_threshold 0\n",
    "steps-not-int": "FROM tiny\nPARAMETER diffusion_steps many\n",
    "t-max-not-float": "FROM tiny\nPARAMETER diffusion_t_max hot\n",
    "progress-not-bool": "FROM tiny\nPARAMETER diffusion_progress maybe\n",
    "unknown-parameter": "FROM tiny\nPARAMETER no_such_knob 1\n",
    "no-from": "PARAMETER diffusion_steps 4\n",
    "adapter": "FROM tiny\nADAPTER ./lora.gguf\n",
}

# REST calls: (label, method, path, JSON body or None).
API_CALLS: list[tuple[str, str, str, Any]] = [
    ("version", "GET", "/api/version", None),
    ("tags", "GET", "/api/tags", None),
    ("show", "POST", "/api/show", {"model": "tiny"}),
    ("show-verbose", "POST", "/api/show", {"model": "tiny", "verbose": True}),
    ("show-unknown", "POST", "/api/show", {"model": "nosuch"}),
    ("generate", "POST", "/api/generate", {"model": "tiny", "prompt": "Hello", "stream": False, "options": FAST}),
    ("generate-stream", "POST", "/api/generate", {"model": "tiny", "prompt": "Hello", "options": FAST}),
    ("generate-raw", "POST", "/api/generate", {"model": "tiny", "prompt": "Hi", "raw": True, "stream": False,
                                               "options": FAST}),
    ("generate-progress", "POST", "/api/generate", {"model": "tiny", "prompt": "Hello",
                                                    "options": {**FAST, "diffusion_preview": True}}),
    ("generate-unknown-model", "POST", "/api/generate", {"model": "nosuch", "prompt": "Hi"}),
    ("generate-bad-type", "POST", "/api/generate", {"model": "tiny", "prompt": "Hi",
                                                    "options": {"diffusion_steps": "four"}}),
    ("generate-bad-steps", "POST", "/api/generate", {"model": "tiny", "prompt": "Hi",
                                                     "options": {"diffusion_steps": 0}}),
    ("generate-bad-t", "POST", "/api/generate", {"model": "tiny", "prompt": "Hi",
                                                 "options": {"diffusion_t_min": 0.9, "diffusion_t_max": 0.1}}),
    ("generate-bad-entropy", "POST", "/api/generate", {"model": "tiny", "prompt": "Hi",
                                                       "options": {"diffusion_entropy_bound": -1}}),
    ("generate-bad-stability", "POST", "/api/generate", {"model": "tiny", "prompt": "Hi",
                                                         "options": {"diffusion_stability_threshold": 0}}),
    ("generate-temperature-zero", "POST", "/api/generate", {"model": "tiny", "prompt": "Hi", "stream": False,
                                                            "options": {**FAST, "temperature": 0}}),
    ("chat", "POST", "/api/chat", {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}],
                                   "stream": False, "options": FAST}),
    ("chat-stream", "POST", "/api/chat", {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}],
                                          "options": FAST}),
    ("chat-bad-role", "POST", "/api/chat", {"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}),
    ("chat-tools", "POST", "/api/chat", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                         "tools": [{"type": "function", "function": {"name": "f"}}],
                                         "stream": False, "options": FAST}),
    ("bad-json", "POST", "/api/generate", "{not json"),
    ("ps", "GET", "/api/ps", None),
    ("openai-models", "GET", "/v1/models", None),
    ("openai-model", "GET", "/v1/models/tiny", None),
    ("openai-chat", "POST", "/v1/chat/completions", {"model": "tiny", "seed": 7, "max_tokens": 16,
                                                     "messages": [{"role": "user", "content": "Hello"}]}),
    ("openai-chat-stream", "POST", "/v1/chat/completions", {"model": "tiny", "seed": 7, "max_tokens": 16,
                                                            "stream": True,
                                                            "messages": [{"role": "user", "content": "Hello"}]}),
    ("openai-chat-unknown", "POST", "/v1/chat/completions", {"model": "nosuch",
                                                             "messages": [{"role": "user", "content": "x"}]}),
    ("openai-completions", "POST", "/v1/completions", {"model": "tiny", "prompt": "Hello", "seed": 7,
                                                       "max_tokens": 16}),
    ("openai-completions-list", "POST", "/v1/completions", {"model": "tiny", "prompt": ["hi"], "seed": 7,
                                                            "max_tokens": 16}),  # a list of one is accepted
    ("openai-embeddings", "POST", "/v1/embeddings", {"model": "tiny", "input": "x"}),
    ("copy-missing", "POST", "/api/copy", {"source": "nosuch", "destination": "other"}),
    ("delete-missing", "DELETE", "/api/delete", {"model": "nosuch"}),
    ("not-found", "GET", "/api/nosuch", None),
]

_VOLATILE_KEYS = re.compile(r"(_duration|_at|^created|^system_fingerprint|^expires_in)$")
_TIMING = re.compile(r"(duration|rate):(\s+)[\d.]+(µs|ms|s|m[\d.]+s|h[\dm.]+s)?")
_AGO = re.compile(r"\b(\d+|About a|An?|Less than a) (second|minute|hour)s?( ago)?\b")
_TMP = re.compile(r"/tmp/[^\s'\"]*|/private/[^\s'\"]*")
_CHATCMPL = re.compile(r"\b(chatcmpl|cmpl)-[A-Za-z0-9]+")
_ISO_TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)?")


def normalise(value: Any) -> Any:
    """`value` with run-dependent parts replaced by placeholders (recursively for JSON)."""
    if isinstance(value, dict):
        return {k: ("<volatile>" if _VOLATILE_KEYS.search(k) and not isinstance(v, (dict, list)) else normalise(v))
                for k, v in value.items()}
    if isinstance(value, list):
        return [normalise(v) for v in value]
    if isinstance(value, str):
        value = _TMP.sub("<tmp>", value)
        value = _CHATCMPL.sub(r"\1-<id>", value)
        value = _ISO_TIME.sub("<time>", value)
        value = _AGO.sub("<ago>", value)
        value = _TIMING.sub(r"\1:\2<timing>", value)
        value = re.sub(r"127\.0\.0\.1:\d+", "127.0.0.1:<port>", value)
        return value
    return value


def _body(response: httpx.Response) -> Any:
    text = response.text
    kind = response.headers.get("content-type", "")
    if "ndjson" in kind:
        return [normalise(json.loads(line)) for line in text.splitlines() if line.strip()]
    if "event-stream" in kind:
        events = []
        for line in text.splitlines():
            if line.startswith("data: "):
                data = line[6:]
                events.append(data if data == "[DONE]" else normalise(json.loads(data)))
        return events
    try:
        return normalise(response.json())
    except ValueError:
        return normalise(text)


def _cli(env: dict[str, str], *args: str) -> dict[str, Any]:
    code, out, err = in_process(env, *args)
    return {"code": code, "stdout": normalise(out), "stderr": normalise(err)}


def _cli_process(env: dict[str, str], *args: str) -> dict[str, Any]:
    """The installed `dgemma ARGS` in its own process (help shows the program's name; `run` writes to fd 1)."""
    done = subprocess.run([str(Path(sys.executable).parent / "dgemma"), *args], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    return {"code": done.returncode, "stdout": normalise(done.stdout), "stderr": normalise(done.stderr)}


def capture(work: Path, tiny_gguf: Path, with_help: bool = True) -> dict[str, Any]:
    """Everything the golden holds, captured from the code as it is now; `work` is an empty scratch folder.
    with_help=False leaves the help texts out (they do not depend on the engine's kernels)."""
    env = {"DGEMMA_MODELS": str(work / "store"), "DGEMMA_HOST": f"127.0.0.1:{free_port()}", "COLUMNS": "100",
           "NO_COLOR": "1", "TERM": "dumb"}
    gguf = work / "tiny.gguf"
    shutil.copyfile(tiny_gguf, gguf)
    result: dict[str, Any] = {"help": {}, "cli": {}, "api": {}}
    for words in HELP_COMMANDS if with_help else []:
        result["help"][" ".join(words) or "dgemma"] = _cli_process(env, *words, "--help")

    modelfile = work / "Modelfile"
    modelfile.write_text(f"FROM {gguf}\nPARAMETER diffusion_steps 4\nPARAMETER seed 7\nSYSTEM You are terse.\n")
    result["cli"]["create"] = _cli(env, "create", "tiny", "-f", str(modelfile))
    for label, text in BAD_MODELFILES.items():
        bad = work / f"{label}.Modelfile"
        bad.write_text(text)
        result["cli"][f"create-{label}"] = _cli(env, "create", f"bad-{label}", "-f", str(bad))
    for label, args in {
        "list": ["list"],
        "show": ["show", "tiny"],
        "show-modelfile": ["show", "tiny", "--modelfile"],
        "show-parameters": ["show", "tiny", "--parameters"],
        "show-unknown": ["show", "nosuch"],
        "rm-invalid-name": ["rm", "Bad Name!"],
        "cp-missing": ["cp", "nosuch", "other"],
        "run-bad-steps": ["run", "tiny", "--steps", "0", "hi"],
        "debug-generate-bad-t": ["debug", "generate", str(gguf), "--prompt-ids", "2,10", "--t-min", "0.9",
                                 "--t-max", "0.1"],
        "debug-generate-bad-entropy": ["debug", "generate", str(gguf), "--prompt-ids", "2,10",
                                       "--entropy-bound", "0"],
        "convert-missing": ["convert", str(work / "nosuch"), "--outfile", str(work / "x.gguf")],
    }.items():
        result["cli"][label] = _cli(env, *args)
    result["cli"]["run"] = _cli_process(env, "run", "tiny", "--seed", "7", "--steps", "4", "Hello")
    result["cli"]["run-verbose"] = _cli_process(env, "run", "tiny", "--seed", "7", "--steps", "4", "--verbose", "Hi")

    with ServeProcess(work / "store", {"DGEMMA_NOPRUNE": "1"}) as server, httpx.Client(base_url=server.url,
                                                                                       timeout=120) as http:
        for label, method, path, body in API_CALLS:
            if isinstance(body, str):
                response = http.request(method, path, content=body, headers={"content-type": "application/json"})
            else:
                response = http.request(method, path, json=body)
            result["api"][label] = {"status": response.status_code, "body": _body(response)}
    return result
