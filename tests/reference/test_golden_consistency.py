"""The golden recordings are self-consistent and follow the documented sampler
(docs/model.md#sampler, #torch-rng-stream) exactly.

A NumPy re-implementation of HF's entropy-bound sampler with a torch-compatible MT19937 stream is replayed on the
recorded raw logits; every recorded decision must come out bit-identical. This guards the fixture files (and the
claims in tests/fixtures/README.md) that the engine and sampler tests rely on. No torch needed.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
NAMES = ("tiny-a", "tiny-b")


def load_index(name: str) -> dict:
    return json.loads((FIXTURES / name / "golden" / "index.json").read_text())


def all_runs() -> list[tuple[str, str]]:
    return [(name, run) for name in NAMES for run in sorted(load_index(name)["runs"])]


class TorchMT:
    """torch CPU's generator: MT19937 seeded like `torch.manual_seed` (init_genrand), 32-bit outputs."""

    def __init__(self, seed: int):
        key, pos = np.random.RandomState(seed % 2**32).get_state()[1:3]  # legacy seeding == init_genrand
        self.bits = np.random.MT19937()
        self.bits.state = {"bit_generator": "MT19937", "state": {"key": key, "pos": pos}}

    def randint(self, n: int, high: int) -> np.ndarray:
        return (self.bits.random_raw(n) % high).astype(np.int64)

    def exponential(self, n: int) -> np.ndarray:
        pairs = self.bits.random_raw(2 * n).reshape(n, 2)
        x = (pairs[:, 0] << np.uint64(32)) | pairs[:, 1]
        u = (x & np.uint64(2**53 - 1)).astype(np.float64) * 2.0**-53
        return (-np.log1p(-u)).astype(np.float32)


def temperature(step: int, cfg: dict) -> np.float32:
    """HF: t_min + (t_max - t_min) * (step / N), each op in fp32 with (t_max - t_min) taken in double first."""
    ratio = np.float32(step) / np.float32(cfg["max_denoising_steps"])
    return np.float32(cfg["t_min"]) + np.float32(cfg["t_max"] - cfg["t_min"]) * ratio


def accept_mask(entropy: np.ndarray, bound: float) -> np.ndarray:
    """Accept rank j iff the sum of the strictly lower-ranked entropies is <= bound (torch cumsum runs in double)."""
    order = np.argsort(entropy, kind="stable")
    sorted_h = entropy[order]
    cumulative = np.cumsum(sorted_h.astype(np.float64)).astype(np.float32)
    mask = np.zeros(entropy.shape, bool)
    mask[order] = (cumulative - sorted_h) <= np.float32(bound)
    return mask


def softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize("name,run_name", all_runs())
def test_run_replays_with_documented_sampler(name: str, run_name: str) -> None:
    index = load_index(name)
    meta = index["runs"][run_name]
    cfg = index["generation_configs"][meta["generation_config"]]
    golden = np.load(FIXTURES / name / "golden" / meta["file"])
    c, v = index["canvas_length"], index["vocab_size"]
    raw = golden["raw"] if meta["has_raw"] else None
    if meta["raw_same_as"]:
        raw = np.load(FIXTURES / name / "golden" / f"{meta['raw_same_as']}.npz")["raw"][: meta["n_calls"]]

    prompt = golden["prompt"]
    n_p = len(prompt)
    assert prompt.tolist() == (index["long_prompt"] if meta["prompt"] == "long" else index["short_prompt"])
    assert golden["steps_per_canvas"].tolist() == meta["steps_per_canvas"]
    assert len(golden["canvas"]) == meta["n_calls"] == sum(meta["steps_per_canvas"])

    rng = TorchMT(meta["seed"])
    history = None
    committed = []
    for n in range(meta["n_calls"]):
        first_step = not golden["has_sc"][n]
        if first_step:
            assert golden["step"][n] == cfg["max_denoising_steps"]
            assert np.array_equal(golden["canvas"][n], rng.randint(c, v)), "canvas init draw"
            history = np.full((cfg["stability_threshold"], c), -1)
        else:
            assert np.array_equal(golden["canvas"][n], golden["next_canvas"][n - 1])
        ci = golden["canvas_index"][n]
        assert np.array_equal(golden["pos"][n], np.arange(n_p + ci * c, n_p + (ci + 1) * c))
        t = temperature(int(golden["step"][n]), cfg)
        assert golden["T"][n] == t

        if meta["greedy"]:
            if raw is not None:
                assert np.array_equal(golden["sampled"][n], (raw[n] / t).argmax(-1))
        else:
            exp = rng.exponential(c * v).reshape(c, v)
            if raw is not None:
                sampled = (softmax(raw[n] / t).astype(np.float32) / exp).argmax(-1)
                assert np.array_equal(golden["sampled"][n], sampled), "categorical draw"
        if raw is not None:
            z = raw[n] / t
            assert np.array_equal(golden["argmax"][n], z.argmax(-1))
            lse = np.log(np.exp(z.astype(np.float64) - z.max(-1, keepdims=True)).sum(-1)) + z.max(-1)
            entropy = lse - (softmax(z.astype(np.float64)) * z).sum(-1)
            np.testing.assert_allclose(golden["entropy"][n], entropy, rtol=1e-4, atol=1e-5)

        accept = accept_mask(golden["entropy"][n], cfg["entropy_bound"])
        assert np.array_equal(golden["accept"][n], accept), "entropy-bound acceptance"
        renoise = rng.randint(c, v)
        assert np.array_equal(golden["next_canvas"][n], np.where(accept, golden["sampled"][n], renoise))

        stable = True
        if cfg["stability_threshold"] > 0:
            stable = bool((history == golden["argmax"][n]).all())
            history = np.concatenate([history[1:], golden["argmax"][n][None]])
        # torch's vectorised mean sums in another order: equal up to rounding; the decision uses the recorded value
        np.testing.assert_allclose(golden["mean_entropy"][n], golden["entropy"][n].astype(np.float64).mean(), rtol=1e-6)
        assert golden["stop"][n] == (stable and golden["mean_entropy"][n] < np.float32(cfg["confidence_threshold"]))
        last_of_canvas = n + 1 == meta["n_calls"] or not golden["has_sc"][n + 1]
        assert golden["stop"][n] or not last_of_canvas or golden["step"][n] == 1
        if last_of_canvas:
            committed.append(golden["argmax"][n])

    expected = np.concatenate([prompt] + committed)
    hits = np.flatnonzero(np.isin(expected[n_p:], cfg["eos_token_id"]))
    if len(hits):  # keep the first EOS, pad after it (only the last canvas can hold one)
        assert hits[0] >= len(expected) - n_p - c
        expected[n_p + hits[0] + 1:] = cfg["pad_token_id"]
    else:
        assert len(committed) * c >= cfg["max_new_tokens"], "stopped early without EOS"
    assert np.array_equal(golden["seq"], expected)


@pytest.mark.parametrize("name", NAMES)
def test_encoder_cache_shapes_follow_the_config(name: str) -> None:
    config = json.loads((FIXTURES / name / "config.json").read_text())["text_config"]
    cache = np.load(FIXTURES / name / "golden" / "encoder_cache.npz")
    n = len(cache["prompt"])
    window = config["sliding_window"]
    overrides = {int(k): val for k, val in config.get("per_layer_config", {}).items()}
    for i, kind in enumerate(config["layer_types"]):
        if kind == "full_attention":
            hd = overrides.get(i, {}).get("head_dim", config.get("global_head_dim"))
            kv = overrides.get(i, {}).get("num_key_value_heads", config.get("num_global_key_value_heads"))
            length = n
        else:
            hd, kv, length = config["head_dim"], config["num_key_value_heads"], min(n, window - 1)
        assert cache[f"k_{i}"].shape == cache[f"v_{i}"].shape == (kv, length, hd)
        # V is a weight-less RMS norm per head: mean square 1 (up to eps)
        np.testing.assert_allclose((cache[f"v_{i}"].astype(np.float64) ** 2).mean(-1), 1.0, rtol=1e-4)


@pytest.mark.parametrize("name", NAMES)
def test_tokenizer_has_exact_vocab_and_special_ids(name: str) -> None:
    from tokenizers import Tokenizer

    config = json.loads((FIXTURES / name / "config.json").read_text())
    tok = Tokenizer.from_file(str(FIXTURES / name / "tokenizer.json"))
    assert tok.get_vocab_size(with_added_tokens=True) == config["text_config"]["vocab_size"]
    expected = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<mask>": 4, "<|tool>": 46, "<|tool_response>": 50,
                '<|"|>': 52, "<|think|>": 98, "<|channel>": 100, "<channel|>": 101, "<|turn>": 105,
                "<turn|>": 106, "\n": 107, "<|image|>": config["image_token_id"],
                "<|image>": config["boi_token_id"], "<image|>": config["eoi_token_id"]}
    assert {token: tok.token_to_id(token) for token in expected} == expected
    text = "Hello world, café 你好 😀\n\n  def main():\treturn 42"
    encoding = tok.encode(text, add_special_tokens=False)
    assert tok.decode(encoding.ids) == text
    assert tok.encode("<|turn>user\n", add_special_tokens=False).ids[:1] == [105]
