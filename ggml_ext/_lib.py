"""Locate and load dgemma's compiled C libraries with ctypes.

The engine links against ggml's shared libraries inside `llama_cpp/lib`. Importing `llama_cpp` first makes those exact
libraries resident (matched by SONAME), so this process holds one ggml whatever the install layout (editable or not).
"""
import ctypes
import functools
import glob
import os

_HERE = os.path.dirname(os.path.abspath(__file__))


@functools.cache
def load_library(name: str) -> ctypes.CDLL:
    """Load `dgemma_engine._<name>` (built by setup.py) as a ctypes library."""
    if name == "engine":
        import llama_cpp  # noqa: F401  (loads llama_cpp/lib/libggml*.so: the one ggml of this process)

    matches = sorted(glob.glob(os.path.join(_HERE, f"_{name}*.so")))
    if not matches:
        raise ImportError(f"dgemma's native library '_{name}' is not built; reinstall with `pip install -e .`")
    return ctypes.CDLL(matches[0])
