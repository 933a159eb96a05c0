"""dgemma's engine: DiffusionGemma on ggml (load, encode, denoise step, commit) and the generation loop."""
