"""Locate and load dgemma's compiled C libraries with ctypes.

The engine (and its test hooks, `_engine_tests`, which only tests/ and bench/ load) links against ggml's shared
libraries inside `llama_cpp/lib`. Importing `llama_cpp` first makes those exact
libraries resident (matched by SONAME), so this process holds one ggml whatever the install layout (editable or not).
"""
import ctypes
import functools
import glob
import logging
import os

_HERE = os.path.dirname(os.path.abspath(__file__))


@functools.cache
def load_library(name: str) -> ctypes.CDLL:
    """Load `dgemma_engine._<name>` (built by setup.py) as a ctypes library."""
    if name in ("engine", "engine_tests"):
        import llama_cpp  # noqa: F401  (loads llama_cpp/lib/libggml*.so: the one ggml of this process)

    # `_engine.cpython-311-….so` or `_engine.so`, never `_engine_tests….so`
    matches = sorted(glob.glob(os.path.join(_HERE, f"_{name}.*so")))
    if not matches:
        raise ImportError(f"dgemma's native library '_{name}' is not built; reinstall with `pip install -e .`")
    lib = ctypes.CDLL(matches[0])
    if name == "engine":
        _load_registry(lib)
    return lib


def _load_registry(lib: ctypes.CDLL) -> None:
    """Load ggml's backend registry once, before anything else uses it, with what backends print on stderr as they
    load (e.g. the Vulkan backend's device list, or "No devices found.") moved to the debug log."""
    buf = ctypes.create_string_buffer(8192)
    load = getattr(lib, "dg_devices_load")
    load.restype, load.argtypes = ctypes.c_int, [ctypes.c_char_p, ctypes.c_size_t]
    load(buf, len(buf))
    for line in buf.value.decode("utf-8", "replace").splitlines():
        if line.strip():
            logging.getLogger("dgemma.engine").debug("ggml: %s", line)
