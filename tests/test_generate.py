"""The generation loop (dgemma_engine.generate) driven by a context that replays transformers' recorded logits.

`ReplayContext` stands in for the engine: it checks every call the loop makes (the canvas fed to each decoder step,
the self-conditioning temperature, what gets encoded and when) against the recording and answers with the recorded
logits. So these tests pin the loop's bookkeeping exactly, without a forward pass: init draws, step counts, adaptive
stops, commits by encoder pass (append, no re-prefill), EOS with first-EOS-kept/pad-after, whole-canvas budgets."""
from __future__ import annotations

import json
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from dgemma_engine.errors import EngineError
from dgemma_engine.generate import (CanvasEvent, DoneEvent, SamplerParams, StepEvent, eos_ids_from_metadata, generate,
                                    torch_compatible_sequence)

FIXTURES = Path(__file__).parent / "fixtures"


class ReplayContext:
    """Engine stand-in serving recorded decoder outputs; asserts the loop asks for exactly the recorded calls."""

    def __init__(self, index: dict, rec: dict[str, np.ndarray], n_ctx: int = 1000):
        self.model = SimpleNamespace(hparams=SimpleNamespace(canvas_length=index["canvas_length"],
                                                             n_vocab=index["vocab_size"]))
        self.rec, self.n_ctx, self.n_past = rec, n_ctx, 0
        self.calls = 0
        self.encoded: list[list[int]] = []

    def encode(self, ids) -> None:
        ids = [int(t) for t in ids]
        assert self.n_past + len(ids) <= self.n_ctx
        self.encoded.append(ids)
        self.n_past += len(ids)

    def step(self, canvas, sc_temperature=None) -> np.ndarray:
        k, rec = self.calls, self.rec
        assert k < len(rec["raw"]), "the loop ran more decoder steps than transformers"
        assert np.array_equal(np.asarray(canvas), rec["canvas"][k]), f"call {k}: canvas"
        if rec["has_sc"][k]:
            assert np.float32(sc_temperature) == rec["T"][k - 1], f"call {k}: SC temperature must be T of step k-1"
        else:
            assert sc_temperature is None, f"call {k}: first step of a canvas has no self-conditioning"
        positions = rec["pos"][k]
        assert positions[0] == self.n_past, f"call {k}: canvas must start right after the cached tokens"
        self.calls += 1
        return rec["raw"][k]


def recorded(name: str, run: str) -> tuple[dict, dict, dict, dict[str, np.ndarray]]:
    index = json.loads((FIXTURES / name / "golden" / "index.json").read_text())
    meta = index["runs"][run]
    gen = index["generation_configs"][meta["generation_config"]]
    rec = dict(np.load(FIXTURES / name / "golden" / meta["file"]))
    if not meta["has_raw"]:
        rec["raw"] = np.load(FIXTURES / name / "golden" / index["runs"][meta["raw_same_as"]]["file"])["raw"]
    return index, meta, gen, rec


def params_for(gen: dict, meta: dict) -> SamplerParams:
    return SamplerParams(max_steps=gen["max_denoising_steps"], t_min=gen["t_min"], t_max=gen["t_max"],
                         entropy_bound=gen["entropy_bound"], confidence_threshold=gen["confidence_threshold"],
                         stability_threshold=gen["stability_threshold"], seed=meta["seed"], rng="torch",
                         greedy=meta["greedy"])


REPLAYS = [(name, run) for name in ("tiny-a", "tiny-b")
           for run in ("g1_seed0", "g2_seed0", "g3_seed0", "g4_seed0", "greedy_seed0", "short_seed0")]


@pytest.mark.parametrize("name,run", REPLAYS)
def test_loop_reproduces_transformers_sequence(name: str, run: str) -> None:
    index, meta, gen, rec = recorded(name, run)
    ctx = ReplayContext(index, rec)
    prompt = rec["prompt"].tolist()
    events = list(generate(ctx, prompt, params_for(gen, meta), max_new_tokens=gen["max_new_tokens"],
                           eos_ids=gen["eos_token_id"], threads=1))
    canvases = [e for e in events if isinstance(e, CanvasEvent)]
    done = events[-1]
    assert isinstance(done, DoneEvent) and not any(isinstance(e, DoneEvent) for e in events[:-1])

    assert ctx.calls == len(rec["canvas"]), "decoder calls"
    assert [c.steps for c in canvases] == meta["steps_per_canvas"]
    assert torch_compatible_sequence(prompt, canvases, gen["pad_token_id"]) == rec["seq"].tolist()
    C = index["canvas_length"]
    # Prefill once, then each committed canvas except the last is appended by one encoder pass.
    assert ctx.encoded == [prompt] + [c.canvas for c in canvases[:-1]]
    assert all(len(c) == C for c in ctx.encoded[1:])

    eos = set(gen["eos_token_id"])
    hit = any(t in eos for c in canvases for t in c.canvas)
    assert done.reason == ("eos" if hit else "length")
    if hit:
        last = canvases[-1]
        assert last.ids == last.canvas[:last.eos_position] and last.canvas[last.eos_position] in eos
    steps = [e for e in events if isinstance(e, StepEvent)]
    assert [e.step for e in steps] == [s for n in meta["steps_per_canvas"] for s in range(1, n + 1)]
    assert [e.argmax_ids for e in steps] == rec["argmax"].tolist()
    assert all(e.accepted == int(a.sum()) for e, a in zip(steps, rec["accept"]))
    stats = done.stats
    assert stats.prompt_tokens == len(prompt) and stats.canvases == len(canvases)
    assert stats.steps_per_canvas == meta["steps_per_canvas"] and stats.seed == meta["seed"]
    assert stats.committed_tokens == sum(len(c.ids) for c in canvases)
    assert stats.denoise_s > 0 and stats.tokens_per_s == pytest.approx(stats.committed_tokens / stats.denoise_s)


def test_context_limit_stops_without_encoding_a_canvas_that_leaves_no_room() -> None:
    index, meta, gen, rec = recorded("tiny-a", "g1_seed0")
    C, n_p = index["canvas_length"], len(rec["prompt"])
    ctx = ReplayContext(index, rec, n_ctx=n_p + 2 * C + C - 1)  # room for 2 canvases, not 3
    events = list(generate(ctx, rec["prompt"].tolist(), params_for(gen, meta), max_new_tokens=48,
                           eos_ids=[1], threads=1))
    done = events[-1]
    assert done.reason == "context" and done.stats.canvases == 2
    assert len(ctx.encoded) == 2  # the prompt and canvas 1; canvas 2 is the last that fits, never encoded

    with pytest.raises(EngineError, match="no room for a diffusion canvas"):
        next(generate(ReplayContext(index, rec, n_ctx=n_p + C - 1), rec["prompt"].tolist(), params_for(gen, meta)))


def test_cancellation_between_steps() -> None:
    index, meta, gen, rec = recorded("tiny-a", "g1_seed0")
    ctx = ReplayContext(index, rec)
    cancel = threading.Event()
    seen = []
    for event in generate(ctx, rec["prompt"].tolist(), params_for(gen, meta), max_new_tokens=48, eos_ids=[1],
                          cancel=cancel, threads=1):
        seen.append(event)
        if isinstance(event, StepEvent) and event.step == 3:
            cancel.set()
    assert isinstance(seen[-1], DoneEvent) and seen[-1].reason == "cancelled"
    assert ctx.calls == 3 and not any(isinstance(e, CanvasEvent) for e in seen)


def test_budget_is_whole_canvases() -> None:
    """max_new_tokens 20 with C = 16 gives two full canvases (32 tokens), never a truncated one."""
    index, meta, gen, rec = recorded("tiny-a", "g4_seed0")
    events = list(generate(ReplayContext(index, rec), rec["prompt"].tolist(), params_for(gen, meta),
                           max_new_tokens=20, eos_ids=[1], threads=1))
    canvases = [e for e in events if isinstance(e, CanvasEvent)]
    assert len(canvases) == 2 and all(len(c.ids) == 16 for c in canvases)
    assert events[-1].reason == "length"


def test_canvas_text_is_stream_safe(gguf_path) -> None:
    """With a tokenizer, each CanvasEvent carries only complete text; the pieces join to the decode of all ids."""
    from dgemma_engine.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(gguf_path("tiny-a", "f32"))
    index, meta, gen, rec = recorded("tiny-a", "g1_seed0")
    events = list(generate(ReplayContext(index, rec), rec["prompt"].tolist(), params_for(gen, meta),
                           max_new_tokens=48, eos_ids=[1], tokenizer=tok, threads=1))
    canvases = [e for e in events if isinstance(e, CanvasEvent)]
    all_ids = [t for c in canvases for t in c.ids]
    assert "".join(c.text for c in canvases) == tok.decode(all_ids)
    assert all("\ufffd" not in c.text for c in canvases[:-1]) or "\ufffd" in tok.decode(all_ids)


def test_sampler_params_precedence() -> None:
    md = {"diffusion.eb_max_steps": np.uint32(24), "diffusion.eb_t_max": np.float32(0.9)}
    p = SamplerParams.from_metadata(md, t_min=0.2, seed=5, entropy_bound=None)
    assert (p.max_steps, p.t_min, p.t_max, p.entropy_bound, p.seed) == (24, 0.2, pytest.approx(0.9), 0.1, 5)
    assert SamplerParams.from_metadata({}) == SamplerParams()
    with pytest.raises(EngineError, match="unknown sampler setting"):
        SamplerParams.from_metadata({}, temperature=1.0)


def test_eos_rule() -> None:
    released = ["<pad>", "<eos>", "<bos>"] + ["x"] * 200
    released[106], released[50] = "<turn|>", "<|tool_response>"
    assert eos_ids_from_metadata({"tokenizer.ggml.tokens": released, "tokenizer.ggml.eos_token_id": 1}) == (1, 106, 50)
    other = ["<pad>", "</s>", "<s>", "<turn|>", "y"]
    assert eos_ids_from_metadata({"tokenizer.ggml.tokens": other, "tokenizer.ggml.eos_token_id": 1}) == (1, 3)
    assert eos_ids_from_metadata({"tokenizer.ggml.tokens": ["a"], "tokenizer.ggml.eos_token_id": 0}) == (0,)
