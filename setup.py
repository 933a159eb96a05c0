"""Build the engine's C core against the ggml that llama-cpp-python ships.

llama-cpp-python installs ggml's headers at `<site-packages>/include` and its shared libraries at
`<site-packages>/llama_cpp/lib` (see docs/build.md). We compile against exactly those, and link with an
RPATH to the runtime copy inside `llama_cpp/lib`, so the process holds one ggml: the one `llama_cpp` loads.
"""
import glob
import importlib.util
import os

from setuptools import Extension, setup


def llama_cpp_paths() -> tuple[str, str]:
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        raise RuntimeError("llama-cpp-python must be installed to build dgemma's engine (it provides ggml)")
    pkg_dir = os.path.dirname(spec.origin)
    include_dir = os.path.join(os.path.dirname(pkg_dir), "include")
    lib_dir = os.path.join(pkg_dir, "lib")
    for needed in (os.path.join(include_dir, "ggml.h"), os.path.join(lib_dir, "libggml-base.so")):
        if not os.path.exists(needed):
            raise RuntimeError(f"llama-cpp-python does not provide {os.path.basename(needed)} where expected")
    return include_dir, lib_dir


include_dir, lib_dir = llama_cpp_paths()
common_args = ["-O3", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter", "-fvisibility=hidden", "-pthread"]

ggml_link = {
    "library_dirs": [lib_dir],
    "libraries": ["ggml", "ggml-base", "ggml-cpu"],
    "extra_compile_args": common_args,
    "extra_link_args": ["-Wl,-rpath,$ORIGIN/../llama_cpp/lib", "-pthread", "-lm"],
}
# The forward pass on ggml: GGUF load, encoder prefill, decoder step with self-conditioning.
engine = Extension(
    "dgemma_engine._engine",
    sources=sorted(glob.glob("ggml_ext/csrc/engine/*.c")),
    include_dirs=[include_dir, "ggml_ext/csrc", "ggml_ext/csrc/engine"],
    **ggml_link,
)
# The engine's test hooks (kernel checks, the matmul bench) with the kernel sources they exercise: loaded by tests/ and
# bench/ only, so the product library exports none of them.
HOOKED_KERNELS = ["cpu", "error", "ops", "f32_matmul", "qkernels", "qkernels_avx2", "qkernels_avxvnni", "qkernels_avx512",
                  "expert_matmul", "soft_embedding"]
engine_tests = Extension(
    "dgemma_engine._engine_tests",
    sources=sorted(glob.glob("ggml_ext/csrc/engine_tests/*.c"))
    + [f"ggml_ext/csrc/engine/{name}.c" for name in HOOKED_KERNELS],
    include_dirs=[include_dir, "ggml_ext/csrc", "ggml_ext/csrc/engine", "ggml_ext/csrc/engine_tests"],
    **ggml_link,
)
# The entropy-bound sampler and torch-compatible RNG: plain C over a float logits buffer, no ggml needed.
sampler = Extension(
    "dgemma_engine._sampler",
    sources=sorted(glob.glob("ggml_ext/csrc/sampler/*.c")),
    include_dirs=["ggml_ext/csrc/sampler"],
    extra_compile_args=common_args,
    extra_link_args=["-pthread", "-lm"],
)

# The converter's fast Q4_K/Q5_K/Q6_K quantizers: byte-identical to ggml's only if no multiply-add is ever fused.
kquant = Extension(
    "dgemma_convert._quant",
    sources=sorted(glob.glob("convert/csrc/*.c")),
    include_dirs=[include_dir, "ggml_ext/csrc"],
    library_dirs=[lib_dir],
    libraries=["ggml-base"],
    extra_compile_args=common_args + ["-ffp-contract=off", "-fno-fast-math"],
    extra_link_args=["-Wl,-rpath,$ORIGIN/../llama_cpp/lib", "-pthread"],
)

setup(ext_modules=[ext for ext in (engine, engine_tests, sampler, kquant) if ext.sources])
