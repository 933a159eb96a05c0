"""The GGUF metadata keys of a DiffusionGemma file (docs/gguf.md#metadata-keys, #tokenizer-keys, #lora-adapters).

Each key is spelled here once for Python: the converter writes them, the engine, the store and the server read them
(the sampler keys are rows of `dgemma_engine.settings`, the task key is `dgemma_engine.tasks.TASK_KEY`). A pure module,
like `dgemma_engine.arch`. The names follow the C engine's `DG_KEY_*` (csrc/engine/gguf_names.h).
"""
from __future__ import annotations

from dgemma_engine.arch import ARCH


def arch_key(name: str, arch: str = ARCH) -> str:
    """An architecture key: `arch_key("block_count")` is "diffusion-gemma.block_count"."""
    return f"{arch}.{name}"


def for_arch(key: str, arch: str) -> str:
    """One of the architecture keys below under another architecture's prefix (a file that names its own)."""
    return arch_key(key.removeprefix(arch_key("")), arch)


# general.*
KEY_ARCHITECTURE = "general.architecture"
KEY_GENERAL_TYPE = "general.type"  # "model", or "adapter" for a LoRA file
KEY_NAME = "general.name"
KEY_SIZE_LABEL = "general.size_label"
KEY_QUANTIZATION_VERSION = "general.quantization_version"
KEY_FILE_TYPE = "general.file_type"
KEY_ALIGNMENT = "general.alignment"

# The architecture's hyperparameters
KEY_BLOCK_COUNT = arch_key("block_count")
KEY_CONTEXT_LENGTH = arch_key("context_length")
KEY_EMBEDDING_LENGTH = arch_key("embedding_length")
KEY_FEED_FORWARD_LENGTH = arch_key("feed_forward_length")
KEY_EXPERT_FEED_FORWARD_LENGTH = arch_key("expert_feed_forward_length")
KEY_EXPERT_COUNT = arch_key("expert_count")
KEY_EXPERT_USED_COUNT = arch_key("expert_used_count")
KEY_HEAD_COUNT = arch_key("attention.head_count")
KEY_HEAD_COUNT_KV = arch_key("attention.head_count_kv")
KEY_KEY_LENGTH = arch_key("attention.key_length")
KEY_VALUE_LENGTH = arch_key("attention.value_length")
KEY_KEY_LENGTH_SWA = arch_key("attention.key_length_swa")
KEY_VALUE_LENGTH_SWA = arch_key("attention.value_length_swa")
KEY_SLIDING_WINDOW = arch_key("attention.sliding_window")
KEY_SLIDING_WINDOW_PATTERN = arch_key("attention.sliding_window_pattern")
KEY_RMS_EPS = arch_key("attention.layer_norm_rms_epsilon")
KEY_CAUSAL = arch_key("attention.causal")
KEY_SHARED_KV_LAYERS = arch_key("attention.shared_kv_layers")
KEY_EMBEDDING_LENGTH_PER_LAYER_INPUT = arch_key("embedding_length_per_layer_input")
KEY_ROPE_FREQ_BASE = arch_key("rope.freq_base")
KEY_ROPE_FREQ_BASE_SWA = arch_key("rope.freq_base_swa")
KEY_ROPE_DIMENSION_COUNT = arch_key("rope.dimension_count")
KEY_ROPE_DIMENSION_COUNT_SWA = arch_key("rope.dimension_count_swa")
KEY_LOGIT_SOFTCAP = arch_key("final_logit_softcapping")

# Diffusion
KEY_CANVAS_LENGTH = "diffusion.canvas_length"

# Tokenizer
KEY_TOKENIZER_MODEL = "tokenizer.ggml.model"
KEY_TOKENS = "tokenizer.ggml.tokens"
KEY_SCORES = "tokenizer.ggml.scores"
KEY_TOKEN_TYPE = "tokenizer.ggml.token_type"
KEY_MERGES = "tokenizer.ggml.merges"
KEY_BOS_ID = "tokenizer.ggml.bos_token_id"
KEY_EOS_ID = "tokenizer.ggml.eos_token_id"
KEY_UNKNOWN_ID = "tokenizer.ggml.unknown_token_id"
KEY_PADDING_ID = "tokenizer.ggml.padding_token_id"
KEY_MASK_ID = "tokenizer.ggml.mask_token_id"
KEY_ADD_SPACE_PREFIX = "tokenizer.ggml.add_space_prefix"
KEY_ADD_BOS = "tokenizer.ggml.add_bos_token"
KEY_CHAT_TEMPLATE = "tokenizer.chat_template"
SPECIAL_TOKEN_KEYS = {"bos": KEY_BOS_ID, "eos": KEY_EOS_ID, "unk": KEY_UNKNOWN_ID, "pad": KEY_PADDING_ID,
                      "mask": KEY_MASK_ID}  # role -> the key of its token id

# LoRA adapter files (llama.cpp's keys), with KEY_GENERAL_TYPE "adapter"
KEY_ADAPTER_TYPE = "adapter.type"
KEY_LORA_ALPHA = "adapter.lora.alpha"

# Vision projector files (llama.cpp's mtmd `clip.*` keys, tools/mtmd/clip-impl.h; docs/gguf.md#vision-projector),
# general.architecture "clip". mtmd has no key for the soft-token budget or the 2-D RoPE base of Gemma 4's tower
# (its gemma4v loader hard-codes 40..280 tokens and θ = 100), so those two are dgemma's own.
KEY_CLIP_PROJECTOR_TYPE = "clip.projector_type"
KEY_CLIP_HAS_VISION_ENCODER = "clip.has_vision_encoder"
KEY_CLIP_USE_GELU = "clip.use_gelu"
KEY_VISION_IMAGE_SIZE = "clip.vision.image_size"
KEY_VISION_PATCH_SIZE = "clip.vision.patch_size"
KEY_VISION_EMBEDDING_LENGTH = "clip.vision.embedding_length"
KEY_VISION_FEED_FORWARD_LENGTH = "clip.vision.feed_forward_length"
KEY_VISION_BLOCK_COUNT = "clip.vision.block_count"
KEY_VISION_PROJECTION_DIM = "clip.vision.projection_dim"
KEY_VISION_HEAD_COUNT = "clip.vision.attention.head_count"
KEY_VISION_HEAD_COUNT_KV = "clip.vision.attention.head_count_kv"
KEY_VISION_HEAD_DIM = "clip.vision.attention.head_dim"
KEY_VISION_LAYER_NORM_EPS = "clip.vision.attention.layer_norm_epsilon"
KEY_VISION_IMAGE_MEAN = "clip.vision.image_mean"
KEY_VISION_IMAGE_STD = "clip.vision.image_std"
KEY_VISION_POOLING = "clip.vision.projector.scale_factor"  # the pooling kernel size k (mtmd's n_merge)
KEY_VISION_MAX_SOFT_TOKENS = "dgemma.vision.max_soft_tokens"
KEY_VISION_ROPE_FREQ_BASE = "dgemma.vision.rope.freq_base"
