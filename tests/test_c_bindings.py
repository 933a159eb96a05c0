"""The ctypes structures of the Python binding against the C headers they mirror, field by field: name, C type,
array length and order. A size check alone passes when two same-size fields swap, or one is renamed."""
from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest

from dgemma_engine import model, sampler, vision

CSRC = Path(__file__).resolve().parent.parent / "ggml_ext" / "csrc"
HEADERS = (CSRC / "engine" / "engine.h", CSRC / "sampler" / "sampler.h")
C_TYPES = {"int32_t": ctypes.c_int32, "uint32_t": ctypes.c_uint32, "int64_t": ctypes.c_int64,
           "uint64_t": ctypes.c_uint64, "uint8_t": ctypes.c_uint8, "int8_t": ctypes.c_int8, "float": ctypes.c_float,
           "double": ctypes.c_double}
# the bound structures: C name -> the ctypes class mirroring it
BOUND = {"dg_hparams": model.HParamsC, "dg_vision_hparams": vision.VisionHParamsC,
         "dg_sampler_params": sampler.ParamsC, "dg_step_info": sampler.StepInfoC}


def strip_comments(text: str) -> str:
    return re.sub(r"//[^\n]*|/\*.*?\*/", "", text, flags=re.S)


def header_structs() -> tuple[dict[str, list[tuple[str, str, int | None]]], dict[str, int]]:
    """Each bound `typedef struct [tag] { ... } name;` of the headers as (field, C type, array length or None), in order,
    and the headers' integer #defines."""
    structs, defines = {}, {}
    for header in HEADERS:
        text = strip_comments(header.read_text())
        defines.update({m[1]: int(m[2]) for m in re.finditer(r"#define\s+(\w+)\s+(\d+)\b", text)})
        for m in re.finditer(r"typedef\s+struct\s*\w*\s*\{(.*?)\}\s*(\w+)\s*;", text, re.S):
            if m[2] not in BOUND:  # engine-internal structs (tensor pointers, enum-sized arrays) are not bound
                continue
            fields = []
            for declaration in filter(None, (d.strip() for d in m[1].split(";"))):
                ctype, names = declaration.split(None, 1)
                for name in (n.strip() for n in names.split(",")):
                    array = re.fullmatch(r"(\w+)\s*\[\s*(\w+)\s*\]", name)
                    if array:
                        size = array[2]
                        fields.append((array[1], ctype, int(size) if size.isdigit() else defines[size]))
                    else:
                        fields.append((name, ctype, None))
            structs[m[2]] = fields
    return structs, defines


def binding_fields(cls: type[ctypes.Structure]) -> list[tuple[str, str, int | None]]:
    by_ctype = {v: k for k, v in C_TYPES.items()}
    out = []
    for name, ctype in cls._fields_:
        if issubclass(ctype, ctypes.Array):
            out.append((name, by_ctype[ctype._type_], ctype._length_))
        else:
            out.append((name, by_ctype[ctype], None))
    return out


@pytest.mark.parametrize("c_name", sorted(BOUND))
def test_binding_mirrors_the_header_field_by_field(c_name):
    structs, _ = header_structs()
    assert c_name in structs, f"{c_name} is not a typedef struct of {', '.join(h.name for h in HEADERS)}"
    assert binding_fields(BOUND[c_name]) == structs[c_name]


def test_the_comparison_sees_a_swap_of_two_same_size_fields():
    """What a size check misses: two int32 fields swapped keep the size and break the binding."""
    structs, _ = header_structs()
    fields = list(model.HParamsC._fields_)
    fields[0], fields[1] = fields[1], fields[0]
    swapped = type("Swapped", (ctypes.Structure,), {"_fields_": fields})
    assert ctypes.sizeof(swapped) == ctypes.sizeof(model.HParamsC)
    assert binding_fields(swapped) != structs["dg_hparams"]


def test_the_layer_bound_matches_the_header():
    _, defines = header_structs()
    assert model.MAX_LAYERS == defines["DG_MAX_LAYERS"]
