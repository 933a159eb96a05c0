"""Sampling steps (docs/engine.md#sampling-on-the-device) on the CPU: the reductions a step makes in the graph against
the C sampler on the same logits, the probabilities they leave for self-conditioning, candidates dropped after one,
and the sampler's half (draw inputs, a step from reductions). The same checks run with every unit on an RPC device in
tests/test_engine_devices.py.
"""
from __future__ import annotations

import numpy as np
import pytest

from dgemma_engine.errors import EngineError
from dgemma_engine.model import Context, Model
from dgemma_engine.sampler import Sampler
from sampling_check import kept_candidate, reduced_vs_host
from test_generate_free_running import golden, params_for

PROMPT = list(range(2, 30))
ENTROPY_TOLERANCE = 1e-5  # relative to max(1, H): float sums of 512 terms against the sampler's double ones


def assert_agreement(result: dict, where: str) -> None:
    for i, step in enumerate(result["steps"]):
        at = f"{where}, step {i + 1}: {step}"
        assert step["temperature"][0] == step["temperature"][1], at
        assert step["argmax_equal"] == 1.0, at  # random fixtures: no exact ties
        assert step["entropy_max_error"] <= ENTROPY_TOLERANCE, at
        assert step["separated"] >= 0.5, at
        assert step["host_draws_equal_separated"] and step["draws_equal_separated"], at
        assert step["accepted_equal"], at
    # the probabilities a sampling step leaves are what the next step would compute from its logits
    assert result["next_step_max_diff"] <= 1e-6, where


@pytest.mark.parametrize("name,outtype", [("tiny-a", "f32"), ("tiny-b", "f32"), ("tiny-b", "q8_0")])
def test_sampling_steps_agree_with_the_c_sampler(gguf_path, name, outtype):
    with Model.load(gguf_path(name, outtype), threads=1) as m:
        result = reduced_vs_host(m, PROMPT)
    assert_agreement(result, f"{name} {outtype}")
    assert result["transfers"] == {"to_device": 0, "from_device": 0, "steps": 5}  # the CPU alone: nothing crosses


def test_candidates_dropped_after_a_sampling_step_keep_their_probabilities(gguf_path):
    with Model.load(gguf_path("tiny-b", "f32"), threads=1) as m:
        assert kept_candidate(m, PROMPT, sampling=True) <= 1e-4  # batched against alone, as test_candidates
        assert kept_candidate(m, PROMPT, sampling=False) <= 1e-4


def test_sampling_step_checks_its_input(gguf_path):
    with Model.load(gguf_path("tiny-a", "f32"), threads=1) as m, Context(m, n_ctx=64) as ctx:
        C = m.hparams.canvas_length
        ctx.encode(PROMPT)
        canvas = np.arange(C)
        for uniforms, temperature, message in ((np.full(C - 1, 0.5), 0.7, "one uniform per canvas row"),
                                               (np.full(C, 1.0), 0.7, "not in \\[0, 1\\)"),
                                               (np.full(C, np.nan), 0.7, "not in \\[0, 1\\)"),
                                               (np.full(C, 0.5), 0.0, "temperature must be positive")):
            with pytest.raises(EngineError, match=message):
                ctx.step_reduced(canvas, temperature, uniforms)
        red = ctx.step_reduced(canvas, 0.7, np.full(C, 0.5))
        with pytest.raises(EngineError, match="sampled on the device"):
            ctx.logits()
        with pytest.raises(EngineError, match="outside the vocabulary"):
            ctx.step_reduced(np.full(C, m.hparams.n_vocab), 0.7, np.full(C, 0.5))
        assert red.argmax.shape == red.draw.shape == red.entropy.shape == (C,)
        assert (red.draw >= 0).all() and (red.draw < m.hparams.n_vocab).all()


def test_the_sampler_steps_from_reductions():
    C, V = 4, 10
    kw = dict(max_steps=3, t_min=0.4, t_max=0.8, entropy_bound=0.1, confidence_threshold=0.005,
              stability_threshold=1, seed=1)
    with Sampler(C, V, rng="torch", **kw) as s:
        s.begin_canvas()
        with pytest.raises(EngineError, match="fast RNG mode"):
            s.draw_inputs()
    with Sampler(C, V, **kw) as s, Sampler(C, V, greedy=True, **kw) as g:
        with pytest.raises(EngineError, match="active canvas"):
            s.draw_inputs()
        s.begin_canvas()
        g.begin_canvas()
        uniforms, temperature = s.draw_inputs()
        assert uniforms.dtype == np.float32 and ((uniforms >= 0) & (uniforms < 1)).all()
        assert temperature == pytest.approx(0.8)
        argmax, entropy, draw = np.array([1, 2, 3, 4]), np.array([0.0, 0.05, 2.0, 3.0]), np.array([5, 6, 7, 8])
        with pytest.raises(EngineError, match="outside the vocabulary"):
            s.step_reduced(argmax, entropy, np.array([5, 6, 7, V]))
        r = s.step_reduced(argmax, entropy, draw)
        # the rows below each one hold 0, 0, 0.05 and 2.05 nats: the first three are within the bound
        assert r.accepted.tolist() == [True, True, True, False] and r.canvas[:3].tolist() == [5, 6, 7]
        assert r.argmax.tolist() == [1, 2, 3, 4] and r.step == 1 and r.temperature == pytest.approx(0.8)
        assert g.step_reduced(argmax, entropy, draw).canvas[:3].tolist() == [1, 2, 3]  # greedy keeps the argmax
        assert s.draw_inputs()[1] == pytest.approx(0.8 - 0.4 / 3)


def test_generation_samples_on_the_device_only_in_fast_mode(gguf_path):
    from dgemma_engine.debug_generate import run_debug_generation
    from dgemma_engine.generate import SamplerParams

    meta, gen, rec = golden("tiny-a", "g2_seed7")
    with Model.load(gguf_path("tiny-a", "f32"), threads=1) as m:
        # torch mode consumes its stream over every logit: it keeps the host path and stays token-exact
        out = run_debug_generation(m, rec["prompt"].tolist(), params_for(gen, meta), gen["max_new_tokens"],
                                   eos_ids=gen["eos_token_id"], pad_id=gen["pad_token_id"], threads=1,
                                   sample_on_device=True)
        assert out == {"sequence": rec["seq"].tolist(), "steps_per_canvas": meta["steps_per_canvas"]}
        fast = SamplerParams(max_steps=6, seed=4, rng="fast", num_canvases=2)
        runs = [run_debug_generation(m, PROMPT, fast, 32, eos_ids=(), threads=1, sample_on_device=on_device)
                for on_device in (False, True)]
    for run in runs:
        assert len(run["sequence"]) == len(PROMPT) + 32 and len(run["steps_per_canvas"]) == 2
