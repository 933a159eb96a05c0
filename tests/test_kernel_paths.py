"""The transformers goldens hold on every kernel path this machine has, not only on the one its CPU dispatches.

The main run covers the native path; this runs the golden modules again in a child pytest on each other path
(tests/kernel_paths.py): the portable kernels with the standard-op graph (what a CPU without AVX2, or an accelerator,
runs), and each lower instruction set the CPU has (an AVX-512 machine also runs the AVX-VNNI and AVX2 kernels), all
held to the same goldens and tolerances. The surface golden covers native and portable itself (tests/test_surface.py).
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernel_paths import ISA_PATHS, cpu_has_isa, native_isa, path_env

TESTS = Path(__file__).parent
GOLDEN_MODULES = ["test_engine.py", "test_generate.py", "test_engine_quant.py", "test_generate_free_running.py",
                  "test_sudoku_agreement.py"]


@pytest.mark.parametrize("path", ["portable", *ISA_PATHS])
def test_goldens_hold_on_each_path(path):
    if path in ISA_PATHS and not cpu_has_isa(path):
        pytest.skip(f"this CPU lacks {path}")
    if path == native_isa():
        pytest.skip(f"{path} is this CPU's native path: the main run holds it to the goldens")
    env = {**os.environ, **path_env(path)}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                           *[str(TESTS / m) for m in GOLDEN_MODULES]],
                          env=env, cwd=TESTS.parent, capture_output=True, text=True, timeout=1200)
    tail = "\n".join(done.stdout.splitlines()[-25:])
    assert done.returncode == 0, f"golden tests failed on the {path} path:\n{tail}"
    assert " passed" in done.stdout.splitlines()[-1] and "skipped" not in done.stdout.splitlines()[-1], tail
