"""Compiling a structured-output format into a token automaton: the vocabulary side, the isolated compile and the
cache files (docs/generation.md, "Structured output").

Compiling is outlines-core's work and its cost depends on the schema and the vocabulary: milliseconds for a small
schema on a small vocabulary, seconds for a 6-field schema at the released 262,144 tokens, tens of seconds for "any
JSON object" there, and no end for hostile schemas (`minLength: 100000`, patterns whose DFA explodes). So:
- what does not depend on the schema is computed once per vocabulary (`Vocabulary`: the bytes each text token writes,
  the stop ids, a digest naming them);
- each compile runs in a child Python at low CPU priority under a CPU-time limit, and can be stopped at any moment
  (the child is killed), so a schema that would take too long is refused instead of tying up a core;
- the child writes the automaton to a cache file (numpy arrays, no pickle) named by the vocabulary digest and the
  schema, so a schema is compiled once per vocabulary across requests and restarts. A file that does not read back
  as a consistent automaton is ignored. The cache has a size bound: `trim_cache` removes the least recently used
  files (`mark_used` records a use in the file's access time) once the files hold more than the bound.
The server decides when to compile and how long to wait (dgemma_cli/server/schema_compiler.py).
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, fields
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from dgemma_engine.constrained import ConstraintError, TokenAutomaton, compile_token_map, text_token_map
from dgemma_engine import gguf_keys

CACHE_LAYOUT = 1            # raised when token_bytes or the cache files change meaning
CHILD_NICENESS = 19         # compiles take only the CPU that generations leave
POLL_S = 0.05               # how often a waiting compile checks its stop flag
MAX_MESSAGE_CHARS = 1000    # of a compile error (an error can quote the schema's whole regular expression)
ONE_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}  # a compile is serial


class CompileLimitExceeded(ConstraintError):
    """The compile ran past its limit (`kind`: "CPU time" or "wall time") and was stopped."""

    def __init__(self, kind: str, seconds: float):
        super().__init__(f"the JSON schema is too complex: compiling it takes more than {seconds:g} s of {kind}")
        self.kind = kind
        self.seconds = seconds


class CompileStopped(ConstraintError):
    """The compile was stopped from outside (its requester left) before it finished."""


def schema_key(schema: dict[str, Any] | None) -> str:
    """One text per schema whatever its key order (None: any JSON object)."""
    return json.dumps(schema, sort_keys=True, separators=(",", ":"))


@dataclass(frozen=True, eq=False)
class Vocabulary:
    """What a compile needs from a model, and nothing that depends on the schema."""

    token_map: dict[bytes, list[int]]   # the bytes a text token writes -> its ids, stop ids left out (outlines-core)
    stop_ids: tuple[int, ...]
    n_tokens: int
    digest: str                         # names the vocabulary in cache keys: same tokens, types and stops, same digest

    @classmethod
    def from_metadata(cls, metadata: dict[str, Any]) -> Vocabulary:
        """From GGUF keys: tokenizer.ggml.tokens, tokenizer.ggml.token_type; stop ids as eos_ids_from_metadata."""
        from importlib.metadata import version

        from dgemma_engine.generate import eos_ids_from_metadata  # not at the top: the compile child never needs it

        tokens = list(metadata.get(gguf_keys.KEY_TOKENS) or [])
        token_types = metadata.get(gguf_keys.KEY_TOKEN_TYPE)
        stop_ids = tuple(int(t) for t in eos_ids_from_metadata(metadata))
        token_map = text_token_map(tokens, token_types, stop_ids)
        # the token_bytes rules and outlines-core's version decide the automata too
        named = json.dumps([CACHE_LAYOUT, version("outlines_core"), list(stop_ids), tokens,
                            None if token_types is None else [int(t) for t in token_types]])
        return cls(token_map, stop_ids, len(tokens), hashlib.sha256(named.encode()).hexdigest())


def compile_for_vocabulary(schema: dict[str, Any] | None, vocabulary: Vocabulary) -> TokenAutomaton:
    """The automaton of `schema` (None: any JSON object) over `vocabulary`, in this process."""
    return compile_token_map(schema, vocabulary.token_map, vocabulary.stop_ids)


def _layout() -> str:
    """Names the TokenAutomaton layout the files hold: files of another layout are never opened."""
    names = sorted(f.name for f in fields(TokenAutomaton)) + sorted(_cached_names())
    return f"v{CACHE_LAYOUT}-" + hashlib.sha256(",".join(names).encode()).hexdigest()[:12]


def _cached_names() -> list[str]:
    return [name for name, value in vars(TokenAutomaton).items() if isinstance(value, cached_property)]


def cache_file(cache_dir: Path, vocabulary: Vocabulary, schema: dict[str, Any] | None) -> Path:
    """Where the automaton of (vocabulary, schema) is kept under `cache_dir`."""
    return Path(cache_dir) / _layout() / vocabulary.digest[:32] / _schema_file_name(schema)


def mark_used(path: Path) -> None:
    """Record a use of a cache file for trim_cache: its access time becomes now, its modification time (when it was
    written) stays."""
    try:
        os.utime(path, ns=(time.time_ns(), os.stat(path).st_mtime_ns))
    except OSError:  # gone meanwhile, or another user's file in a shared store: its order is only a little off
        pass


def trim_cache(cache_dir: Path, max_bytes: int, max_files: int, keep: tuple[Path, ...] = ()) -> list[Path]:
    """Remove cache files under `cache_dir` until the rest hold at most `max_bytes` in at most `max_files` files;
    returns the removed paths. First go the scratch files a killed compile left (an hour or more ago), then the
    least recently used (mark_used) schemas' automata; "any JSON object"'s (one per vocabulary, compiled when its
    model entered the store) only after every schema's. `keep` (the file just written) is never removed, nor a
    scratch file that may still be being written."""
    root = Path(cache_dir)
    current = _layout()
    any_object = _schema_file_name(None)
    now = time.time()
    entries = []  # (eviction order, size, path)
    try:
        candidates = [p for p in root.glob("*/*/*") if p.is_file() and not p.is_symlink()]
    except OSError:
        return []
    for path in candidates:
        try:
            st = path.stat()
        except OSError:
            continue
        if path.name.startswith("."):  # save_automaton's scratch file
            if now - st.st_mtime < 3600:
                continue  # a compile may still be writing it; it is not counted either
            rank = (0, 0.0)
        else:  # files of another layout (another dgemma sharing the store) age like the others
            last_use = max(st.st_atime, st.st_mtime)
            rank = (2 if path.name == any_object and path.parent.parent.name == current else 1, last_use)
        entries.append((rank, st.st_size, path))
    entries.sort(key=lambda entry: entry[0])
    total = sum(size for _, size, _ in entries)
    count = len(entries)
    removed = []
    kept = {Path(p) for p in keep}
    for rank, size, path in entries:
        if total <= max_bytes and count <= max_files and rank[0] != 0:
            break
        if path in kept:
            continue
        try:
            path.unlink()
        except FileNotFoundError:
            pass  # another server sharing the store removed it first
        except OSError:
            continue
        total -= size
        count -= 1
        removed.append(path)
    folders = {path.parent for path in removed} | {path.parent.parent for path in removed}
    for folder in sorted(folders, key=lambda f: len(f.parts), reverse=True):  # a vocabulary's, then its layout's
        try:
            folder.rmdir()  # only when empty
        except OSError:
            pass
    return removed


def _schema_file_name(schema: dict[str, Any] | None) -> str:
    return hashlib.sha256(schema_key(schema).encode()).hexdigest()[:32] + ".npz"


def save_automaton(path: Path, automaton: TokenAutomaton) -> None:
    """Write the automaton (its fields and the cached properties computed so far) atomically: a reader sees the
    whole file or none."""
    arrays: dict[str, np.ndarray] = {}
    for name, value in vars(automaton).items():
        if name.startswith("_"):  # kept in memory only (the fast decode's index, constrained.decode_index)
            continue
        arrays[name] = np.array(sorted(value), dtype=np.int64) if isinstance(value, frozenset) else np.asarray(value)
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(scratch, "wb") as f:
            np.savez(f, **arrays)
        os.replace(scratch, path)
    finally:
        scratch.unlink(missing_ok=True)


def load_automaton(path: Path, n_tokens: int) -> TokenAutomaton | None:
    """The automaton in `path`, or None when there is none or it is not a consistent automaton over `n_tokens` token
    ids (a damaged file is recompiled, never trusted)."""
    try:
        with np.load(path, allow_pickle=False) as data:
            stored = {name: data[name] for name in data.files}
        automaton = _automaton_from_arrays(stored)
    except Exception:  # noqa: BLE001 - missing, truncated, foreign or damaged: all mean "compile it again"
        return None
    return automaton if _consistent(automaton, n_tokens) else None


def _automaton_from_arrays(stored: dict[str, np.ndarray]) -> TokenAutomaton:
    values = {}
    for f in fields(TokenAutomaton):
        array = stored[f.name]
        if f.type == "int":
            values[f.name] = int(array)
        elif f.type.startswith("frozenset"):
            values[f.name] = frozenset(int(x) for x in array)
        else:
            values[f.name] = np.ascontiguousarray(array)
    automaton = TokenAutomaton(**values)
    for name in _cached_names():
        if name in stored:
            automaton.__dict__[name] = np.ascontiguousarray(stored[name])
    return automaton


def _consistent(a: TokenAutomaton, n_tokens: int) -> bool:
    """Every index the decoder follows lies in range, and the edges are grouped by destination as `build` groups
    them."""
    edge_arrays = (a.src, a.tok, a.dst)
    if a.n_states < 1 or not 0 <= a.initial < a.n_states:
        return False
    if any(x.dtype.kind not in "iu" or x.ndim != 1 or len(x) != len(a.src) for x in edge_arrays) or not len(a.src):
        return False
    if min(a.src.min(), a.dst.min(), a.tok.min()) < 0 or max(a.src.max(), a.dst.max()) >= a.n_states:
        return False
    if a.tok.max() >= n_tokens or any(not 0 <= f < a.n_states for f in a.finals):
        return False
    seg_starts = np.flatnonzero(np.r_[True, a.dst[1:] != a.dst[:-1]])
    if np.any(np.diff(a.dst) < 0) or not np.array_equal(seg_starts, a.seg_starts):
        return False
    if not np.array_equal(a.dst[seg_starts], a.seg_dst):
        return False
    for name in _cached_names():  # per-state tables the compile computed
        table = a.__dict__.get(name)
        if table is not None and (table.ndim != 1 or len(table) != a.n_states or table.dtype.kind not in "iu"):
            return False
    return True


# ---- the isolated compile ------------------------------------------------------------------------------------------

def compile_isolated(schema: dict[str, Any] | None, vocabulary: Vocabulary, out_path: Path,
                     cpu_limit_s: float | None = None, wall_limit_s: float | None = None,
                     stop: threading.Event | None = None) -> TokenAutomaton:
    """Compile in a child Python (`python -m dgemma_engine.automata`) at low priority; it writes the automaton to
    `out_path`, which this reads back. CompileLimitExceeded past `cpu_limit_s` of the child's CPU time or
    `wall_limit_s` of waiting, CompileStopped once `stop` is set; the child is killed in both cases."""
    job = pickle.dumps({"schema": schema, "token_map": vocabulary.token_map, "stop_ids": vocabulary.stop_ids,
                        "n_tokens": vocabulary.n_tokens, "out_path": str(out_path), "cpu_limit_s": cpu_limit_s})
    child = subprocess.Popen(_child_command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, env={**os.environ, **ONE_THREAD})
    # The job (megabytes at a large vocabulary) goes in from a thread: Popen.communicate cannot resume sending input
    # after a timeout, and this thread must keep checking `stop`.
    feeder = threading.Thread(target=_send, args=(child, job), name="dgemma-compile-input", daemon=True)
    feeder.start()
    waited = 0.0
    try:
        while True:
            try:
                child.wait(timeout=POLL_S)
                break
            except subprocess.TimeoutExpired:
                waited += POLL_S
            if stop is not None and stop.is_set():
                raise CompileStopped("the JSON schema compile was stopped")
            if wall_limit_s is not None and waited > wall_limit_s:
                raise CompileLimitExceeded("wall time", wall_limit_s)
        out = child.stdout.read()  # the answer is one short pickle: it fits the pipe, so the child did not block
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        feeder.join()
        child.stdout.close()
    if cpu_limit_s is not None and child.returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        raise CompileLimitExceeded("CPU time", cpu_limit_s)
    try:
        status, message = pickle.loads(out)
    except Exception:  # noqa: BLE001 - a crashed child leaves nothing readable
        raise ConstraintError(f"cannot compile the JSON schema: the compiler exited with status {child.returncode}")
    if status != "ok":
        raise ConstraintError(message)
    automaton = load_automaton(out_path, vocabulary.n_tokens)
    if automaton is None:
        raise ConstraintError("cannot compile the JSON schema: the compiler's result does not read back")
    return automaton


def _child_command() -> list[str]:
    """`python -m dgemma_engine.automata`, started through `nice` where there is one: the child's start (the
    interpreter, numpy, outlines-core) is a third of a second of CPU that must not compete with generations
    either, and a priority set from inside would come after it (and, on Linux, only for the calling thread)."""
    command = [sys.executable, "-m", "dgemma_engine.automata"]
    nice = shutil.which("nice")
    return [nice, "-n", str(CHILD_NICENESS), *command] if nice else command


def _send(child: subprocess.Popen, job: bytes) -> None:
    try:
        child.stdin.write(job)
        child.stdin.close()
    except (BrokenPipeError, OSError):  # the child died or was killed first: its exit status tells why
        pass


def _limit_child(cpu_limit_s: float | None) -> None:
    """Low priority; a CPU-time limit the kernel enforces (SIGXCPU, then SIGKILL a second later); on Linux, death
    with the server, so a killed server leaves no compile running."""
    import ctypes
    import math
    import resource

    os.nice(max(0, CHILD_NICENESS - os.nice(0)))  # when no `nice` started it so
    if hasattr(os, "SCHED_IDLE"):
        # Linux: a nice-19 task still runs whole time slices once picked (with ggml's spinning worker threads a
        # concurrent generation measured 2.5–5× slower beside two compiles on Linux 6.18); an idle-policy task yields
        # to any normal one at once
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except OSError:
            pass
    if cpu_limit_s is not None:
        seconds = max(1, math.ceil(cpu_limit_s))
        resource.setrlimit(resource.RLIMIT_CPU, (seconds, seconds + 1))
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def child_main() -> None:
    """The child side of compile_isolated: one job from stdin; the automaton to its file; ("ok", None) or
    ("error", one line) to stdout."""
    job = pickle.loads(sys.stdin.buffer.read())
    _limit_child(job["cpu_limit_s"])
    vocabulary = Vocabulary(job["token_map"], tuple(job["stop_ids"]), job["n_tokens"], digest="")
    try:
        save_automaton(Path(job["out_path"]), compile_for_vocabulary(job["schema"], vocabulary))
        answer = ("ok", None)
    except ConstraintError as exc:
        answer = ("error", str(exc).splitlines()[0])
    except BaseException as exc:  # noqa: BLE001 - outlines-core panics are BaseExceptions; report them as one line
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        answer = ("error", f"cannot compile the JSON schema: {text}")
    answer = (answer[0], answer[1] and answer[1][:MAX_MESSAGE_CHARS])  # the answer must fit the pipe (see above)
    sys.stdout.buffer.write(pickle.dumps(answer))
    sys.stdout.buffer.flush()


if __name__ == "__main__":
    child_main()
