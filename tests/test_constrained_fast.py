"""The fast constrained decode (best_canvas) returns exactly the canvas of the plain dynamic program
(best_canvas_reference): the same ids, end state and log_prob, bit for bit, ties included. Checked on 1,200 random
cases (small random automata and vocabularies, random and adversarial logits: heavy ties, flat rows, -inf entries,
rows so unlikely that the float64 scores swallow float32 differences; edges into a state in any order), with the
decoder's size thresholds lowered so that every path of it runs (direct sets, candidate walks, fallbacks, capped
candidate rows), and on the automata of the test schemas over tiny-a's vocabulary."""
from __future__ import annotations

import numpy as np
import pytest

from dgemma_engine.automata import load_automaton, save_automaton
from dgemma_engine.constrained import (ConstraintError, DecodeIndex, TokenAutomaton, _log_softmax, _scan_rows,
                                       best_canvas, best_canvas_reference, compile_constraint, decode_index)
from dgemma_engine.generate import eos_ids_from_metadata
from json_schemas import SCHEMAS

CASES_PER_SEED = 100
SEEDS = range(12)  # 1,200 cases


def random_automaton(rng: np.random.Generator, vocab: int) -> TokenAutomaton:
    """A random DFA over `vocab` token ids (the last one or two are stop ids) whose states often share token sets
    (as the string states of a JSON automaton do), so the decoder's set deduplication and large-set paths run."""
    n_stops = int(rng.integers(1, 3))
    stops = list(range(vocab - n_stops, vocab))
    text = np.arange(vocab - n_stops)
    n_states = int(rng.integers(1, 9))
    shared = [rng.choice(text, size=int(rng.integers(1, len(text) + 1)), replace=False) for _ in range(3)]
    transitions: dict[int, dict[int, int]] = {}
    for state in range(n_states):
        out: dict[int, int] = {}
        for _ in range(int(rng.integers(0, 4))):
            tokens = shared[int(rng.integers(3))] if rng.random() < 0.6 else \
                rng.choice(text, size=int(rng.integers(1, len(text) + 1)), replace=False)
            order = rng.permutation(len(tokens))  # each state lists its tokens in its own order
            dst = int(rng.integers(n_states))
            for t in tokens[order]:
                out.setdefault(int(t), dst)
        if out:
            transitions[state] = out
    present = sorted(set(transitions) | {d for out in transitions.values() for d in out.values()} | {0})
    finals = [s for s in present if rng.random() < 0.4] or [present[-1]]
    return TokenAutomaton.build(transitions, initial=0, finals=finals, stop_ids=stops)


def interleaved(automaton: TokenAutomaton, rng: np.random.Generator) -> TokenAutomaton:
    """The same automaton with the edges into each state in a random order, so that one (source, destination) pair
    is split over several runs and the first edge of a tie can lie in any of them."""
    order = np.lexsort((rng.random(len(automaton.dst)), automaton.dst))
    return TokenAutomaton(automaton.n_states, automaton.initial, automaton.src[order], automaton.tok[order],
                          automaton.dst[order], automaton.seg_starts, automaton.seg_dst, automaton.finals)


def random_logits(rng: np.random.Generator, positions: int, vocab: int) -> np.ndarray:
    kind = int(rng.integers(8))
    if kind == 0:   # smooth
        x = rng.normal(size=(positions, vocab)) * rng.choice([0.5, 3.0, 20.0])
    elif kind == 1:  # a few values: ties everywhere
        x = rng.integers(0, int(rng.integers(1, 4)), size=(positions, vocab)).astype(float)
    elif kind == 2:  # flat rows among smooth ones
        x = rng.normal(size=(positions, vocab))
        x[rng.random(positions) < 0.5] = 1.5
    elif kind == 3:  # -inf entries (a masked model)
        x = rng.normal(size=(positions, vocab))
        x[rng.random((positions, vocab)) < 0.3] = -np.inf
        x[:, 0] = rng.normal(size=positions)  # no row entirely -inf
    elif kind in (4, 7):  # rows of values a few float32 steps apart, which the log-softmax rounds together; with
        # kind 4 also rows where every text token is hugely unlikely (scores near -4e9 for an open value), after which
        # the float64 sums round them together
        base = np.float32(rng.normal())
        steps = rng.integers(0, 6, size=(positions, vocab)).astype(np.float32)
        x = base + steps * np.spacing(base)
        x[rng.random((positions, vocab)) < rng.random()] = base - 3  # far below: thresholds far from the top
        if kind == 4:
            huge = rng.random(positions) < 0.4
            x[huge] = 0
            x[huge, -1] = np.float32(4e9)  # a stop id: every text token costs -4e9 there
        return x
    elif kind == 5:  # quantised smooth values: occasional ties
        x = np.round(rng.normal(size=(positions, vocab)) * 4) / 4
    else:           # float64 input
        return rng.normal(size=(positions, vocab)) * 2
    return x.astype(np.float32)


def set_members(index: DecodeIndex) -> list[np.ndarray]:
    small = np.split(index.small_tokens, index.small_offsets[1:]) if index.n_small else []
    return [*small, *index.big_tokens]


def outcome(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except ConstraintError as exc:
        return ("error", str(exc))


@pytest.mark.parametrize("seed", SEEDS)
def test_fast_decode_equals_the_plain_program_on_random_cases(seed):
    rng = np.random.default_rng(seed)
    for case in range(CASES_PER_SEED):
        vocab = int(rng.integers(3, 48))
        automaton = random_automaton(rng, vocab)
        if rng.random() < 0.3:
            automaton = interleaved(automaton, rng)
        positions = int(rng.integers(1, 14))
        logits = random_logits(rng, positions, vocab)
        state = int(rng.integers(automaton.n_states))
        tokens_after = [None, 0, 1, 2, 5][int(rng.integers(5))]
        expected = outcome(best_canvas_reference, logits, automaton, state, tokens_after)
        # the default index and candidates, then thresholds low enough for every path at this size
        assert outcome(best_canvas, logits, automaton, state, tokens_after) == expected, (seed, case)
        index = DecodeIndex.build(automaton, small_set=int(rng.integers(0, 4)))
        got = outcome(best_canvas, logits, automaton, state, tokens_after, index=index,
                      sample_stride=int(rng.integers(1, 6)), sample_rank=int(rng.integers(1, 4)),
                      max_candidates=int(rng.integers(1, 6)), deep_min_set=int(rng.integers(0, 3)))
        assert got == expected, (seed, case)


@pytest.fixture(scope="module")
def tiny_automata(gguf_path):
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path("tiny-a", "f32")))
    metadata = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    stops = eos_ids_from_metadata(metadata)
    return {label: compile_constraint(schema, metadata["tokenizer.ggml.tokens"], metadata["tokenizer.ggml.token_type"],
                                      stops) for label, schema in SCHEMAS.items()}


@pytest.mark.parametrize("label", list(SCHEMAS))
def test_fast_decode_equals_the_plain_program_on_schema_automata(tiny_automata, label):
    automaton = tiny_automata[label]
    rng = np.random.default_rng(len(label))
    small = DecodeIndex.build(automaton, small_set=8)
    for case in range(6):
        vocab = int(automaton.tok.max()) + 1 + int(rng.integers(0, 3))
        logits = (rng.normal(size=(int(rng.integers(1, 40)), vocab)) * 3).astype(np.float32)
        if case % 2:
            logits = np.round(logits)
        for tokens_after in (None, 0, 3):
            expected = outcome(best_canvas_reference, logits, automaton, automaton.initial, tokens_after)
            assert outcome(best_canvas, logits, automaton, automaton.initial, tokens_after) == expected
            assert outcome(best_canvas, logits, automaton, automaton.initial, tokens_after, index=small,
                           sample_stride=4, max_candidates=16, deep_min_set=0) == expected


def test_index_runs_and_sets_describe_the_edges(tiny_automata):
    for automaton in tiny_automata.values():
        index = decode_index(automaton)
        assert decode_index(automaton) is index  # built once
        members = set_members(index)
        assert index.run_start[0] == 0 and index.run_stop[-1] == len(automaton.tok)
        assert np.array_equal(index.run_start[1:], index.run_stop[:-1])
        for run in range(len(index.run_src)):
            edges = slice(index.run_start[run], index.run_stop[run])
            assert set(automaton.src[edges]) == {index.run_src[run]}
            assert set(automaton.dst[edges]) == {index.group_dst[index.run_group[run]]}
            assert set(automaton.tok[edges].tolist()) == set(members[index.run_set[run]].tolist())
        assert len({tuple(sorted(m.tolist())) for m in members}) == index.n_sets  # deduplicated


def test_the_index_is_not_saved_with_the_automaton(tiny_automata, tmp_path):
    automaton = tiny_automata["json"]
    decode_index(automaton)
    save_automaton(tmp_path / "a.npz", automaton)
    loaded = load_automaton(tmp_path / "a.npz", int(automaton.tok.max()) + 1)
    assert loaded is not None and "_decode_index" not in vars(loaded)
    assert np.array_equal(loaded.tok, automaton.tok)


def test_row_by_row_scan_is_bit_identical_to_the_log_softmax():
    rng = np.random.default_rng(0)
    for vocab in (7, 1000, 262_144):
        x = (rng.normal(size=(3, vocab)) * 4).astype(np.float32)
        gather = rng.integers(vocab, size=50)
        mx, lse, threshold, rows, cols, values, gathered = _scan_rows(x, gather, 4, 2, max_candidates=vocab)
        assert np.array_equal((x - mx[:, None]) - lse[:, None], _log_softmax(x))
        assert np.array_equal(np.stack([rows, cols]), np.nonzero(x > threshold[:, None]))
        assert np.array_equal(values, x[rows, cols]) and np.array_equal(gathered, x[:, gather])
        assert np.array_equal(threshold, [np.sort(r[::4])[-2] for r in x])


@pytest.mark.parametrize("small_set", [0, 64])
@pytest.mark.parametrize("earlier", ["top", "second"])
def test_scores_that_round_together_take_the_first_edge(small_set, earlier):
    """After a position that costs an open value -4e9, two tokens one float32 step apart reach the same float64
    score: the plain program takes the first edge of the two, and so must the fast decode, whether the set is maxed
    directly or through candidates far above the threshold."""
    n = 12
    top, second = 3, 7
    order = [second, top] if earlier == "second" else [top, second]
    order += [t for t in range(n) if t not in order]
    automaton = TokenAutomaton.build({0: {t: 0 for t in order}}, initial=0, finals=[], stop_ids=[n])
    logits = np.zeros((2, n + 1), dtype=np.float32)
    logits[0, n] = 4e9  # only the stop id, which an open value cannot take, is likely
    logits[1] = 1.5 - 3
    logits[1, top] = 1.5
    logits[1, second] = np.nextafter(np.float32(1.5), np.float32(0))
    logp = _log_softmax(logits)
    assert logp[1, top] != logp[1, second] and logp[0, 0] + logp[1, top] == logp[0, 0] + logp[1, second]
    expected = best_canvas_reference(logits, automaton, 0, None)
    assert expected.ids[1] == order[0]  # the first edge of the two, not the higher logit
    index = DecodeIndex.build(automaton, small_set=small_set)
    for rank in (1, 2, 3):
        assert best_canvas(logits, automaton, 0, None, index=index, sample_stride=1, sample_rank=rank) == expected


def test_fingerprint_collisions_are_caught(monkeypatch):
    """Runs are grouped into sets by a hash of their tokens and then compared exactly: with every hash equal, the
    sets and the canvases are still right."""
    import dgemma_engine.constrained as constrained

    monkeypatch.setattr(constrained, "_run_fingerprints", lambda tok, run_stop, n: np.zeros(len(run_stop), np.uint64))
    rng = np.random.default_rng(99)
    for _ in range(50):
        vocab = int(rng.integers(3, 30))
        automaton = random_automaton(rng, vocab)
        index = DecodeIndex.build(automaton, small_set=int(rng.integers(0, 6)))
        members = set_members(index)
        for run in range(len(index.run_src)):
            tokens = automaton.tok[index.run_start[run]:index.run_stop[run]]
            assert set(tokens.tolist()) == set(members[index.run_set[run]].tolist())
        logits = random_logits(rng, int(rng.integers(1, 8)), vocab)
        expected = outcome(best_canvas_reference, logits, automaton, 0, None)
        assert outcome(best_canvas, logits, automaton, 0, None, index=index, sample_stride=2) == expected
