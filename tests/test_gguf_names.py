"""The C engine's GGUF names (ggml_ext/csrc/engine/gguf_names.h) against the Python tables: the architecture string
(ggml_ext/arch.py), the metadata keys the converter writes (convert/gguf_metadata.py), the tensor names
(convert/tensor_map.py) and the LoRA targets and pass prefixes (convert/lora.py). And the engine's C files spell
none of those names themselves: they use the header's macros.
"""
from __future__ import annotations

import re
from pathlib import Path

from dgemma_convert import lora, tensor_map
from dgemma_engine import gguf_keys
from dgemma_engine.arch import ARCH

ROOT = Path(__file__).resolve().parent.parent
ENGINE = ROOT / "ggml_ext" / "csrc" / "engine"
HEADER = ENGINE / "gguf_names.h"

_DEFINE = re.compile(r"^#define\s+(DG_\w+)(\(\w+\))?\s+(.*?)\s*(?://.*)?$", re.M)
_LITERAL = re.compile(r'"((?:\\.|[^"\\])*)"')


def header_names() -> dict[str, str]:
    """Every object-like #define of the header, evaluated: string literals and earlier macros concatenated, and
    DG_GGUF_KEY("x") as DG_GGUF_ARCH "." "x"."""
    values: dict[str, str] = {}
    for name, params, body in _DEFINE.findall(HEADER.read_text(encoding="utf-8")):
        if params:
            assert name == "DG_GGUF_KEY", f"unexpected function-like macro {name}"
            continue
        body = re.sub(r'DG_GGUF_KEY\(("[^"]*")\)', r'DG_GGUF_ARCH "." \1', body)
        parts = re.findall(r'"(?:\\.|[^"\\])*"|DG_\w+', body)
        assert "".join(parts).replace(" ", "") == body.replace(" ", ""), f"{name}: cannot evaluate {body!r}"
        values[name] = "".join(values[p] if p.startswith("DG_") else p[1:-1] for p in parts)
    return values


NAMES = header_names()
ALTERNATES = {k: v for k, v in NAMES.items() if k.endswith(("_SPLIT", "_OLD"))}
TENSORS = {v for k, v in NAMES.items() if k.startswith("DG_TENSOR_") and k not in ALTERNATES}


def python_tensor_names() -> set[str]:
    """The tensor names the converter writes: its source tables plus the generated tensors (a block's name without
    its blk.N. prefix)."""
    text = Path(tensor_map.__file__).read_text(encoding="utf-8")
    generated = {name for name in re.findall(r'_spec\(f?"(?:blk\.\{i\}\.)?([\w.]+)", None', text)}
    generated |= set(re.findall(r'_spec\(f"blk\.\{i\}\.([\w.]+)", f"model\.encoder', text))
    return set(tensor_map.GLOBAL_SOURCES) | set(tensor_map.BLOCK_SOURCES) | generated


def test_the_architecture_is_the_python_one():
    assert NAMES["DG_GGUF_ARCH"] == ARCH


def python_key(macro: str) -> str | None:
    """The value of the same name in dgemma_engine.gguf_keys (DG_KEY_X -> KEY_X)."""
    return getattr(gguf_keys, macro.removeprefix("DG_"), None)


def test_every_metadata_key_is_the_python_one():
    keys = [name for name in NAMES if name.startswith("DG_KEY_")]
    assert {name: NAMES[name] for name in keys} == {name: python_key(name) for name in keys}


def test_every_metadata_key_is_one_the_converter_writes():
    text = (ROOT / "convert" / "gguf_metadata.py").read_text(encoding="utf-8")
    written = set(re.findall(r"KeyValue\(gguf_keys\.(KEY_\w+)", text))
    model_keys = {name.removeprefix("DG_") for name in NAMES if name.startswith("DG_KEY_")}
    assert model_keys - {"KEY_ADAPTER_TYPE", "KEY_LORA_ALPHA"} - written == set()


def test_the_adapter_keys_are_the_ones_the_adapter_converter_reads():
    text = Path(lora.__file__).read_text(encoding="utf-8")
    for key in ("KEY_GENERAL_TYPE", "KEY_ADAPTER_TYPE", "KEY_LORA_ALPHA"):
        assert re.search(rf"\b{key}\b", text), key


def test_the_tensor_names_are_the_converters():
    assert python_tensor_names(), "the tensor table of convert/tensor_map.py was not found"
    assert TENSORS == python_tensor_names()
    assert NAMES["DG_BLOCK"] == "blk.%d." and NAMES["DG_BLOCK_PREFIX"] == "blk."
    assert all(n.startswith(NAMES["DG_SELF_COND_PREFIX"]) for n in TENSORS if "self_cond" in n)
    assert {n for n in TENSORS if NAMES["DG_EXPERTS_MARK"] in n} == {"ffn_gate_up_exps.weight",
                                                                     "ffn_down_exps.weight", "ffn_down_exps.scale"}


def test_the_split_experts_are_the_adapter_converters():
    assert {ALTERNATES["DG_TENSOR_GATE_EXPS_SPLIT"], ALTERNATES["DG_TENSOR_UP_EXPS_SPLIT"]} == set(lora.SPLIT_EXPERTS)


def test_the_lora_targets_and_prefixes_are_the_adapter_converters():
    text = (ENGINE / "lora.c").read_text(encoding="utf-8")

    def table(name: str) -> set[str]:
        body = re.search(name + r"\[[^\]]*\] = \{(.*?)\};", text, re.S).group(1)
        return {NAMES[macro] for macro in re.findall(r"DG_\w+(?=\s*(?:,|$))", body) if macro in NAMES}
    assert table("TARGET_NAMES") == set(lora.BLOCK_TARGETS)
    assert table("SELF_COND_NAMES") == set(lora.DECODER_ONLY_TARGETS)
    assert {NAMES["DG_LORA_PREFIX_ENCODER"], NAMES["DG_LORA_PREFIX_DECODER"]} == {f"{p}." for p in lora.PASSES}
    assert (NAMES["DG_LORA_SUFFIX_A"], NAMES["DG_LORA_SUFFIX_B"]) == (".lora_a", ".lora_b")


def test_no_engine_file_spells_a_gguf_name():
    names = {v for k, v in NAMES.items() if len(v) > 3}  # not "." or the like
    for path in sorted(ENGINE.glob("*.[ch]")):
        if path == HEADER:
            continue
        code = re.sub(r"//[^\n]*|/\*.*?\*/", " ", path.read_text(encoding="utf-8"), flags=re.S)
        spelled = {lit for lit in _LITERAL.findall(code) if lit in names}
        assert not spelled, f"{path.name} spells {sorted(spelled)}: use gguf_names.h"
