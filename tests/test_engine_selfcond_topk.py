"""`self_cond_top_k` (docs/engine.md#self-conditioning): the self-conditioning input from each row's k most probable
tokens, renormalised, against the dense product of that sparse distribution, on each path that computes it: the CPU
soft-embedding op (quantized embedding), the graph of standard ops (F32 files; every unit off the CPU, checked with
layers on an RPC device in tests/test_engine_devices.py). 0, or k at least the vocabulary, is the dense product."""
from __future__ import annotations

import numpy as np
import pytest

from dgemma_engine.errors import EngineError
from dgemma_engine.generate import SamplerParams, generate
from dgemma_engine.model import Context, Model

PATHS = [("tiny-a", "f32", False), ("tiny-b", "q8_0", False), ("tiny-b", "f32", True)]


def peaked(rows: int, vocab: int, seed: int = 0) -> np.ndarray:
    z = np.random.default_rng(seed).standard_normal((rows, vocab)).astype(np.float32) * 3
    p = np.exp(z - z.max(axis=1, keepdims=True))
    return (p / p.sum(axis=1, keepdims=True)).astype(np.float32)


def sparse(p: np.ndarray, k: int) -> np.ndarray:
    """Each row's k largest probabilities (ties to the lower index), renormalised; the rest zero."""
    out = np.zeros_like(p)
    for r, row in enumerate(p):
        top = np.argsort(-row, kind="stable")[:k]
        out[r, top] = row[top] / row[top].astype(np.float64).sum()
    return out


@pytest.mark.parametrize("name,outtype,standard", PATHS, ids=["graph-f32", "cpu-op-q8_0", "standard-ops-f32"])
def test_top_k_is_the_dense_product_of_the_renormalised_top_k(gguf_path, monkeypatch, name, outtype, standard):
    if standard:
        monkeypatch.setenv("DGEMMA_STANDARD_OPS", "1")
    else:  # the path named: the CPU op, or the graph of an F32 file (whose dense product is exact)
        monkeypatch.delenv("DGEMMA_STANDARD_OPS", raising=False)
    with Model.load(gguf_path(name, outtype), threads=2) as m, Context(m, n_ctx=64) as ctx:
        V = m.hparams.n_vocab
        p = peaked(m.hparams.canvas_length, V)
        dense = ctx._soft_embedding(p)
        for k in (1, 5, 32, 200, V - 1):
            want = ctx._soft_embedding(sparse(p, k))
            ctx.self_cond_top_k = k
            got = ctx._soft_embedding(p)
            ctx.self_cond_top_k = 0
            np.testing.assert_allclose(got, want, atol=2e-7 * np.abs(dense).max() * 10, rtol=0, err_msg=f"k {k}")
        ctx.self_cond_top_k = V  # at least the vocabulary: the dense product itself
        assert np.array_equal(ctx._soft_embedding(p), dense)


def test_top_k_changes_a_self_conditioned_step_and_generation_sets_it(gguf_path):
    from test_engine import load_run

    run = load_run("tiny-b", "g1_seed0")
    with Model.load(gguf_path("tiny-b", "f32"), threads=1) as m:
        logits = {}
        for k in (0, 256, m.hparams.n_vocab):
            with Context(m, n_ctx=len(run["seq"]) + 16) as ctx:
                ctx.self_cond_top_k = k
                ctx.encode(run["prompt"])
                ctx.set_self_cond_logits(run["raw"][0])
                logits[k] = np.array(ctx.step(run["canvas"][1], sc_temperature=float(run["T"][0])))
        assert 0 < np.abs(logits[256] - logits[0]).max() < 1e-2  # 9e-5 of the mass left out, on average
        assert np.array_equal(logits[m.hparams.n_vocab], logits[0])
        with Context(m, n_ctx=64) as ctx:
            for event in generate(ctx, list(range(2, 30)), SamplerParams(max_steps=2, self_cond_top_k=32, seed=1),
                                  max_new_tokens=16):
                pass
            assert ctx.self_cond_top_k == 32
            with pytest.raises(EngineError, match="between 0 and 4096"):
                ctx.self_cond_top_k = 4097
            with pytest.raises(EngineError, match="between 0 and 4096"):
                ctx.self_cond_top_k = -1


def test_top_k_is_a_sampler_setting():
    from dgemma_cli.server import options as server_options
    from dgemma_engine import settings

    row = settings.setting_for_option("self_cond_top_k")
    assert row is not None and row.default == 0 and row.gguf_key is None
    assert server_options.resolve_sampler({"self_cond_top_k": 256}, {}, 256).self_cond_top_k == 256
    with pytest.raises(settings.SettingError, match=r"self_cond_top_k: 5000 \(must be between 0 and 4096\)"):
        settings.check_values({"self_cond_top_k": 5000})
