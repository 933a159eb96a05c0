"""The GGUF architecture name of DiffusionGemma: `general.architecture` and the prefix of its metadata keys.

A pure module (no engine import) so the converter, the store, the server and the CLI share this one spelling; the C
engine checks the same string (csrc/engine/model.c, ARCH).
"""
ARCH = "diffusion-gemma"
