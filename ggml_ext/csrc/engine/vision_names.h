// The GGUF names of a vision projector file (llama.cpp's mtmd layout for Gemma 4, "gemma4v";
// docs/gguf.md#vision-projector), written once here for C. The Python spellings live in ggml_ext/arch.py, ggml_ext/gguf_keys.py and convert/mmproj.py;
// tests/test_convert_mmproj.py ties the two.
#pragma once

#include "gguf_names.h"  // the names both layouts share

#define DG_V_ARCH "clip"
#define DG_V_PROJECTOR_GEMMA4V "gemma4v"

// Metadata keys
#define DG_V_KEY_ARCHITECTURE DG_KEY_ARCHITECTURE
#define DG_V_KEY_PROJECTOR_TYPE "clip.projector_type"
#define DG_V_KEY_HAS_VISION_ENCODER "clip.has_vision_encoder"
#define DG_V_KEY_PATCH_SIZE "clip.vision.patch_size"
#define DG_V_KEY_EMBEDDING_LENGTH "clip.vision.embedding_length"
#define DG_V_KEY_FEED_FORWARD_LENGTH "clip.vision.feed_forward_length"
#define DG_V_KEY_BLOCK_COUNT "clip.vision.block_count"
#define DG_V_KEY_PROJECTION_DIM "clip.vision.projection_dim"
#define DG_V_KEY_HEAD_COUNT "clip.vision.attention.head_count"
#define DG_V_KEY_HEAD_COUNT_KV "clip.vision.attention.head_count_kv"
#define DG_V_KEY_HEAD_DIM "clip.vision.attention.head_dim"
#define DG_V_KEY_LAYER_NORM_EPS "clip.vision.attention.layer_norm_epsilon"
#define DG_V_KEY_POOLING "clip.vision.projector.scale_factor"
#define DG_V_KEY_MAX_SOFT_TOKENS "dgemma.vision.max_soft_tokens"
#define DG_V_KEY_ROPE_FREQ_BASE "dgemma.vision.rope.freq_base"

// Tensors
#define DG_V_TENSOR_PATCH_EMBD "v.patch_embd.weight"
#define DG_V_TENSOR_POSITION_EMBD "v.position_embd.weight"
#define DG_V_TENSOR_STD_BIAS "v.std_bias"
#define DG_V_TENSOR_STD_SCALE "v.std_scale"
#define DG_V_TENSOR_INPUT_PROJECTION "mm.input_projection.weight"
#define DG_V_BLOCK "v.blk.%d."  // + one of the block suffixes
#define DG_V_LN1 "ln1.weight"
#define DG_V_ATTN_Q "attn_q"  // the clippable linears: + ".weight", or + "." + a bound
#define DG_V_ATTN_K "attn_k"
#define DG_V_ATTN_V "attn_v"
#define DG_V_ATTN_OUT "attn_out"
#define DG_V_FFN_GATE "ffn_gate"
#define DG_V_FFN_UP "ffn_up"
#define DG_V_FFN_DOWN "ffn_down"
#define DG_V_ATTN_Q_NORM DG_TENSOR_ATTN_Q_NORM
#define DG_V_ATTN_K_NORM DG_TENSOR_ATTN_K_NORM
#define DG_V_ATTN_POST_NORM "attn_post_norm.weight"
#define DG_V_LN2 "ln2.weight"
#define DG_V_FFN_POST_NORM "ffn_post_norm.weight"
#define DG_V_BOUND_INPUT_MIN "input_min"
#define DG_V_BOUND_INPUT_MAX "input_max"
#define DG_V_BOUND_OUTPUT_MIN "output_min"
#define DG_V_BOUND_OUTPUT_MAX "output_max"
