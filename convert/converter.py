"""Orchestration: plan the GGUF from config + tokenizer, check the checkpoint against it, stream tensor by tensor.

`plan()` reads only JSON files and produces the complete key and tensor inventory (names, shapes, types, sizes), so
the layout of a 26B file can be checked without its 50 GB of weights. `convert()` then verifies every checkpoint
tensor against the plan (presence, shape, dtype) before writing a byte, and converts one tensor at a time in row
chunks: peak memory is a few chunks, independent of the model size.
"""
from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, TypeVar

import numpy as np
from gguf import GGMLQuantizationType as T

from dgemma_convert.errors import ConvertError
from dgemma_convert.gguf_metadata import ARCH, KeyValue, build_metadata
from dgemma_convert.hf_config import ModelConfig, load_model_config, load_sampler_defaults
from dgemma_convert.quantize import FLOAT_TYPES, GGMLQuantizer, OutType, choose_types, nbytes, parse_outtype
from dgemma_convert.safetensors_reader import FLOAT_DTYPES, Checkpoint, TensorEntry
from dgemma_convert.tensor_map import TensorSpec, is_dropped, rope_freqs, source_shape_matches, tensor_specs
from dgemma_convert.tokenizer_meta import load_tokenizer
from dgemma_convert.writer import StreamingGGUFWriter

CHUNK_ELEMENTS = 1 << 24  # 16 Mi elements per chunk: 64 MiB as float32
PREFETCH_CHUNKS = 1  # decoded ahead while the current chunk is quantized: one more chunk in memory
RAW_CHUNK_BYTES = 64 << 20
# safetensors dtype -> the GGML type whose bytes are identical (these copy through unchanged)
SAME_BYTES = {"F32": T.F32, "F16": T.F16, "BF16": T.BF16}


@dataclass(frozen=True)
class PlannedTensor:
    spec: TensorSpec
    ggml_type: T
    nbytes: int

    @property
    def name(self) -> str:
        return self.spec.name


@dataclass(frozen=True)
class ConversionPlan:
    hf_dir: Path
    outtype: OutType
    config: ModelConfig
    metadata: list[KeyValue]
    tensors: list[PlannedTensor]

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


@dataclass(frozen=True)
class ConversionResult:
    path: Path
    n_tensors: int
    nbytes: int
    seconds: float


class ProgressSink:
    """Receives progress; the default does nothing (quiet). The CLI passes a Rich progress bar on a TTY."""

    def start(self, n_tensors: int, total_bytes: int) -> None: ...

    def tensor(self, index: int, name: str) -> None: ...

    def advance(self, nbytes: int) -> None: ...

    def stop(self) -> None: ...


def plan(hf_dir: Path, outtype: str | OutType) -> ConversionPlan:
    """Everything about the output except the weights: keys, tensor names, shapes, types and sizes."""
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise ConvertError(f"not a checkpoint folder: {hf_dir}")
    out = outtype if isinstance(outtype, OutType) else parse_outtype(outtype)
    cfg = load_model_config(hf_dir)
    tok = load_tokenizer(hf_dir, cfg)
    specs = tensor_specs(cfg, tok.n_tokens)
    types = choose_types(specs, cfg.n_layer, out)
    tensors = [PlannedTensor(s, t, nbytes(t, s.ne)) for s, t in zip(specs, types, strict=True)]
    metadata = build_metadata(cfg, load_sampler_defaults(hf_dir), tok, name=hf_dir.resolve().name,
                              file_type=out.file_type, specs=specs)
    return ConversionPlan(hf_dir, out, cfg, metadata, tensors)


def match_checkpoint(p: ConversionPlan, ckpt: Checkpoint) -> dict[str, TensorEntry]:
    """Checkpoint entry of every planned tensor; any missing, misshapen, non-float or unknown tensor is an error."""
    sources: dict[str, TensorEntry] = {}
    for t in p.tensors:
        src = t.spec.source
        if src is None:
            continue
        entry = ckpt.entries.get(src)
        if entry is None:
            raise ConvertError(f"checkpoint lacks tensor '{src}' (needed for {t.name})")
        if not source_shape_matches(t.spec, entry.shape):
            raise ConvertError(f"tensor '{src}' has shape {list(entry.shape)} but config.json implies "
                               f"{list(t.spec.hf_shape)}")
        if entry.dtype not in FLOAT_DTYPES:
            raise ConvertError(f"tensor '{src}' has unsupported dtype {entry.dtype}")
        sources[t.name] = entry
    used = {e.name for e in sources.values()}
    for name in sorted(ckpt.entries):
        if name not in used and not is_dropped(name, p.config):
            raise ConvertError(f"unexpected tensor '{name}' in the checkpoint (does config.json match the weights?)")
    return sources


def convert(hf_dir: Path, outfile: Path, outtype: str | OutType, *, threads: int | None = None,
            progress: ProgressSink | None = None) -> ConversionResult:
    """Convert a DiffusionGemma checkpoint folder to one GGUF file (atomically: temp file + rename)."""
    started = time.monotonic()
    p = plan(hf_dir, outtype)
    with Checkpoint.open(p.hf_dir) as ckpt:
        sources = match_checkpoint(p, ckpt)
        quantizer = make_quantizer(p.tensors, threads)
        write_gguf(Path(outfile), p.metadata, p.tensors,
                   lambda t: _tensor_bytes(t, sources.get(t.name), ckpt, p.config, quantizer), progress)
    return ConversionResult(Path(outfile), len(p.tensors), Path(outfile).stat().st_size, time.monotonic() - started)


def make_quantizer(tensors: list[PlannedTensor], threads: int | None) -> GGMLQuantizer | None:
    """ggml is loaded only when some tensor is quantized (float outputs need numpy only)."""
    if all(t.ggml_type in FLOAT_TYPES for t in tensors):
        return None
    return GGMLQuantizer(threads or os.cpu_count() or 1)


def write_gguf(outfile: Path, metadata: list[KeyValue], tensors: list[PlannedTensor],
               tensor_bytes: Callable[[PlannedTensor], Iterator[bytes | np.ndarray]],
               progress: ProgressSink | None = None, arch: str = ARCH) -> None:
    """Write metadata and tensor infos, then each tensor's chunks; the file appears only when complete."""
    if outfile.is_dir():
        raise ConvertError(f"output path is a folder: {outfile}")
    progress = progress or ProgressSink()
    with StreamingGGUFWriter(outfile, arch) as writer:
        for kv in metadata:
            writer.add_key_value(kv.key, kv.value, kv.vtype, kv.sub_type)
        for t in tensors:
            writer.add_tensor_info(t.name, t.spec.ne, t.ggml_type, t.nbytes)
        writer.begin_data()
        progress.start(len(tensors), sum(t.nbytes for t in tensors))
        try:
            for index, t in enumerate(tensors):
                progress.tensor(index, t.name)
                writer.write_tensor(t.name, _counted(tensor_bytes(t), progress.advance))
            writer.finish()
        finally:
            progress.stop()


def _counted(chunks: Iterator[bytes | np.ndarray], advance: Callable[[int], None]) -> Iterator[bytes | np.ndarray]:
    for chunk in chunks:
        yield chunk
        advance(chunk.nbytes if isinstance(chunk, np.ndarray) else len(chunk))


def _tensor_bytes(t: PlannedTensor, entry: TensorEntry | None, ckpt: Checkpoint, cfg: ModelConfig,
                  quantizer: GGMLQuantizer | None) -> Iterator[bytes | np.ndarray]:
    """The output bytes of one tensor, chunk by chunk."""
    if entry is None:  # generated
        yield rope_freqs(cfg)
        return
    n_rows = int(np.prod(t.spec.ne[1:])) if t.spec.n_dims > 1 else 1  # < entry.n_rows for a truncated token_embd
    if SAME_BYTES.get(entry.dtype) == t.ggml_type:  # bit-exact copy
        yield from ckpt.iter_raw(entry, RAW_CHUNK_BYTES, n_rows)
        return
    yield from encode_rows(prefetched(ckpt.iter_rows_f32(entry, CHUNK_ELEMENTS, n_rows)), t.ggml_type, quantizer)


Item = TypeVar("Item")


def prefetched(items: Iterator[Item], depth: int = PREFETCH_CHUNKS) -> Iterator[Item]:
    """The same items in the same order, produced on a background thread at most `depth` ahead of the caller.

    Reading and decoding the next chunk (file reads and numpy release the GIL) then overlap with quantizing the
    current one; at most depth + 1 items are alive at once. The producer stops when the caller stops early, and its
    exceptions are raised in the caller.
    """
    ready: queue.Queue = queue.Queue()
    slots = threading.Semaphore(depth + 1)  # the caller's current item, and the ones made ahead of it
    stop = threading.Event()
    end = object()

    def produce() -> None:
        try:
            while True:
                while not slots.acquire(timeout=0.1):
                    if stop.is_set():
                        return
                item = end if stop.is_set() else next(items, end)
                ready.put((item, None))
                if item is end:
                    return
        except BaseException as exc:  # handed to the caller, raised there
            ready.put((end, exc))

    producer = threading.Thread(target=produce, name="convert-prefetch", daemon=True)
    producer.start()
    try:
        while True:
            item, error = ready.get()
            if error is not None:
                raise error
            if item is end:
                return
            yield item
            slots.release()  # the caller is done with this item
    finally:
        stop.set()
        producer.join()


def encode_rows(chunks: Iterator[np.ndarray], ggml_type: T, quantizer: GGMLQuantizer | None) -> Iterator[np.ndarray]:
    """float32 row chunks -> bytes of the output type."""
    for rows in chunks:
        if ggml_type == T.F32:
            yield rows
        elif ggml_type == T.F16:
            yield rows.astype("<f2")
        elif ggml_type == T.BF16:
            yield float32_to_bf16(rows)
        else:
            yield quantizer.quantize(ggml_type, rows)


def float32_to_bf16(x: np.ndarray) -> np.ndarray:
    """Round to nearest even, NaNs kept quiet: the same bits as ggml's fp32 -> bf16 conversion."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((u + (0x7FFF + ((u >> 16) & 1))) >> 16).astype(np.uint16)
    is_nan = (u & 0x7FFFFFFF) > 0x7F800000
    if is_nan.any():
        rounded[is_nan] = ((u[is_nan] >> 16) | 64).astype(np.uint16)
    return rounded
