"""`dgemma convert`: HF checkpoint folder -> GGUF. (Implementation: dgemma_convert.)"""
from pathlib import Path

import typer


def convert(
    hf_dir: Path = typer.Argument(..., help="Hugging Face checkpoint folder"),
    outfile: Path = typer.Option(..., "--outfile", "-o", help="output .gguf path"),
    outtype: str = typer.Option("bf16", "--outtype", help="f32|f16|bf16|q8_0|q4_0|q4_k_m|q5_k_m|q6_k"),
) -> None:
    """Convert a DiffusionGemma checkpoint to GGUF."""
    raise NotImplementedError("being written")
