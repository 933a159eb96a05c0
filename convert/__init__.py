"""HF DiffusionGemma checkpoint -> GGUF (llama.cpp PR #24423 layout), streamed and quantized with ggml's quantizers."""
from dgemma_convert.converter import ConversionPlan, ConversionResult, ProgressSink, convert, plan, requantize
from dgemma_convert.errors import ConvertError

__all__ = ["ConversionPlan", "ConversionResult", "ConvertError", "ProgressSink", "convert", "plan", "requantize"]
