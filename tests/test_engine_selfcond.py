"""The self-conditioning soft embedding P·E equals numpy's P @ E read straight from the GGUF, for vocabularies that
split into several slices, with and without padding rows: F32 files through their exact transposed, sliced copy;
F16 and quantized files through the soft-embedding op on the stored embedding (F32 arithmetic, so as exact), and,
in the standard-op graph (an accelerator's), through the F16 transposed copy made for them there."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from dgemma_engine.model import Context, Model

sys.path.insert(0, str(Path(__file__).parent))
from synthetic_checkpoint import FULL, SLIDING, text_config, write_synthetic_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def synthetic_gguf(tmp_path_factory):
    from dgemma_convert import convert

    made = {}

    def build(vocab: int, outtype: str) -> Path:
        if (vocab, outtype) not in made:
            folder = tmp_path_factory.mktemp(f"sc{vocab}")
            text = text_config(vocab_size=vocab, hidden_size=256, layer_types=[SLIDING, FULL], num_hidden_layers=2)
            ckpt = write_synthetic_checkpoint(folder / "hf", text, fast=True)
            made[(vocab, outtype)] = folder / f"model-{outtype}.gguf"
            convert(ckpt, made[(vocab, outtype)], outtype, threads=1)
        return made[(vocab, outtype)]

    return build


def embedding_from_file(path: Path) -> np.ndarray:
    from gguf import GGUFReader

    from gguf.quants import dequantize

    t = next(t for t in GGUFReader(str(path)).tensors if t.name == "token_embd.weight")
    return dequantize(t.data, t.tensor_type).astype(np.float32).reshape(int(t.shape[1]), int(t.shape[0]))  # [V, H]


@pytest.mark.parametrize("vocab", [4096, 5000])  # 2 slices of 2048; 3 slices of 1680 with 40 padding rows
@pytest.mark.parametrize("outtype, standard_ops, rel_tol", [
    ("f32", False, 1e-5), ("f32", True, 1e-5),
    ("f16", False, 1e-5), ("q8_0", False, 1e-5), ("q6_k", False, 1e-5),
    ("f16", True, 2e-3), ("q8_0", True, 2e-3),
])
def test_sliced_soft_embedding_matches_numpy(synthetic_gguf, monkeypatch, vocab, outtype, standard_ops, rel_tol):
    if standard_ops:
        monkeypatch.setenv("DGEMMA_STANDARD_OPS", "1")
    path = synthetic_gguf(vocab, outtype)
    E = embedding_from_file(path)
    rng = np.random.default_rng(vocab)
    logits = rng.normal(size=(16, vocab)).astype(np.float32) * 4
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    probs[0] = 0  # a one-hot row picks exactly one embedding row (the last one: in the padded slice)
    probs[0, vocab - 1] = 1
    with Model.load(path, threads=1) as m, Context(m, n_ctx=32, threads=1) as ctx:
        got = ctx._soft_embedding(probs)
    want = probs.astype(np.float64) @ E.astype(np.float64)
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= rel_tol * scale
    np.testing.assert_allclose(got[0], E[vocab - 1], rtol=rel_tol, atol=rel_tol * np.abs(E[vocab - 1]).max())
