"""HF DiffusionGemma checkpoint -> GGUF (llama.cpp PR #24423 layout), streamed and quantized with ggml's quantizers."""
from dgemma_convert.converter import ConversionPlan, ConversionResult, ProgressSink, convert, plan
from dgemma_convert.errors import ConvertError
from dgemma_convert.mmproj import convert_mmproj, plan_mmproj
from dgemma_convert.requantize import requantize

__all__ = ["ConversionPlan", "ConversionResult", "ConvertError", "ProgressSink", "convert", "convert_mmproj", "plan",
           "plan_mmproj", "requantize"]
