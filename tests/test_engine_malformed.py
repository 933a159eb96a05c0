"""Malformed GGUF files must raise a clear EngineError; none may crash the process (each case runs in a subprocess).

Each case edits one field of a valid converted fixture in place (located by walking the GGUF header here), so it
tests exactly the lie it names: truncation, counts and sizes beyond the file, offsets past EOF, unknown types,
too many dims, duplicate names, wrong architecture, missing tensor, wrong shape or type, wrong-typed keys.
"""
from __future__ import annotations

import struct
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

SCALAR_SIZE = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING, ARRAY = 8, 9


@dataclass
class KV:
    key: str
    key_len_at: int   # offset of the u64 key length
    type_at: int      # offset of the u32 value type
    value_at: int     # offset of the value (for arrays: of the u32 element type)


@dataclass
class TensorInfo:
    name: str
    name_at: int      # offset of the name bytes
    n_dims_at: int
    ne_at: list[int]
    type_at: int
    offset_at: int


@dataclass
class Layout:
    kvs: dict[str, KV] = field(default_factory=dict)
    tensors: dict[str, TensorInfo] = field(default_factory=dict)


def walk(data: bytes) -> Layout:
    """Byte offsets of every key/value and tensor-info field of a (valid) GGUF v3 file."""
    pos = 24
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    out = Layout()

    def string(p: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", data, p)
        return data[p + 8:p + 8 + n].decode(), p + 8 + n

    def skip(p: int, t: int) -> int:
        if t == STRING:
            return string(p)[1]
        if t == ARRAY:
            et, n = struct.unpack_from("<IQ", data, p)
            p += 12
            for _ in range(n) if et == STRING else ():
                p = string(p)[1]
            return p if et == STRING else p + n * SCALAR_SIZE[et]
        return p + SCALAR_SIZE[t]

    for _ in range(n_kv):
        key, p = string(pos)
        (t,) = struct.unpack_from("<I", data, p)
        out.kvs[key] = KV(key, pos, p, p + 4)
        pos = skip(p + 4, t)
    for _ in range(n_tensors):
        name, p = string(pos)
        (n_dims,) = struct.unpack_from("<I", data, p)
        ne_at = [p + 4 + 8 * d for d in range(n_dims)]
        type_at = p + 4 + 8 * n_dims
        out.tensors[name] = TensorInfo(name, pos + 8, p, ne_at, type_at, type_at + 4)
        pos = type_at + 12
    return out


def put_u32(b: bytearray, at: int, v: int) -> None:
    struct.pack_into("<I", b, at, v)


def put_u64(b: bytearray, at: int, v: int) -> None:
    struct.pack_into("<Q", b, at, v)


def rename(b: bytearray, at: int, old: str, new: str) -> None:
    assert len(old) == len(new) and b[at:at + len(old)] == old.encode()
    b[at:at + len(new)] = new.encode()


Mutation = Callable[[bytearray, Layout], bytes]


def case_table() -> dict[str, tuple[Mutation, str]]:
    def t(name):
        return lambda L: L.tensors[name]

    def arch_value(b: bytearray, L: Layout) -> bytes:
        rename(b, L.kvs["general.architecture"].value_at + 8, "diffusion-gemma", "diffusion-llama")
        return bytes(b)

    def dup_name(b: bytearray, L: Layout) -> bytes:
        rename(b, L.tensors["blk.0.attn_k.weight"].name_at, "blk.0.attn_k.weight", "blk.0.attn_q.weight")
        return bytes(b)

    def transposed(b: bytearray, L: Layout) -> bytes:  # same byte size, wrong orientation
        ne = L.tensors["blk.0.ffn_gate.weight"].ne_at
        d0, d1 = struct.unpack_from("<QQ", b, ne[0])
        put_u64(b, ne[0], d1)
        put_u64(b, ne[1], d0)
        return bytes(b)

    def tokens_count(b: bytearray, L: Layout) -> bytes:
        put_u64(b, L.kvs["tokenizer.ggml.tokens"].value_at + 4, 1 << 40)
        return bytes(b)

    return {
        "empty file": (lambda b, L: b"", "only 0 bytes"),
        "magic only": (lambda b, L: b"GGUF", "only 4 bytes"),
        "bad magic": (lambda b, L: b"GGML" + bytes(b[4:]), "bad magic"),
        "bad version": (lambda b, L: bytes(b[:4]) + struct.pack("<I", 99) + bytes(b[8:]), "unsupported GGUF version"),
        "truncated header": (lambda b, L: bytes(b[:300]), "truncated"),
        "truncated data": (lambda b, L: bytes(b[:-100]), "past the end of the file"),
        "tensor count lies": (lambda b, L: (put_u64(b, 8, 1 << 63), bytes(b))[1], "cannot fit"),
        "key count lies": (lambda b, L: (put_u64(b, 16, (1 << 64) - 1), bytes(b))[1], "cannot fit"),
        "key length past EOF": (lambda b, L: (put_u64(b, 24, 1 << 40), bytes(b))[1], "exceeds"),
        "string array count lies": (tokens_count, "more than the file holds"),
        "n_dims > 4": (lambda b, L: (put_u32(b, L.tensors["output_norm.weight"].n_dims_at, 5), bytes(b))[1],
                       "dimensions"),
        "shape overflows": (lambda b, L: (put_u64(b, L.tensors["token_embd.weight"].ne_at[1], 1 << 62), bytes(b))[1],
                            "larger than the file"),
        "unknown tensor type": (lambda b, L: (put_u32(b, L.tensors["blk.0.ffn_up.weight"].type_at, 200), bytes(b))[1],
                                "unknown type"),
        "removed tensor type": (lambda b, L: (put_u32(b, L.tensors["blk.0.ffn_up.weight"].type_at, 4), bytes(b))[1],
                                "unknown type"),
        "offset past EOF": (lambda b, L: (put_u64(b, L.tensors["blk.1.ffn_up.weight"].offset_at, 1 << 40), bytes(b))[1],
                            "past the end of the file"),
        "misaligned offset": (lambda b, L: (put_u64(b, L.tensors["blk.1.ffn_up.weight"].offset_at, 33), bytes(b))[1],
                              "not aligned"),
        "duplicate tensor name": (dup_name, "duplicate tensor name"),
        "wrong architecture": (arch_value, "unsupported model architecture 'diffusion-llama'"),
        "missing tensor": (lambda b, L: (rename(b, L.tensors["blk.1.attn_q.weight"].name_at, "blk.1.attn_q.weight",
                                                "blk.1.attn_x.weight"), bytes(b))[1],
                           "missing tensor 'blk.1.attn_q.weight'"),
        "wrong shape": (transposed, "'blk.0.ffn_gate.weight' has shape [96, 64, 1, 1], expected [64, 96, 1]"),
        "wrong type": (lambda b, L: (put_u32(b, L.tensors["blk.0.ffn_up.weight"].type_at, 26), bytes(b))[1],
                       "'blk.0.ffn_up.weight' has unsupported type i32"),
        "size disagrees with offsets": (lambda b, L: (put_u64(b, L.tensors["output_norm.weight"].ne_at[0], 32),
                                                      bytes(b))[1], "sizes and offsets disagree"),
        "wrong-typed block_count": (lambda b, L: (put_u32(b, L.kvs["diffusion-gemma.block_count"].type_at, 6),
                                                  bytes(b))[1], "expected an integer"),
        "block_count lies": (lambda b, L: (put_u32(b, L.kvs["diffusion-gemma.block_count"].value_at, 7), bytes(b))[1],
                             "expected block_count = 7"),
        "missing canvas_length": (lambda b, L: (rename(b, L.kvs["diffusion.canvas_length"].key_len_at + 8,
                                                       "diffusion.canvas_length", "diffusion.canvas_lengtX"),
                                                bytes(b))[1], "missing the required key 'diffusion.canvas_length'"),
    }


LOADER = """
import sys
from dgemma_engine.errors import EngineError
from dgemma_engine.model import Model
try:
    Model.load(sys.argv[1], threads=1)
except EngineError as exc:
    print("ENGINE_ERROR", exc)
    sys.exit(3)
print("LOADED")
"""


@pytest.fixture(scope="module")
def outcomes(gguf_path, tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """Write every malformed file, then load each in its own subprocess (a few at a time)."""
    valid = gguf_path("tiny-a", "f32").read_bytes()
    layout = walk(valid)
    folder = tmp_path_factory.mktemp("malformed")
    paths = {}
    for i, (name, (mutate, _)) in enumerate(case_table().items()):
        paths[name] = folder / f"case{i}.gguf"
        paths[name].write_bytes(mutate(bytearray(valid), layout))

    def load(path: Path) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", LOADER, str(path)], capture_output=True, text=True, timeout=60)

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = dict(zip(paths, pool.map(load, paths.values())))
    results["(valid file)"] = load(gguf_path("tiny-a", "f32"))
    return results


@pytest.mark.parametrize("case", list(case_table()))
def test_malformed_gguf_raises_engine_error(outcomes, case):
    result = outcomes[case]
    expected = case_table()[case][1]
    assert result.returncode == 3, f"rc {result.returncode}\nstdout {result.stdout}\nstderr {result.stderr[-2000:]}"
    assert "ENGINE_ERROR" in result.stdout and expected in result.stdout, result.stdout
    assert "Traceback" not in result.stderr


def test_unmodified_file_loads(outcomes):
    assert outcomes["(valid file)"].returncode == 0 and "LOADED" in outcomes["(valid file)"].stdout


def test_cli_reports_one_line_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 10)
    out = tmp_path / "out.npy"
    result = subprocess.run([sys.executable, "-m", "dgemma_cli.main", "debug", "logits", str(bad), "--prompt-ids", "2,3",
                             "--canvas-ids", "4,5", "--out", str(out)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert result.stderr.startswith("Error: ") and result.stderr.count("\n") == 1, result.stderr
    assert "Traceback" not in result.stderr and not out.exists()
