"""Request `options` (docs/compat.md#options-typing, #sampler-options): typing, ranges, and the sampler settings they
resolve to.

Unknown keys are ignored (clients such as LangChain send Ollama-only knobs); known keys with the wrong JSON type are a
400 naming the expected type, exactly like Ollama. Diffusion defaults come from the model's GGUF metadata, falling back
to the reference `generation_config.json` values.

A request's options are decoded once, in its route, into a `RequestOptions` (`decode_options`): the Modelfile's
PARAMETERs, the request's options on top, typed, merged over the model's defaults and range-checked. The job carries
that record to the runner; nothing downstream reads the options dict again.
"""
import asyncio
import functools
import logging
from dataclasses import dataclass, field
from typing import Any

from dgemma_cli.errors import DgemmaError
from dgemma_cli.modelfile import parameter_type, type_word, typed_parameters, typed_value
from dgemma_cli.server.config import ServerConfig
from dgemma_cli.server.errors import RequestError
from dgemma_engine import settings
from dgemma_engine.settings import SamplerParams, setting_for_option

log = logging.getLogger("dgemma.server")


def option_type(name: str) -> str | None:
    """The JSON type a known request option must have (None: an unknown option). Types and ranges come from
    dgemma_engine.settings (the sampler table and the options table); `num_parallel` is a PARAMETER only."""
    if setting_for_option(name) is None:
        row = settings.option_setting(name)
        if row is None or not row.request:
            return None
    kind = parameter_type(name)
    return type_word(kind) if kind is not None else None


def check_options(options: dict[str, Any] | None) -> dict[str, Any]:
    """Known options typed and, outside the sampler settings (resolve_sampler checks those merged over the model's
    defaults), range-checked; unknown ones dropped (logged at debug). `None` values mean absent."""
    checked: dict[str, Any] = {}
    for name, value in (options or {}).items():
        if option_type(name) is None:
            log.debug("ignoring unknown option %r", name)
            continue
        if value is None:
            continue
        checked[name] = _typed(name, value)
    return checked


def _typed(name: str, value: Any) -> Any:
    try:
        value = typed_value(name, value)
        settings.check_option(name, value)
    except (settings.SettingError, DgemmaError) as exc:
        raise RequestError(str(exc)) from None
    return value


def stored_parameters(parameters: dict[str, Any] | None) -> dict[str, Any]:
    """A stored model's PARAMETERs as a request reads them: typed, and outside the sampler settings range-checked,
    so a model stored before a range existed (or pulled unchecked) is a 400 naming the value, never a load that
    aborts the process. Unknown names are dropped, as request options are."""
    try:
        typed = typed_parameters(parameters or {}, unknown="drop")
        for name, value in typed.items():
            settings.check_option(name, value)
    except (settings.SettingError, DgemmaError) as exc:
        raise RequestError(f"the model's parameters are invalid: {exc}") from None
    return typed


@dataclass(frozen=True)
class LoadOptions:
    """What the runner loads a model with, from its (checked) PARAMETERs: None means the engine's default."""

    threads: int | None = None
    num_gpu: int | None = None
    num_cpu_moe: int = 0


def load_options(parameters: dict[str, Any] | None) -> LoadOptions:
    """The load-time PARAMETERs a runner reads (num_thread: Ollama's meaning, 0 the default; num_gpu, num_cpu_moe:
    placement), checked against the options table again: the runner never passes an unchecked count to the
    engine."""
    checked = stored_parameters(parameters)
    threads = checked.get("num_thread") or None
    return LoadOptions(threads, checked.get("num_gpu"), checked.get("num_cpu_moe", 0))


# `temperature: 0` is argmax at every step (docs/server.md): greedy draws, and a fixed seed for the canvas's initial
# and renoised tokens, so that the answer does not depend on the request's seed either.
GREEDY_SEED = 0


@dataclass(frozen=True)
class SamplerSettings(SamplerParams):
    """Everything one generation needs from the options: the engine's sampler params, validated and with model
    defaults filled in, plus what the request does with the output."""

    num_predict: int = -1  # < 1: until EOS (still capped)
    stop: tuple[str, ...] = ()
    progress: bool = False
    preview: bool = False


def resolve_sampler(options: dict[str, Any], metadata: dict, max_steps_cap: int) -> SamplerSettings:
    """Merge typed `options` over the model's diffusion defaults (its GGUF `metadata`, else the released ones) and
    check the ranges: the one place a sampler setting is range-checked."""
    values = settings.defaults_from_metadata(metadata)
    for setting in settings.SAMPLER_SETTINGS:
        if setting.option in options:
            values[setting.field] = options[setting.option]
        elif setting.limits.capped:  # a model's default above the cap is clipped, not an error
            values[setting.field] = min(values[setting.field], max_steps_cap)
    try:
        settings.check_values(values, max_steps_cap=max_steps_cap)
    except settings.SettingError as exc:
        raise RequestError(str(exc)) from None
    greedy = options.get("temperature") == 0
    seed = GREEDY_SEED if greedy else options.get("seed", -1)
    preview = bool(options.get("diffusion_preview", False))
    return SamplerSettings(
        **{s.field: s.type(values[s.field]) for s in settings.SAMPLER_SETTINGS},
        greedy=greedy,
        seed=None if seed == -1 else int(seed),
        num_predict=int(options.get("num_predict", -1)),
        stop=tuple(s for s in options.get("stop", ()) if s),
        progress=preview or bool(options.get("diffusion_progress", False)),
        preview=preview,
    )


# load-time options that change where the weights go: a runner loaded with other values is reloaded
PLACEMENT_OPTIONS = ("num_gpu", "num_cpu_moe")


@dataclass(frozen=True)
class RequestOptions:
    """What a request's options decided, once, in the route."""

    sampler: SamplerSettings
    num_ctx: int
    placement: dict[str, int] = field(default_factory=dict)  # PLACEMENT_OPTIONS given: what the runner loads with


def decode_options(parameters: dict[str, Any] | None, request_options: dict[str, Any] | None,
                   metadata: dict[str, Any], context_length: int, max_steps_cap: int) -> RequestOptions:
    """Modelfile `parameters`, then the request's options on top, typed (docs/compat.md#options-typing) and resolved
    over the model's GGUF `metadata`; `context_length` is num_ctx when neither sets it."""
    options = {name: value for name, value in stored_parameters(parameters).items() if option_type(name) is not None}
    options.update(check_options(request_options))
    num_ctx = int(options.get("num_ctx", context_length))  # a given one is within the options table's range
    placement = {name: options[name] for name in PLACEMENT_OPTIONS if name in options}
    return RequestOptions(resolve_sampler(options, metadata, max_steps_cap), num_ctx, placement)


@functools.lru_cache(maxsize=16)
def sampler_metadata(gguf_path: str) -> dict[str, Any]:
    """The sampler defaults a model's GGUF holds (its `diffusion.eb_*` keys), read from the header without loading
    weights; cached by path, since store blobs are content-addressed and never change."""
    from dgemma_cli.gguf_check import read_gguf_info

    metadata = read_gguf_info(gguf_path).metadata
    keys = {s.gguf_key for s in settings.SAMPLER_SETTINGS if s.gguf_key is not None}
    return {key: metadata[key] for key in keys if key in metadata}


async def request_options(config: ServerConfig, local_model: Any, request_options: dict[str, Any] | None
                          ) -> RequestOptions:
    """`decode_options` for a stored model (its Modelfile PARAMETERs and GGUF) under the server's limits."""
    metadata = await asyncio.to_thread(sampler_metadata, str(local_model.gguf_path))
    return decode_options(local_model.parameters, request_options, metadata, config.context_length,
                          config.max_steps)
