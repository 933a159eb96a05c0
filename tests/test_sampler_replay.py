"""Teacher-forced sampler replay: fed transformers' recorded per-step logits, the C sampler in torch-RNG mode must
take exactly transformers' decisions (tests/fixtures/<name>/golden, recorded by tests/reference/make_fixtures.py).

Every recorded decoder call k gives: the canvas fed to it, its raw logits, T, argmax, entropies, the categorical
draw, the acceptance mask, the next canvas and the adaptive-stop flag. The sampler sees only the raw logits."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dgemma_engine.sampler import Sampler, temperature

FIXTURES = Path(__file__).parent / "fixtures"
NAMES = ("tiny-a", "tiny-b")


def golden_index(name: str) -> dict:
    return json.loads((FIXTURES / name / "golden" / "index.json").read_text())


def replayable_runs() -> list[tuple[str, str]]:
    """Runs whose raw logits are stored, directly or in the run they share their decoder calls with."""
    out = []
    for name in NAMES:
        for run, meta in golden_index(name)["runs"].items():
            if meta["has_raw"] or meta["raw_same_as"]:
                out.append((name, run))
    return out


def load_run(name: str, run: str) -> tuple[dict, dict, dict[str, np.ndarray]]:
    index = golden_index(name)
    meta = index["runs"][run]
    gen = index["generation_configs"][meta["generation_config"]]
    rec = dict(np.load(FIXTURES / name / "golden" / meta["file"]))
    if not meta["has_raw"]:
        shared = dict(np.load(FIXTURES / name / "golden" / index["runs"][meta["raw_same_as"]]["file"]))
        n = meta["n_calls"]
        assert np.array_equal(shared["canvas"][:n], rec["canvas"]), "raw_same_as run diverges"
        rec["raw"] = shared["raw"][:n]
    return meta, gen, rec


def make_sampler(index: dict, meta: dict, gen: dict, rng: str = "torch") -> Sampler:
    return Sampler(index["canvas_length"], index["vocab_size"], max_steps=gen["max_denoising_steps"],
                   t_min=gen["t_min"], t_max=gen["t_max"], entropy_bound=gen["entropy_bound"],
                   confidence_threshold=gen["confidence_threshold"],
                   stability_threshold=gen["stability_threshold"], seed=meta["seed"], rng=rng,
                   greedy=meta["greedy"], threads=2)


@pytest.mark.parametrize("name,run", replayable_runs())
def test_replay_matches_transformers_step_by_step(name: str, run: str) -> None:
    index = golden_index(name)
    meta, gen, rec = load_run(name, run)
    sampler = make_sampler(index, meta, gen)
    n_p = len(rec["prompt"])
    C = index["canvas_length"]
    committed = []
    last = None
    for k in range(len(rec["raw"])):
        if not rec["has_sc"][k]:  # a new canvas: its initial tokens are the first draws after the previous canvas
            if k:
                committed.append(last.argmax)
            assert np.array_equal(sampler.begin_canvas(), rec["canvas"][k]), f"call {k}: initial canvas"
        step = sampler.step(rec["raw"][k])
        where = f"{name}/{run} call {k}"
        assert np.float32(step.temperature) == rec["T"][k], where
        assert np.array_equal(step.argmax, rec["argmax"][k]), where
        np.testing.assert_allclose(step.entropy, rec["entropy"][k], rtol=2e-5, atol=2e-6, err_msg=where)
        assert np.array_equal(step.sampled, rec["sampled"][k]), f"{where}: categorical draw"
        assert np.array_equal(step.accepted, rec["accept"][k]), f"{where}: acceptance mask"
        assert np.array_equal(step.canvas, rec["next_canvas"][k]), f"{where}: next canvas"
        assert step.stop == bool(rec["stop"][k]), f"{where}: adaptive stop"
        np.testing.assert_allclose(step.mean_entropy, rec["mean_entropy"][k], rtol=2e-5, err_msg=where)
        if k + 1 < len(rec["raw"]) and rec["has_sc"][k + 1]:
            assert not step.finished, f"{where}: sampler finished a canvas transformers continued"
            assert np.array_equal(step.canvas, rec["canvas"][k + 1]), where
        else:
            assert step.finished, f"{where}: transformers ended the canvas here"
        last = step
    committed.append(last.argmax)

    # Steps per canvas and the committed canvases (the argmax canvas of each canvas's last step).
    starts = np.flatnonzero(~rec["has_sc"])
    steps = np.diff(np.append(starts, len(rec["raw"])))
    assert steps.tolist() == meta["steps_per_canvas"]
    seq = rec["seq"]
    eos = set(gen["eos_token_id"])
    for i, canvas in enumerate(committed):
        golden = seq[n_p + i * C: n_p + (i + 1) * C]
        hits = [j for j, t in enumerate(canvas.tolist()) if t in eos]
        keep = hits[0] + 1 if hits else C
        assert np.array_equal(canvas[:keep], golden[:keep]), f"{name}/{run}: committed canvas {i}"
        assert (golden[keep:] == gen["pad_token_id"]).all()


def test_replay_covers_early_stop_eos_length_and_greedy() -> None:
    """The replayed runs exercise every branch: adaptive stops, EOS, a short budget and the greedy variant."""
    kinds = set()
    for name, run in replayable_runs():
        meta = golden_index(name)["runs"][run]
        gen = golden_index(name)["generation_configs"][meta["generation_config"]]
        if min(meta["steps_per_canvas"]) < gen["max_denoising_steps"]:
            kinds.add("early stop")
        if gen["eos_token_id"] != [1]:
            kinds.add("eos")
        if gen["max_new_tokens"] < 3 * index_canvas(name):
            kinds.add("short budget")
        if meta["greedy"]:
            kinds.add("greedy")
    assert kinds == {"early stop", "eos", "short budget", "greedy"}


def index_canvas(name: str) -> int:
    return golden_index(name)["canvas_length"]


def test_temperature_schedule_counts_down_in_fp32() -> None:
    """T(n) = f32(t_min) + f32(t_max - t_min) * (f32(n) / f32(N)): first step t_max, last step never t_min."""
    N = 48
    for n in range(1, N + 1):
        expected = np.float32(0.4) + np.float32(0.8 - 0.4) * (np.float32(n) / np.float32(N))
        assert np.float32(temperature(n, N, 0.4, 0.8)) == expected
    assert np.float32(temperature(N, N, 0.4, 0.8)) == np.float32(0.8)
    assert temperature(1, N, 0.4, 0.8) > 0.408


def test_fast_mode_is_reproducible_and_independent_of_threads() -> None:
    """The default RNG: same seed, same decisions whatever the thread count; another seed differs."""
    rng = np.random.default_rng(3)
    C, V = 32, 1000
    logits = [(30 * np.tanh(rng.standard_normal((C, V)) * 3 / 30)).astype(np.float32) for _ in range(4)]

    def trajectory(seed: int, threads: int) -> list[np.ndarray]:
        s = Sampler(C, V, max_steps=4, t_min=0.4, t_max=0.8, entropy_bound=0.1, confidence_threshold=0.005,
                    stability_threshold=1, seed=seed, rng="fast", threads=threads)
        out = [s.begin_canvas()]
        for raw in logits:
            r = s.step(raw)
            out += [r.canvas, r.sampled]
        return out

    one, four = trajectory(5, 1), trajectory(5, 4)
    assert all(np.array_equal(a, b) for a, b in zip(one, four))
    other = trajectory(6, 2)
    assert not all(np.array_equal(a, b) for a, b in zip(one, other))


def test_fast_mode_draws_follow_the_distribution() -> None:
    """Categorical draws in fast mode have the softmax(z / T) frequencies (chi-square style bound)."""
    C, V = 256, 4
    raw = np.tile(np.log(np.array([0.1, 0.2, 0.3, 0.4], np.float32)) * np.float32(0.8), (C, 1))  # z = log p at T=0.8
    counts = np.zeros(V)
    s = Sampler(C, V, max_steps=40, t_min=0.4, t_max=0.8, entropy_bound=0.1, confidence_threshold=0.005,
                stability_threshold=1, seed=11, rng="fast", threads=2)
    s.begin_canvas()
    r = s.step(raw.astype(np.float32))
    assert r.temperature == pytest.approx(0.8)
    counts += np.bincount(r.sampled, minlength=V)
    for seed in range(12, 40):
        s = Sampler(C, V, max_steps=40, t_min=0.4, t_max=0.8, entropy_bound=0.1, confidence_threshold=0.005,
                    stability_threshold=1, seed=seed, rng="fast", threads=2)
        s.begin_canvas()
        counts += np.bincount(s.step(raw.astype(np.float32)).sampled, minlength=V)
    freq = counts / counts.sum()
    np.testing.assert_allclose(freq, [0.1, 0.2, 0.3, 0.4], atol=0.012)


def test_acceptance_is_a_prefix_of_the_entropy_order_within_the_bound() -> None:
    """Hand-built entropies: one-hot rows (H = 0) are always accepted; the bound admits the next row only while
    the sum of lower-ranked entropies stays <= B."""
    C, V = 6, 50
    raw = np.zeros((C, V), np.float32)
    raw[0, 3] = raw[1, 7] = 30.0          # near one-hot: H ~ 0
    raw[2, :2] = 30.0                      # two equal peaks: H = ln 2 at any T
    # rows 3..5 flat: H = ln 50
    s = Sampler(C, V, max_steps=8, t_min=0.4, t_max=0.8, entropy_bound=0.1, confidence_threshold=0.005,
                stability_threshold=1, seed=0, rng="torch", threads=1)
    s.begin_canvas()
    r = s.step(raw)
    np.testing.assert_allclose(r.entropy[2:], [np.log(2)] + [np.log(50)] * 3, rtol=1e-5)
    # ranks: rows 0, 1 (H ~ 0), then row 2 (sum below = ~0 <= 0.1: accepted), then flat rows (sum below ln 2 > 0.1)
    assert r.accepted.tolist() == [True, True, True, False, False, False]
    assert r.sampled[0] == 3 and r.sampled[1] == 7 and r.sampled[2] in (0, 1)
    assert r.canvas[0] == 3 and r.canvas[1] == 7
    assert r.argmax.tolist()[:3] == [3, 7, 0]  # first maximal index on ties


def test_stop_needs_stability_and_confidence() -> None:
    C, V = 4, 20
    peaked = np.full((C, V), -30.0, np.float32)
    peaked[np.arange(C), [1, 2, 3, 4]] = 30.0
    s = Sampler(C, V, max_steps=10, t_min=0.4, t_max=0.8, entropy_bound=0.1, confidence_threshold=0.005,
                stability_threshold=1, seed=0, rng="fast", threads=1)
    s.begin_canvas()
    first = s.step(peaked)
    assert first.confident and not first.stable and not first.stop  # history starts at -1: earliest stop is step 2
    second = s.step(peaked)
    assert second.stable and second.stop and second.finished and second.step == 2
    flat = np.zeros((C, V), np.float32)
    s.begin_canvas()
    for _ in range(9):
        r = s.step(flat)
        assert r.stable == (r.step > 1) and not r.confident and not r.finished
    assert s.step(flat).exhausted


def test_invalid_settings_raise_engine_error() -> None:
    from dgemma_engine.errors import EngineError

    with pytest.raises(EngineError):
        Sampler(16, 512, max_steps=0, t_min=0.4, t_max=0.8, entropy_bound=0.1, confidence_threshold=0.005,
                stability_threshold=1, seed=0)
    with pytest.raises(EngineError):
        Sampler(16, 512, max_steps=4, t_min=0.8, t_max=0.4, entropy_bound=0.1, confidence_threshold=0.005,
                stability_threshold=1, seed=0)
    with pytest.raises(EngineError):
        Sampler(16, 512, max_steps=4, t_min=0.4, t_max=0.8, entropy_bound=0.1, confidence_threshold=0.005,
                stability_threshold=1, seed=0, rng="philox")
    s = Sampler(16, 512, max_steps=4, t_min=0.4, t_max=0.8, entropy_bound=0.1, confidence_threshold=0.005,
                stability_threshold=1, seed=0)
    with pytest.raises(EngineError):
        s.step(np.zeros((16, 512), np.float32))  # no canvas begun
    s.begin_canvas()
    with pytest.raises(EngineError):
        s.step(np.zeros((16, 511), np.float32))
