"""The GGUF architecture name of DiffusionGemma: `general.architecture` and the prefix of its metadata keys.

A pure module (no engine import) so the converter, the store, the server and the CLI share this one spelling; the C
engine spells it once too (csrc/engine/gguf_names.h, DG_GGUF_ARCH; tests/test_gguf_names.py ties the two).
"""
ARCH = "diffusion-gemma"

# The vision projector file (the `--mmproj-outfile` of `dgemma convert`): llama.cpp's mtmd layout, whose
# `general.architecture` is "clip" and whose `clip.projector_type` names the tower (Gemma 4's: "gemma4v").
CLIP_ARCH = "clip"
PROJECTOR_GEMMA4V = "gemma4v"
