"""The GGUF architecture name of DiffusionGemma: `general.architecture` and the prefix of its metadata keys, and the
one decision made on it: is this model one dgemma runs (`is_diffusion_gemma`, `check_architecture`).

A pure module (no engine import) so the converter, the store, the server and the CLI share this one spelling and this
one check; the C engine spells it once too (csrc/engine/gguf_names.h, DG_GGUF_ARCH; tests/test_gguf_names.py ties the
two). tests/test_decisions_once.py keeps the comparison and its error in this module.
"""
from typing import Any

from dgemma_engine.errors import DgemmaError, EngineError

ARCH = "diffusion-gemma"

# The vision projector file (the `--mmproj-outfile` of `dgemma convert`): llama.cpp's mtmd layout, whose
# `general.architecture` is "clip" and whose `clip.projector_type` names the tower (Gemma 4's: "gemma4v").
CLIP_ARCH = "clip"
PROJECTOR_GEMMA4V = "gemma4v"


def is_diffusion_gemma(name: Any, families: Any = ()) -> bool:
    """Whether a GGUF's `general.architecture`, or a manifest config's `model_family` (with its `model_families`),
    names DiffusionGemma. Values from untrusted files and configs: anything that is not the name is not it."""
    return name == ARCH or (isinstance(families, (list, tuple)) and ARCH in families)


def check_architecture(name: Any, *, families: Any = (), error: type[DgemmaError] = EngineError) -> None:
    """The one refusal of a model dgemma cannot run, a one-line 400 in each door's own error type (`error`: the
    create, pull, request or CLI error its caller already raises)."""
    if not is_diffusion_gemma(name, families):
        raise error(f'model architecture "{name or "unknown"}" is not supported by dgemma')
