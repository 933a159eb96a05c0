"""The GGUF architecture name of DiffusionGemma: `general.architecture` and the prefix of its metadata keys.

A pure module (no engine import) so the converter, the store, the server and the CLI share this one spelling; the C
engine spells it once too (csrc/engine/gguf_names.h, DG_GGUF_ARCH; tests/test_gguf_names.py ties the two).
"""
ARCH = "diffusion-gemma"
