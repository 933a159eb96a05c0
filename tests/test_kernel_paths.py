"""The transformers goldens hold on the portable kernel path too, not only on the one this CPU dispatches.

The main run covers the native path; this runs the golden modules again in a child pytest with the portable kernels
and the standard-op graph (tests/kernel_paths.py), so a CPU without AVX2, or an accelerator running the standard
ops, is held to the same goldens and tolerances. The surface golden covers both paths itself (tests/test_surface.py).
"""
import os
import subprocess
import sys
from pathlib import Path

from kernel_paths import path_env

TESTS = Path(__file__).parent
GOLDEN_MODULES = ["test_engine.py", "test_generate.py", "test_engine_quant.py", "test_generate_free_running.py",
                  "test_sudoku_agreement.py"]


def test_goldens_hold_on_the_portable_path():
    env = {**os.environ, **path_env("portable")}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                           *[str(TESTS / m) for m in GOLDEN_MODULES]],
                          env=env, cwd=TESTS.parent, capture_output=True, text=True, timeout=1200)
    tail = "\n".join(done.stdout.splitlines()[-25:])
    assert done.returncode == 0, f"golden tests failed on the portable path:\n{tail}"
    assert " passed" in done.stdout.splitlines()[-1] and "skipped" not in done.stdout.splitlines()[-1], tail
