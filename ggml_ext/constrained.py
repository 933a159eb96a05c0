"""Structured output for a canvas denoised in parallel: a constrained MAP decode at commit time.

Autoregressive grammar sampling masks one next token at a time; a diffusion canvas has no "next" token. Instead, the
canvas is denoised as usual and, when it is committed, its tokens are chosen jointly: the sequence that maximises the
sum of per-position log-probabilities of the final step among those a token automaton accepts. The automaton comes
from a JSON schema (or "any JSON object") compiled by `outlines-core` over the model's vocabulary; a dynamic program
over positions × automaton states finds the best sequence exactly (docs/generation.md, "Structured output").

After the value closes, a stop id ends the text and the remaining positions are unconstrained (never delivered).
A canvas that does not close the value ends in a live state, and the next canvas continues from it. Each canvas is
told how many tokens may still follow it (the canvases left, the context, `num_predict`) and may only end in a state
whose shortest way to the closed state fits in them, so the value can always close in time and the last canvas
closes it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Sequence

import numpy as np

from dgemma_engine.errors import EngineError

# Token types of a GGUF vocabulary (llama.cpp's numbering) that never occur inside JSON text.
_NOT_TEXT_TYPES = {2, 3, 4, 5}    # unknown, control, user-defined, unused
_BYTE_TYPE = 6
_SPACE_MARK = "▁"
NEVER = np.iinfo(np.int64).max    # tokens_to_close of a state from which the value cannot close


class ConstraintError(EngineError):
    """A schema that cannot be compiled, or a vocabulary that cannot write it."""


def token_bytes(tokens: Sequence[str], token_types: Sequence[int] | None) -> dict[bytes, list[int]]:
    """What each text token writes, as outlines-core's vocabulary map (bytes → ids). Special tokens are left out."""
    out: dict[bytes, list[int]] = {}
    for token_id, token in enumerate(tokens):
        kind = int(token_types[token_id]) if token_types is not None and token_id < len(token_types) else 1
        if kind in _NOT_TEXT_TYPES or not token:
            continue
        if kind == _BYTE_TYPE and len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            written = bytes([int(token[3:5], 16)])
        else:
            written = token.replace(_SPACE_MARK, " ").encode("utf-8")
        out.setdefault(written, []).append(token_id)
    return out


def schema_regex(schema: dict[str, Any] | None) -> str:
    """The regular expression for a JSON schema; None means any JSON object (Ollama's `format: "json"`)."""
    from outlines_core.json_schema import build_regex_from_schema

    try:
        return build_regex_from_schema(json.dumps(schema if schema is not None else {"type": "object"}))
    except Exception as exc:  # outlines-core raises its own types for unsupported or invalid schemas
        raise ConstraintError(f"unsupported JSON schema: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}")


@dataclass(frozen=True)
class TokenAutomaton:
    """A DFA over token ids, edges sorted by destination for the per-position max-reduction. State `end` (the last
    one) is "value closed and a stop id written"."""

    n_states: int
    initial: int
    src: np.ndarray
    tok: np.ndarray
    dst: np.ndarray
    seg_starts: np.ndarray      # first edge of each destination that has incoming edges
    seg_dst: np.ndarray         # that destination
    finals: frozenset[int]

    @property
    def end(self) -> int:
        return self.n_states - 1

    @cached_property
    def tokens_to_close(self) -> np.ndarray:
        """Per state, the fewest tokens (the stop id included) that lead to `end`; NEVER where none do. A
        breadth-first search backwards from `end`, once per automaton (edges are grouped by destination)."""
        incoming = np.full(self.n_states, -1, dtype=np.int64)
        incoming[self.seg_dst] = np.arange(len(self.seg_dst))
        seg_ends = np.r_[self.seg_starts[1:], len(self.dst)]
        distance = np.full(self.n_states, NEVER, dtype=np.int64)
        distance[self.end] = 0
        queue = [self.end]
        for state in queue:  # grows while it is read: states in order of distance
            k = incoming[state]
            if k < 0:
                continue
            sources = np.unique(self.src[self.seg_starts[k]:seg_ends[k]])
            new = sources[distance[sources] == NEVER]
            distance[new] = distance[state] + 1
            queue.extend(new.tolist())
        return distance

    @property
    def shortest_value(self) -> int:
        """Tokens of the shortest value the automaton accepts (the stop id not counted); NEVER if it accepts none."""
        steps = int(self.tokens_to_close[self.initial])
        return NEVER if steps == NEVER else steps - 1

    @classmethod
    def build(cls, transitions: dict[int, dict[int, int]], initial: int, finals: Sequence[int],
              stop_ids: Sequence[int]) -> TokenAutomaton:
        stops = set(int(t) for t in stop_ids)
        states = sorted(set(transitions) | {d for edges in transitions.values() for d in edges.values()} | {initial})
        number = {state: i for i, state in enumerate(states)}
        end = len(states)
        edges = [(number[s], t, number[d]) for s, out in transitions.items() for t, d in out.items() if t not in stops]
        final_numbers = sorted(number[f] for f in finals if f in number)
        edges += [(f, stop, end) for f in final_numbers for stop in sorted(stops)]
        if not edges:
            raise ConstraintError("the vocabulary cannot write any value of this schema")
        arr = np.array(edges, dtype=np.int64)
        arr = arr[np.argsort(arr[:, 2], kind="stable")]
        src, tok, dst = (np.ascontiguousarray(arr[:, k]) for k in range(3))
        seg_starts = np.flatnonzero(np.r_[True, dst[1:] != dst[:-1]])
        automaton = cls(end + 1, number[initial], src, tok, dst, seg_starts, dst[seg_starts], frozenset(final_numbers))
        automaton.tokens_to_close  # noqa: B018 - computed where the automaton is compiled, and pickled with it
        return automaton


def text_token_map(tokens: Sequence[str], token_types: Sequence[int] | None,
                   stop_ids: Sequence[int]) -> dict[bytes, list[int]]:
    """token_bytes without the stop ids: a stop id ends the value, it is never written inside it."""
    if not stop_ids:
        raise ConstraintError("structured output needs a stop token")
    stops = {int(t) for t in stop_ids}
    kept = {written: [i for i in ids if i not in stops] for written, ids in token_bytes(tokens, token_types).items()}
    return {written: ids for written, ids in kept.items() if ids}


def compile_token_map(schema: dict[str, Any] | None, token_map: dict[bytes, list[int]],
                      stop_ids: Sequence[int]) -> TokenAutomaton:
    """A JSON schema (None: any object) → token automaton over `token_map` (text_token_map), ending in a stop id."""
    from outlines_core import Index, Vocabulary

    try:
        index = Index(schema_regex(schema), Vocabulary(int(stop_ids[0]), token_map))
    except ConstraintError:
        raise
    except Exception as exc:
        raise ConstraintError(f"cannot compile the JSON schema for this vocabulary: {exc}") from exc
    return TokenAutomaton.build(index.get_transitions(), index.get_initial_state(), index.get_final_states(),
                                stop_ids)


def compile_constraint(schema: dict[str, Any] | None, tokens: Sequence[str], token_types: Sequence[int] | None,
                       stop_ids: Sequence[int]) -> TokenAutomaton:
    """A JSON schema (None: any object) → token automaton for this vocabulary, ending in one of `stop_ids`."""
    return compile_token_map(schema, text_token_map(tokens, token_types, stop_ids), stop_ids)


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


@dataclass(frozen=True)
class ConstrainedCanvas:
    ids: list[int]
    state: int          # automaton state after the canvas (`end`: the value is closed)
    log_prob: float


def best_canvas(logits: np.ndarray, automaton: TokenAutomaton, state: int,
                tokens_after: int | None) -> ConstrainedCanvas:
    """The most probable canvas (sum of log-softmax over positions) that the automaton accepts from `state`.
    tokens_after: how many tokens may still follow this canvas (None: no limit). The canvas ends in a state from which
    the value can close within them (0: it closes in this canvas); when no such state is reachable, in the reachable
    state nearest to closing, so the text stays a valid prefix."""
    logp = _log_softmax(np.asarray(logits, dtype=np.float32))
    positions = logp.shape[0]
    a = automaton
    row_best = logp.argmax(axis=1)
    row_max = logp[np.arange(positions), row_best]
    score = np.full(a.n_states, -np.inf)
    score[state] = 0.0
    back = np.empty((positions, a.n_states), dtype=np.int64)  # edge taken into each state, -1: stayed closed
    for i in range(positions):
        cand = score[a.src] + logp[i, a.tok]
        best = np.maximum.reduceat(cand, a.seg_starts)
        winners = np.flatnonzero(cand == np.repeat(best, np.diff(np.r_[a.seg_starts, len(cand)])))
        seg_of = np.searchsorted(a.seg_starts, winners, side="right") - 1
        first = winners[np.r_[True, seg_of[1:] != seg_of[:-1]]]
        new = np.full(a.n_states, -np.inf)
        new[a.seg_dst] = best
        back[i, a.seg_dst] = first
        stay = score[a.end] + row_max[i]
        if stay > new[a.end]:
            new[a.end] = stay
            back[i, a.end] = -1
        score = new
    reached = np.isfinite(score)
    if not reached.any():
        raise ConstraintError("no canvas satisfies the output format from this point")
    if tokens_after is not None:
        to_close = a.tokens_to_close
        fits = reached & (to_close <= tokens_after)
        score = np.where(fits if fits.any() else reached & (to_close == to_close[reached].min()), score, -np.inf)
    last = int(np.argmax(score))
    ids = [0] * positions
    s = last
    for i in range(positions - 1, -1, -1):
        edge = back[i, s]
        if edge < 0:
            ids[i] = int(row_best[i])
        else:
            ids[i] = int(a.tok[edge])
            s = int(a.src[edge])
    return ConstrainedCanvas(ids, last, float(score[last]))


def check_room(automaton: TokenAutomaton, canvas_tokens: int, token_limit: int | None) -> None:
    """ConstraintError when even the shortest value cannot be written within the budget: `canvas_tokens` positions
    (the canvases the budget and the context allow; the stop id must be among them) and `token_limit` delivered tokens
    (`num_predict`; the stop id may follow the cut)."""
    shortest = automaton.shortest_value
    if shortest == NEVER:
        raise ConstraintError("the vocabulary cannot write any value of this format")
    if token_limit is not None and shortest > token_limit:
        raise ConstraintError(f"num_predict {token_limit} is too small for this format: its shortest value takes "
                              f"{shortest} tokens")
    if shortest + 1 > canvas_tokens:
        raise ConstraintError(f"the canvases this request can denoise hold {canvas_tokens} tokens, too few for this "
                              f"format: its shortest value takes {shortest} tokens and a stop token")


@dataclass
class CanvasConstraint:
    """The state of one constrained generation across its canvases. token_limit: an exact cut of the delivered
    tokens (Ollama's `num_predict`); the value must then close before it, not just within the canvas."""

    automaton: TokenAutomaton
    token_limit: int | None = None
    state: int = field(init=False)
    written: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.state = self.automaton.initial

    @property
    def closed(self) -> bool:
        return self.state == self.automaton.end

    def commit(self, logits: np.ndarray, tokens_after: int | None) -> list[int]:
        """The canvas to commit instead of the argmax canvas. tokens_after: how many tokens the canvases that may
        follow this one hold (0: none may; None: no limit besides `token_limit`)."""
        logits = np.asarray(logits)
        positions = logits.shape[0]
        room = None if self.token_limit is None else max(0, self.token_limit - self.written)
        self.written += positions
        if room is not None and room < positions:
            # the cut falls inside this canvas: close within the delivered tokens (the stop id may sit right at the
            # cut, it is never delivered); what follows is cut anyway
            head = room + 1
            chosen = best_canvas(logits[:head], self.automaton, self.state, tokens_after=0)
            self.state = chosen.state
            return chosen.ids + [int(t) for t in logits[head:].argmax(axis=1)]
        if room is not None:  # the cut comes later: the stop id may still sit right at it
            after_cut = room - positions + 1
            tokens_after = after_cut if tokens_after is None else min(tokens_after, after_cut)
        chosen = best_canvas(logits, self.automaton, self.state, tokens_after)
        self.state = chosen.state
        return chosen.ids
