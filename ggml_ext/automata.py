"""Token automata for structured output, compiled once per (model, schema) and kept in a small LRU cache.

Compiling is outlines-core's work and its cost depends on the schema and the vocabulary: milliseconds for a small
schema, ~10 s for "any JSON object" on the 512-token test vocabulary, and some schemas (bounded string lengths above
a dozen or so) take minutes. So each compile runs in a child Python under a time limit: a schema that would take
too long is refused instead of tying up the server, and a hung compile is killed (docs/generation.md, "Structured
output").
"""
from __future__ import annotations

import json
import pickle
import subprocess
import sys
import threading
from collections import OrderedDict
from typing import Any, Hashable

from dgemma_engine.constrained import ConstraintError, TokenAutomaton, compile_constraint
from dgemma_engine.generate import eos_ids_from_metadata

CACHE_SIZE = 8                 # automata kept per process (the "any JSON object" one of a 262k vocabulary is large)
COMPILE_TIMEOUT_S = 120.0


def schema_key(schema: dict[str, Any] | None) -> str:
    """One text per schema whatever its key order (None: any JSON object)."""
    return json.dumps(schema, sort_keys=True, separators=(",", ":"))


def compile_isolated(schema: dict[str, Any] | None, tokens, token_types, stop_ids,
                     timeout_s: float = COMPILE_TIMEOUT_S) -> TokenAutomaton:
    """compile_constraint in a child Python (`python -m dgemma_engine.automata`, pickles over its stdin/stdout);
    ConstraintError when it fails or runs past `timeout_s` (then it is killed)."""
    types = None if token_types is None else [int(t) for t in token_types]
    job = pickle.dumps((schema, [str(t) for t in tokens], types, [int(t) for t in stop_ids]))
    child = subprocess.Popen([sys.executable, "-m", "dgemma_engine.automata"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        out, _ = child.communicate(job, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate()
        raise ConstraintError(f"the JSON schema is too complex: compiling it took longer than {timeout_s:g} s") from None
    try:
        status, value = pickle.loads(out)
    except Exception:  # noqa: BLE001 - a crashed child leaves nothing readable
        raise ConstraintError(f"cannot compile the JSON schema: the compiler exited with status {child.returncode}")
    if status != "ok":
        raise ConstraintError(value)
    return value


def child_main() -> None:
    """The child side of compile_isolated: one job from stdin, ("ok", automaton) or ("error", text) to stdout."""
    schema, tokens, token_types, stop_ids = pickle.loads(sys.stdin.buffer.read())
    try:
        answer = ("ok", compile_constraint(schema, tokens, token_types, stop_ids))
    except ConstraintError as exc:
        answer = ("error", str(exc))
    except BaseException as exc:  # noqa: BLE001 - outlines-core panics are BaseExceptions; report them as one line
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        answer = ("error", f"cannot compile the JSON schema: {text}")
    sys.stdout.buffer.write(pickle.dumps(answer))
    sys.stdout.buffer.flush()


class AutomatonCache:
    """LRU of compiled automata by (model key, schema). Concurrent requests for the same pair share one compile."""

    def __init__(self, size: int = CACHE_SIZE, timeout_s: float = COMPILE_TIMEOUT_S):
        self.size = size
        self.timeout_s = timeout_s
        self._entries: OrderedDict[tuple[Hashable, str], TokenAutomaton] = OrderedDict()
        self._lock = threading.Lock()
        self._compiling: dict[tuple[Hashable, str], threading.Lock] = {}

    def get(self, model_key: Hashable, schema: dict[str, Any] | None, metadata: dict[str, Any]) -> TokenAutomaton:
        """The automaton for `schema` over the vocabulary in `metadata` (GGUF keys: tokenizer.ggml.tokens,
        tokenizer.ggml.token_type; stop ids as eos_ids_from_metadata)."""
        key = (model_key, schema_key(schema))
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return self._entries[key]
            gate = self._compiling.setdefault(key, threading.Lock())
        with gate:
            with self._lock:
                if key in self._entries:
                    return self._entries[key]
            try:
                automaton = compile_isolated(schema, metadata.get("tokenizer.ggml.tokens") or [],
                                             metadata.get("tokenizer.ggml.token_type"),
                                             eos_ids_from_metadata(metadata), self.timeout_s)
            finally:
                with self._lock:
                    self._compiling.pop(key, None)
            with self._lock:
                self._entries[key] = automaton
                while len(self._entries) > self.size:
                    self._entries.popitem(last=False)
            return automaton


AUTOMATA = AutomatonCache()


if __name__ == "__main__":
    child_main()
