"""Structured output: the constrained MAP decode of a canvas always yields text that parses and validates, and it is
the most probable such canvas (checked against brute force on a tiny automaton)."""
import itertools
import json

import jsonschema
import numpy as np
import pytest

from dgemma_engine.constrained import CanvasConstraint, TokenAutomaton, best_canvas, compile_constraint
from dgemma_engine.tokenizer import Tokenizer
from json_schemas import SCHEMAS

STOPS = [1, 106]


@pytest.fixture(scope="module")
def vocab(gguf_path):
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf_path("tiny-a", "f32")))
    metadata = {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    return metadata, Tokenizer.from_metadata(metadata)


@pytest.mark.parametrize("label", list(SCHEMAS))
def test_random_canvases_always_validate(vocab, label):
    metadata, tokenizer = vocab
    schema = SCHEMAS[label]
    automaton = compile_constraint(schema, metadata["tokenizer.ggml.tokens"], metadata["tokenizer.ggml.token_type"],
                                   STOPS)
    rng = np.random.default_rng(len(label))
    for _ in range(10):
        logits = (rng.normal(size=(64, tokenizer.n_vocab)) * 3).astype(np.float32)
        ids = CanvasConstraint(automaton).commit(logits, tokens_after=0)
        end = next(i for i, t in enumerate(ids) if t in STOPS)
        jsonschema.validate(json.loads(tokenizer.decode(ids[:end])), schema or {"type": "object"})


def test_value_spanning_canvases_continues_from_the_state(vocab):
    metadata, tokenizer = vocab
    automaton = compile_constraint(SCHEMAS["numbers"], metadata["tokenizer.ggml.tokens"],
                                   metadata["tokenizer.ggml.token_type"], STOPS)
    rng = np.random.default_rng(3)
    constraint = CanvasConstraint(automaton)
    first = rng.normal(size=(4, tokenizer.n_vocab)).astype(np.float32)
    digit = tokenizer.token_to_id("1")
    first[:, digit] += 50  # the model insists on digits: "[" then digits, still open after four positions
    ids = constraint.commit(first, tokens_after=None)
    assert not constraint.closed
    ids += constraint.commit(rng.normal(size=(8, tokenizer.n_vocab)).astype(np.float32), tokens_after=0)
    assert constraint.closed
    end = next(i for i, t in enumerate(ids) if t in STOPS)
    assert all(isinstance(x, (int, float)) for x in json.loads(tokenizer.decode(ids[:end])))


def test_dynamic_program_finds_the_most_probable_accepted_canvas():
    # a b* c over tokens {0: a, 1: b, 2: c}, stop id 3; brute force over every canvas of 4 tokens
    automaton = TokenAutomaton.build({0: {0: 1}, 1: {1: 1, 2: 2}}, initial=0, finals=[2], stop_ids=[3])
    rng = np.random.default_rng(0)
    for _ in range(20):
        logits = rng.normal(size=(4, 5)).astype(np.float32) * 2
        logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
        best = max((seq for seq in itertools.product(range(5), repeat=4) if _accepts(seq)),
                   key=lambda seq: sum(logp[i, t] for i, t in enumerate(seq)))
        got = best_canvas(logits, automaton, automaton.initial, tokens_after=0)
        assert _prefix_to_stop(got.ids) == _prefix_to_stop(best)
        assert got.log_prob == pytest.approx(sum(logp[i, t] for i, t in enumerate(best)), abs=1e-4)


def _prefix_to_stop(seq):
    return tuple(seq[:seq.index(3) + 1])


def _accepts(seq):
    if 3 not in seq:
        return False
    text = "".join("abc"[t] if t < 3 else "?" for t in seq[:seq.index(3)])
    return len(text) >= 2 and text[0] == "a" and text[-1] == "c" and set(text[1:-1]) <= {"b"}


def _plain_build(transitions, initial, finals, stop_ids):
    """TokenAutomaton.build edge by edge, as it was first written: states numbered in ascending id order, edges in
    the order of `transitions` then the stop edges, stably sorted by destination."""
    stops = set(stop_ids)
    states = sorted(set(transitions) | {d for out in transitions.values() for d in out.values()} | {initial})
    number = {state: i for i, state in enumerate(states)}
    end = len(states)
    edges = [(number[s], t, number[d]) for s, out in transitions.items() for t, d in out.items() if t not in stops]
    final_numbers = sorted(number[f] for f in finals if f in number)
    edges += [(f, stop, end) for f in final_numbers for stop in sorted(stops)]
    if not edges:
        return None
    arr = np.array(edges, dtype=np.int64)
    arr = arr[np.argsort(arr[:, 2], kind="stable")]
    return end + 1, number[initial], arr[:, 0], arr[:, 1], arr[:, 2], frozenset(final_numbers)


def test_the_automaton_is_built_as_edge_by_edge():
    """build works on arrays per source state (19 million edges for "any JSON object" at 262,144 tokens); it gives
    the automaton the edge-by-edge construction gives, on random transition tables: state ids dense, strided as
    outlines-core's are, or scattered; stop ids among the tokens; finals that are no state; no edges at all."""
    from dgemma_engine.constrained import ConstraintError

    rng = np.random.default_rng(7)
    for case in range(600):
        n_states, n_tokens = int(rng.integers(1, 9)), int(rng.integers(1, 11))
        dense, strided = rng.choice(1000, n_states + 3, replace=False), rng.choice(10**5, n_states + 3, replace=False)
        ids = [dense, 64 * strided + 383616, rng.choice(10**9, n_states + 3, replace=False)][case % 3].tolist()
        transitions = {}
        for s in rng.choice(ids, int(rng.integers(0, n_states + 1)), replace=False).tolist():
            tokens = rng.choice(n_tokens, int(rng.integers(0, n_tokens + 1)), replace=False).tolist()
            transitions[s] = {t: int(rng.choice(ids)) for t in tokens}
        initial = int(rng.choice(ids))
        finals = rng.choice(ids, int(rng.integers(0, 4)), replace=False).tolist()
        stops = rng.choice(n_tokens + 2, int(rng.integers(0, 3)), replace=False).tolist()
        expected = _plain_build(transitions, initial, finals, stops)
        if expected is None:
            with pytest.raises(ConstraintError):
                TokenAutomaton.build(transitions, initial, finals, stops)
            continue
        got = TokenAutomaton.build(transitions, initial, finals, stops)
        n_states_, initial_, src, tok, dst, finals_ = expected
        assert (got.n_states, got.initial, got.finals) == (n_states_, initial_, finals_)
        assert type(got.initial) is int and all(type(f) is int for f in got.finals)
        for name, want in (("src", src), ("tok", tok), ("dst", dst)):
            assert getattr(got, name).dtype == np.int64 and np.array_equal(getattr(got, name), want), name
        assert np.array_equal(got.seg_dst, dst[got.seg_starts])
        assert np.array_equal(got.seg_starts, np.flatnonzero(np.r_[True, dst[1:] != dst[:-1]]))
