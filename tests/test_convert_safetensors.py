"""The converter's own safetensors reader on hand-made files: valid data reads back exactly, every lie is refused."""
from __future__ import annotations

import json

import numpy as np
import pytest

from dgemma_convert import ConvertError
from dgemma_convert.safetensors_reader import Checkpoint


def write_file(path, header: dict, data: bytes, header_len: int | None = None) -> None:
    blob = json.dumps(header).encode()
    n = len(blob) if header_len is None else header_len
    path.write_bytes(n.to_bytes(8, "little") + blob + data)


def two_tensors(tmp_path):
    a = np.arange(12, dtype="<f4").reshape(3, 4)
    b = (np.arange(6, dtype=np.float32).view(np.uint32) >> 16).astype("<u2")  # bf16 of 0..5
    header = {"__metadata__": {"format": "pt"},
              "a": {"dtype": "F32", "shape": [3, 4], "data_offsets": [0, 48]},
              "b": {"dtype": "BF16", "shape": [6], "data_offsets": [48, 60]}}
    write_file(tmp_path / "model.safetensors", header, a.tobytes() + b.tobytes())
    return header, a.tobytes() + b.tobytes()


def test_reads_back_f32_exactly_and_bf16_widened(tmp_path):
    two_tensors(tmp_path)
    with Checkpoint.open(tmp_path) as ckpt:
        (a,) = list(ckpt.iter_rows_f32(ckpt.entries["a"], max_elements=1 << 20))
        assert a.tolist() == np.arange(12, dtype=np.float32).reshape(3, 4).tolist()
        chunks = list(ckpt.iter_rows_f32(ckpt.entries["a"], max_elements=4))  # one row per chunk
        assert len(chunks) == 3 and np.concatenate(chunks).tolist() == a.tolist()
        (b,) = list(ckpt.iter_rows_f32(ckpt.entries["b"], max_elements=1 << 20))
        assert b.ravel().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
        assert list(ckpt.iter_raw(ckpt.entries["a"], 1 << 20, n_rows=2)) == [a[:2].tobytes()]


@pytest.mark.parametrize("mutate, message", [
    (lambda h: h["a"].update(dtype="F33"), "unknown dtype"),
    (lambda h: h["a"].update(shape=[3, -4]), "shape"),
    (lambda h: h["a"].update(shape="3x4"), "shape"),
    (lambda h: h["a"].update(data_offsets=[0]), "data_offsets"),
    (lambda h: h["a"].update(data_offsets=[10, 5]), "invalid data_offsets"),
    (lambda h: h["a"].update(data_offsets=[0, 44]), "needs 48"),
    (lambda h: h["b"].update(data_offsets=[40, 52]), "overlap"),
    (lambda h: h["b"].update(data_offsets=[1000, 1012]), "offsets lie"),
    (lambda h: h.update(a=[1, 2]), "must be an object"),
])
def test_lying_headers_are_refused(tmp_path, mutate, message):
    header, data = two_tensors(tmp_path)
    mutate(header)
    write_file(tmp_path / "model.safetensors", header, data)
    with pytest.raises(ConvertError, match=message):
        Checkpoint.open(tmp_path)


@pytest.mark.parametrize("raw, message", [
    (b"\x05\x00", "too short"),
    ((10**12).to_bytes(8, "little") + b"{}", "implausible"),
    ((100).to_bytes(8, "little") + b"{}", "truncated"),
    ((4).to_bytes(8, "little") + b"{no}", "not valid JSON"),
    ((2).to_bytes(8, "little") + b"[]", "JSON object"),
])
def test_broken_files_are_refused(tmp_path, raw, message):
    (tmp_path / "model.safetensors").write_bytes(raw)
    with pytest.raises(ConvertError, match=message):
        Checkpoint.open(tmp_path)


def test_sharded_index_is_validated(tmp_path):
    header, data = two_tensors(tmp_path)
    (tmp_path / "model.safetensors").rename(tmp_path / "part-1.safetensors")
    index = tmp_path / "model.safetensors.index.json"

    index.write_text(json.dumps({"weight_map": {"a": "part-1.safetensors", "b": "part-1.safetensors"}}))
    with Checkpoint.open(tmp_path) as ckpt:
        assert set(ckpt.entries) == {"a", "b"}

    for weight_map, message in [
        ({"a": "../part-1.safetensors"}, "invalid shard name"),
        ({"a": "/etc/passwd"}, "invalid shard name"),
        ({"a": "part-2.safetensors"}, "missing shard part-2.safetensors"),
        ({"c": "part-1.safetensors"}, "not stored in shard"),
        ({}, "no 'weight_map'"),
    ]:
        index.write_text(json.dumps({"weight_map": weight_map}))
        with pytest.raises(ConvertError, match=message):
            Checkpoint.open(tmp_path)


def test_folder_without_weights(tmp_path):
    with pytest.raises(ConvertError, match="no model.safetensors"):
        Checkpoint.open(tmp_path)
