"""Structured output for a canvas denoised in parallel: a constrained MAP decode at commit time.

Autoregressive grammar sampling masks one next token at a time; a diffusion canvas has no "next" token. Instead, the
canvas is denoised as usual and, when it is committed, its tokens are chosen jointly: the sequence that maximises the
sum of per-position log-probabilities of the final step among those a token automaton accepts. The automaton comes
from a JSON schema (or "any JSON object") compiled by `outlines-core` over the model's vocabulary; a dynamic program
over positions × automaton states finds the best sequence exactly (docs/generation.md, "Structured output").
best_canvas runs that program over runs of edges and deduplicated token sets instead of single edges ("the fast
decode" below) and returns exactly the canvas of the plain program, best_canvas_reference, which tests compare it to.

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


# A deterministic refusal: the model's tokens cannot spell any value of the format (e.g. a digits-only vocabulary)
VOCABULARY_CANNOT_WRITE = "this model's vocabulary cannot write this format"


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
        # Edges in the order of `transitions` (its sources, then each source's tokens), then the stop edges; stably
        # sorted by destination. Array work per source: "any JSON object" at 262,144 tokens has 19 million edges.
        stops = np.array(sorted({int(t) for t in stop_ids}), dtype=np.int64)
        outs = [(int(s), np.fromiter(out.keys(), np.int64, len(out)), np.fromiter(out.values(), np.int64, len(out)))
                for s, out in transitions.items()]
        states = np.unique(np.concatenate([np.array([initial, *transitions], dtype=np.int64), *(d for *_, d in outs)]))
        end = len(states)                               # state ids are numbered in ascending order
        srcs, toks, dsts = [], [], []
        for s, tok, dst in outs:
            if len(stops):
                kept = ~np.isin(tok, stops)
                tok, dst = tok[kept], dst[kept]
            toks.append(tok)
            dsts.append(np.searchsorted(states, dst))
            srcs.append(np.full(len(tok), np.searchsorted(states, s), dtype=np.int64))
        finals = np.array(sorted({int(f) for f in finals}), dtype=np.int64)
        at = np.minimum(np.searchsorted(states, finals), end - 1)
        final_numbers = at[states[at] == finals]        # finals that are no state are dropped
        srcs.append(np.repeat(final_numbers, len(stops)))
        toks.append(np.tile(stops, len(final_numbers)))
        dsts.append(np.full(len(final_numbers) * len(stops), end, dtype=np.int64))
        src, tok, dst = (np.concatenate(parts) for parts in (srcs, toks, dsts))
        if not len(src):
            raise ConstraintError("the vocabulary cannot write any value of this schema")
        order = np.argsort(dst, kind="stable")
        src, tok, dst = (np.ascontiguousarray(x[order]) for x in (src, tok, dst))
        seg_starts = np.flatnonzero(np.r_[True, dst[1:] != dst[:-1]])
        automaton = cls(end + 1, int(np.searchsorted(states, initial)), src, tok, dst, seg_starts, dst[seg_starts],
                        frozenset(int(f) for f in final_numbers))
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
        text = str(exc)
        if "incompatible with the regex" in text:  # outlines-core's word; its message then quotes the whole regex
            raise ConstraintError(VOCABULARY_CANNOT_WRITE) from None
        first = text.splitlines()[0][:200] if text else type(exc).__name__
        raise ConstraintError(f"cannot compile the JSON schema for this vocabulary: {first}") from None
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


# ---- the fast decode -----------------------------------------------------------------------------------------------
#
# The plain program costs one pass over every edge per position: states × matching tokens, tens of millions of edges
# for "any JSON object" at the released 262,144 tokens. The fast decode returns the same canvas (bit for bit: ids,
# state, log_prob) from far less:
# - The edges are split into runs: consecutive edges (in the automaton's order, grouped by destination) with one
#   source and one destination. Within a run the score of an edge is score[src] + logp[i, tok], so the best edge of a
#   run is the one of the best token: per position the program needs only, per run, the max of logp over its token
#   set, and float64 addition is monotone, so score[src] + that max is exactly the best edge's score. Runs are
#   disjoint and in edge order, so the first edge of the best score into a state lies in the first run reaching it.
#   Thousands of runs replace millions of edges in the per-position loop.
# - Many runs share one token set (every "inside a string" state allows the same tokens), so the sets are
#   deduplicated once per automaton (DecodeIndex). Per canvas, the max over each set is computed for all positions at
#   once, before the loop (it does not depend on the scores): small sets directly; large ones from each position's
#   top candidates by logit (those above a threshold taken from a strided sample of the row), walked down in order
#   until a member is found, which is exact when that member's logp is strictly above the threshold's (every other
#   token is at or below it); where none is, the same over a deeper tier of candidates for that row (for very large
#   sets, such as a string's characters, when the row favours the few tokens outside it), and otherwise directly.
# - Which token of the winning run an edge stands for is settled only on the path traced back: the set's argmax token
#   when it is unique and no lower token of the set could round to the same float64 score; otherwise the run's edges
#   are scanned as the plain program would.
# - The log-softmax is never materialised: logp[i, t] = (x[i, t] - max_i) - lse_i in float32, the same operations as
#   _log_softmax, only for the tokens looked at; lse_i is computed as _log_softmax computes it, row by row.

SMALL_SET = 2048          # token sets up to this size are maxed directly; larger ones through the candidates
SAMPLE_STRIDE = 128       # the candidate threshold: the SAMPLE_RANK-th largest of every SAMPLE_STRIDE-th logit
SAMPLE_RANK = 2           # (about SAMPLE_RANK × SAMPLE_STRIDE candidates per position)
MAX_CANDIDATES = 4096     # a row with more candidates than this gets the exact MAX_CANDIDATES-th value instead
DEEP_FACTOR = 16          # the second tier of candidates, for rows where a large set has no member in the first,
DEEP_MIN_SET = 65536      # for sets larger than this (for smaller ones, reading all members costs less)


@dataclass(frozen=True, eq=False)
class DecodeIndex:
    """What the fast decode needs from an automaton: its runs and their deduplicated token sets. Built once per
    automaton in memory (a third of a second for "any JSON object" at 262,144 tokens: 19 million edges, 6,454 runs,
    109 token sets), never saved."""

    run_src: np.ndarray       # [R] source state of each run (a run: consecutive edges with one source and destination)
    run_start: np.ndarray     # [R] its first edge
    run_stop: np.ndarray      # [R] one past its last edge
    run_set: np.ndarray       # [R] its token set
    run_group: np.ndarray     # [R] its destination's group
    group_start: np.ndarray   # [G] first run into each destination that has incoming edges
    group_dst: np.ndarray     # [G] that destination
    n_tokens: int             # one past the largest token id of the automaton
    small_tokens: np.ndarray  # members of the small sets 0 .. n_small - 1, each ascending, concatenated
    small_offsets: np.ndarray  # [n_small] where each starts
    big_tokens: tuple         # members of the large sets n_small, n_small + 1, ..., ascending
    big_masks: np.ndarray     # [n_big, n_tokens + 1] membership; the last column (tokens past the automaton's) False

    @property
    def n_small(self) -> int:
        return len(self.small_offsets)

    @property
    def n_sets(self) -> int:
        return self.n_small + len(self.big_tokens)

    @classmethod
    def build(cls, automaton: TokenAutomaton, small_set: int = SMALL_SET) -> DecodeIndex:
        src, tok, dst = automaton.src, automaton.tok, automaton.dst
        n_edges = len(tok)
        cut = np.flatnonzero((src[1:] != src[:-1]) | (dst[1:] != dst[:-1])) + 1
        run_start = np.r_[0, cut].astype(np.int64)
        run_stop = np.r_[cut, n_edges].astype(np.int64)
        n_runs = len(run_start)
        run_dst = dst[run_start]
        group_start = np.flatnonzero(np.r_[True, run_dst[1:] != run_dst[:-1]])
        run_group = np.repeat(np.arange(len(group_start)), np.diff(np.r_[group_start, n_runs]))
        n_tokens = int(tok.max()) + 1
        sizes = run_stop - run_start
        fingerprint = _run_fingerprints(tok, run_stop, n_tokens)
        # runs with the same size and fingerprint are candidates for one set; each is checked exactly
        order = np.lexsort((fingerprint, sizes))
        same = (sizes[order][1:] == sizes[order][:-1]) & (fingerprint[order][1:] == fingerprint[order][:-1])
        run_set = np.full(n_runs, -1, dtype=np.int64)
        reps: list[int] = []     # the run whose tokens stand for each set
        masks: dict[int, np.ndarray] = {}

        def members(run: int) -> np.ndarray:
            return tok[run_start[run]:run_stop[run]]

        distinct: dict[int, np.ndarray] = {}

        def sorted_members(run: int) -> np.ndarray:
            if run not in distinct:
                distinct[run] = np.unique(members(run))
            return distinct[run]

        def mask_of(run: int) -> np.ndarray:
            mask = np.zeros(n_tokens + 1, dtype=bool)
            mask[members(run)] = True
            return mask

        k = 0
        while k < n_runs:
            j = k + 1
            while j <= n_runs - 1 and same[j - 1]:
                j += 1
            block = order[k:j].tolist()  # runs with one (size, fingerprint), in run order
            block.sort()
            open_sets: list[int] = []    # sets made in this block (a fingerprint collision makes several)
            for run in block:
                for set_id in open_sets:
                    rep = reps[set_id]
                    if sizes[run] <= small_set:
                        equal = np.array_equal(sorted_members(run), sorted_members(rep))
                    else:
                        if rep not in masks:
                            masks[rep] = mask_of(rep)
                        equal = np.array_equal(mask_of(run), masks[rep])
                    if equal:
                        run_set[run] = set_id
                        break
                else:
                    run_set[run] = len(reps)
                    open_sets.append(len(reps))
                    reps.append(run)
            k = j
        # number the small sets first, then the large ones
        rep_sizes = np.array([len(members(r)) for r in reps], dtype=np.int64)
        small = rep_sizes <= small_set
        new_id = np.empty(len(reps), dtype=np.int64)
        new_id[small] = np.arange(int(small.sum()))
        new_id[~small] = int(small.sum()) + np.arange(int((~small).sum()))
        run_set = new_id[run_set]
        small_reps = [r for r, s in zip(reps, small) if s]
        big_reps = [r for r, s in zip(reps, small) if not s]
        # each set's tokens ascending (its rows are gathered in memory order) and once each
        small_tokens = (np.concatenate([sorted_members(r) for r in small_reps]) if small_reps
                        else np.zeros(0, dtype=np.int64))
        small_offsets = np.cumsum([0] + [len(sorted_members(r)) for r in small_reps[:-1]]).astype(np.int64) \
            if small_reps else np.zeros(0, dtype=np.int64)
        big_masks = np.stack([masks[r] if r in masks else mask_of(r) for r in big_reps]) if big_reps \
            else np.zeros((0, n_tokens + 1), dtype=bool)
        return cls(src[run_start].astype(np.int64), run_start, run_stop, run_set, run_group,
                   group_start.astype(np.int64), run_dst[group_start].astype(np.int64), n_tokens,
                   np.ascontiguousarray(small_tokens, dtype=np.int64), small_offsets,
                   tuple(np.flatnonzero(mask[:n_tokens]) for mask in big_masks), big_masks)


def _run_fingerprints(tok: np.ndarray, run_stop: np.ndarray, n_tokens: int, chunk: int = 1 << 22) -> np.ndarray:
    """Per run, the wrapping sum of a fixed random 64-bit hash of its tokens (order-free), in chunks of edges."""
    hashes = np.random.default_rng(0x5EED).integers(0, np.iinfo(np.uint64).max, size=n_tokens, dtype=np.uint64,
                                                    endpoint=True)
    last = run_stop - 1
    at_last = np.empty(len(run_stop), dtype=np.uint64)
    carry = np.uint64(0)
    for lo in range(0, len(tok), chunk):
        part = np.cumsum(hashes[tok[lo:lo + chunk]], dtype=np.uint64)
        part += carry
        here = (last >= lo) & (last < lo + chunk)
        at_last[here] = part[last[here] - lo]
        carry = part[-1]
    return np.diff(at_last, prepend=np.uint64(0))


def decode_index(automaton: TokenAutomaton) -> DecodeIndex:
    """The automaton's DecodeIndex, built on first use and kept with it (in memory only: save_automaton skips it)."""
    index = automaton.__dict__.get("_decode_index")
    if index is None:
        index = DecodeIndex.build(automaton)
        automaton.__dict__["_decode_index"] = index
    return index


def _scan_rows(x: np.ndarray, gather: np.ndarray, sample_stride: int, sample_rank: int, max_candidates: int):
    """One pass over the logits, row by row, so that each row is read from memory once and its temporaries stay in
    cache. Per row: its max; its log-normaliser lse = log(sum(exp(x - max))) in float32, exactly as _log_softmax
    computes it; its candidate threshold, the sample_rank-th largest of every sample_stride-th logit (or, when more
    than max_candidates tokens lie above that, the max_candidates-th largest logit); its candidates, the tokens above
    the threshold, and their logits; and its logits at the `gather` tokens. Returns (max, lse, threshold, candidate
    rows, candidate tokens, their logits, gathered logits), or None when a row's max is not finite (NaN or +inf in
    it, or a row of -inf)."""
    positions, vocab = x.shape
    mx = np.empty(positions, dtype=np.float32)
    threshold = np.empty(positions, dtype=np.float32)
    sums = np.empty((positions, 1), dtype=np.float32)
    gathered = np.empty((positions, len(gather)), dtype=np.float32)
    scratch = np.empty((1, vocab), dtype=np.float32)
    n_sample = len(range(0, vocab, sample_stride))
    rank = n_sample - min(sample_rank, n_sample)
    rows, cols, values = [], [], []
    for i in range(positions):
        row2 = x[i:i + 1]
        row = row2[0]
        top = row.max()
        if not np.isfinite(top):
            return None
        mx[i] = top
        sample = row[::sample_stride].copy()
        sample.partition(rank)
        threshold[i] = sample[rank]
        np.subtract(row2, top, out=scratch)
        np.exp(scratch, out=scratch)
        sums[i] = scratch.sum(axis=1, keepdims=True)
        found = np.flatnonzero(row > threshold[i])
        if len(found) > max_candidates:
            threshold[i] = np.partition(row, vocab - max_candidates)[vocab - max_candidates]
            found = np.flatnonzero(row > threshold[i])
        rows.append(np.full(len(found), i))
        cols.append(found)
        values.append(row[found])
        np.take(row, gather, out=gathered[i])
    return (mx, np.log(sums)[:, 0], threshold, np.concatenate(rows), np.concatenate(cols), np.concatenate(values),
            gathered)


@dataclass
class _SetMax:
    """Per position and token set: the max logp, a token reaching it, whether more than one does, and a bound on
    the largest logp of the set below the max (for the rounding check)."""

    value: np.ndarray   # [C, S] float32
    token: np.ndarray   # [C, S] int64
    tie: np.ndarray     # [C, S] bool
    below: np.ndarray   # [C, S] float32


def _direct(x, mx, lse, rows: np.ndarray, tokens: np.ndarray):
    """_SetMax columns of one set for `rows`, over all its members."""
    g = (x[np.ix_(rows, tokens)] - mx[rows, None]) - lse[rows, None]
    value = g.max(axis=1)
    eq = g == value[:, None]
    below = np.where(eq, np.float32(-np.inf), g).max(axis=1)
    return value, tokens[eq.argmax(axis=1)], eq.sum(axis=1) > 1, below


def _walk(sets: _SetMax, set_id: int, mask: np.ndarray, rows: np.ndarray, cols: np.ndarray, lp: np.ndarray,
          bound: np.ndarray) -> np.ndarray:
    """Fill the set's _SetMax columns for the rows whose candidates (rows, cols, lp: sorted by row, then by logp
    descending; every other token of row i has logp <= bound[i]) settle it: those where the first member among the
    candidates is strictly above the bound. Returns which rows were settled."""
    settled = np.zeros(len(bound), dtype=bool)
    hits = np.flatnonzero(mask[np.minimum(cols, len(mask) - 1)])
    if not len(hits):
        return settled
    r, v = rows[hits], lp[hits]
    starts = np.flatnonzero(np.r_[True, r[1:] != r[:-1]])
    ends = np.r_[starts[1:], len(hits)]
    at, top = r[starts], v[starts]
    same = np.add.reduceat(v == np.repeat(top, ends - starts), starts, dtype=np.int64)  # members tied at the top
    nxt = starts + same
    below = np.where(nxt < ends, v[np.minimum(nxt, len(v) - 1)], bound[at])  # the next member down, or the bound
    ok = top > bound[at]
    at = at[ok]
    sets.value[at, set_id] = top[ok]
    sets.token[at, set_id] = cols[hits[starts[ok]]]
    sets.tie[at, set_id] = same[ok] > 1
    sets.below[at, set_id] = below[ok]
    settled[at] = True
    return settled


class _DeepCandidates:
    """A second, deeper tier of candidates (DEEP_FACTOR times as many), made only for the rows where a large set has
    no member among the first ones (a row that favours tokens outside the set), and kept for the other sets."""

    def __init__(self, x, mx, lse, stride: int, rank: int, cap: int):
        self.x, self.mx, self.lse, self.stride, self.rank, self.cap = x, mx, lse, stride, rank, cap
        self.rows: dict[int, tuple[np.ndarray, np.ndarray, np.float32]] = {}

    def _row(self, i: int):
        if i not in self.rows:
            row, vocab = self.x[i], self.x.shape[1]
            sample = row[::self.stride].copy()
            rank = len(sample) - min(self.rank, len(sample))
            sample.partition(rank)
            threshold = sample[rank]
            found = np.flatnonzero(row > threshold)
            if len(found) > self.cap:
                threshold = np.partition(row, vocab - self.cap)[vocab - self.cap]
                found = np.flatnonzero(row > threshold)
            lp = (row[found] - self.mx[i]) - self.lse[i]
            order = np.argsort(-lp, kind="stable")
            self.rows[i] = (found[order], lp[order], (threshold - self.mx[i]) - self.lse[i])
        return self.rows[i]

    def of(self, rows: np.ndarray):
        """(rows, cols, lp, bound) of the deeper candidates of `rows`, as _walk takes them (bound: for all rows)."""
        parts = [self._row(int(i)) for i in rows]
        bound = np.full(len(self.mx), np.float32(np.inf))
        bound[rows] = [p[2] for p in parts]
        return (np.repeat(rows, [len(p[0]) for p in parts]), np.concatenate([p[0] for p in parts]),
                np.concatenate([p[1] for p in parts]).astype(np.float32), bound)


def best_canvas(logits: np.ndarray, automaton: TokenAutomaton, state: int, tokens_after: int | None, *,
                index: DecodeIndex | None = None, sample_stride: int = SAMPLE_STRIDE, sample_rank: int = SAMPLE_RANK,
                max_candidates: int = MAX_CANDIDATES, deep_min_set: int = DEEP_MIN_SET) -> ConstrainedCanvas:
    """The most probable canvas (sum of log-softmax over positions) that the automaton accepts from `state`.
    tokens_after: how many tokens may still follow this canvas (None: no limit). The canvas ends in a state from which
    the value can close within them (0: it closes in this canvas); when no such state is reachable, in the reachable
    state nearest to closing, so the text stays a valid prefix.

    The same canvas as best_canvas_reference (the plain dynamic program), ties and float rounding included, at a
    fraction of its cost (see "the fast decode" above). The keyword arguments are for tests."""
    a = automaton
    x = np.asarray(logits, dtype=np.float32)
    if x.ndim != 2 or x.shape[0] == 0:
        return best_canvas_reference(logits, a, state, tokens_after)
    ix = decode_index(a) if index is None else index
    positions, vocab = x.shape
    if ix.n_tokens > vocab:  # the plain program's own error
        return best_canvas_reference(logits, a, state, tokens_after)
    x = np.ascontiguousarray(x)
    scanned = _scan_rows(x, ix.small_tokens, sample_stride, sample_rank, max_candidates)
    if scanned is None:  # the plain program's arithmetic on non-finite logits
        return best_canvas_reference(logits, a, state, tokens_after)
    mx, lse, threshold, rows, cols, values, gathered = scanned
    row_max = (mx - mx) - lse  # logp of each row's argmax, as the plain program reads it
    # the candidates, sorted by logp (descending) within each row
    lp = (values - mx[rows]) - lse[rows]
    order = np.lexsort((-lp, rows))
    rows, cols, lp = rows[order], cols[order], lp[order]
    bound = (threshold - mx) - lse  # every token outside the candidates has logp <= bound

    sets = _SetMax(np.empty((positions, ix.n_sets), np.float32), np.empty((positions, ix.n_sets), np.int64),
                   np.empty((positions, ix.n_sets), bool), np.empty((positions, ix.n_sets), np.float32))
    all_rows = np.arange(positions)
    if ix.n_small:
        offsets = ix.small_offsets
        g = (gathered - mx[:, None]) - lse[:, None]
        value = np.maximum.reduceat(g, offsets, axis=1)
        eq = g == np.repeat(value, np.diff(np.r_[offsets, g.shape[1]]), axis=1)
        first = np.minimum.reduceat(np.where(eq, np.arange(g.shape[1]), g.shape[1]), offsets, axis=1)
        s = slice(0, ix.n_small)
        sets.value[:, s] = value
        sets.token[:, s] = ix.small_tokens[first]
        sets.tie[:, s] = np.add.reduceat(eq, offsets, axis=1, dtype=np.int32) > 1
        sets.below[:, s] = np.maximum.reduceat(np.where(eq, np.float32(-np.inf), g), offsets, axis=1)
    deeper = _DeepCandidates(x, mx, lse, sample_stride, sample_rank * DEEP_FACTOR, max_candidates * DEEP_FACTOR)
    for k, tokens in enumerate(ix.big_tokens):
        set_id = ix.n_small + k
        settled = _walk(sets, set_id, ix.big_masks[k], rows, cols, lp, bound)
        rest = all_rows[~settled]
        if len(rest) and len(tokens) > deep_min_set:  # no member above the threshold: the same walk over more
            # candidates of those rows
            d_rows, d_cols, d_lp, d_bound = deeper.of(rest)
            settled[rest] = _walk(sets, set_id, ix.big_masks[k], d_rows, d_cols, d_lp, d_bound)[rest]
            rest = all_rows[~settled]
        if len(rest):
            (sets.value[rest, set_id], sets.token[rest, set_id], sets.tie[rest, set_id],
             sets.below[rest, set_id]) = _direct(x, mx, lse, rest, tokens)

    # the program over runs
    run_value = sets.value[:, ix.run_set]
    run_src, group_start, group_dst, run_group = ix.run_src, ix.group_start, ix.group_dst, ix.run_group
    n_runs = len(run_src)
    run_ids = np.arange(n_runs)
    end = a.end
    score = np.full(a.n_states, -np.inf)
    score[state] = 0.0
    history = np.empty((positions, a.n_states))
    back = np.empty((positions, a.n_states), dtype=np.int64)  # run taken into each state, -1: stayed closed
    for i in range(positions):
        history[i] = score
        cand = score[run_src] + run_value[i]
        best = np.maximum.reduceat(cand, group_start)
        first = np.minimum.reduceat(np.where(cand == best[run_group], run_ids, n_runs), group_start)
        new = np.full(a.n_states, -np.inf)
        new[group_dst] = best
        back[i, group_dst] = first
        score = _stay_at_end(new, back[i], score, end, row_max[i])
    score, last = _final_state(score, a, tokens_after)

    def step_back(i: int, run: int) -> tuple[int, int | None]:
        if run < 0:
            return _row_argmax(x, mx, lse, row_max, bound, rows, cols, lp, i), None
        set_id, source = ix.run_set[run], int(run_src[run])
        base = history[i, source]
        reached_score = base + sets.value[i, set_id]
        if sets.tie[i, set_id] or base + sets.below[i, set_id] == reached_score:
            # several tokens of the run reach the score: the first edge, as the plain program takes it
            tokens = a.tok[ix.run_start[run]:ix.run_stop[run]]
            scores = base + ((x[i, tokens] - mx[i]) - lse[i])
            return int(tokens[np.argmax(scores == reached_score)]), source
        return int(sets.token[i, set_id]), source

    return ConstrainedCanvas(_backtrack(back, last, step_back), last, float(score[last]))


def _backtrack(back: np.ndarray, last: int, step_back) -> list[int]:
    """The token of each position, from the last back to the first: `step_back(i, back[i, state])` gives position i's
    token and the state before it (None: the same state, a position that stayed closed)."""
    ids = [0] * len(back)
    state = last
    for i in range(len(back) - 1, -1, -1):
        ids[i], before = step_back(i, int(back[i, state]))
        state = state if before is None else before
    return ids


def _stay_at_end(new: np.ndarray, back_row: np.ndarray, score: np.ndarray, end: int, row_best: float) -> np.ndarray:
    """A closed value may be followed by anything: at `end` a position takes its row's best token (back -1) when that
    beats arriving there by an edge. Returns `new`, the scores after this position."""
    stay = score[end] + row_best
    if stay > new[end]:
        new[end] = stay
        back_row[end] = -1
    return new


def _final_state(score: np.ndarray, automaton: TokenAutomaton, tokens_after: int | None) -> tuple[np.ndarray, int]:
    """The state a canvas ends in, from the scores after its last position: the best one from which the value can
    close within `tokens_after` tokens (None: no limit), else the reachable one nearest to closing. Returns the
    scores left to choose from and that state."""
    reached = np.isfinite(score)
    if not reached.any():
        raise ConstraintError("no canvas satisfies the output format from this point")
    if tokens_after is not None:
        to_close = automaton.tokens_to_close
        fits = reached & (to_close <= tokens_after)
        score = np.where(fits if fits.any() else reached & (to_close == to_close[reached].min()), score, -np.inf)
    return score, int(np.argmax(score))


def _row_argmax(x, mx, lse, row_max, bound, rows, cols, lp, i: int) -> int:
    """The first token of row i with the row's max logp (the plain program's argmax of its log-softmax row)."""
    if row_max[i] > bound[i]:  # all of them are among the candidates
        lo, hi = np.searchsorted(rows, [i, i + 1])
        return int(cols[lo:hi][lp[lo:hi] == row_max[i]].min())
    return int(np.argmax((x[i] - mx[i]) - lse[i]))


def best_canvas_reference(logits: np.ndarray, automaton: TokenAutomaton, state: int,
                tokens_after: int | None) -> ConstrainedCanvas:
    """best_canvas by the plain dynamic program: one numpy pass over all the automaton's edges per position, over
    the whole log-softmax. The definition the fast decode (best_canvas) must reproduce exactly, ties included: into
    each state the first edge (in the automaton's edge order) of the highest score; at state `end`, staying closed
    (the position's argmax token) only when strictly better. Tests compare the two."""
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
        score = _stay_at_end(new, back[i], score, a.end, row_max[i])
    score, last = _final_state(score, a, tokens_after)

    def step_back(i: int, edge: int) -> tuple[int, int | None]:
        return (int(row_best[i]), None) if edge < 0 else (int(a.tok[edge]), int(a.src[edge]))

    return ConstrainedCanvas(_backtrack(back, last, step_back), last, float(score[last]))


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
