"""Prefill with images, text side: the engine against transformers (fp32) on tiny-v (tests/fixtures/README.md, section 6).

The image features come from the goldens (transformers' `get_image_features(...).pooler_output`), so these tests need
no vision engine: the prompt's image markers are expanded to boi, image × n_soft, eoi, the soft-token rows take the
features, and the encoder attends bidirectionally within each image (sliding and full layers, as generate() builds the
mask). Cases: `square` (a 64-token block, longer than the window W = 52), `wide` (46 < W), `two` (two images).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dgemma_engine.errors import EngineError
from dgemma_engine.generate import CanvasEvent, SamplerParams, generate, torch_compatible_sequence
from dgemma_engine.image_prompt import ImageTokens, expand_image_markers, image_token_ids
from dgemma_engine.model import Context, Model
from test_engine import replay

GOLDEN = Path(__file__).parent / "fixtures" / "tiny-v" / "golden"
INDEX = json.loads((GOLDEN / "index.json").read_text())
CASES = sorted(INDEX["cases"])
TOLERANCE = 1e-4


def load_case(case: str) -> dict[str, np.ndarray]:
    with np.load(GOLDEN / INDEX["cases"][case]["file"]) as z:
        return {k: z[k] for k in z.files}


def image_rows(run: dict[str, np.ndarray]) -> list[np.ndarray]:
    """The golden features split per image, in prompt order."""
    return np.split(run["image_features"], np.cumsum(run["n_soft"])[:-1])


@pytest.fixture(scope="module")
def model(gguf_path):
    with Model.load(gguf_path("tiny-v", "f32"), threads=1) as m:
        yield m


def image_context(model: Model, run: dict[str, np.ndarray], **kw) -> Context:
    n_ctx = len(run["seq"]) + model.hparams.canvas_length
    return Context(model, n_ctx=n_ctx, threads=1, max_image_tokens=kw.pop("max_image_tokens", int(run["n_soft"].max())),
                   **kw)


def prefill(model: Model, ctx: Context, run: dict[str, np.ndarray]) -> None:
    expanded = expand_image_markers(run["marker_prompt"], image_rows(run), image_token_ids(model.metadata),
                                    model.hparams.n_embd)
    assert expanded.ids == run["prompt"].tolist(), "the expansion differs from transformers' processor"
    ctx.encode_images(expanded.ids, expanded.spans)


def test_fixture_exercises_both_window_cases(model):
    assert model.hparams.sliding_window == INDEX["sliding_window"] == 52
    n_soft = {case: INDEX["cases"][case]["n_soft"] for case in CASES}
    assert max(n_soft["square"]) > 52 > max(n_soft["wide"])
    assert image_token_ids(model.metadata) == ImageTokens(image=509, boi=510, eoi=511)


@pytest.mark.parametrize("case", CASES)
def test_first_and_self_conditioned_step_match_transformers(model, case):
    run = load_case(case)
    assert not run["has_sc"][0] and run["has_sc"][1]
    with image_context(model, run) as ctx:
        prefill(model, ctx, run)
        assert ctx.n_past == len(run["prompt"])
        first = ctx.step(run["canvas"][0]).copy()
        ctx.set_self_cond_logits(run["raw"][0])
        second = ctx.step(run["canvas"][1], sc_temperature=float(run["T"][0]))
        assert np.abs(first - run["raw"][0]).max() < TOLERANCE
        assert np.abs(second - run["raw"][1]).max() < TOLERANCE


@pytest.mark.parametrize("case", CASES)
def test_every_recorded_call_matches_after_commits(model, case):
    """Teacher-forced replay of the whole run: the committed canvases after an image prefill are plain text."""
    run = load_case(case)
    worst = 0.0
    with image_context(model, run) as ctx:
        for _, logits, want in replay(ctx, run, prefill=lambda c: prefill(model, c, run)):
            worst = max(worst, float(np.abs(logits - want).max()))
    assert worst < TOLERANCE


def test_block_mask_is_needed(model):
    """The same rows encoded as text (features in place, causal mask) give other logits: the test above sees the mask."""
    run = load_case("square")
    with image_context(model, run) as ctx:
        expanded = expand_image_markers(run["marker_prompt"], image_rows(run), image_token_ids(model.metadata),
                                        model.hparams.n_embd)
        # one single-row span per soft token: the same embeddings, no bidirectional block
        rows = expanded.spans[0]
        singles = [type(rows)(first=rows.first + r, embeddings=rows.embeddings[r:r + 1])
                   for r in range(rows.embeddings.shape[0])]
        ctx.encode_images(expanded.ids, singles)
        causal = ctx.step(run["canvas"][0])
        assert np.abs(causal - run["raw"][0]).max() > 0.1


def test_image_after_a_long_prefix_is_independent_of_the_sliding_cache_size(model):
    """100 text tokens before the image: with room for exactly one image pass the sliding caches move their visible
    tail to the front between chunks (kv_cache.c); with room for everything they never move. Same step either way."""
    run = load_case("square")
    marker_prompt = [2] + [10 + k % 200 for k in range(100)] + run["marker_prompt"][1:].tolist()
    tokens = image_token_ids(model.metadata)
    expanded = expand_image_markers(marker_prompt, image_rows(run), tokens, model.hparams.n_embd)
    n_ctx = len(expanded.ids) + model.hparams.canvas_length
    steps = []
    for room in (64, n_ctx):  # 64: a sliding cache of W − 1 + 15 + 64 = 130 slots < n_ctx; n_ctx: all of it
        with Context(model, n_ctx=n_ctx, threads=1, max_image_tokens=room) as ctx:
            ctx.encode_images(expanded.ids, expanded.spans)
            steps.append(ctx.step(run["canvas"][0]).copy())
    assert np.abs(steps[0] - steps[1]).max() < 1e-5


@pytest.mark.parametrize("case", CASES)
def test_torch_rng_generation_is_token_exact(model, case):
    run = load_case(case)
    meta = INDEX["cases"][case]
    gen = INDEX["generation_configs"][meta["generation_config"]]
    params = SamplerParams(max_steps=gen["max_denoising_steps"], t_min=gen["t_min"], t_max=gen["t_max"],
                           entropy_bound=gen["entropy_bound"], confidence_threshold=gen["confidence_threshold"],
                           stability_threshold=gen["stability_threshold"], seed=meta["seed"], rng="torch")
    with image_context(model, run) as ctx:
        events = list(generate(ctx, run["marker_prompt"].tolist(), params, max_new_tokens=gen["max_new_tokens"],
                               eos_ids=gen["eos_token_id"], threads=1, images=image_rows(run)))
    canvases = [e for e in events if isinstance(e, CanvasEvent)]
    assert [c.steps for c in canvases] == meta["steps_per_canvas"]
    assert torch_compatible_sequence(run["prompt"], canvases, gen["pad_token_id"]) == run["seq"].tolist()
    assert events[-1].stats.prompt_tokens == len(run["prompt"])


# ---------------------------------------------------------------------------------------------------------------
# errors: one line each, nothing encoded


def test_marker_count_mismatch(model):
    run = load_case("square")
    tokens = image_token_ids(model.metadata)
    with pytest.raises(EngineError, match=r"1 image marker\(s\) .* but 2 image\(s\)"):
        expand_image_markers(run["marker_prompt"], image_rows(run) * 2, tokens, model.hparams.n_embd)
    with pytest.raises(EngineError, match=r"0 image marker\(s\) .* but 1 image\(s\)"):
        expand_image_markers([2, 10, 11], image_rows(run), tokens, model.hparams.n_embd)
    with image_context(model, run) as ctx:
        with pytest.raises(EngineError, match="image marker"):
            list(generate(ctx, run["marker_prompt"].tolist(), SamplerParams(seed=0), max_new_tokens=16,
                          images=image_rows(run) * 2))
        assert ctx.n_past == 0


def test_expanded_prompt_is_refused(model):
    run = load_case("square")
    with pytest.raises(EngineError, match="one <\\|image\\|> per image"):
        expand_image_markers(run["prompt"], image_rows(run), image_token_ids(model.metadata), model.hparams.n_embd)


@pytest.mark.parametrize("bad, message", [
    (lambda f: f[:, :32], r"image 0: embeddings must be float32 \[n_soft, 64\], got shape \[64, 32\]"),
    (lambda f: f[0], r"got shape \[64\]"),
    (lambda f: f[:0], r"got shape \[0, 64\]"),
    (lambda f: np.where(np.arange(64)[:, None] == 3, np.nan, f), "NaN or infinity"),
    (lambda f: (f * 100).astype(np.int32), "floating point"),
])
def test_bad_embeddings(model, bad, message):
    run = load_case("square")
    with pytest.raises(EngineError, match=message):
        expand_image_markers(run["marker_prompt"], [bad(image_rows(run)[0])], image_token_ids(model.metadata),
                             model.hparams.n_embd)


def test_image_block_longer_than_a_pass_is_refused(model):
    """Without room for the image in its sliding caches, a context refuses it and says where the limit is."""
    run = load_case("square")
    with image_context(model, run, max_image_tokens=0) as ctx:
        with pytest.raises(EngineError) as err:
            prefill(model, ctx, run)
        message = str(err.value)
        assert "\n" not in message
        assert "image 0 has 64 soft tokens but one encoder pass of this context takes at most 32" in message
        assert ctx.n_past == 0
    with image_context(model, run, max_image_tokens=64) as ctx:  # exactly enough
        prefill(model, ctx, run)
        assert ctx.n_past == len(run["prompt"])


def test_spans_must_lie_inside_the_prompt(model):
    run = load_case("wide")
    expanded = expand_image_markers(run["marker_prompt"], image_rows(run), image_token_ids(model.metadata),
                                    model.hparams.n_embd)
    span = expanded.spans[0]
    with image_context(model, run) as ctx:
        for first in (len(expanded.ids) - 10, -1):
            with pytest.raises(EngineError, match="are not inside"):
                ctx.encode_images(expanded.ids, [type(span)(first=first, embeddings=span.embeddings)])
        with pytest.raises(EngineError, match="are not inside"):  # overlapping spans
            ctx.encode_images(expanded.ids, [span, span])
        assert ctx.n_past == 0


def test_context_refuses_a_negative_image_budget(model):
    with pytest.raises(EngineError, match="image_rows must be in"):
        Context(model, n_ctx=128, threads=1, max_image_tokens=-1)


# ---------------------------------------------------------------------------------------------------------------
# `dgemma debug logits|generate --image-embeds X.npy` (repeatable)


def write_embeds(tmp_path: Path, run: dict[str, np.ndarray]) -> list[Path]:
    paths = []
    for k, rows in enumerate(image_rows(run)):
        paths.append(tmp_path / f"image{k}.npy")
        np.save(paths[-1], rows)
    return paths


def test_debug_logits_with_image_embeds(tmp_path, gguf_path):
    from dgemma_engine.debug import debug_images, debug_logits

    run = load_case("two")
    out = tmp_path / "out.npy"
    debug_logits(gguf_path("tiny-v", "f32"), run["marker_prompt"].tolist(), run["canvas"][0].tolist(), None, 1.0,
                 out, 1, images=debug_images(write_embeds(tmp_path, run)))
    assert np.abs(np.load(out) - run["raw"][0]).max() < TOLERANCE


def test_debug_generate_with_image_embeds_is_token_exact(tmp_path, gguf_path):
    import io

    from dgemma_engine.debug import debug_generate, debug_images

    run = load_case("square")
    meta = INDEX["cases"]["square"]
    gen = INDEX["generation_configs"][meta["generation_config"]]
    result = debug_generate(gguf_path("tiny-v", "f32"), run["marker_prompt"].tolist(), seed=meta["seed"], rng="torch",
                            max_new_tokens=gen["max_new_tokens"], steps=gen["max_denoising_steps"], t_max=gen["t_max"],
                            t_min=gen["t_min"], entropy_bound=gen["entropy_bound"],
                            confidence_threshold=gen["confidence_threshold"],
                            stability_threshold=gen["stability_threshold"], threads=1, eos_ids=gen["eos_token_id"],
                            out=io.StringIO(), images=debug_images(write_embeds(tmp_path, run)))
    assert result["sequence"] == run["seq"].tolist()
    assert result["steps_per_canvas"] == meta["steps_per_canvas"]


def test_debug_image_embeds_errors(tmp_path, gguf_path):
    from dgemma_engine.debug import debug_images, debug_logits

    run = load_case("square")
    missing = tmp_path / "missing.npy"
    with pytest.raises(EngineError, match="cannot read --image-embeds"):
        debug_images([missing])
    with pytest.raises(EngineError, match=r"0 image marker\(s\)"):
        debug_logits(gguf_path("tiny-v", "f32"), [2, 10, 11], [5] * 16, None, 1.0, tmp_path / "o.npy", 1,
                     images=debug_images(write_embeds(tmp_path, run)))
    assert not (tmp_path / "o.npy").exists()
