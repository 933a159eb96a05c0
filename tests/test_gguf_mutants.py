"""GGUFs that `create` accepts can run (issue 14): every mutant of a valid fixture (tests/gguf_mutator.py) is either
refused by create with one line naming the problem, or accepted and generates. The engine's own loader refuses the
same files without ggml's log lines, and its errors name the model rather than the blob."""
from __future__ import annotations

import threading

import pytest

from dgemma_cli.create import create_model
from dgemma_cli.errors import DgemmaError
from dgemma_cli.modelfile import parse_modelfile
from dgemma_cli.server.options import SamplerSettings
from dgemma_cli.server.runner import EngineRunner
from dgemma_cli.store import Store
from dgemma_engine.errors import EngineError
from dgemma_engine.model import Model
from gguf_mutator import MUTANTS, mutate

# mutant -> words the refusal must contain (None: create accepts it, and then it must run)
EXPECTED = {
    "unchanged": None,
    "an extra unknown key": None,
    "tokens as i32": "tokenizer.ggml.tokens must be a non-empty array of strings",
    "tokens as f32": "tokenizer.ggml.tokens must be a non-empty array of strings",
    "tokens all empty": "tokenizer.ggml.tokens are all the same string",
    "tokens all identical": "tokenizer.ggml.tokens are all the same string",
    "tokens empty array": "tokenizer.ggml.tokens must be a non-empty array of strings",
    "eos_token_id as an array": "tokenizer.ggml.eos_token_id must be an integer",
    "eos_token_id as a string": "tokenizer.ggml.eos_token_id must be an integer",
    "bos_token_id out of range": "tokenizer.ggml.bos_token_id 1073741824 is outside the vocabulary",
    "merges as i32": "tokenizer.ggml.merges must be an array of strings",
    "token_type too short": "tokenizer.ggml.token_type has 2 entries",
    "unknown tokenizer model": "unsupported tokenizer.ggml.model 'bpe2000'",
    "context_length missing": "diffusion-gemma.context_length is missing or zero",
    "context_length zero": "diffusion-gemma.context_length is missing or zero",
    "context_length smaller than a canvas": "context_length 4 leaves no room",
    "canvas_length 65536": "diffusion.canvas_length 65536 is larger than 4096",
    "canvas_length zero": "diffusion.canvas_length must be a positive integer",
    "canvas_length as a string": "diffusion.canvas_length must be a positive integer",
    "duplicate key": "duplicate key 'diffusion.canvas_length'",
    "empty key": "empty metadata key",
    "duplicate tokenizer key": "duplicate key 'tokenizer.ggml.tokens'",
}
SHORT = SamplerSettings(max_steps=2, t_max=0.8, t_min=0.4, entropy_bound=1.0, confidence_threshold=0.9,
                        stability_threshold=2, seed=1, num_predict=16)


def test_every_mutant_has_an_expectation():
    assert set(EXPECTED) == set(MUTANTS)


@pytest.fixture(scope="module")
def fixture_gguf(gguf_path):
    return gguf_path("tiny-a", "f32")


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_mutant_is_refused_clearly_or_runs(tmp_path, fixture_gguf, name):
    mutate(fixture_gguf, tmp_path / "mutant.gguf", name)
    store = Store(tmp_path / "models")
    expected = EXPECTED[name]
    if expected is not None:
        with pytest.raises(DgemmaError) as info:
            list(create_model("mutant", parse_modelfile("FROM ./mutant.gguf"), store, tmp_path))
        message = str(info.value)
        assert expected in message and "\n" not in message and "sha256" not in message
        assert not store.exists("mutant")
        return
    list(create_model("mutant", parse_modelfile("FROM ./mutant.gguf"), store, tmp_path))
    runner = EngineRunner(store.resolve("mutant"), 256)
    try:
        ids = runner.tokenize(runner.render_chat([{"role": "user", "content": "Hello"}], False))
        events = list(runner.generate(ids, SHORT, runner.canvas_length, threading.Event()))
        assert events and type(events[-1]).__name__ == "DoneEvent"
    finally:
        runner.close()


@pytest.mark.parametrize("name,words", [
    ("duplicate key", "duplicate metadata key 'diffusion.canvas_length'"),
    ("empty key", "empty metadata key"),
    ("canvas_length 65536", "diffusion.canvas_length"),
    ("context_length missing", "diffusion-gemma.context_length"),
])
def test_the_engine_loader_refuses_them_too(tmp_path, fixture_gguf, name, words, capfd):
    path = mutate(fixture_gguf, tmp_path / "sha256-0123.gguf", name)
    with pytest.raises(EngineError) as info:
        Model.load(path, threads=1, name="model 'mutant'")
    message = str(info.value)
    assert message.startswith("cannot load model 'mutant': ") and words in message and "sha256" not in message
    assert "gguf_init" not in capfd.readouterr().err  # ggml's parser never saw the file


def test_malformed_tokenizer_metadata_already_in_a_store_is_a_clear_engine_error():
    """Files stored before create checked them: the tokenizer reports one line instead of a TypeError (a 500)."""
    import numpy as np

    from dgemma_engine.tokenizer import Tokenizer

    for metadata in ({"tokenizer.ggml.model": "gemma4", "tokenizer.ggml.tokens": np.arange(5, dtype=np.int32)},
                     {"tokenizer.ggml.model": "gemma4", "tokenizer.ggml.tokens": ["a", "b"],
                      "tokenizer.ggml.eos_token_id": np.array([1, 2])},
                     {"tokenizer.ggml.model": "gemma4", "tokenizer.ggml.tokens": ["a", "b"],
                      "tokenizer.ggml.merges": np.array([1, 2])}):
        with pytest.raises(EngineError) as info:
            Tokenizer.from_metadata(metadata)
        assert "\n" not in str(info.value)
