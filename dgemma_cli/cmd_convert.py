"""`dgemma convert HF_DIR --outfile OUT.gguf --outtype TYPE`: HF checkpoint folder -> GGUF (dgemma_convert).

`dgemma convert --lora PEFT_DIR --outfile OUT.gguf [--base BASE.gguf]`: PEFT adapter folder -> GGUF LoRA file
(docs/gguf.md#lora-adapters)."""
from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Any, Optional

import typer
from typer.core import TyperCommand


class ConvertCommand(TyperCommand):
    """`convert`, whose `--help` lists every output type from the converter's own table. The converter (numpy, gguf)
    is imported only when help is shown: too slow to load on every `dgemma` start."""

    def format_help(self, ctx: Any, formatter: Any) -> None:
        from dgemma_convert.quantize import OUT_TYPES

        outtype = next(param for param in self.params if param.name == "outtype")
        outtype.help = "output type: " + ", ".join(OUT_TYPES)  # separate words, so Rich wraps the list, never crops it
        super().format_help(ctx, formatter)


def convert(
    ctx: typer.Context,
    hf_dir: Optional[Path] = typer.Argument(None, help="Hugging Face checkpoint folder"),
    outfile: Path = typer.Option(..., "--outfile", "-o", help="output .gguf path"),
    outtype: str = typer.Option("bf16", "--outtype", help="output type"),  # the list: ConvertCommand
    threads: Optional[int] = typer.Option(None, "--threads", min=1, help="quantizer threads (default: all cores)"),
    lora: Optional[Path] = typer.Option(None, "--lora", help="convert this PEFT LoRA adapter folder instead"),
    base: Optional[Path] = typer.Option(None, "--base", help="with --lora: check the adapter against this base GGUF"),
    mmproj_outfile: Optional[Path] = typer.Option(None, "--mmproj-outfile",
                                                  help="also write the vision projector GGUF (llama.cpp mtmd layout)"),
    mmproj_outtype: Optional[str] = typer.Option(None, "--mmproj-outtype",
                                                 help="projector type: f32, f16, bf16, q8_0 (default: --outtype if "
                                                      "one of those, else f16)"),
) -> None:
    """Convert a DiffusionGemma checkpoint to GGUF (llama.cpp PR #24423 / Unsloth layout).

    With --lora: a PEFT LoRA adapter folder to a GGUF LoRA file (docs/gguf.md, LoRA adapters)."""
    from dgemma_convert import convert as run_conversion
    from dgemma_convert.errors import ConvertError

    if lora is not None:
        if hf_dir is not None:
            raise ConvertError("give either a checkpoint folder or --lora, not both")
        convert_adapter(lora, outfile, base)
        return
    if hf_dir is None:  # a usage error (exit 2), as when the argument was required
        param = next(p for p in ctx.command.params if p.name == "hf_dir")
        raise typer.BadParameter("missing: give a checkpoint folder, or --lora PEFT_DIR", ctx=ctx, param=param)
    if base is not None:
        raise ConvertError("--base goes with --lora")
    if mmproj_outtype is not None and mmproj_outfile is None:
        raise ConvertError("--mmproj-outtype goes with --mmproj-outfile")
    projector = plan_projector(hf_dir, outtype, mmproj_outtype) if mmproj_outfile is not None else None
    # a terminated conversion unwinds like an interrupted one: the temporary output file is removed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    interactive = sys.stderr.isatty()
    progress = RichProgress() if interactive else None  # quiet when piped
    result = run_conversion(hf_dir, outfile, outtype, threads=threads, progress=progress)
    if interactive:
        size_gib = result.nbytes / 2**30
        print(f"wrote {result.path} ({result.n_tensors} tensors, {size_gib:.2f} GiB) in {result.seconds:.1f} s",
              file=sys.stderr)
    if mmproj_outfile is not None:
        write_projector(hf_dir, mmproj_outfile, projector, threads, interactive)


def plan_projector(hf_dir: Path, outtype: str, mmproj_outtype: Optional[str]) -> Optional[str]:
    """The projector's output type, checked before the text model is converted; None (with a one-line note) when the
    checkpoint has no vision tower: the text model is still written and the command succeeds, as Ollama's create
    does for a text-only model."""
    from dgemma_convert.mmproj import MMPROJ_OUT_TYPES, plan_mmproj

    chosen = mmproj_outtype or (outtype.lower() if outtype.lower() in MMPROJ_OUT_TYPES else "f16")
    if plan_mmproj(hf_dir, chosen) is None:
        print(f"note: {hf_dir} has no vision tower (no vision_config in config.json); no projector written",
              file=sys.stderr)
        return None
    return chosen


def write_projector(hf_dir: Path, outfile: Path, outtype: Optional[str], threads: Optional[int],
                    interactive: bool) -> None:
    from dgemma_convert import convert_mmproj

    if outtype is None:
        return
    result = convert_mmproj(hf_dir, outfile, outtype, threads=threads)
    if interactive and result is not None:
        print(f"wrote {result.path} ({result.n_tensors} tensors, {result.nbytes / 2**20:.1f} MiB, {outtype})",
              file=sys.stderr)


def convert_adapter(peft_dir: Path, outfile: Path, base: Optional[Path]) -> None:
    from dgemma_convert.lora import convert_lora

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    result = convert_lora(peft_dir, outfile, base=base)
    if sys.stderr.isatty():
        ranks = ", ".join(str(r) for r in result.ranks)
        print(f"wrote {result.path} ({result.n_pairs} adapted weights, rank {ranks}, {result.nbytes / 2**20:.1f} MiB)",
              file=sys.stderr)


class RichProgress:
    """A Rich progress bar over the output bytes: tensors done, bytes, rate and ETA."""

    def start(self, n_tensors: int, total_bytes: int) -> None:
        from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                                   TransferSpeedColumn)

        self.n_tensors = n_tensors
        self._bar = Progress(
            TextColumn("{task.fields[tensors]}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
            TimeRemainingColumn(), TextColumn("{task.fields[current]}"), transient=False,
            console=_stderr_console(),
        )
        self._task = self._bar.add_task("convert", total=total_bytes, tensors=f"0/{self.n_tensors}", current="")
        self._bar.start()

    def tensor(self, index: int, name: str) -> None:
        self._bar.update(self._task, tensors=f"{index + 1}/{self.n_tensors} tensors", current=name)

    def advance(self, nbytes: int) -> None:
        self._bar.advance(self._task, nbytes)

    def stop(self) -> None:
        self._bar.stop()


def _stderr_console():
    from rich.console import Console

    return Console(stderr=True)
