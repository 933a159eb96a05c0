"""Images end to end at the debug interface: `dgemma debug logits|generate M.gguf --mmproj P.gguf --image IMG`, both
files converted from tests/fixtures/tiny-v by `dgemma convert --mmproj-outfile`, against transformers' recordings of
the same images (tests/reference/make_vision_fixtures.py): the image decoded, preprocessed and encoded by dgemma's
vision engine, then placed in the encoder pass. The prompt is given as transformers' processor writes it (boi,
image × n, eoi per image) or with one marker per image.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

TINY_V = Path(__file__).parent / "fixtures" / "tiny-v"
GOLDEN = TINY_V / "golden"
INDEX = json.loads((GOLDEN / "index.json").read_text())
TOLERANCE = 1e-4  # fp32 engine vs fp32 transformers, as for text


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> tuple[Path, Path]:
    out = tmp_path_factory.mktemp("tiny-v")
    model, projector = out / "tiny-v.gguf", out / "tiny-v-mmproj.gguf"
    proc = subprocess.run([sys.executable, "-m", "dgemma_cli.main", "convert", str(TINY_V), "--outfile", str(model),
                           "--outtype", "f32", "--mmproj-outfile", str(projector)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return model, projector


def dgemma(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dgemma_cli.main", "debug", *args], capture_output=True, text=True,
                          timeout=300)


def image_args(case: str) -> list[str]:
    return [a for name in INDEX["cases"][case]["images"] for a in ("--image", str(TINY_V / "images" / f"{name}.png"))]


def ids(values) -> str:
    return ",".join(str(int(v)) for v in values)


@pytest.mark.parametrize("case", sorted(INDEX["cases"]))
def test_debug_logits_with_an_image_file_matches_transformers(converted, tmp_path, case):
    model, projector = converted
    run = np.load(GOLDEN / INDEX["cases"][case]["file"])
    first = int(np.flatnonzero(~run["has_sc"])[0])
    sc = int(np.flatnonzero(run["has_sc"])[0])  # a self-conditioned step: its input is the step before's raw logits
    np.save(tmp_path / "prev.npy", run["raw"][sc - 1])
    for label, call, extra in (("first step", first, []),
                               ("self-conditioned step", sc, ["--sc-logits", str(tmp_path / "prev.npy"),
                                                              "--sc-temperature", repr(float(run["T"][sc - 1]))])):
        prompt = run["prompt"][: INDEX["cases"][case]["prompt_length"]]  # the processor's ids: image blocks expanded
        out = tmp_path / f"{call}.npy"
        proc = dgemma("logits", str(model), "--mmproj", str(projector), *image_args(case), "--prompt-ids", ids(prompt),
                      "--canvas-ids", ids(run["canvas"][call]), "--out", str(out), "--threads", "1", *extra)
        assert proc.returncode == 0, proc.stderr
        err = float(np.abs(np.load(out) - run["raw"][call]).max())
        assert err <= TOLERANCE, f"{case} {label}: max |dlogits| {err}"


@pytest.mark.parametrize("prompt_form", ["marker", "expanded"])
def test_debug_generate_with_an_image_file_is_token_exact(converted, prompt_form):
    """The prompt as one marker per image, or with each image's block expanded as the processor writes it."""
    model, projector = converted
    meta = INDEX["cases"]["square"]
    gen = INDEX["generation_configs"][meta["generation_config"]]
    run = np.load(GOLDEN / meta["file"])
    prompt = run["marker_prompt"] if prompt_form == "marker" else run["prompt"][: meta["prompt_length"]]
    proc = dgemma("generate", str(model), "--mmproj", str(projector), *image_args("square"),
                  "--prompt-ids", ids(prompt), "--seed", str(meta["seed"]), "--rng", "torch",
                  "--max-new-tokens", str(gen["max_new_tokens"]), "--steps", str(gen["max_denoising_steps"]),
                  "--t-max", str(gen["t_max"]), "--t-min", str(gen["t_min"]),
                  "--entropy-bound", str(gen["entropy_bound"]),
                  "--confidence-threshold", str(gen["confidence_threshold"]),
                  "--stability-threshold", str(gen["stability_threshold"]), "--threads", "1")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["sequence"] == run["seq"].tolist()
    assert result["steps_per_canvas"] == meta["steps_per_canvas"]


def test_debug_image_arguments_fail_with_one_line(converted, tmp_path):
    model, projector = converted
    run = np.load(GOLDEN / INDEX["cases"]["square"]["file"])
    common = ["logits", str(model), "--canvas-ids", ids(run["canvas"][0]), "--out", str(tmp_path / "o.npy")]
    prompt = ids(run["prompt"][: INDEX["cases"]["square"]["prompt_length"]])
    not_png = tmp_path / "notes.png"
    not_png.write_text("not an image")
    cases = {
        "--image needs --mmproj": [*common, "--prompt-ids", prompt, *image_args("square")],
        "--mmproj needs at least one --image": [*common, "--prompt-ids", prompt, "--mmproj", str(projector)],
        # the block in the prompt holds 64 image tokens; the wide image has 46 soft tokens
        "image 0 has 46 soft tokens but its block in the prompt holds 64": [
            *common, "--prompt-ids", prompt, "--mmproj", str(projector), *image_args("wide")],
        "--image": [*common, "--prompt-ids", prompt, "--mmproj", str(projector), "--image", str(not_png)],
        "without its": [*common, "--prompt-ids", ids([2, 511, 509, 509, 5]), "--mmproj", str(projector),
                    *image_args("square")],
    }
    for message, args in cases.items():
        proc = dgemma(*args)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 1 and len(lines) == 1 and lines[0].startswith("Error: "), (message, proc.stderr)
        assert message in lines[0], (message, lines[0])
        assert not (tmp_path / "o.npy").exists()
