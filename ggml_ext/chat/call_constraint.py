"""A tool call as an output format: the token automaton of "one call, in the template's syntax, of one of these
functions, with arguments that follow its parameter schema" (OpenAI's `tool_choice: "required"` or a named function;
docs/server.md, "Tools").

The automaton is composed from parts, so the costly part is the one structured output already compiles and caches:
1. the begin marker (`<|tool_call>`): its token when the vocabulary has it as one token, else spelled in text tokens;
2. the call's head (`call:NAME`, ToolCallFormat.head) for each function, spelled in text tokens (a trie: names may
   share a start); a token never spans the head and the arguments;
3. the function's arguments: the automaton of its parameter schema (a JSON object), compiled as structured output is;
4. the end marker, then one of the stop ids (the answer ends with the call).
The call's text is then parsed by the template's own parser (tool_calls.py), which reads JSON arguments.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dgemma_engine.chat.tool_calls import ToolCallFormat
from dgemma_engine.constrained import NEVER, ConstraintError, TokenAutomaton


class _Edges:
    """A growing automaton: states are numbered as they are made; edges are collected as arrays."""

    def __init__(self) -> None:
        self.n_states = 0
        self.src: list[np.ndarray] = []
        self.tok: list[np.ndarray] = []
        self.dst: list[np.ndarray] = []

    def state(self, count: int = 1) -> int:
        first, self.n_states = self.n_states, self.n_states + count
        return first

    def add(self, src, tok, dst) -> None:
        tok = np.asarray(tok, dtype=np.int64).reshape(-1)
        self.src.append(np.broadcast_to(np.asarray(src, dtype=np.int64), tok.shape).copy())
        self.tok.append(tok)
        self.dst.append(np.broadcast_to(np.asarray(dst, dtype=np.int64), tok.shape).copy())


def _spell(edges: _Edges, sources: Sequence[int], words: Sequence[bytes], token_map: dict[bytes, list[int]],
           ends: dict[bytes, int] | None = None) -> dict[bytes, int]:
    """States and edges that write each of `words` with text tokens from every state in `sources` (a trie: words
    that share a start share its states). Returns the state reached after each word (`ends` may fix some)."""
    ends = dict(ends or {})
    nodes: dict[bytes, int] = {}  # each proper prefix of a word (b"" stands for `sources`) -> its state
    prefixes = sorted({w[:i] for w in words for i in range(1, len(w))} | {b""}, key=len)
    for prefix in prefixes:
        if prefix:
            nodes[prefix] = edges.state()
    for word in words:
        if word not in ends:
            ends[word] = edges.state()
    longest = max((len(t) for t in token_map), default=0)
    for prefix in prefixes:
        froms = list(sources) if not prefix else [nodes[prefix]]
        reached: dict[int, int] = {}  # token -> state after it, once per token
        for word in words:
            if not word.startswith(prefix) or len(word) == len(prefix):
                continue
            for size in range(1, min(longest, len(word) - len(prefix)) + 1):
                piece = word[len(prefix):len(prefix) + size]
                to = ends[word] if len(prefix) + size == len(word) else nodes.get(prefix + piece)
                if to is None:
                    continue
                for token in token_map.get(piece, ()):
                    reached.setdefault(token, to)
        tokens = np.fromiter(reached.keys(), np.int64, len(reached))
        targets = np.fromiter(reached.values(), np.int64, len(reached))
        for state in froms:
            edges.add(state, tokens, targets)
    return ends


def _marker(edges: _Edges, sources: Sequence[int], marker: str, marker_id: int | None,
            token_map: dict[bytes, list[int]]) -> int:
    """The state after writing `marker` from each of `sources`: its own token where the vocabulary has one."""
    if marker_id is not None:
        after = edges.state()
        for state in sources:
            edges.add(state, [marker_id], after)
        return after
    word = marker.encode("utf-8")
    return _spell(edges, sources, [word], token_map)[word]


def call_automaton(fmt: ToolCallFormat, functions: Sequence[tuple[str, TokenAutomaton]],
                   token_map: dict[bytes, list[int]], stop_ids: Sequence[int],
                   begin_id: int | None = None, end_id: int | None = None) -> TokenAutomaton:
    """The automaton of one call of one of `functions` (name, automaton of its arguments' schema) in `fmt`'s syntax,
    then a stop id. `token_map`: the vocabulary's text tokens (automata.Vocabulary.token_map); `begin_id`/`end_id`:
    the markers' own tokens (None: spelled in text tokens)."""
    if not functions:
        raise ConstraintError("a tool call needs at least one function")
    stops = np.array(sorted({int(t) for t in stop_ids}), dtype=np.int64)
    if not len(stops):
        raise ConstraintError("structured output needs a stop token")
    edges = _Edges()
    initial = edges.state()
    opened = _marker(edges, [initial], fmt.begin, begin_id, token_map)
    heads = {name: fmt.head(name).encode("utf-8") for name, _ in functions}
    after_head = _spell(edges, [opened], list(dict.fromkeys(heads.values())), token_map)
    copies: dict[int, tuple[TokenAutomaton, int]] = {}  # one copy of each arguments automaton, by identity
    finals: list[int] = []
    for name, arguments in functions:
        if id(arguments) not in copies:
            offset = edges.state(arguments.end)  # every state but `end` (the stop ids are the call's now)
            keep = arguments.dst != arguments.end
            edges.add(arguments.src[keep] + offset, arguments.tok[keep], arguments.dst[keep] + offset)
            copies[id(arguments)] = (arguments, offset)
            finals += [offset + f for f in sorted(arguments.finals)]
        arguments, offset = copies[id(arguments)]
        start = (arguments.src == arguments.initial) & (arguments.dst != arguments.end)
        edges.add(after_head[heads[name]], arguments.tok[start], arguments.dst[start] + offset)  # the head opens them
    closed = _marker(edges, finals, fmt.end, end_id, token_map)
    end = edges.state()
    edges.add(closed, stops, end)
    automaton = _automaton(edges, initial, closed)
    if automaton.shortest_value == NEVER:
        raise ConstraintError("the vocabulary cannot write a call of these tools")
    return automaton


def _automaton(edges: _Edges, initial: int, closed: int) -> TokenAutomaton:
    """The collected edges as a TokenAutomaton: one edge per (source, token), grouped by destination."""
    src, tok, dst = (np.concatenate(parts) for parts in (edges.src, edges.tok, edges.dst))
    _, first = np.unique(src * (int(tok.max()) + 1) + tok, return_index=True)  # the first edge of a (source, token)
    first.sort()
    src, tok, dst = src[first], tok[first], dst[first]
    order = np.argsort(dst, kind="stable")
    src, tok, dst = (np.ascontiguousarray(x[order]) for x in (src, tok, dst))
    seg_starts = np.flatnonzero(np.r_[True, dst[1:] != dst[:-1]])
    automaton = TokenAutomaton(edges.n_states, initial, src, tok, dst, seg_starts, dst[seg_starts],
                               frozenset({closed}))
    automaton.tokens_to_close  # noqa: B018 - computed once, where the automaton is made
    return automaton
