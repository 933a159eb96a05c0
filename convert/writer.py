"""Streaming GGUF output through gguf-py's GGUFWriter, written to a temporary file and renamed at the end.

GGUF puts all tensor infos (name, shape, type, offset) before the data, so the writer first registers every tensor,
writes header + key/values + tensor infos, and then receives each tensor's bytes in chunks, checking that exactly the
announced number of bytes arrives. The output appears under its final name only when complete; on any error the
temporary file is removed, so a failed conversion never leaves a half-written GGUF behind.
"""
from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
from gguf import GGUFValueType, GGUFWriter, GGMLQuantizationType

from dgemma_convert.errors import ConvertError
from dgemma_engine.gguf_keys import KEY_ARCHITECTURE


class StreamingGGUFWriter:
    def __init__(self, outfile: Path, arch: str):
        self.outfile = outfile
        directory = outfile.parent if str(outfile.parent) else Path(".")
        if not directory.is_dir():
            raise ConvertError(f"output folder does not exist: {directory}")
        # The name is fixed before the file exists, so an interruption at any point can remove it (abort).
        self.tmp_path = directory / f".{outfile.name}.{uuid.uuid4().hex[:12]}.tmp"
        self._gguf = GGUFWriter(path=None, arch=arch)
        self._expected: list[tuple[str, int]] = []  # (name, nbytes) in file order
        self._next = 0
        self._fout = None

    # -- metadata and tensor infos (before any data) ------------------------------------------------------------

    def add_key_value(self, key: str, value: Any, vtype: GGUFValueType, sub_type: GGUFValueType | None = None) -> None:
        if key == KEY_ARCHITECTURE:  # GGUFWriter writes it first by itself
            if value != self._gguf.arch:
                raise ConvertError(f"internal error: architecture {value!r} != {self._gguf.arch!r}")
            return
        self._gguf.add_key_value(key, value, vtype, sub_type=sub_type)

    def add_tensor_info(self, name: str, ne: Sequence[int], ggml_type: GGMLQuantizationType, nbytes: int) -> None:
        # GGUFWriter takes the numpy-order shape and writes it reversed (ggml ne order)
        self._gguf.add_tensor_info(name, tuple(reversed(ne)), np.dtype(np.float32), nbytes, raw_dtype=ggml_type)
        self._expected.append((name, nbytes))

    def begin_data(self) -> None:
        """Write header, key/values and tensor infos; afterwards only tensor data may follow."""
        try:  # exclusive creation, never through a symlink; the mode follows the umask like any new file
            os.close(os.open(self.tmp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o666))
        except OSError as exc:
            raise ConvertError(f"cannot write to {self.tmp_path.parent}: {exc}") from None
        self._gguf.open_output_file(self.tmp_path)
        self._gguf.write_header_to_file()
        self._gguf.write_kv_data_to_file()
        self._gguf.write_ti_data_to_file()
        self._fout = self._gguf.fout[0]
        self._pad()

    # -- tensor data --------------------------------------------------------------------------------------------

    def write_tensor(self, name: str, chunks: Iterable[bytes | np.ndarray]) -> None:
        expected_name, expected = self._expected[self._next]
        if name != expected_name:
            raise ConvertError(f"internal error: tensor {name} written out of order (expected {expected_name})")
        written = 0
        for chunk in chunks:
            data = memoryview(np.ascontiguousarray(chunk)).cast("B") if isinstance(chunk, np.ndarray) else chunk
            written += len(data)
            if written > expected:
                break
            self._fout.write(data)
        if written != expected:
            raise ConvertError(f"internal error: tensor {name} has {written} bytes, {expected} announced")
        self._pad()
        self._next += 1

    def _pad(self) -> None:
        align = self._gguf.data_alignment
        pad = -self._fout.tell() % align
        if pad:
            self._fout.write(b"\0" * pad)

    # -- completion -----------------------------------------------------------------------------------------------

    def finish(self) -> None:
        if self._next != len(self._expected):
            raise ConvertError(f"internal error: {len(self._expected) - self._next} tensors were not written")
        self._fout.flush()
        os.fsync(self._fout.fileno())
        self._gguf.close()
        os.replace(self.tmp_path, self.outfile)

    def abort(self) -> None:
        self._gguf.close()
        self.tmp_path.unlink(missing_ok=True)

    def __enter__(self) -> "StreamingGGUFWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
