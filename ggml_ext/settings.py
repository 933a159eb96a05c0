"""The diffusion sampler's settings, one row each: every name, type, default and range of a setting lives here.

Everything else is derived from `SAMPLER_SETTINGS`: the converter's `diffusion.eb_*` keys, `SamplerParams` and its
GGUF defaults, the server's `options` typing and range check, Modelfile PARAMETERs, the REPL's `/set parameter`,
`dgemma show`, `run`'s flags and `debug generate`'s check. Adding a setting is one row here plus its use by the
engine (a `SamplerParams` field the sampler reads; `task_tries` is read by the server's task layer instead); see
docs/generation.md.

The other options (load-time knobs such as `num_thread` and `num_ctx`, generation knobs such as `num_predict`, and the
Ollama ones the diffusion sampler ignores) have one row each in `OPTION_SETTINGS`: name, type and range. Request
options, REST create `parameters`, Modelfile PARAMETERs and pulled params layers are all typed and checked from
these two tables.

Pure Python on purpose: the converter imports it without the native engine.
"""
from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass, fields
from typing import Any, Callable, Mapping

from dgemma_engine.errors import EngineError


class SettingError(ValueError):
    """A sampler value out of its range. The message is the user-facing text; callers raise it as their own error
    type (a 400 in the server, an `Error:` line in the CLI)."""


@dataclass(frozen=True)
class Limits:
    """A lower bound: a number, or the field name of another setting this one may not be below (t_max >= t_min)."""

    low: float | str
    inclusive: bool = True  # False: strictly greater than `low`
    capped: bool = False    # also at most the server's step cap (DGEMMA_MAX_STEPS), when the caller passes one
    high: float | None = None  # a fixed upper bound (inclusive)


@dataclass(frozen=True)
class SamplerSetting:
    field: str              # SamplerParams attribute
    option: str             # request option = Modelfile PARAMETER = `/set parameter` name
    gguf_key: str | None    # GGUF key the converter writes from generation_config.json (None: a run-time setting)
    hf_key: str | None      # key in generation_config.json ("section.key" inside a nested object), or None
    type: type              # int or float
    default: int | float    # transformers' default = the released generation_config.json value
    label: str              # row in `dgemma show`; settings sharing a label share one row, joined by " → "
    help: str               # one line in `/set parameter`'s list
    limits: Limits          # dgemma's range (request options, Modelfiles; docs/server.md)
    reference_limits: Limits | None = None  # transformers' range, where it differs (`debug generate`)

    def limits_for(self, reference: bool) -> Limits:
        return self.reference_limits if reference and self.reference_limits is not None else self.limits


MAX_CANVASES = 16  # num_canvases: beyond this, memory grows and the gain in quality is marginal
MAX_TASK_TRIES = 64  # task_tries: each try is a whole generation

# In the order requests, `show` and `/set parameter` list them.
SAMPLER_SETTINGS: tuple[SamplerSetting, ...] = (
    SamplerSetting("max_steps", "diffusion_steps", "diffusion.eb_max_steps", "max_denoising_steps", int, 48,
                   "max denoising steps", "Max denoising steps per canvas", Limits(1, capped=True)),
    # the range check accepts t_max == t_min, which the engine's sampler then refuses (it wants t_min < t_max, like
    # transformers); `temperature: 0` leaves both alone and draws greedily instead (SamplerParams.greedy)
    SamplerSetting("t_max", "diffusion_t_max", "diffusion.eb_t_max", "t_max", float, 0.8,
                   "temperature schedule", "Sampling temperature at the first step", Limits("t_min"),
                   Limits("t_min", inclusive=False)),
    SamplerSetting("t_min", "diffusion_t_min", "diffusion.eb_t_min", "t_min", float, 0.4,
                   "temperature schedule", "Sampling temperature at the last step", Limits(0)),
    SamplerSetting("entropy_bound", "diffusion_entropy_bound", "diffusion.eb_entropy_bound",
                   "sampler_config.entropy_bound", float, 0.1, "entropy bound", "Entropy bound of the sampler",
                   Limits(0, inclusive=False)),
    SamplerSetting("confidence_threshold", "diffusion_confidence_threshold", "diffusion.eb_confidence_threshold",
                   "confidence_threshold", float, 0.005, "confidence threshold",
                   "Mean entropy below which a canvas may stop early", Limits(0, inclusive=False)),
    # transformers allows 0 (stop on confidence alone); the API asks for at least one unchanged step
    SamplerSetting("stability_threshold", "diffusion_stability_threshold", "diffusion.eb_stability_threshold",
                   "stability_threshold", int, 1, "stability threshold", "Unchanged steps needed to stop early",
                   Limits(1), Limits(0)),
    # candidates cost a canvas of cache scratch and logits each, and one decoder step holds them all
    # a run-time choice of dgemma's, in no file format: requests, Modelfiles and `/set parameter` only
    SamplerSetting("num_canvases", "num_canvases", None, None, int, 1,
                   "candidate canvases", "Candidate canvases denoised together; the best one is kept",
                   Limits(1, high=MAX_CANVASES)),
    # the engine's, not the sampler's: the self-conditioning input from each row's k most probable tokens (renormalised)
    # instead of all V; 0 keeps the exact dense product (docs/engine.md#self-conditioning)
    SamplerSetting("self_cond_top_k", "self_cond_top_k", None, None, int, 0, "self-cond top-k",
                   "Self-condition on each position's k most likely tokens (0: all, exact)", Limits(0, high=4096)),
    # read by the server's task layer, not the sampler: a model whose GGUF names a task (dgemma_engine.tasks) gets up
    # to this many tries, each under a new symmetry of its input, until an answer passes the task's rules
    SamplerSetting("task_tries", "task_tries", None, None, int, 1, "task tries",
                   "Tries of a task model (e.g. sudoku) until an answer passes its rules",
                   Limits(1, high=MAX_TASK_TRIES)),
)


# The rows the file formats carry (generation_config.json -> GGUF `diffusion.eb_*`).
FILE_SETTINGS: tuple[SamplerSetting, ...] = tuple(s for s in SAMPLER_SETTINGS if s.gguf_key is not None)


def setting_for_option(option: str) -> SamplerSetting | None:
    return next((s for s in SAMPLER_SETTINGS if s.option == option), None)


def setting_for_field(field: str) -> SamplerSetting:
    return next(s for s in SAMPLER_SETTINGS if s.field == field)


def released_defaults() -> dict[str, int | float]:
    return {s.field: s.default for s in SAMPLER_SETTINGS}


def defaults_from_metadata(metadata: Mapping[str, Any]) -> dict[str, int | float]:
    """Per field: the GGUF's `diffusion.eb_*` value when it holds a number, else the released default."""
    out: dict[str, int | float] = {}
    for s in SAMPLER_SETTINGS:
        value = metadata.get(s.gguf_key) if s.gguf_key is not None else None
        # a NaN or infinite value (a file stored before create checked them) falls back like a missing one
        is_number = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
        out[s.field] = s.type(value) if is_number else s.default
    return out


def options_from_fields(values: Mapping[str, Any]) -> dict[str, Any]:
    """Request options for values given by field name (None = not given), in table order."""
    unknown = set(values) - {s.field for s in SAMPLER_SETTINGS}
    if unknown:
        raise KeyError(f"not a sampler setting: {', '.join(sorted(unknown))}")
    return {s.option: values[s.field] for s in SAMPLER_SETTINGS if values.get(s.field) is not None}


# ---- the one range check ------------------------------------------------------------------------------------------

def check_values(values: Mapping[str, float], *, max_steps_cap: int | None = None, reference: bool = False) -> None:
    """Raise SettingError for the first value (by field name) out of range, e.g.
    `invalid value for diffusion_t_max: 0.1 (must be at least diffusion_t_min (0.9))`.

    Absent fields are not checked; a bound on an absent setting is that setting's own lowest valid value.
    `max_steps_cap`: the upper bound of capped settings (None: no upper bound). `reference`: transformers' ranges
    (t_min < t_max, stability 0 allowed) instead of dgemma's."""
    for setting in _checking_order(reference):
        if setting.field in values:
            rule = _broken_rule(setting, values, max_steps_cap, reference)
            if rule is not None:
                shown = _shown(values[setting.field], setting.limits_for(reference))
                raise SettingError(f"invalid value for {setting.option}: {shown} ({rule})")


def _checking_order(reference: bool) -> list[SamplerSetting]:
    """Table order, except that a setting bounded by another one is checked right after it."""
    order: list[SamplerSetting] = []
    for s in SAMPLER_SETTINGS:
        if not isinstance(s.limits_for(reference).low, str):
            order.append(s)
            order += [d for d in SAMPLER_SETTINGS if d.limits_for(reference).low == s.field]
    return order


def _broken_rule(setting: SamplerSetting, values: Mapping[str, float], cap: int | None,
                 reference: bool) -> str | None:
    limits = setting.limits_for(reference)
    low, bound = limits.low, None
    if isinstance(low, str):
        other = setting_for_field(low)
        if low in values:
            low, bound = values[low], f"{other.option} ({values[low]:g})"
        else:
            low = other.limits_for(reference).low
            if isinstance(low, str):
                return None
    bound = bound or f"{low:g}"
    value = values[setting.field]
    too_low = value < low if limits.inclusive else not value > low
    if value != value:  # NaN compares false with every bound
        too_low = True
    capped = limits.capped and cap is not None
    high = cap if capped else limits.high
    if not too_low and not (high is not None and value > high):
        return None
    if high is not None:
        return f"must be between {bound} and {high:g}"
    return f"must be at least {bound}" if limits.inclusive else f"must be greater than {bound}"


def _shown(value: float, limits: Limits) -> str:
    """The value as the server has always printed it: `%g` against a strict bound, else whole floats as integers."""
    if not limits.inclusive:
        return f"{value:g}"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


# ---- the other options: load-time and generation knobs ------------------------------------------------------------
# One row per request option / Modelfile PARAMETER that is not a sampler setting: its type and its range, checked at
# create (REST `parameters`, Modelfile PARAMETERs), at pull (a params layer) and per request (docs/compat.md#options-
# typing). Ranges are inclusive; `None` leaves the type's own range (int64, float32).

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # options are int64 and float32, as in Ollama
FLOAT32_MAX = 3.4028234663852886e38

THREADS_PER_CORE = 4  # beyond 4x the cores, threads only slow every answer (128 on a small box: 0.3 s -> 17 s)
# The engine itself refuses more than ggml's 512 (1000 once overflowed its graph and aborted); a server keeps well
# below: past this, threads only compete for the cores.
MAX_THREADS = 256
MAX_CONTEXT = 1 << 20  # num_ctx: tokens (the model's trained length caps what is allocated)
MAX_BATCH = 1 << 20
MAX_LAYERS = 1 << 16   # num_gpu / num_cpu_moe count layers; clients send 999 for "all of them"
MAX_DEVICE_INDEX = 255
MAX_PARALLEL = 64      # num_parallel: each generation slot holds a K/V context


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def max_threads() -> int:
    """num_thread's upper bound on this machine: THREADS_PER_CORE x the usable cores, at most MAX_THREADS."""
    return min(THREADS_PER_CORE * usable_cores(), MAX_THREADS)


@dataclass(frozen=True)
class OptionSetting:
    name: str            # request option = Modelfile PARAMETER name
    type: type           # int, float, bool, or list (of strings)
    use: str             # "load": read when the model loads; "generation"; "ignored": typed, then unused
    low: int | float | None = None  # inclusive; None: the type's own bound
    high: int | float | Callable[[], int] | None = None  # a number, or computed on the machine that checks
    request: bool = True  # False: a Modelfile PARAMETER only (a request option of that name is unknown, ignored)

    def bounds(self) -> tuple[int | float | None, int | float | None]:
        return self.low, self.high() if callable(self.high) else self.high


_IGNORED_INTS = ("top_k", "repeat_last_n", "num_keep", "draft_num_predict")
_IGNORED_FLOATS = ("top_p", "min_p", "typical_p", "repeat_penalty", "presence_penalty", "frequency_penalty")

OPTION_SETTINGS: tuple[OptionSetting, ...] = (
    OptionSetting("num_ctx", int, "load", 1, MAX_CONTEXT),
    OptionSetting("num_batch", int, "load", 1, MAX_BATCH),  # a hint: the engine sizes its own batches
    OptionSetting("num_gpu", int, "load", -1, MAX_LAYERS),  # -1: as many layers as fit, 0: CPU only
    OptionSetting("main_gpu", int, "load", 0, MAX_DEVICE_INDEX),  # a hint, unused
    OptionSetting("num_thread", int, "load", 0, max_threads),  # 0: the engine's default (the core count)
    OptionSetting("use_mmap", bool, "load"),
    OptionSetting("num_cpu_moe", int, "load", -1, MAX_LAYERS),  # -1: every layer's experts (llama.cpp's --cpu-moe)
    OptionSetting("num_parallel", int, "load", 1, MAX_PARALLEL, request=False),
    OptionSetting("num_predict", int, "generation"),  # < 1: until EOS (still capped by the context)
    OptionSetting("seed", int, "generation"),  # -1: random
    OptionSetting("temperature", float, "generation"),  # only 0 (greedy) means something to the diffusion sampler
    OptionSetting("stop", list, "generation"),
    *(OptionSetting(name, int, "ignored") for name in _IGNORED_INTS),
    *(OptionSetting(name, float, "ignored") for name in _IGNORED_FLOATS),
    OptionSetting("diffusion_progress", bool, "generation"),
    OptionSetting("diffusion_preview", bool, "generation"),
)


def option_setting(name: str) -> OptionSetting | None:
    return next((o for o in OPTION_SETTINGS if o.name == name), None)


def check_option(name: str, value: Any) -> None:
    """Raise SettingError when a typed option value is outside its row's range, e.g.
    `invalid value for num_thread: 1000 (must be between 0 and 8)`. Sampler settings: check_values."""
    row = option_setting(name)
    if row is None or row.type not in (int, float):
        return
    low, high = row.bounds()
    if (low is None or value >= low) and (high is None or value <= high):
        return
    if low is not None and high is not None:
        rule = f"must be between {low} and {high}"
    else:
        rule = f"must be at least {low}" if low is not None else f"must be at most {high}"
    raise SettingError(f"invalid value for {name}: {value} ({rule})")


# ---- the resolved settings ----------------------------------------------------------------------------------------

_RELEASED = released_defaults()


@dataclass(frozen=True)
class SamplerParams:
    """Entropy-bound sampler settings (one field per SAMPLER_SETTINGS row) plus how to draw. seed None: a fresh
    random seed per generation (reported in the stats)."""

    max_steps: int = _RELEASED["max_steps"]
    t_min: float = _RELEASED["t_min"]
    t_max: float = _RELEASED["t_max"]
    entropy_bound: float = _RELEASED["entropy_bound"]
    confidence_threshold: float = _RELEASED["confidence_threshold"]
    stability_threshold: int = _RELEASED["stability_threshold"]
    num_canvases: int = _RELEASED["num_canvases"]
    self_cond_top_k: int = _RELEASED["self_cond_top_k"]
    task_tries: int = _RELEASED["task_tries"]
    seed: int | None = None
    rng: str = "fast"          # "fast" (counter-based, parallel) or "torch" (transformers' CPU stream, bit for bit)
    greedy: bool = False       # argmax instead of a categorical draw (reference recordings, `temperature: 0`)

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any], **overrides: Any) -> SamplerParams:
        """Defaults from the GGUF's `diffusion.eb_*` keys, else the released values; `overrides` (None = not given)
        win over both. Precedence as in the PR runtime: caller > GGUF > defaults."""
        unknown = set(overrides) - {f.name for f in fields(cls)}
        if unknown:
            raise EngineError(f"unknown sampler setting(s): {', '.join(sorted(unknown))}")
        values: dict[str, Any] = defaults_from_metadata(metadata)
        values.update({k: v for k, v in overrides.items() if v is not None})
        for s in SAMPLER_SETTINGS:
            values[s.field] = s.type(values[s.field])
        return cls(**values)

    def setting_values(self) -> dict[str, int | float]:
        """The table's fields of these params, by field name (what `check_values` takes)."""
        return {s.field: getattr(self, s.field) for s in SAMPLER_SETTINGS}
