"""Engine logits against transformers (fp32) on the fixture models.

Teacher-forced replay of the recorded decoder calls (tests/fixtures/<name>/golden, written by
tests/reference/make_fixtures.py): encode the prompt, then for each recorded call run one decoder step on the recorded
canvas and compare with the recorded softcapped logits; when a new canvas starts, commit the finished one (the
recorded sequence slice) with an encoder pass first. The self-conditioning input is the recorded previous raw logits,
tempered by the recorded T inside the engine. Both fixtures are conditioned so that transformers' own fp32 logits are
within ~2e-5 of an fp64 run on every recorded call (tests/reference/engine_fp32_floor.json), so 1e-4 holds everywhere.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dgemma_engine.errors import EngineError
from dgemma_engine.model import Context, Model

FIXTURES = Path(__file__).parent / "fixtures"
FIXTURE_NAMES = ["tiny-a", "tiny-b"]
TOLERANCE = 1e-4  # fp32 engine vs fp32 transformers (issue 3), on every fixture and every recorded call
# max |transformers fp32 − transformers fp64| per fixture and run (tests/reference/engine_fp32_floor.py): the
# disagreement any correct fp32 implementation may have. TOLERANCE is only meaningful while it is well above it.
FP32_FLOOR = json.loads((Path(__file__).parent / "reference" / "engine_fp32_floor.json").read_text())


def load_run(name: str, run: str) -> dict[str, np.ndarray]:
    with np.load(FIXTURES / name / "golden" / f"{run}.npz") as z:
        return {k: z[k] for k in z.files}


def golden_index(name: str) -> dict:
    return json.loads((FIXTURES / name / "golden" / "index.json").read_text())


def replay(ctx: Context, run: dict[str, np.ndarray], prefill=None):
    """Yield (call, engine logits, recorded logits) for every recorded decoder call, in order. prefill(ctx) encodes the
    prompt (default: its ids as text)."""
    if prefill is None:
        ctx.encode(run["prompt"])
    else:
        prefill(ctx)
    for i in range(len(run["pos"])):
        start = int(run["pos"][i][0])
        if start != ctx.n_past:  # a new canvas: commit the previous one at its positions
            ctx.encode(run["seq"][ctx.n_past:start])
        assert ctx.n_past == start
        if run["has_sc"][i]:
            ctx.set_self_cond_logits(run["raw"][i - 1])
            logits = ctx.step(run["canvas"][i], sc_temperature=float(run["T"][i - 1]))
        else:
            logits = ctx.step(run["canvas"][i])
        yield i, logits, run["raw"][i]


@pytest.fixture(scope="module")
def f32_model(gguf_path):
    models = {}

    def get(name: str) -> Model:
        if name not in models:
            models[name] = Model.load(gguf_path(name, "f32"), threads=1)
        return models[name]

    yield get
    for m in models.values():
        m.close()


@pytest.mark.parametrize("name", FIXTURE_NAMES)
@pytest.mark.parametrize("run_name, prompt_kind", [("g1_seed0", "long"), ("short_seed0", "short"), ("g2_seed0", "long"),
                                                   ("greedy_seed0", "long")])
def test_teacher_forced_logits_match_transformers(f32_model, name, run_name, prompt_kind):
    m = f32_model(name)
    run = load_run(name, run_name)
    window = golden_index(name)["sliding_window"]
    # the recordings must cover what this test claims to check
    assert (len(run["prompt"]) > window) == (prompt_kind == "long")
    assert run["has_sc"].any() and not run["has_sc"].all()
    with Context(m, n_ctx=len(run["seq"]) + m.hparams.canvas_length, threads=1) as ctx:
        row_err = []
        for i, logits, want in replay(ctx, run):
            assert logits.shape == want.shape and logits.dtype == np.float32
            row_err.append(float(np.abs(logits - want).max()))
    assert FP32_FLOOR[name][run_name] <= TOLERANCE / 4, "the fixture is too ill-conditioned for a 1e-4 bar"
    worst = max(row_err)
    assert worst <= TOLERANCE, f"max |Δ| {worst:.2e}"


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_replay_covers_self_conditioning_after_two_commits(f32_model, name):
    """The long-prompt run reaches a self-conditioned step of the third canvas (two canvases committed)."""
    m = f32_model(name)
    run = load_run(name, "g1_seed0")
    third_canvas_sc = [i for i in range(len(run["pos"])) if run["canvas_index"][i] == 2 and run["has_sc"][i]]
    assert third_canvas_sc
    with Context(m, n_ctx=len(run["seq"]) + m.hparams.canvas_length, threads=1) as ctx:
        for i, logits, want in replay(ctx, run):
            if i == third_canvas_sc[0]:
                assert ctx.n_past == len(run["prompt"]) + 2 * m.hparams.canvas_length
                assert np.abs(logits - want).max() <= TOLERANCE
                break


def test_self_conditioning_on_own_logits_stays_in_engine(f32_model):
    """A step self-conditioned on the engine's own previous logits (ping-pong buffers, no copy through Python) is
    bit-identical to handing the same logits in from Python."""
    m = f32_model("tiny-a")
    run = load_run("tiny-a", "g1_seed0")
    with Context(m, n_ctx=64, threads=1) as ctx:
        ctx.encode(run["prompt"])
        first = ctx.step(run["canvas"][0]).copy()
        chained = ctx.step(run["canvas"][1], sc_temperature=0.7).copy()
        again = ctx.step(run["canvas"][2], sc_temperature=0.6).copy()
        ctx.set_self_cond_logits(first)
        np.testing.assert_array_equal(ctx.step(run["canvas"][1], sc_temperature=0.7), chained)
        ctx.set_self_cond_logits(chained)
        np.testing.assert_array_equal(ctx.step(run["canvas"][2], sc_temperature=0.6), again)
        assert not np.array_equal(chained, ctx.step(run["canvas"][1], sc_temperature=0.3))  # T matters


def test_first_step_ignores_stale_self_conditioning(f32_model):
    """sc_temperature=None means no self-conditioning, whatever logits the engine holds."""
    m = f32_model("tiny-a")
    run = load_run("tiny-a", "g1_seed0")
    with Context(m, n_ctx=64, threads=1) as ctx:
        ctx.encode(run["prompt"])
        ctx.set_self_cond_logits(run["raw"][5])
        assert np.abs(ctx.step(run["canvas"][0]) - run["raw"][0]).max() <= TOLERANCE


def test_step_returns_view_valid_until_next_step(f32_model):
    m = f32_model("tiny-a")
    run = load_run("tiny-a", "g1_seed0")
    with Context(m, n_ctx=64, threads=1) as ctx:
        ctx.encode(run["prompt"])
        first = ctx.step(run["canvas"][0])
        assert not first.flags.writeable
        copy = first.copy()
        ctx.set_self_cond_logits(run["raw"][0])  # writes the other buffer: the view stays intact
        np.testing.assert_array_equal(first, copy)
        assert ctx.logits_address() != first.ctypes.data


def test_context_accounting_and_errors(f32_model):
    m = f32_model("tiny-a")
    hp = m.hparams
    with Context(m, n_ctx=24, threads=1) as ctx:
        assert (ctx.n_ctx, ctx.n_past) == (24, 0)
        ctx.encode([2, 10, 11])
        assert ctx.n_past == 3
        with pytest.raises(EngineError, match="exceed the context"):
            ctx.encode(list(range(10, 32)))
        assert ctx.n_past == 3
        with pytest.raises(EngineError, match="vocabulary"):
            ctx.encode([hp.n_vocab])
        with pytest.raises(EngineError, match="self-conditioning"):
            ctx.step([5] * hp.canvas_length, sc_temperature=0.8)  # no previous logits yet
        with pytest.raises(EngineError, match="does not fit"):
            ctx.encode([5] * 10)
            ctx.step([5] * hp.canvas_length)
        with pytest.raises(EngineError, match="sc_temperature"):
            ctx.step([5], sc_temperature=0.0)
        ctx.reset()
        assert ctx.n_past == 0
        assert ctx.step([5] * hp.canvas_length).shape == (hp.canvas_length, hp.n_vocab)


def test_hparams_and_metadata(f32_model):
    m = f32_model("tiny-b")
    cfg = json.loads((FIXTURES / "tiny-b" / "config.json").read_text())
    text = cfg["text_config"]
    hp = m.hparams
    assert (hp.n_vocab, hp.n_embd, hp.n_layer, hp.n_expert, hp.n_expert_used) == (
        text["vocab_size"], text["hidden_size"], text["num_hidden_layers"], text["num_experts"], text["top_k_experts"])
    assert hp.layer_sliding == tuple(t == "sliding_attention" for t in text["layer_types"])
    assert hp.canvas_length == cfg["canvas_length"] and hp.sliding_window == text["sliding_window"]
    assert hp.has_self_cond and hp.has_enc_scale and not hp.split_experts
    md = m.metadata
    assert md["general.architecture"] == "diffusion-gemma"
    assert len(md["tokenizer.ggml.tokens"]) == hp.n_vocab
    assert list(md["diffusion-gemma.attention.sliding_window_pattern"]) == list(hp.layer_sliding)


def test_debug_logits_writes_the_step(tmp_path, gguf_path):
    from dgemma_engine.debug import debug_logits

    run = load_run("tiny-a", "g1_seed0")
    path = gguf_path("tiny-a", "f32")
    out = tmp_path / "out.npy"
    debug_logits(path, run["prompt"].tolist(), run["canvas"][0].tolist(), None, 1.0, out, 1)
    assert np.abs(np.load(out) - run["raw"][0]).max() <= TOLERANCE
    prev = tmp_path / "prev.npy"
    np.save(prev, run["raw"][0])
    debug_logits(path, run["prompt"].tolist(), run["canvas"][1].tolist(), prev, float(run["T"][0]), out, 1)
    assert run["has_sc"][1]
    assert np.abs(np.load(out) - run["raw"][1]).max() <= TOLERANCE


def test_long_prefill_is_independent_of_chunking(f32_model):
    """Sliding layers keep a bounded cache whose visible tail moves to the front when full; where that happens must
    not matter: a 150-token prompt encoded at once (32-row chunks) or in pieces of 7 gives the same step."""
    m = f32_model("tiny-a")
    rng = np.random.default_rng(3)
    prompt = rng.integers(0, m.hparams.n_vocab, 150)
    canvas = rng.integers(0, m.hparams.n_vocab, m.hparams.canvas_length)
    with Context(m, n_ctx=200, threads=1) as whole, Context(m, n_ctx=200, threads=1) as pieces:
        whole.encode(prompt)
        for i in range(0, len(prompt), 7):
            pieces.encode(prompt[i:i + 7])
        assert whole.n_past == pieces.n_past == 150
        a = whole.step(canvas).copy()
        b = pieces.step(canvas).copy()
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
        assert np.abs(a - whole.step(canvas[::-1].copy())).max() > 1e-3  # the step does depend on its input
