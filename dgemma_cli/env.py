"""Every `DGEMMA_*` environment variable in one table: name, kind, default, meaning, and how its text is parsed.

Like Ollama's `envconfig`: each variable is defined once and read one way. `Var.get` strips surrounding whitespace
and quotes (`clean`), then applies the variable's parser; an unset variable gives its default. What a value the
parser refuses does is the reader's choice: the server logs `ignoring NAME=...` and keeps the default
(`ServerConfig.from_env`), the CLI and the pull options quietly keep the default (`Var.get_or_default`).
Only `DGEMMA_*` variables are read: a machine that also runs Ollama must not have dgemma bind its port or use its
store. docs/server.md, docs/store.md and docs/engine.md list these variables (`DOCS`; a test keeps them equal).
"""
from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from dgemma_cli.errors import DgemmaError
from dgemma_cli.gotext import FOREVER, parse_keep_alive
from dgemma_cli.hosts import DEFAULT_HOST, parse_host

_SIZE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}


# ---- parsers of a cleaned value -------------------------------------------------------------------------------------

def clean(value: str) -> str:
    """Environment values are stripped of surrounding whitespace and quotes."""
    return value.strip().strip("\"'").strip()


def parse_bool(value: str) -> bool:
    text = value.strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("", "0", "false", "no", "off"):
        return False
    raise DgemmaError(f"invalid boolean {value!r}")


def parse_size(value: str) -> int:
    """Bytes from `128GB`, `512MiB`, `1000`: decimal and binary units, case-insensitive."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", value)
    if match is None or match.group(2).lower() not in _SIZE_UNITS:
        raise DgemmaError(f"invalid size {value!r}")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


def _keep_alive_env(value: str) -> float:
    seconds = parse_keep_alive(value)
    return 300.0 if seconds is None else seconds


def _load_timeout_env(value: str) -> float:
    seconds = parse_keep_alive(value)
    return 0.0 if seconds is None or seconds == FOREVER else seconds


def _comma_list(value: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in value.split(",") if part.strip())


def _positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise ValueError("must be at least 1")
    return number


def _dotted_version(value: str) -> str:
    if not re.fullmatch(r"\d+(\.\d+)*", value):
        raise ValueError("must be a dotted number such as 0.32.0")
    return value


def _debug_level(value: str) -> int:
    return 2 if value.strip() == "2" else int(parse_bool(value))


def _text_or_none(value: str) -> str | None:
    return value or None


def _positive_seconds(value: str) -> float:
    seconds = float(value)
    if not 0 < seconds < float("inf"):  # also refuses nan
        raise ValueError("must be a number of seconds > 0")
    return seconds


def _non_negative(kind: type) -> Callable[[str], Any]:
    def parse(value: str) -> Any:
        number = kind(value)
        if not number >= 0:  # also refuses nan
            raise ValueError("must be >= 0")
        return number

    return parse


# ---- the table ------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Var:
    """One environment variable. `setting` names the ServerConfig field a server variable sets."""

    name: str
    kind: str  # for the docs: what the text may be
    default: Any
    shown_default: str  # the default as a user would write it
    description: str
    parse: Callable[[str], Any] = str
    setting: str | None = None

    def raw(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The value exactly as set, or None when unset."""
        return (os.environ if environ is None else environ).get(self.name)

    def get(self, environ: Mapping[str, str] | None = None) -> Any:
        """The parsed value, or the default when unset; a value the parser refuses raises DgemmaError or ValueError."""
        raw = self.raw(environ)
        return self.default if raw is None else self.parse(clean(raw))

    def get_or_default(self, environ: Mapping[str, str] | None = None) -> Any:
        """As `get`, with the default in place of a value the parser refuses."""
        try:
            return self.get(environ)
        except (DgemmaError, ValueError):
            return self.default


# The server's variables, in the order `dgemma serve` logs them.
HOST = Var("DGEMMA_HOST", "address", parse_host(DEFAULT_HOST), DEFAULT_HOST,
           "bind address of `dgemma serve`, and where the CLI connects; a non-loopback bind logs a warning (and "
           "another without an API key)", parse_host, "host")
MODELS = Var("DGEMMA_MODELS", "path", None, "~/.dgemma/models", "the model store (Ollama layout)",
             os.path.expanduser, "models_dir")
KEEP_ALIVE = Var("DGEMMA_KEEP_ALIVE", "duration", 300.0, "5m",
                 "how long an idle model stays loaded (`-1`: forever, `0`: unload after each request)",
                 _keep_alive_env, "keep_alive")
ORIGINS = Var("DGEMMA_ORIGINS", "list", (), "", "extra allowed browser origins (`*` wildcards), comma-separated",
              _comma_list, "origins")
NUM_PARALLEL = Var("DGEMMA_NUM_PARALLEL", "integer >= 1", 1, "1", "concurrent generations per model",
                   _positive_int, "num_parallel")
MAX_QUEUE = Var("DGEMMA_MAX_QUEUE", "integer >= 1", 512, "512", "requests that may wait for a model (then 503)",
                _positive_int, "max_queue")
MAX_LOADED_MODELS = Var("DGEMMA_MAX_LOADED_MODELS", "integer >= 1", 1, "1", "models resident at once",
                        _positive_int, "max_loaded_models")
CONTEXT_LENGTH = Var("DGEMMA_CONTEXT_LENGTH", "integer >= 1", 8192, "8192", "default `num_ctx` (capped by the model)",
                     _positive_int, "context_length")
LOAD_TIMEOUT = Var("DGEMMA_LOAD_TIMEOUT", "duration", 300.0, "5m", "how long a model load may take (`0`: no limit)",
                   _load_timeout_env, "load_timeout")
DEBUG = Var("DGEMMA_DEBUG", "boolean or 2", 0, "off", "debug logging (`2`: more)", _debug_level, "debug")
NOPRUNE = Var("DGEMMA_NOPRUNE", "boolean", False, "off", "do not prune unused blobs at startup", parse_bool,
              "noprune")
API_KEY = Var("DGEMMA_API_KEY", "text", None, "unset",
              "require `Authorization: Bearer <key>` on every route except `/` (the CLI sends it)", _text_or_none,
              "api_key")
READONLY = Var("DGEMMA_READONLY", "boolean", False, "off", "refuse pull/create/copy/delete/blob uploads (403)",
               parse_bool, "readonly")
ALLOWED_HOSTS = Var("DGEMMA_ALLOWED_HOSTS", "list", (), "", "extra Host header names, comma-separated", _comma_list,
                    "allowed_hosts")
MAX_UPLOAD = Var("DGEMMA_MAX_UPLOAD", "size", 128 * 10**9, "128GB", "blob upload cap (413)", parse_size,
                 "max_upload")
MAX_CANVASES = Var("DGEMMA_MAX_CANVASES", "integer >= 1", 16, "16", "canvases one request may denoise",
                   _positive_int, "max_canvases")
MAX_IMAGES = Var("DGEMMA_MAX_IMAGES", "integer >= 1", 16, "16", "images one request may carry (then a 400)",
                 _positive_int, "max_images")
MAX_STEPS = Var("DGEMMA_MAX_STEPS", "integer >= 1", 256, "256",
                "most denoising steps per canvas a request or Modelfile may ask for", _positive_int, "max_steps")
COMPAT_VERSION = Var("DGEMMA_COMPAT_VERSION", "version", "0.32.0", "0.32.0",
                     "the Ollama version `/api/version` reports", _dotted_version, "compat_version")
# 10 s: a 6-field schema takes 7-7.5 s of CPU at the released 262,144-token vocabulary (docs/generation.md).
SCHEMA_COMPILE_TIMEOUT = Var("DGEMMA_SCHEMA_COMPILE_TIMEOUT", "seconds > 0", 10.0, "10",
                             "CPU seconds a request's JSON schema may take to compile (then a 400); `format: \"json\"` "
                             "is compiled once per model in the background and waited for, never refused",
                             _positive_seconds, "schema_compile_timeout")
# Slow and numerous clients (docs/server.md#connections): half-sent requests must neither hold the server nor take
# every file descriptor.
HEADER_TIMEOUT = Var("DGEMMA_HEADER_TIMEOUT", "seconds > 0", 10.0, "10",
                     "seconds a connection has to send a complete request head (then it is closed)",
                     _positive_seconds, "header_timeout")
BODY_TIMEOUT = Var("DGEMMA_BODY_TIMEOUT", "seconds > 0", 60.0, "60",
                   "seconds a request body may pause, and a JSON body may take in all (blob uploads: only the pause)",
                   _positive_seconds, "body_timeout")
MAX_CONNECTIONS = Var("DGEMMA_MAX_CONNECTIONS", "integer >= 1", 4096, "4096",
                      "open connections at most (fewer under a low open-file limit); beyond, the oldest one still "
                      "waiting for a request head is closed, or the new one gets a 503", _positive_int,
                      "max_connections")

SERVER = (HOST, MODELS, KEEP_ALIVE, ORIGINS, NUM_PARALLEL, MAX_QUEUE, MAX_LOADED_MODELS, CONTEXT_LENGTH, LOAD_TIMEOUT,
          DEBUG, NOPRUNE, API_KEY, READONLY, ALLOWED_HOSTS, MAX_UPLOAD, MAX_CANVASES, MAX_IMAGES, MAX_STEPS,
          COMPAT_VERSION, SCHEMA_COMPILE_TIMEOUT, HEADER_TIMEOUT, BODY_TIMEOUT, MAX_CONNECTIONS)

# The CLI's and the pull's variables.
NOHISTORY = Var("DGEMMA_NOHISTORY", "boolean", False, "off", "no `~/.dgemma/history` for the interactive `run`",
                parse_bool)
REGISTRY_MIRRORS = Var("DGEMMA_REGISTRY_MIRRORS", "list", "", "",
                       "`host=baseURL,...`: send a registry's requests elsewhere (air-gapped mirrors, tests), e.g. "
                       "`hf.co=http://127.0.0.1:8080`")
REGISTRY_ALLOW = Var("DGEMMA_REGISTRY_ALLOW", "list", "", "",
                     "`host[:port],...` exempt from the SSRF block of loopback/private/link-local addresses")
PULL_PART_SIZE = Var("DGEMMA_PULL_PART_SIZE", "integer >= 0", 0, "0",
                     "bytes per ranged part (`0`: total/16 within 100 MB–1 GB)", _non_negative(int))
PULL_STREAMS = Var("DGEMMA_PULL_STREAMS", "integer >= 0", 8, "8", "parallel ranged parts per blob (at least 1)",
                   _non_negative(int))
PULL_STALL_TIMEOUT = Var("DGEMMA_PULL_STALL_TIMEOUT", "seconds", 30.0, "30",
                         "seconds without data before a part restarts", _non_negative(float))
PULL_RETRIES = Var("DGEMMA_PULL_RETRIES", "integer >= 0", 6, "6", "retries per part", _non_negative(int))
PULL_BACKOFF = Var("DGEMMA_PULL_BACKOFF", "seconds", 1.0, "1", "first retry backoff in seconds (doubling)",
                   _non_negative(float))

PULL = (REGISTRY_MIRRORS, REGISTRY_ALLOW, PULL_PART_SIZE, PULL_STREAMS, PULL_STALL_TIMEOUT, PULL_RETRIES, PULL_BACKOFF)
CLIENT = (NOHISTORY,) + PULL

# Read by the C engine itself (getenv), listed here so the table is complete.
PROFILE_NODES = Var("DGEMMA_PROFILE_NODES", "any", None, "unset",
                    "a profiled step (`Context.step_profiled`) prints one line per graph node: its class, op, "
                    "shapes and seconds (bench notes)")
QKERNELS = Var("DGEMMA_QKERNELS", "`auto`, `avx512`, `avxvnni`, `avx2`, `scalar`, `off`", None, "auto",
               "quantized weight products: the engine's integer kernels on that path (`auto`: the best under "
               "`DGEMMA_CPU_ISA`), or ggml's own ops (`off`); a path this CPU lacks means ggml's ops")
CPU_ISA = Var("DGEMMA_CPU_ISA", "`auto`, `avx512`, `avxvnni`, `avx2`, `none`", None, "auto",
              "the highest instruction set the engine's own CPU kernels use (F32 tiles, soft embedding, the "
              "quantized kernels' `auto`); `auto`: the best this CPU has (tests and benchmarks force each path)")
STANDARD_OPS = Var("DGEMMA_STANDARD_OPS", "boolean", False, "unset",
                   "the standard-op graph (what accelerators run) on the CPU too, without the fast custom ops (tests)",
                   parse_bool)
# Read by the engine's Python side (dgemma_engine.devices) when it loads a model; `dgemma serve --rpc` sets it.
RPC = Var("DGEMMA_RPC", "list", (), "",
          "ggml RPC servers (`host:port`, comma-separated) whose devices take layers like GPUs; unauthenticated: "
          "loopback or a private network only", _comma_list)
ENGINE = (PROFILE_NODES, STANDARD_OPS, RPC, QKERNELS, CPU_ISA)

# Read by the converter itself (dgemma_convert.fast_quant), listed here so the table is complete.
FAST_QUANT = Var("DGEMMA_FAST_QUANT", "boolean", True, "on",
                 "`0`: ggml's own K-quant quantizers instead of the converter's byte-identical AVX2 ones", parse_bool)
CONVERT = (FAST_QUANT,)

# What a `dgemma serve` process reads (its --help lists them): its own, the pulls' (it pulls), the engine's (it loads
# models; not the profiler's, which only profiled bench steps read) and the converter's (`create --quantize`).
SERVE = SERVER + PULL + (STANDARD_OPS, RPC, QKERNELS, CPU_ISA) + CONVERT

ALL = SERVER + CLIENT + ENGINE + CONVERT


def markdown_table(variables: tuple[Var, ...]) -> str:
    """The docs' table of `variables`: one `| name | kind | default | meaning |` row each."""
    rows = ["| Variable | Kind | Default | |", "|---|---|---|---|"]
    for var in variables:
        rows.append(f"| `{var.name}` | {var.kind} | {_shown(var.shown_default)} | {var.description} |")
    return "\n".join(rows)


def _shown(default: str) -> str:
    if not default:
        return "–"
    return default if default in ("unset", "off") else f"`{default}`"


def docs_block(variables: tuple[Var, ...], marker: str) -> str:
    """The table between `<!-- env:MARKER -->` lines in a docs page (tests compare it with the page)."""
    return f"<!-- env:{marker} -->\n{markdown_table(variables)}\n<!-- /env:{marker} -->"


DOCS = {"docs/server.md": (SERVER, "server"), "docs/store.md": (CLIENT, "client"), "docs/engine.md": (ENGINE, "engine"),
        "docs/convert.md": (CONVERT, "convert")}
