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
import math
from dataclasses import dataclass, field
from typing import Any

from dgemma_cli.errors import out_of_range
from dgemma_cli.server.config import ServerConfig
from dgemma_cli.server.errors import RequestError
from dgemma_cli.server.validation import INT64_MAX, INT64_MIN, check_float32
from dgemma_engine import settings
from dgemma_engine.settings import SamplerParams, setting_for_option

log = logging.getLogger("dgemma.server")

_INT = "integer"
_FLOAT = "float32"
_BOOL = "boolean"
_ARRAY = "array"

OPTION_TYPES: dict[str, str] = {
    # load-time
    "num_ctx": _INT, "num_batch": _INT, "num_gpu": _INT, "main_gpu": _INT, "num_thread": _INT, "use_mmap": _BOOL,
    "num_cpu_moe": _INT,
    # generation
    "num_predict": _INT, "seed": _INT, "temperature": _FLOAT, "stop": _ARRAY,
    # accepted and type-checked, then ignored by the diffusion sampler
    "top_k": _INT, "top_p": _FLOAT, "min_p": _FLOAT, "typical_p": _FLOAT, "repeat_penalty": _FLOAT,
    "repeat_last_n": _INT, "presence_penalty": _FLOAT, "frequency_penalty": _FLOAT, "num_keep": _INT,
    "draft_num_predict": _INT,
    # diffusion request flags; the sampler settings' own types come from dgemma_engine.settings
    "diffusion_progress": _BOOL, "diffusion_preview": _BOOL,
}


def option_type(name: str) -> str | None:
    """The JSON type a known option must have (None: an unknown option)."""
    setting = setting_for_option(name)
    if setting is not None:
        return _INT if setting.type is int else _FLOAT
    return OPTION_TYPES.get(name)


def _typed(name: str, value: Any, kind: str) -> Any:
    """`value` converted to the option's type, or the 400 of docs/compat.md#options-typing."""
    if not _has_type(value, kind):
        raise RequestError(f'option "{name}" must be of type {kind}')
    if kind == _BOOL:
        return value
    if kind == _ARRAY:
        return list(value)
    if kind == _INT:
        value = int(value)
    if isinstance(value, int) and not INT64_MIN <= value <= INT64_MAX:  # also from Modelfile PARAMETERs
        raise out_of_range(name)
    return value if kind == _INT else check_float32(name, float(value))


def _has_type(value: Any, kind: str) -> bool:
    if kind == _BOOL:
        return isinstance(value, bool)
    if kind == _ARRAY:
        return isinstance(value, list) and all(isinstance(item, str) for item in value)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    if isinstance(value, float) and not math.isfinite(value):
        return False
    return kind != _INT or not isinstance(value, float) or value.is_integer()


def check_options(options: dict[str, Any] | None) -> dict[str, Any]:
    """Known options typed; unknown ones dropped (logged at debug). `None` values mean absent."""
    checked: dict[str, Any] = {}
    for name, value in (options or {}).items():
        kind = option_type(name)
        if kind is None:
            log.debug("ignoring unknown option %r", name)
            continue
        if value is None:
            continue
        checked[name] = _typed(name, value, kind)
    return checked


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
    options = check_options(parameters)
    options.update(check_options(request_options))
    num_ctx = int(options.get("num_ctx", context_length))
    if num_ctx < 1:
        raise RequestError(f"invalid value for num_ctx: {num_ctx} (must be at least 1)")
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
