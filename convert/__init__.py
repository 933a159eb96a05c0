"""HF DiffusionGemma checkpoint -> GGUF (llama.cpp PR #24423 layout), streamed and quantized with ggml's quantizers."""
