"""dgemma's AVX2 Q4_K/Q5_K/Q6_K quantizers give exactly ggml_quantize_chunk's bytes, on random and adversarial rows."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T

from dgemma_convert.fast_quant import DISABLE_ENV, load_fast_quantizer
from dgemma_convert.quantize import GGMLQuantizer

FAST_TYPES = (T.Q4_K, T.Q5_K, T.Q6_K)
ROW = 2816  # the release's hidden size: 11 super-blocks


@pytest.fixture(scope="module")
def ggml() -> GGMLQuantizer:
    return GGMLQuantizer(threads=1, fast=False)  # loads ggml first, as the converter does


@pytest.fixture(scope="module")
def fast(ggml):
    quantizer = load_fast_quantizer()
    if quantizer is None:
        pytest.skip("the fast quantizers are not built or the CPU lacks AVX2")
    return quantizer


def fast_bytes(fast, t: T, rows: np.ndarray, row_bytes: int) -> np.ndarray:
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    out = np.zeros(rows.shape[0] * row_bytes, dtype=np.uint8)
    assert fast.quantize(t, rows.ctypes.data, out.ctypes.data, rows.shape[0], rows.shape[1]) == out.nbytes
    return out


def assert_same(ggml, fast, t: T, rows: np.ndarray) -> None:
    want = ggml.quantize(t, rows)
    got = fast_bytes(fast, t, rows, ggml.row_size(t, rows.shape[1]))
    if not np.array_equal(want, got):
        block = int(np.flatnonzero(want != got)[0]) // (want.nbytes // (rows.size // 256))
        pytest.fail(f"{t.name}: first differing super-block {block} of {rows.size // 256}")


def random_rows(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    scale = 10.0 ** rng.uniform(-6, 3, size=(48, 1))
    rows = rng.standard_normal((48, ROW)) * scale
    rows[::3] += rng.uniform(-2, 2, size=(16, 1)) * scale[::3]  # offset rows: mostly positive or negative
    rows[1::5] = rng.laplace(size=(10, ROW)) * scale[1::5]  # heavy tails
    return rows.astype(np.float32)


def adversarial_rows() -> np.ndarray:
    rng = np.random.default_rng(7)
    rows = []
    rows.append(np.zeros(ROW))
    rows.append(np.full(ROW, 0.5))
    rows.append(np.full(ROW, -3.0))
    rows.append(-np.abs(rng.standard_normal(ROW)))  # negative only
    rows.append(np.abs(rng.standard_normal(ROW)))  # positive only (min clamped to 0)
    spike = np.zeros(ROW)
    spike[::97] = 1.0
    rows.append(spike)
    rows.append(rng.standard_normal(ROW) * 1e-38)  # subnormal range
    rows.append(rng.standard_normal(ROW) * 1e-19)  # squares underflow
    rows.append(rng.standard_normal(ROW) * 1e18)  # squares overflow to inf
    rows.append(rng.uniform(-3.4e38, 3.4e38, ROW))  # near the largest float
    mixed = rng.standard_normal(ROW)
    mixed[np.arange(ROW) // 32 % 3 == 0] = 0.25  # constant sub-blocks next to random ones
    rows.append(mixed)
    rows.append(np.repeat(rng.standard_normal(ROW // 8), 8))  # few distinct values per sub-block
    rows.append(np.round(rng.standard_normal(ROW) * 4) / 4)  # on a grid (ties in the rounding)
    bf16 = (rng.standard_normal(ROW).astype(np.float32).view(np.uint32) & 0xFFFF0000).view(np.float32)
    rows.append(bf16)  # the checkpoint's bf16 values
    one_hot = np.zeros(ROW)
    one_hot[5] = -7.0
    rows.append(one_hot)
    rows.append(np.where(rng.random(ROW) < 0.5, -0.0, 0.0))  # signed zeros
    return np.stack(rows).astype(np.float32)


def special_rows() -> np.ndarray:
    rng = np.random.default_rng(11)
    rows = rng.standard_normal((4, ROW)).astype(np.float32)
    rows[0, 3] = np.inf
    rows[1, 40] = -np.inf
    rows[2, 100] = np.nan
    rows[3, :256] = np.nan
    return rows


@pytest.mark.parametrize("t", FAST_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("seed", range(4))
def test_random_rows_are_byte_identical(ggml, fast, t, seed):
    assert_same(ggml, fast, t, random_rows(seed))


@pytest.mark.parametrize("t", FAST_TYPES, ids=lambda t: t.name)
def test_adversarial_rows_are_byte_identical(ggml, fast, t):
    rows = adversarial_rows()
    for i in range(rows.shape[0]):  # one at a time: the failure names the row
        assert_same(ggml, fast, t, rows[i:i + 1])


@pytest.mark.parametrize("t", FAST_TYPES, ids=lambda t: t.name)
def test_inf_and_nan_rows_are_byte_identical(ggml, fast, t):
    rows = special_rows()
    for i in range(rows.shape[0]):
        assert_same(ggml, fast, t, rows[i:i + 1])


@pytest.mark.parametrize("t", FAST_TYPES, ids=lambda t: t.name)
def test_converter_quantizer_uses_the_fast_path_with_the_same_bytes(ggml, fast, t):
    rows = random_rows(9)[:13]  # odd row count: the two threads get unequal parts
    converter_quantizer = GGMLQuantizer(threads=2)
    assert t in converter_quantizer.fast_types  # it passed the probe against ggml
    assert np.array_equal(converter_quantizer.quantize(t, rows), ggml.quantize(t, rows))


def test_a_fast_quantizer_that_disagrees_with_ggml_is_not_used(monkeypatch, ggml, fast):
    class Wrong:
        types = fast.types

        def quantize(self, t, src, dst, n_rows, row_length):
            return fast.quantize(t, src + 4, dst, n_rows - 1, row_length)  # shifted input, one row short

    monkeypatch.setattr("dgemma_convert.quantize.load_fast_quantizer", lambda: Wrong())
    quantizer = GGMLQuantizer(threads=1)
    assert quantizer.fast_types == frozenset()
    rows = random_rows(3)[:4]
    assert np.array_equal(quantizer.quantize(T.Q4_K, rows), ggml.quantize(T.Q4_K, rows))


def test_unhandled_inputs_write_nothing(fast):
    rows = np.ones((2, 256), dtype=np.float32)
    out = np.zeros(400, dtype=np.uint8)
    assert fast.quantize(T.Q8_0, rows.ctypes.data, out.ctypes.data, 2, 256) == 0
    assert fast.quantize(T.Q4_K, rows.ctypes.data, out.ctypes.data, 1, 255) == 0
    assert not out.any()


def test_environment_switches_the_fast_path_off(monkeypatch, ggml):
    monkeypatch.setenv(DISABLE_ENV, "0")
    assert load_fast_quantizer() is None


def test_prefetched_keeps_order_and_stops_and_raises():
    from dgemma_convert.converter import prefetched

    assert list(prefetched(iter(range(50)))) == list(range(50))
    made = []

    def counting():
        for i in range(1000):
            made.append(i)
            yield i

    items = prefetched(counting(), depth=1)
    assert next(items) == 0
    items.close()  # the caller stops early: the producer stops too, at most depth + 1 items made
    assert len(made) <= 2

    def failing():
        yield 1
        raise ValueError("broken shard")

    with pytest.raises(ValueError, match="broken shard"):
        list(prefetched(failing()))
