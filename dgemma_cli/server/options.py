"""Request `options` (spec ollama-compat.md §2.2, §3.2): typing, ranges, and the sampler settings they resolve to.

Unknown keys are ignored (clients such as LangChain send Ollama-only knobs); known keys with the wrong JSON type are a
400 naming the expected type, exactly like Ollama. Diffusion defaults come from the model's GGUF metadata, falling back
to the reference `generation_config.json` values.
"""
import logging
import math
from dataclasses import dataclass
from typing import Any

from dgemma_cli.server.errors import RequestError

log = logging.getLogger("dgemma.server")

_INT = "integer"
_FLOAT = "float32"
_BOOL = "boolean"
_ARRAY = "array"

OPTION_TYPES: dict[str, str] = {
    # load-time
    "num_ctx": _INT, "num_batch": _INT, "num_gpu": _INT, "main_gpu": _INT, "num_thread": _INT, "use_mmap": _BOOL,
    # generation
    "num_predict": _INT, "seed": _INT, "temperature": _FLOAT, "stop": _ARRAY,
    # accepted and type-checked, then ignored by the diffusion sampler
    "top_k": _INT, "top_p": _FLOAT, "min_p": _FLOAT, "typical_p": _FLOAT, "repeat_penalty": _FLOAT,
    "repeat_last_n": _INT, "presence_penalty": _FLOAT, "frequency_penalty": _FLOAT, "num_keep": _INT,
    "draft_num_predict": _INT,
    # diffusion (§3.2)
    "diffusion_steps": _INT, "diffusion_t_max": _FLOAT, "diffusion_t_min": _FLOAT, "diffusion_entropy_bound": _FLOAT,
    "diffusion_confidence_threshold": _FLOAT, "diffusion_stability_threshold": _INT,
    "diffusion_progress": _BOOL, "diffusion_preview": _BOOL,
}

# GGUF metadata key and reference fallback per sampler option (§3.2).
DIFFUSION_DEFAULTS: dict[str, tuple[str, float | int]] = {
    "diffusion_steps": ("diffusion.eb_max_steps", 48),
    "diffusion_t_max": ("diffusion.eb_t_max", 0.8),
    "diffusion_t_min": ("diffusion.eb_t_min", 0.4),
    "diffusion_entropy_bound": ("diffusion.eb_entropy_bound", 0.1),
    "diffusion_confidence_threshold": ("diffusion.eb_confidence_threshold", 0.005),
    "diffusion_stability_threshold": ("diffusion.eb_stability_threshold", 1),
}


def _typed(name: str, value: Any, kind: str) -> Any:
    """`value` converted to the option's type, or the 400 of §2.2."""
    bad = RequestError(f'option "{name}" must be of type {kind}')
    if kind == _BOOL:
        if isinstance(value, bool):
            return value
        raise bad
    if kind == _ARRAY:
        if isinstance(value, list) and all(isinstance(item, str) for item in value):
            return list(value)
        raise bad
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise bad
    if kind == _INT:
        if isinstance(value, float) and (not math.isfinite(value) or not value.is_integer()):
            raise bad
        return int(value)
    if not math.isfinite(value):
        raise bad
    return float(value)


def check_options(options: dict[str, Any] | None) -> dict[str, Any]:
    """Known options typed; unknown ones dropped (logged at debug). `None` values mean absent."""
    checked: dict[str, Any] = {}
    for name, value in (options or {}).items():
        kind = OPTION_TYPES.get(name)
        if kind is None:
            log.debug("ignoring unknown option %r", name)
            continue
        if value is None:
            continue
        checked[name] = _typed(name, value, kind)
    return checked


@dataclass(frozen=True)
class SamplerSettings:
    """Everything one generation needs from the options, validated and with model defaults filled in."""

    max_steps: int
    t_max: float
    t_min: float
    entropy_bound: float
    confidence_threshold: float
    stability_threshold: int
    seed: int | None  # None: fresh random seed
    num_predict: int  # < 1: until EOS (still capped)
    stop: tuple[str, ...] = ()
    progress: bool = False
    preview: bool = False


def _metadata_default(metadata: dict, option: str) -> float | int:
    key, fallback = DIFFUSION_DEFAULTS[option]
    value = metadata.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return fallback
    return type(fallback)(value)


def _check_range(name: str, value: float, low: float | None, high: float | None, text: str) -> None:
    if (low is not None and value < low) or (high is not None and value > high):
        shown = value if not float(value).is_integer() or isinstance(value, int) else int(value)
        raise RequestError(f"invalid value for {name}: {shown} ({text})")


def precheck_sampler(options: dict[str, Any], max_steps_cap: int) -> None:
    """The range checks that do not depend on the model's defaults, run before a model is loaded for the request
    (a bad option must not cost a model load). `resolve_sampler` repeats them with the defaults filled in."""
    explicit = {name: options[name] for name in DIFFUSION_DEFAULTS if name in options}
    if "diffusion_t_max" not in explicit or "diffusion_t_min" not in explicit:
        explicit.setdefault("diffusion_t_max", math.inf)  # the relation needs both values
    reference = {key: fallback for key, fallback in DIFFUSION_DEFAULTS.values()}
    resolve_sampler({**explicit, "temperature": options.get("temperature")}, reference, max_steps_cap)


def resolve_sampler(options: dict[str, Any], metadata: dict, max_steps_cap: int) -> SamplerSettings:
    """Merge validated `options` over the model's diffusion defaults and check the ranges of §3.2."""
    value = {name: options.get(name, _metadata_default(metadata, name)) for name in DIFFUSION_DEFAULTS}
    steps = value["diffusion_steps"]
    if "diffusion_steps" not in options:
        steps = min(steps, max_steps_cap)
    _check_range("diffusion_steps", steps, 1, max_steps_cap, f"must be between 1 and {max_steps_cap}")
    t_max, t_min = value["diffusion_t_max"], value["diffusion_t_min"]
    temperature = options.get("temperature")
    if temperature == 0:  # §3.5: temperature 0 means argmax at every step
        t_max = t_min = 0.0
    _check_range("diffusion_t_min", t_min, 0, None, "must be at least 0")
    _check_range("diffusion_t_max", t_max, t_min, None, f"must be at least diffusion_t_min ({t_min:g})")
    for name in ("diffusion_entropy_bound", "diffusion_confidence_threshold"):
        if not value[name] > 0:
            raise RequestError(f"invalid value for {name}: {value[name]:g} (must be greater than 0)")
    _check_range("diffusion_stability_threshold", value["diffusion_stability_threshold"], 1, None, "must be at least 1")
    seed = options.get("seed", -1)
    preview = bool(options.get("diffusion_preview", False))
    return SamplerSettings(
        max_steps=int(steps),
        t_max=float(t_max),
        t_min=float(t_min),
        entropy_bound=float(value["diffusion_entropy_bound"]),
        confidence_threshold=float(value["diffusion_confidence_threshold"]),
        stability_threshold=int(value["diffusion_stability_threshold"]),
        seed=None if seed == -1 else int(seed),
        num_predict=int(options.get("num_predict", -1)),
        stop=tuple(s for s in options.get("stop", ()) if s),
        progress=preview or bool(options.get("diffusion_progress", False)),
        preview=preview,
    )
