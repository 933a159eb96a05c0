"""Memory behaviour: weights are memory-mapped (not copied) and decoder steps do not grow the process."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from dgemma_engine.model import Context, Model

sys.path.insert(0, str(Path(__file__).parent))
from synthetic_checkpoint import FULL, SLIDING, text_config, write_synthetic_checkpoint  # noqa: E402

MiB = 1 << 20


def rss_kib() -> dict[str, int]:
    """VmRSS / RssAnon / RssFile of this process, in KiB (Linux)."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0])
    return out


@pytest.fixture(scope="module")
def medium_gguf(tmp_path_factory) -> Path:
    """A ~50 MB F32 model: large enough that a copy of the weights would stand out from interpreter noise."""
    from dgemma_convert import convert

    folder = tmp_path_factory.mktemp("medium")
    text = text_config(vocab_size=4096, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
                       num_experts=8, top_k_experts=2, layer_types=[SLIDING, FULL], num_hidden_layers=2)
    ckpt = write_synthetic_checkpoint(folder / "hf", text, fast=True)
    out = folder / "medium-f32.gguf"
    convert(ckpt, out, "f32", threads=1)
    return out


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_load_maps_the_file_instead_of_copying(medium_gguf):
    before = rss_kib()
    with Model.load(medium_gguf, threads=1) as m:
        after = rss_kib()
        hp = m.hparams
        file_mib = m.file_size / MiB
        transposed_mib = hp.n_vocab * hp.n_embd * 4 / MiB  # the one copy made at load (self-conditioning layout)
        anon_mib = (after["RssAnon"] - before["RssAnon"]) / 1024
        print(f"file {file_mib:.1f} MiB, RSS after load +{(after['VmRSS'] - before['VmRSS']) / 1024:.1f} MiB "
              f"(anonymous +{anon_mib:.1f}, file-backed +{(after['RssFile'] - before['RssFile']) / 1024:.1f})")
        assert file_mib > 40
        assert anon_mib <= transposed_mib + 6, "the weights were copied instead of mapped"
        with Context(m, n_ctx=64, threads=1) as ctx:  # touching every weight pages the file in, still no copy
            ctx.encode(list(range(2, 20)))
            ctx.step(list(range(5, 5 + hp.canvas_length)))
            stepped = rss_kib()
        assert (stepped["RssFile"] - before["RssFile"]) / 1024 >= 0.8 * file_mib
        kv_and_logits_mib = 2 * hp.n_vocab * hp.canvas_length * 4 / MiB + 1
        compute_mib = 40  # graph buffer of one 16-token step at these widths (logits, softmax, SC matmul, MoE)
        assert (stepped["RssAnon"] - before["RssAnon"]) / 1024 <= transposed_mib + kv_and_logits_mib + compute_mib


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")
def test_rss_does_not_grow_over_200_steps(gguf_path):
    with np.load(Path(__file__).parent / "fixtures" / "tiny-a" / "golden" / "g1_seed0.npz") as z:
        prompt, canvases = z["prompt"], z["canvas"]
    with Model.load(gguf_path("tiny-a", "f32"), threads=1) as m, Context(m, n_ctx=256, threads=1) as ctx:
        ctx.encode(prompt)

        def denoise(n_steps: int) -> None:
            for k in range(n_steps):
                canvas = canvases[k % len(canvases)]
                if k % 12 == 0:
                    ctx.step(canvas)
                else:
                    ctx.step(canvas, sc_temperature=0.4 + 0.4 * (k % 12) / 12)

        denoise(24)  # warm up: both graph variants built and placed
        ctx.encode(canvases[0])  # a commit rebuilds the graphs for the new context length
        denoise(24)
        start = rss_kib()["VmRSS"]
        denoise(200)
        growth_kib = rss_kib()["VmRSS"] - start
    print(f"RSS growth over 200 steps: {growth_kib} KiB")
    assert growth_kib <= 1024
