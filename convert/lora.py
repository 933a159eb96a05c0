"""LoRA adapters: a PEFT adapter folder -> a GGUF LoRA file, and the checks every GGUF LoRA file passes
(docs/gguf.md#lora-adapters).

The GGUF side is llama.cpp's layout (`general.type = adapter`, `adapter.type = lora`, `adapter.lora.alpha`, one
`NAME.lora_a` / `NAME.lora_b` pair per adapted base weight `NAME`) plus a pass prefix: the encoder and the decoder
share every base weight, but PEFT wraps the encoder's and the decoder's copy of a projection separately, so a
trained adapter carries two deltas per weight: `enc.NAME.*` applies in the encoder pass only, `dec.NAME.*` in the
decoder pass only, and an unprefixed `NAME.*` (what llama.cpp's converter writes) in both.

Values are copied unchanged (a permutation for the expert B matrices, no arithmetic), except where the per-module
scale of `alpha_pattern` differs from the file's single alpha: that ratio is folded into B (then written F32).
"""
from __future__ import annotations

import contextlib
import json
import math
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Mapping, Sequence

import numpy as np
from gguf import GGMLQuantizationType as T, GGUFValueType as V

from dgemma_convert.errors import ConvertError
from dgemma_convert.safetensors_reader import DTYPE_SIZES, FLOAT_DTYPES, SafetensorsFile, TensorEntry
from dgemma_convert.tensor_map import DECODER, gguf_name_of_source
from dgemma_convert.writer import StreamingGGUFWriter
from dgemma_engine.arch import ARCH
from dgemma_engine.gguf_keys import KEY_ADAPTER_TYPE, KEY_ARCHITECTURE, KEY_GENERAL_TYPE, KEY_LORA_ALPHA

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLED_WEIGHTS_FILE = "adapter_model.bin"
ENCODER = "model.encoder.language_model."
PEFT_PREFIX = "base_model.model."
PASSES = ("enc", "dec")  # name prefixes; no prefix = both passes
# Base weights an adapter may adapt: every matrix of the layout except the embedding and the output head.
BLOCK_TARGETS = ("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "ffn_gate.weight",
                 "ffn_up.weight", "ffn_down.weight", "ffn_gate_inp.weight", "ffn_gate_up_exps.weight",
                 "ffn_down_exps.weight", "ffn_gate_exps.weight", "ffn_up_exps.weight")
FUSED_EXPERTS, SPLIT_EXPERTS = "ffn_gate_up_exps.weight", ("ffn_gate_exps.weight", "ffn_up_exps.weight")
DECODER_ONLY_TARGETS = ("self_cond_gate.weight", "self_cond_up.weight", "self_cond_down.weight")
EXPERT_PARAMS = ("gate_up_proj", "down_proj")  # DiffusionGemmaTextExperts' 3-D parameters, in registration order
LORA_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0")  # what the engine loads (Q8_0: llama.cpp's --outtype q8_0)
SAFETENSORS_TO_GGML = {"F32": T.F32, "F16": T.F16, "BF16": T.BF16}
_LORA_NAME = re.compile(r"(?:(" + "|".join(PASSES) + r")\.)?(.+)\.lora_(a|b)")
_PEFT_KEY = re.compile(re.escape(PEFT_PREFIX) + r"(.+)\.lora_([AB])\.weight")
_BLOCK_TARGET = re.compile(r"blk\.(\d+)\.(.+)")
_MODULE_PATTERN = re.compile(r"[A-Za-z0-9_.]{1,200}")
# PEFT config keys of features whose saved weights mean something this converter cannot express.
_REFUSED_SETTINGS = {
    "use_dora": "DoRA adapters (use_dora) are not supported",
    "fan_in_fan_out": "fan_in_fan_out adapters are not supported",
    "lora_bias": "adapters with LoRA biases (lora_bias) are not supported",
    "modules_to_save": "adapters with fully trained modules (modules_to_save) are not supported",
    "trainable_token_indices": "adapters with trainable tokens (trainable_token_indices) are not supported",
    "layer_replication": "adapters with layer_replication are not supported",
    "alora_invocation_tokens": "activated LoRA adapters (alora_invocation_tokens) are not supported",
    "use_qalora": "QA-LoRA adapters (use_qalora) are not supported",
    "use_bdlora": "BD-LoRA adapters (use_bdlora) are not supported",
    "velora_config": "VeLoRA adapters (velora_config) are not supported",
    "kasa_config": "KaSA adapters (kasa_config) are not supported",
    "arrow_config": "Arrow adapters (arrow_config) are not supported",
    "monteclora_config": "MonteCLoRA adapters (monteclora_config) are not supported",
}
# Initialisations that also rewrite the base weights: such an adapter is only right on top of that rewritten base.
_BASE_CHANGING_INITS = ("pissa", "olora", "loftq", "corda")


class LoraError(ConvertError):
    """A LoRA adapter that is malformed, unsupported, or not made for the base it is used with (one line)."""


# ---- the GGUF LoRA header ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LoraPair:
    """One adapted base weight: `delta = B @ A` (per expert for 3-D targets), scaled by alpha / rank."""

    target: str  # base GGUF tensor name, e.g. blk.3.attn_q.weight
    pass_name: str  # "enc", "dec" or "" (both passes)
    a_ne: tuple[int, ...]  # [n_in, r] or [n_in, r, E]
    b_ne: tuple[int, ...]  # [r, n_out] or [r, n_out, E]

    @property
    def prefix(self) -> str:
        return f"{self.pass_name}." if self.pass_name else ""

    @property
    def a_name(self) -> str:
        return f"{self.prefix}{self.target}.lora_a"

    @property
    def b_name(self) -> str:
        return f"{self.prefix}{self.target}.lora_b"

    @property
    def rank(self) -> int:
        return self.a_ne[1]

    @property
    def base_ne(self) -> tuple[int, ...]:
        """The shape (ggml ne) the adapted base weight must have."""
        return (self.a_ne[0], self.b_ne[1], *self.a_ne[2:])


@dataclass(frozen=True)
class LoraHeader:
    architecture: str
    alpha: float
    pairs: tuple[LoraPair, ...]

    @property
    def ranks(self) -> list[int]:
        return sorted({p.rank for p in self.pairs})


def is_lora_target(name: str) -> bool:
    match = _BLOCK_TARGET.fullmatch(name)
    return (match is not None and match.group(2) in BLOCK_TARGETS) or name in DECODER_ONLY_TARGETS


def lora_header_from(metadata: Mapping[str, Any], tensors: Iterable[tuple[str, tuple[int, ...], str]]) -> LoraHeader:
    """Check a GGUF's keys and tensor table (name, ggml ne, type name) as a LoRA adapter for this architecture."""
    kind = metadata.get(KEY_GENERAL_TYPE)
    if kind != "adapter":
        what = "a model" if kind in (None, "model") else f"general.type {kind!r}"
        raise LoraError(f"not a LoRA adapter: the GGUF is {what}, not general.type 'adapter'")
    if metadata.get(KEY_ADAPTER_TYPE) != "lora":
        raise LoraError(f"not a LoRA adapter: adapter.type is {metadata.get(KEY_ADAPTER_TYPE)!r}, not 'lora'")
    arch = metadata.get(KEY_ARCHITECTURE)
    if arch != ARCH:
        raise LoraError(f"the adapter was made for architecture {arch!r}, not {ARCH!r}")
    alpha = metadata.get(KEY_LORA_ALPHA)
    if not isinstance(alpha, float) or not math.isfinite(alpha) or alpha <= 0:
        raise LoraError(f"adapter.lora.alpha must be a positive float32, got {alpha!r}")
    halves: dict[tuple[str, str], dict[str, tuple[int, ...]]] = {}
    for name, ne, type_name in tensors:
        match = _LORA_NAME.fullmatch(name)
        if match is None:
            raise LoraError(f"unexpected tensor {name!r} in the adapter (expected NAME.lora_a / NAME.lora_b)")
        pass_name, target, half = match.group(1) or "", match.group(2), match.group(3)
        if not is_lora_target(target):
            raise LoraError(f"adapter tensor {name!r} adapts {target!r}, which is not a weight LoRA can target")
        if pass_name == "enc" and target in DECODER_ONLY_TARGETS:
            raise LoraError(f"adapter tensor {name!r}: the encoder has no {target}")
        if type_name not in LORA_TENSOR_TYPES:
            raise LoraError(f"adapter tensor {name!r} has type {type_name}; only {', '.join(LORA_TENSOR_TYPES)} "
                            "are supported")
        halves.setdefault((pass_name, target), {})[half] = tuple(int(d) for d in ne)
    if not halves:
        raise LoraError("the adapter has no tensors")
    pairs = [_pair(pass_name, target, parts) for (pass_name, target), parts in sorted(halves.items())]
    for pass_name, target in halves:
        if pass_name and ("", target) in halves:
            raise LoraError(f"the adapter has both {target}.* and {pass_name}.{target}.*: use one form per weight")
    return LoraHeader(arch, float(alpha), tuple(pairs))


def _pair(pass_name: str, target: str, parts: dict[str, tuple[int, ...]]) -> LoraPair:
    shown = f"{pass_name}.{target}" if pass_name else target
    for half in ("a", "b"):
        if half not in parts:
            raise LoraError(f"the adapter lacks tensor {shown}.lora_{half}")
    a, b = parts["a"], parts["b"]
    n_dims = 3 if "_exps." in target else 2
    if len(a) != n_dims or len(b) != n_dims:
        raise LoraError(f"{shown}: lora_a {list(a)} / lora_b {list(b)} must both have {n_dims} dimensions")
    if a[1] != b[0]:
        raise LoraError(f"{shown}: rank mismatch, lora_a has rank {a[1]} but lora_b {b[0]}")
    if n_dims == 3 and a[2] != b[2]:
        raise LoraError(f"{shown}: lora_a has {a[2]} experts but lora_b {b[2]}")
    return LoraPair(target, pass_name, a, b)


def check_against_base(header: LoraHeader, base_architecture: str, base_tensors: Mapping[str, tuple[int, ...]]) -> None:
    """Every adapted weight exists in the base with the shape the adapter was made for."""
    if header.architecture != base_architecture:
        raise LoraError(f"the adapter was made for architecture {header.architecture!r}, the base is "
                        f"{base_architecture!r}")
    for pair in header.pairs:
        base = _base_ne(pair.target, base_tensors)
        if base is None:
            raise LoraError(f"the adapter adapts {pair.target}, which the base model does not have")
        if tuple(base) != pair.base_ne:
            raise LoraError(f"the adapter does not fit this base: {pair.target} is {list(base)} in the base but "
                            f"{list(pair.base_ne)} in the adapter (made for another model?)")


def _base_ne(target: str, base_tensors: Mapping[str, tuple[int, ...]]) -> tuple[int, ...] | None:
    """The shape the base gives `target`. The gate and up experts may be fused in one of the two files and split in
    the other (the engine applies either layout to either): a fused pair then fits the split weights stacked, a
    split pair half of the fused weight."""
    if target in base_tensors:
        return tuple(base_tensors[target])
    match = _BLOCK_TARGET.fullmatch(target)
    if match is None:
        return None
    blk = f"blk.{match.group(1)}."
    if match.group(2) == FUSED_EXPERTS:
        gate, up = (base_tensors.get(blk + name) for name in SPLIT_EXPERTS)
        if gate is not None and up is not None and (gate[0], gate[2:]) == (up[0], up[2:]):
            return (gate[0], gate[1] + up[1], *gate[2:])
    elif match.group(2) in SPLIT_EXPERTS and blk + FUSED_EXPERTS in base_tensors:
        fused = base_tensors[blk + FUSED_EXPERTS]
        return (fused[0], fused[1] // 2, *fused[2:])
    return None


def read_lora_header(path: Path) -> LoraHeader:
    """Read and check a GGUF LoRA file's header (data offsets included: a truncated file is refused)."""
    metadata, tensors = _read_gguf(Path(path))
    return lora_header_from(metadata, ((t.name, t.ne, t.type_name) for t in tensors))


def read_base_tensors(path: Path) -> tuple[str, dict[str, tuple[int, ...]]]:
    """A base GGUF's architecture and tensor shapes (ggml ne)."""
    metadata, tensors = _read_gguf(Path(path))
    if metadata.get(KEY_GENERAL_TYPE, "model") != "model":
        raise LoraError(f"{Path(path).name} is not a base model (general.type {metadata.get(KEY_GENERAL_TYPE)!r})")
    return str(metadata.get(KEY_ARCHITECTURE, "")), {t.name: t.ne for t in tensors}


@dataclass(frozen=True)
class _GGUFTensor:
    name: str
    ne: tuple[int, ...]
    type_name: str


def _read_gguf(path: Path) -> tuple[dict[str, Any], list[_GGUFTensor]]:
    from gguf import GGUFReader

    try:
        size = path.stat().st_size
        reader = GGUFReader(path)
        metadata = {name: _field_value(f) for name, f in reader.fields.items() if not name.startswith("GGUF.")}
        tensors = []
        for t in reader.tensors:
            end = t.data_offset + t.n_bytes
            if end > size:
                raise LoraError(f"{path.name} is truncated: tensor {t.name} ends at byte {end} of {size}")
            tensors.append(_GGUFTensor(t.name, tuple(int(d) for d in t.shape), T(t.tensor_type).name))
    except LoraError:
        raise
    except OSError as exc:
        raise LoraError(f"cannot read {path.name}: {exc.strerror or exc}") from None
    except Exception as exc:  # noqa: BLE001 (gguf-py raises many types on malformed input)
        raise LoraError(f"{path.name} is not a valid GGUF file ({exc.__class__.__name__}: {exc})"[:300]) from None
    return metadata, tensors


def _field_value(f) -> Any:
    value = f.contents()
    if f.types and f.types[0] in (V.FLOAT32, V.FLOAT64) and len(f.types) == 1:
        return float(value)
    return value


# ---- PEFT adapter folder -> GGUF ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class PeftSettings:
    r: int
    alpha: float
    use_rslora: bool
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    target_parameters: tuple[str, ...] = ()

    def rank_of(self, key: str) -> int:
        return self.rank_pattern.get(_pattern_key(self.rank_pattern, key), self.r)

    def scale_of(self, key: str) -> float:
        """PEFT's `scaling` of the module (or parameter) `key`."""
        alpha = self.alpha_pattern.get(_pattern_key(self.alpha_pattern, key), self.alpha)
        r = self.rank_of(key)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r

    @property
    def gguf_alpha(self) -> float:
        """The file's one alpha: the engine scales by alpha / rank, so rsLoRA's alpha / sqrt(r) is alpha * sqrt(r)."""
        return self.alpha * math.sqrt(self.r) if self.use_rslora else self.alpha


def _pattern_key(patterns: Mapping[str, Any], key: str) -> str:
    """The first pattern that matches the end of `key` after a dot, as PEFT's `get_pattern_key` picks it."""
    for pattern in patterns:
        if re.match(rf"(.*\.)?({pattern})$", key):
            return pattern
    return key


def load_peft_settings(folder: Path) -> PeftSettings:
    path = folder / CONFIG_FILE
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise LoraError(f"not a PEFT adapter folder: {CONFIG_FILE} is missing in {folder.name}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise LoraError(f"{CONFIG_FILE} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise LoraError(f"{CONFIG_FILE} must be a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"only LoRA adapters are supported, {CONFIG_FILE} has peft_type {config.get('peft_type')!r}")
    for key, message in _REFUSED_SETTINGS.items():
        if config.get(key):
            raise LoraError(message)
    if config.get("bias", "none") != "none":
        raise LoraError(f"adapters with trained biases (bias = {config.get('bias')!r}) are not supported")
    init = config.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
        raise LoraError(f"init_lora_weights {init!r} also changes the base weights; convert the adapter to a plain "
                        "LoRA with PEFT first (path_initial_model_for_weight_conversion)")
    r, alpha = config.get("r"), config.get("lora_alpha")
    if not _positive_int(r):
        raise LoraError(f"{CONFIG_FILE}: r must be a positive integer, got {r!r}")
    if not _positive_number(alpha):
        raise LoraError(f"{CONFIG_FILE}: lora_alpha must be a positive number, got {alpha!r}")
    ranks, alphas = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    if not isinstance(ranks, dict) or not all(_positive_int(v) for v in ranks.values()):
        raise LoraError(f"{CONFIG_FILE}: rank_pattern must map patterns to positive integers")
    if not isinstance(alphas, dict) or not all(_positive_number(v) for v in alphas.values()):
        raise LoraError(f"{CONFIG_FILE}: alpha_pattern must map patterns to positive numbers")
    for key in (*ranks, *alphas):
        # PEFT reads these keys as regular expressions; from an untrusted file only module names (no backtracking)
        if not _MODULE_PATTERN.fullmatch(key):
            raise LoraError(f"{CONFIG_FILE}: pattern {key[:80]!r} is not a module name (regular expressions in "
                            "rank_pattern / alpha_pattern are not supported)")
    use_rslora = bool(config.get("use_rslora"))
    if use_rslora and (ranks or alphas):
        raise LoraError("use_rslora together with rank_pattern or alpha_pattern is not supported (PEFT refuses it "
                        "too)")
    targets = config.get("target_parameters") or []
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise LoraError(f"{CONFIG_FILE}: target_parameters must be a list of names")
    return PeftSettings(r, float(alpha), use_rslora, dict(ranks), {k: float(v) for k, v in alphas.items()},
                        tuple(targets))


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _positive_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0


@dataclass(frozen=True)
class PlannedPair:
    """Where one GGUF pair comes from in the PEFT file and how its bytes are made."""

    pair: LoraPair
    a: TensorEntry
    b: TensorEntry
    n_experts: int  # 0 for a 2-D target
    b_factor: float  # folded into B (1.0: bytes copied unchanged)

    @property
    def out_type(self) -> T:
        return T.F32 if self.b_factor != 1.0 else SAFETENSORS_TO_GGML[self.b.dtype]


@dataclass(frozen=True)
class LoraPlan:
    folder: Path
    settings: PeftSettings
    pairs: list[PlannedPair]
    skipped: int  # vision-tower targets (the text model never runs them)

    @property
    def header(self) -> LoraHeader:
        """The header the GGUF LoRA file will have."""
        return LoraHeader(ARCH, self.settings.gguf_alpha, tuple(p.pair for p in self.pairs))


def plan_lora(folder: Path) -> tuple[LoraPlan, SafetensorsFile]:
    folder = Path(folder)
    if not folder.is_dir():
        raise LoraError(f"not a PEFT adapter folder: {folder.name}")
    settings = load_peft_settings(folder)
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        if (folder / PICKLED_WEIGHTS_FILE).is_file():
            raise LoraError(f"{PICKLED_WEIGHTS_FILE} (pickle) is not supported: save the adapter as safetensors")
        raise LoraError(f"not a PEFT adapter folder: {WEIGHTS_FILE} is missing in {folder.name}")
    st = SafetensorsFile(weights)
    try:
        pairs, skipped = _plan_pairs(settings, st.entries)
    except BaseException:
        st.close()
        raise
    return LoraPlan(folder, settings, pairs, skipped), st


@dataclass
class _Wrapped:
    """The A and B matrices PEFT saved for one wrapped module (or one wrapped parameter of the experts)."""

    module: str  # model path without PEFT's prefix and without `.base_layer`
    depth: int  # number of `.base_layer` steps: nested parameter wrappers on the experts
    halves: dict[str, TensorEntry] = field(default_factory=dict)


def _plan_pairs(settings: PeftSettings, entries: Mapping[str, TensorEntry]) -> tuple[list[PlannedPair], int]:
    wrapped: dict[str, _Wrapped] = {}
    for key, entry in sorted(entries.items()):
        match = _PEFT_KEY.fullmatch(key)
        if match is None:
            raise LoraError(_unsupported_key(key))
        if entry.dtype not in FLOAT_DTYPES:
            raise LoraError(f"adapter tensor {key!r} has dtype {entry.dtype}; only F32, F16 and BF16 are supported")
        raw, half = match.group(1), match.group(2)
        module = raw.replace(".base_layer", "")
        if module.startswith(("decoder.", "encoder.")):  # an adapter made on DiffusionGemmaModel (no LM head)
            module = "model." + module
        wrapped.setdefault(raw, _Wrapped(module, raw.count(".base_layer"))).halves[half] = entry
    if not wrapped:
        raise LoraError(f"{WEIGHTS_FILE} holds no LoRA weights")
    planned, skipped = [], 0
    for raw, w in sorted(wrapped.items()):
        for half in ("A", "B"):
            if half not in w.halves:
                raise LoraError(f"the adapter lacks {PEFT_PREFIX}{raw}.lora_{half}.weight")
        if w.module.startswith(("model.encoder.vision_tower.", "model.encoder.embed_vision.")):
            skipped += 1
            continue
        planned.append(_plan_one(settings, w, _expert_depths(settings, wrapped, w.module)))
    names = [p.pair.a_name for p in planned]
    if len(set(names)) != len(names):
        raise LoraError("the adapter adapts the same weight twice")
    return sorted(planned, key=lambda p: p.pair.a_name), skipped


def _unsupported_key(key: str) -> str:
    if "lora_magnitude_vector" in key:
        return "DoRA adapters (use_dora) are not supported"
    if "lora_embedding_" in key:
        return "LoRA on embeddings is not supported"
    if key.endswith(".bias"):
        return "adapters with LoRA biases (lora_bias) are not supported"
    if "modules_to_save" in key or "trainable_tokens" in key:
        return "adapters with fully trained modules or tokens are not supported"
    return f"unexpected tensor {key!r} in {WEIGHTS_FILE} (not a PEFT LoRA weight)"


def _expert_depths(settings: PeftSettings, wrapped: Mapping[str, _Wrapped], module: str) -> dict[int, str]:
    """For the experts module: nesting depth -> parameter name. PEFT wraps the targeted parameters in registration
    order, each new wrapper around the previous one, so the last targeted parameter is the outermost (depth 0)."""
    if not module.endswith(".experts"):
        return {}
    targeted = [p for p in EXPERT_PARAMS
                if any(t == f"{module}.{p}" or f"{module}.{p}".endswith("." + t) for t in settings.target_parameters)]
    depths = sorted(w.depth for w in wrapped.values() if w.module == module)
    if len(depths) != len(targeted) or depths != list(range(len(depths))):
        raise LoraError(f"cannot tell which expert parameters {PEFT_PREFIX}{module} adapts: target_parameters "
                        f"{list(settings.target_parameters)} do not match the saved weights")
    return {len(targeted) - 1 - i: p for i, p in enumerate(targeted)}


def _plan_one(settings: PeftSettings, w: _Wrapped, expert_depths: Mapping[int, str]) -> PlannedPair:
    if w.module == "lm_head":
        raise LoraError("LoRA on the output head (lm_head, tied to the embedding) is not supported")
    if w.module.startswith(DECODER):
        pass_name, decoder_module = "dec", w.module
    elif w.module.startswith(ENCODER):
        pass_name, decoder_module = "enc", DECODER + w.module[len(ENCODER):]
    else:
        raise LoraError(f"the adapter adapts {w.module!r}, which dgemma's text model does not have")
    if expert_depths:
        param = expert_depths[w.depth]
        source, key = f"{decoder_module}.{param}", f"{w.module}.{param}"
    else:
        source, key = f"{decoder_module}.weight", w.module
    target = gguf_name_of_source(source)
    if target is None or not is_lora_target(target):
        raise LoraError(f"the adapter adapts {w.module!r}, which is not a weight dgemma can adapt")
    if pass_name == "enc" and target in DECODER_ONLY_TARGETS:
        raise LoraError(f"the adapter adapts {w.module!r}, which the encoder does not have")
    a, b = w.halves["A"], w.halves["B"]
    if len(a.shape) != 2 or len(b.shape) != 2 or 0 in a.shape or 0 in b.shape:
        raise LoraError(f"{key}: lora_A {list(a.shape)} and lora_B {list(b.shape)} must be non-empty matrices")
    r = settings.rank_of(key)
    n_experts = 0
    if expert_depths:
        if a.shape[0] % r:
            raise LoraError(f"{key}: rank mismatch, lora_A has {a.shape[0]} rows, not a multiple of r = {r}")
        n_experts = a.shape[0] // r
        a_ne, b_ne = (a.shape[1], r, n_experts), (r, b.shape[0], n_experts)
    else:
        a_ne, b_ne = (a.shape[1], a.shape[0]), (b.shape[1], b.shape[0])
    if a.shape[0] != (r * n_experts if n_experts else r) or b.shape[1] != a.shape[0]:
        raise LoraError(f"{key}: rank mismatch, lora_A {list(a.shape)} and lora_B {list(b.shape)} do not have "
                        f"rank r = {r} from {CONFIG_FILE}")
    b_factor = settings.scale_of(key) / (settings.gguf_alpha / r)
    if abs(b_factor - 1.0) < 1e-12:
        b_factor = 1.0
    return PlannedPair(LoraPair(target, pass_name, a_ne, b_ne), a, b, n_experts, b_factor)


@dataclass(frozen=True)
class LoraResult:
    path: Path
    n_pairs: int
    nbytes: int
    ranks: list[int]
    skipped: int


def convert_lora(peft_dir: Path, outfile: Path, *, base: Path | None = None,
                 base_tensors: tuple[str, Mapping[str, tuple[int, ...]]] | None = None) -> LoraResult:
    """Write the GGUF LoRA file of a PEFT adapter folder (atomically). With `base` (a GGUF path) or `base_tensors`
    (architecture, name -> ne) every target is checked against that base first."""
    plan, st = plan_lora(Path(peft_dir))
    try:
        header = plan.header
        if base is not None:
            base_tensors = read_base_tensors(Path(base))
        if base_tensors is not None:
            check_against_base(header, *base_tensors)
        _write(Path(outfile), plan, st)
    finally:
        st.close()
    out = Path(outfile)
    return LoraResult(out, len(plan.pairs), out.stat().st_size, header.ranks, plan.skipped)


def _write(outfile: Path, plan: LoraPlan, st: SafetensorsFile) -> None:
    if outfile.is_dir():
        raise LoraError(f"output path is a folder: {outfile}")
    tensors: list[tuple[str, tuple[int, ...], T, Any]] = []
    for p in plan.pairs:
        a_type = SAFETENSORS_TO_GGML[p.a.dtype]
        tensors.append((p.pair.a_name, p.pair.a_ne, a_type, lambda p=p: _a_bytes(st, p)))
        tensors.append((p.pair.b_name, p.pair.b_ne, p.out_type, lambda p=p: _b_bytes(st, p)))
    with StreamingGGUFWriter(outfile, ARCH) as writer:
        writer.add_key_value(KEY_GENERAL_TYPE, "adapter", V.STRING)
        writer.add_key_value(KEY_ADAPTER_TYPE, "lora", V.STRING)
        writer.add_key_value(KEY_LORA_ALPHA, plan.settings.gguf_alpha, V.FLOAT32)
        for name, ne, ggml_type, _ in tensors:
            writer.add_tensor_info(name, ne, ggml_type, _nbytes(ggml_type, ne))
        writer.begin_data()
        for name, _, _, data in tensors:
            writer.write_tensor(name, [data()])
        writer.finish()


def _nbytes(ggml_type: T, ne: tuple[int, ...]) -> int:
    return math.prod(ne) * (4 if ggml_type == T.F32 else 2)


def _raw(st: SafetensorsFile, entry: TensorEntry) -> np.ndarray:
    """The tensor's elements in their own bits (bf16 as uint16), torch shape."""
    dtype = {"F32": "<f4", "F16": "<f2", "BF16": "<u2"}[entry.dtype]
    assert DTYPE_SIZES[entry.dtype] == np.dtype(dtype).itemsize
    return np.frombuffer(st.read(entry.offset, entry.nbytes), dtype=dtype).reshape(entry.shape)


def _a_bytes(st: SafetensorsFile, p: PlannedPair) -> np.ndarray:
    # 2-D: torch [r, n_in] is ne [n_in, r]. Experts: PEFT's rows are expert-major (row e*r + k), so [r*E, n_in]
    # is already [E, r, n_in], i.e. ne [n_in, r, E].
    return _raw(st, p.a)


def _b_bytes(st: SafetensorsFile, p: PlannedPair) -> np.ndarray:
    b = _raw(st, p.b)
    if p.n_experts:
        # PEFT's columns are rank-major (column k*E + e): [n_out, r*E] -> [n_out, r, E] -> [E, n_out, r],
        # i.e. ne [r, n_out, E] with B_e = b[e] (PEFT's get_delta_weight: einsum "o r e, e r i -> e o i").
        b = np.ascontiguousarray(b.reshape(b.shape[0], -1, p.n_experts).transpose(2, 0, 1))
    if p.b_factor != 1.0:
        b = (_to_float32(b, p.b.dtype) * np.float32(p.b_factor)).astype(np.float32)
    return b


def _to_float32(x: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "BF16":
        return (x.astype(np.uint32) << 16).view(np.float32)
    return x.astype(np.float32)


@contextlib.contextmanager
def peft_as_gguf(specs: Sequence) -> Iterator[list[tuple[Path, float]]]:
    """Adapters for `Model.load` ((path, scale) each), with every PEFT adapter folder among `specs` converted into a
    GGUF LoRA file in a temporary folder that lives as long as the context (the engine copies the factors at load)."""
    from dgemma_engine.adapters import adapter_spec, is_peft_folder

    with tempfile.TemporaryDirectory(prefix="dgemma-lora-") as tmp:
        files = []
        for i, spec in enumerate(specs):
            path, scale = adapter_spec(spec)
            if is_peft_folder(path):
                out = Path(tmp) / f"{i}-{path.name}.gguf"
                convert_lora(path, out)
                path = out
            files.append((path, scale))
        yield files
