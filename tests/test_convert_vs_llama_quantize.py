"""Cross-check against llama.cpp itself: `llama_model_quantize` from llama-cpp-python's libllama.

The vendored llama.cpp does not know `diffusion-gemma`, but its quantizer only reads hyper-parameters and then walks
the tensors by name, and Gemma 4 uses the same names and keys. So the converter's F32 file, relabeled as `gemma4`,
is quantized by llama.cpp; every tensor (type and bytes) must equal what `dgemma convert` writes directly.
"""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T, GGUFReader, GGUFValueType as V, GGUFWriter

from dgemma_convert import convert
from synthetic_checkpoint import FULL, SLIDING, text_config, write_synthetic_checkpoint

# 8 layers with both layer types: the attn_v counter (n = 6 attn_v tensors) and the per-layer ffn_down rule both vary
LAYER_TYPES = [SLIDING] * 5 + [FULL, SLIDING, FULL]
LLAMA_FTYPE = {"q8_0": 7, "q4_0": 2, "q4_k_m": 15, "q5_k_m": 17, "q6_k": 18}

QUANTIZE = """
import sys, llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = int(sys.argv[3])
params.nthread = 2
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), params))
"""


def relabel_as_gemma4(src, dst) -> None:
    reader = GGUFReader(src)
    writer = GGUFWriter(dst, "gemma4")
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = V(field.types[0])
        writer.add_key_value(name.replace("diffusion-gemma.", "gemma4."), field.contents(), vtype,
                             sub_type=V(field.types[-1]) if vtype == V.ARRAY else None)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=T(t.tensor_type))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("llama-quantize")
    ckpt = write_synthetic_checkpoint(tmp / "ckpt", text_config(num_hidden_layers=8, layer_types=LAYER_TYPES,
                                                                 intermediate_size=256), n_tokens=400)
    convert(ckpt, tmp / "f32.gguf", "f32")
    relabel_as_gemma4(tmp / "f32.gguf", tmp / "gemma4-f32.gguf")
    return ckpt, tmp


@pytest.mark.parametrize("outtype", list(LLAMA_FTYPE))
def test_same_types_and_bytes_as_llama_quantize(source, outtype):
    ckpt, tmp = source
    ours, theirs = tmp / f"{outtype}.gguf", tmp / f"llama-{outtype}.gguf"
    convert(ckpt, ours, outtype, threads=2)
    # in a child process: a failed GGML_ASSERT in llama.cpp would abort the test runner
    run = subprocess.run([sys.executable, "-c", QUANTIZE, str(tmp / "gemma4-f32.gguf"), str(theirs),
                          str(LLAMA_FTYPE[outtype])], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    a = {t.name: t for t in GGUFReader(ours).tensors}
    b = {t.name: t for t in GGUFReader(theirs).tensors}
    assert set(a) == set(b)
    for name, t in a.items():
        assert T(t.tensor_type) == T(b[name].tensor_type), name
        assert np.array_equal(np.asarray(t.data).view(np.uint8), np.asarray(b[name].data).view(np.uint8)), name
    if outtype in ("q4_k_m", "q5_k_m"):  # the mix is non-trivial: the rules were exercised, not bypassed
        assert len({T(t.tensor_type) for t in a.values()}) == 5
