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
