"""What the scheduler keeps resident per model: a `Runner` over the engine (model, K/V context, tokenizer, template).

The scheduler only needs the `Runner` protocol, so tests can put a controllable fake behind it to inject faults (slow
steps, crashes). `EngineRunner` is the real thing over `dgemma_engine`; its methods block and run in worker threads.
"""
import logging
import os
import threading
from collections.abc import Iterator
from typing import Any, Protocol

from dgemma_engine.arch import check_architecture

from dgemma_cli.server.errors import RequestError
from dgemma_cli.server.options import SamplerSettings, load_options
from dgemma_cli.server.prompts import loaded_context
from dgemma_cli.server.request_images import encode_images, no_vision
from dgemma_engine import gguf_keys
from dgemma_engine.chat.answer_text import hidden_control_ids
from dgemma_engine.chat.templates import render_prompt, select_template, tool_format_of


class Runner(Protocol):
    canvas_length: int
    context_length: int  # the loaded num_ctx
    size: int  # bytes of weights + cache
    size_vram: int  # bytes on an accelerator (0 on CPU)
    metadata: dict[str, Any]
    has_thinking: bool
    tool_format: Any  # dgemma_engine.chat.tool_calls.ToolCallFormat of the chat template, None: it cannot render tools
    special_tokens: Any  # dgemma_engine.chat.special_tokens of the vocabulary: what a per-request template renders with
    image_marker: str | None  # the image token's text, where an image goes in a prompt; None: no vision
    image_token_id: int | None
    image_positions: int  # prompt positions one image takes at most (boi, soft tokens, eoi); 0 without vision
    renders_image_parts: bool  # the chat template renders `{"type": "image"}` content parts itself (Gemma 4's)

    def render_chat(self, messages: list[dict], think: bool | None, tools: list[dict] | None = None) -> str: ...

    def tokenize(self, text: str) -> list[int]: ...

    def detokenize(self, ids: list[int]) -> str: ...

    def generate(
        self, prompt_ids: list[int], sampler: SamplerSettings, max_new_tokens: int, cancel: threading.Event,
        constraint: Any = None, checker: Any = None, images: list[Any] | None = None,
    ) -> Iterator[Any]:
        """Yields the generation loop's StepEvent / CanvasEvent / DoneEvent (`dgemma_engine.events`); with a
        `constraint` (a TokenAutomaton), the committed text follows that format (structured output); with a task
        model's `checker` (dgemma_engine.tasks), canvases are chosen and corrected by its rules; `images`
        (request_images.RequestImage) go where their markers are in `prompt_ids`, in order."""
        ...

    def close(self) -> None: ...


log = logging.getLogger("dgemma.server")


def vram_bytes(placement: Any, size: int) -> int:
    """`size_vram` of `/api/ps`: the weights on accelerators, all of `size` when every layer and the output are there
    (the input embedding rows are read on the CPU either way, as in llama.cpp)."""
    on_devices = all(d != 0 for d in (*placement.layer_device, *placement.expert_device, placement.output_device))
    return size if on_devices else min(size, sum(placement.device_bytes))


class EngineRunner:
    """A loaded model with K/V contexts, a tokenizer and the chat template. Methods block (call them in threads)."""

    def __init__(self, local_model: Any, num_ctx: int, threads: int | None = None):
        from dgemma_engine.model import Model
        from dgemma_engine.tokenizer import Tokenizer

        # a Modelfile's `PARAMETER num_thread N` (Ollama's meaning) and the placement (docs/engine.md#devices:
        # PARAMETERs or request options, as llama.cpp's -ngl and --n-cpu-moe), range-checked again here: a stored
        # value outside the options table is a 400, never an engine abort
        load = load_options(getattr(local_model, "parameters", None))
        if threads is None:
            threads = load.threads
        self.threads = threads
        self._lock = threading.Lock()
        self._contexts: list[Any] = []
        # the manifest's LoRA layers, in order, each at scale 1 (docs/gguf.md#lora-adapters)
        adapters = [(str(path), 1.0) for path in getattr(local_model, "adapters", None) or []]
        self.model = Model.load(str(local_model.gguf_path), threads=threads,
                                name=f"model '{local_model.name}'" if getattr(local_model, "name", None) else None,
                                num_gpu=load.num_gpu, num_cpu_moe=load.num_cpu_moe,
                                adapters=adapters)
        try:
            hparams = self.model.hparams
            self.metadata = dict(self.model.metadata)
            check_architecture(self.metadata.get(gguf_keys.KEY_ARCHITECTURE), error=RequestError)
            self.canvas_length = int(hparams.canvas_length)
            self.context_length = loaded_context(num_ctx, hparams.n_ctx_train)  # what request checks assume
            self.tokenizer = Tokenizer.from_metadata(self.metadata)
            self.hidden_ids = hidden_control_ids(self.tokenizer)  # markup no reader of the answer parses
            self._contexts.append(self._new_context())  # allocate the cache now: a load fails early, not mid-request
        except BaseException:
            self.model.close()
            raise
        from dgemma_engine.chat.jinja import special_tokens

        self.special_tokens = special_tokens(self.metadata)  # computed once: it scans the whole vocabulary
        self.template = select_template(local_model, self.metadata)
        self.has_thinking = self.template.kind == "jinja" and "enable_thinking" in self.template.text
        self.tool_format = tool_format_of(self.template)
        self.size = os.path.getsize(local_model.gguf_path)
        self.size_vram = vram_bytes(self.model.placement, self.size)
        self.projector = None
        self.image_marker, self.image_token_id, self.image_positions = None, None, 0
        self.renders_image_parts = False
        if getattr(local_model, "projector", None) is not None:
            try:
                self._load_vision(local_model.projector, threads)
            except BaseException:  # a projector that does not load: nothing stays allocated
                self.close()
                raise
        from dgemma_engine.devices import list_devices

        found = ", ".join(f"{d.name} ({d.description})" for d in list_devices())
        log.info("loaded %s; devices: %s; %s", getattr(local_model, "name", "") or self.gguf_path_name(local_model),
                 found, self.model.placement.describe())
        self.gguf_path = str(local_model.gguf_path)

    def _load_vision(self, projector_path: Any, threads: int | None) -> None:
        """The projector (`dgemma_engine.vision.Projector`) and the vocabulary's image token. A vocabulary without
        the token leaves the model text-only: requests with images are then refused with Ollama's error."""
        ids = self.tokenize(IMAGE_MARKER)
        if len(ids) != 1:
            log.warning("the vocabulary has no %s token; images will be refused", IMAGE_MARKER)
            return
        from dgemma_engine.vision import Projector

        self.projector = Projector.load(str(projector_path), n_threads=threads)
        self.size += os.path.getsize(projector_path)  # /api/ps counts the vision tower's weights too
        self.image_marker, self.image_token_id = IMAGE_MARKER, ids[0]
        self.image_positions = self.projector.geometry.max_soft_tokens + 2
        self.renders_image_parts = template_renders_images(self.template, self.special_tokens)
        with self._lock:  # the first context was made before the projector: remake it with room for an image
            old, self._contexts = self._contexts, []
        for ctx in old:
            ctx.close()
        self._contexts.append(self._new_context())

    @staticmethod
    def gguf_path_name(local_model: Any) -> str:
        return os.path.basename(str(local_model.gguf_path))

    def _new_context(self, max_canvases: int = 1) -> Any:
        from dgemma_engine.model import Context

        images = {}
        if getattr(self, "projector", None) is not None:  # an image is encoded in one pass: room for the largest
            images["max_image_tokens"] = self.projector.geometry.max_soft_tokens
        return Context(self.model, n_ctx=self.context_length, threads=self.threads, max_canvases=max_canvases,
                       **images)

    def render_chat(self, messages: list[dict], think: bool | None, tools: list[dict] | None = None) -> str:
        return render_prompt(self.template, messages, think, self.special_tokens, tools)

    def tokenize(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, special=True))

    def detokenize(self, ids: list[int]) -> str:
        return self.tokenizer.decode(list(ids), hide=self.hidden_ids)

    def generate(
        self, prompt_ids: list[int], sampler: SamplerSettings, max_new_tokens: int, cancel: threading.Event,
        constraint: Any = None, checker: Any = None, images: list[Any] | None = None,
    ) -> Iterator[Any]:
        from dgemma_engine.constrained import CanvasConstraint
        from dgemma_engine.generate import eos_ids_from_metadata, generate

        extra = {}
        if images:  # encoded here, in the worker thread, once the slot is held
            if self.projector is None:  # generation.start refused these already (check_vision)
                raise no_vision("this model")
            extra["images"] = encode_images(self.projector, images)
        canvas_constraint = None
        if constraint is not None:  # fresh per generation: it follows the automaton's state across canvases
            limit = sampler.num_predict if sampler.num_predict >= 1 else None
            canvas_constraint = CanvasConstraint(constraint, token_limit=limit)
        ctx = self._take_context(sampler.num_canvases)
        try:
            ctx.reset()
            yield from generate(
                ctx,
                prompt_ids,
                sampler,  # already resolved over the GGUF's defaults (options.resolve_sampler)
                max_new_tokens=max_new_tokens,
                eos_ids=eos_ids_from_metadata(self.metadata),
                tokenizer=self.tokenizer,
                hidden_ids=self.hidden_ids,
                cancel=cancel,
                constraint=canvas_constraint,
                checker=checker,
                **extra,
            )
        finally:
            with self._lock:
                self._contexts.append(ctx)

    def _take_context(self, canvases: int = 1) -> Any:
        """A free K/V context holding `canvases` candidates: one per concurrent generation (the DGEMMA_NUM_PARALLEL
        slots bound how many exist). A smaller free one is replaced by one made for the request."""
        with self._lock:
            if self._contexts:
                fits = [c for c in self._contexts if c.max_canvases >= canvases]
                ctx = fits[0] if fits else self._contexts[0]
                self._contexts.remove(ctx)
                if ctx.max_canvases >= canvases:
                    return ctx
            else:
                ctx = None
        if ctx is not None:
            ctx.close()
        return self._new_context(canvases)

    def close(self) -> None:
        with self._lock:
            contexts, self._contexts = self._contexts, []
        for ctx in contexts:
            ctx.close()
        if self.projector is not None:
            self.projector.close()
        self.model.close()


IMAGE_MARKER = "<|image|>"  # Gemma 4's image token: one per image in a rendered prompt


def template_renders_images(template: Any, special_tokens: Any) -> bool:
    """Whether the chat template turns a `{"type": "image"}` content part into the image token itself (Gemma 4's
    does); otherwise the server splices the token's text into the message (prompts.with_image_markers)."""
    probe = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]}]
    try:
        text = render_prompt(template, probe, None, special_tokens)
    except Exception:  # noqa: BLE001 - a template that cannot render parts does not render images
        return False
    return text.count(IMAGE_MARKER) == 1
