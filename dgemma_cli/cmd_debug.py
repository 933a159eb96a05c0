"""`dgemma debug ...`: fixed-interface entry points that external checks rely on."""
from pathlib import Path
from typing import Annotated, List, Optional

import typer

app = typer.Typer(help="Debugging entry points (fixed interfaces).", no_args_is_help=True)


def parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated token ids, got {text!r}") from None


# the options both commands take: threads, placement, adapters
Threads = Annotated[Optional[int], typer.Option("--threads")]
NumGpu = Annotated[Optional[int], typer.Option("--num-gpu", help="layers on accelerators / RPC devices (-ngl)")]
NumCpuMoe = Annotated[int, typer.Option("--num-cpu-moe", help="first N layers keep their experts on the CPU")]
Lora = Annotated[Optional[List[str]], typer.Option(
    "--lora", help="LoRA adapter: a GGUF LoRA file or a PEFT adapter folder; PATH:SCALE scales it (default 1); repeatable")]
ImageEmbeds = Annotated[Optional[List[Path]], typer.Option(
    "--image-embeds", help=".npy of one image's embeddings, float32 (n_soft, n_embd), per image of the prompt; repeatable")]
Mmproj = Annotated[Optional[Path], typer.Option("--mmproj", help="the projector GGUF that encodes --image files")]
Images = Annotated[Optional[List[Path]], typer.Option(
    "--image", help="an image file, per image of the prompt (a marker or its whole boi, image × n, eoi block); repeatable")]


def images_of(image_embeds, mmproj, image_files, threads):
    from dgemma_engine.debug import debug_images

    return debug_images(image_embeds or [], mmproj, image_files or [], threads)


def adapter_files(values: Optional[List[str]]):
    """The `--lora` values as the engine loads them: GGUF LoRA files, PEFT folders converted for the command's run."""
    from dgemma_convert.lora import peft_as_gguf
    from dgemma_engine.adapters import parse_adapter_arg

    return peft_as_gguf([parse_adapter_arg(v) for v in values or []])


@app.command("logits")
def logits(
    model: Path = typer.Argument(..., help="GGUF file"),
    prompt_ids: str = typer.Option(..., "--prompt-ids", help="comma-separated prompt token ids"),
    canvas_ids: str = typer.Option(..., "--canvas-ids", help="comma-separated canvas token ids"),
    sc_logits: Optional[Path] = typer.Option(None, "--sc-logits", help=".npy of the previous step's raw logits"),
    sc_temperature: float = typer.Option(1.0, "--sc-temperature", help="temperature applied to --sc-logits"),
    out: Path = typer.Option(..., "--out", help="output .npy, float32 [canvas_len, vocab]"),
    threads: Threads = None,
    num_gpu: NumGpu = None,
    num_cpu_moe: NumCpuMoe = 0,
    lora: Lora = None,
    image_embeds: ImageEmbeds = None,
    mmproj: Mmproj = None,
    image: Images = None,
) -> None:
    """Write the softcapped decoder logits for one denoising step (prompt encoded first)."""
    from dgemma_engine.debug import debug_logits

    with adapter_files(lora) as adapters:
        debug_logits(model, parse_ids(prompt_ids), parse_ids(canvas_ids), sc_logits, sc_temperature, out, threads,
                     adapters=adapters, num_gpu=num_gpu, num_cpu_moe=num_cpu_moe,
                     images=images_of(image_embeds, mmproj, image, threads))


@app.command("generate")
def generate(
    model: Path = typer.Argument(..., help="GGUF file"),
    prompt_ids: str = typer.Option(..., "--prompt-ids"),
    seed: int = typer.Option(0, "--seed"),
    rng: str = typer.Option("fast", "--rng", help="torch | fast"),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens"),
    steps: Optional[int] = typer.Option(None, "--steps"),
    t_max: Optional[float] = typer.Option(None, "--t-max"),
    t_min: Optional[float] = typer.Option(None, "--t-min"),
    entropy_bound: Optional[float] = typer.Option(None, "--entropy-bound"),
    confidence_threshold: Optional[float] = typer.Option(None, "--confidence-threshold"),
    stability_threshold: Optional[int] = typer.Option(None, "--stability-threshold"),
    num_canvases: Optional[int] = typer.Option(None, "--num-canvases",
                                               help="candidate canvases denoised together (the lowest-entropy one is kept)"),
    self_cond_top_k: Optional[int] = typer.Option(None, "--self-cond-top-k",
                                                  help="self-conditioning from each row's k most probable tokens (0: all)"),
    threads: Threads = None,
    num_gpu: NumGpu = None,
    num_cpu_moe: NumCpuMoe = 0,
    lora: Lora = None,
    image_embeds: ImageEmbeds = None,
    mmproj: Mmproj = None,
    image: Images = None,
) -> None:
    """Print JSON {"sequence": [...], "steps_per_canvas": [...]} for one generation."""
    from dgemma_engine.debug import debug_generate

    with adapter_files(lora) as adapters:
        debug_generate(
            model, parse_ids(prompt_ids), seed=seed, rng=rng, max_new_tokens=max_new_tokens, steps=steps, t_max=t_max,
            t_min=t_min, entropy_bound=entropy_bound, confidence_threshold=confidence_threshold,
            stability_threshold=stability_threshold, threads=threads, num_gpu=num_gpu, num_cpu_moe=num_cpu_moe,
            num_canvases=num_canvases, self_cond_top_k=self_cond_top_k, adapters=adapters,
            images=images_of(image_embeds, mmproj, image, threads),
        )
