// The GGUF names the engine reads: the architecture, its metadata keys, and every tensor name (llama.cpp's layout, as
// convert/tensor_map.py writes it). Written once here for C; tests/test_gguf_names.py checks them against the Python
// tables (ggml_ext/arch.py, convert/tensor_map.py, convert/gguf_metadata.py, convert/lora.py).
#pragma once

#define DG_GGUF_ARCH "diffusion-gemma"
#define DG_GGUF_KEY(name) DG_GGUF_ARCH "." name  // an architecture key: "diffusion-gemma.block_count"

// Metadata keys
#define DG_KEY_ARCHITECTURE "general.architecture"
#define DG_KEY_BLOCK_COUNT DG_GGUF_KEY("block_count")
#define DG_KEY_CONTEXT_LENGTH DG_GGUF_KEY("context_length")
#define DG_KEY_EMBEDDING_LENGTH DG_GGUF_KEY("embedding_length")
#define DG_KEY_FEED_FORWARD_LENGTH DG_GGUF_KEY("feed_forward_length")
#define DG_KEY_EXPERT_FEED_FORWARD_LENGTH DG_GGUF_KEY("expert_feed_forward_length")
#define DG_KEY_EXPERT_COUNT DG_GGUF_KEY("expert_count")
#define DG_KEY_EXPERT_USED_COUNT DG_GGUF_KEY("expert_used_count")
#define DG_KEY_HEAD_COUNT DG_GGUF_KEY("attention.head_count")
#define DG_KEY_HEAD_COUNT_KV DG_GGUF_KEY("attention.head_count_kv")
#define DG_KEY_KEY_LENGTH DG_GGUF_KEY("attention.key_length")
#define DG_KEY_KEY_LENGTH_SWA DG_GGUF_KEY("attention.key_length_swa")
#define DG_KEY_VALUE_LENGTH DG_GGUF_KEY("attention.value_length")
#define DG_KEY_VALUE_LENGTH_SWA DG_GGUF_KEY("attention.value_length_swa")
#define DG_KEY_SLIDING_WINDOW DG_GGUF_KEY("attention.sliding_window")
#define DG_KEY_SLIDING_WINDOW_PATTERN DG_GGUF_KEY("attention.sliding_window_pattern")
#define DG_KEY_RMS_EPS DG_GGUF_KEY("attention.layer_norm_rms_epsilon")
#define DG_KEY_ROPE_DIMENSION_COUNT DG_GGUF_KEY("rope.dimension_count")
#define DG_KEY_ROPE_DIMENSION_COUNT_SWA DG_GGUF_KEY("rope.dimension_count_swa")
#define DG_KEY_ROPE_FREQ_BASE DG_GGUF_KEY("rope.freq_base")
#define DG_KEY_ROPE_FREQ_BASE_SWA DG_GGUF_KEY("rope.freq_base_swa")
#define DG_KEY_LOGIT_SOFTCAP DG_GGUF_KEY("final_logit_softcapping")
#define DG_KEY_CANVAS_LENGTH "diffusion.canvas_length"
#define DG_KEY_TOKENS "tokenizer.ggml.tokens"

// Global tensors
#define DG_STEM_TOKEN_EMBD "token_embd"
#define DG_STEM_OUTPUT "output"
#define DG_TENSOR_TOKEN_EMBD DG_STEM_TOKEN_EMBD ".weight"
#define DG_TENSOR_OUTPUT DG_STEM_OUTPUT ".weight"  // untied LM head (optional)
#define DG_TENSOR_OUTPUT_NORM "output_norm.weight"
#define DG_TENSOR_ROPE_FREQS "rope_freqs.weight"
#define DG_TENSOR_SC_PRE_NORM "self_cond_pre_norm.weight"
#define DG_TENSOR_SC_GATE "self_cond_gate.weight"
#define DG_TENSOR_SC_UP "self_cond_up.weight"
#define DG_TENSOR_SC_DOWN "self_cond_down.weight"
#define DG_SELF_COND_PREFIX "self_cond_"  // every self-conditioning tensor's name starts so

// Block tensors: DG_BLOCK (with the layer index) followed by one of these
#define DG_BLOCK "blk.%d."
#define DG_BLOCK_PREFIX "blk."
#define DG_TENSOR_ATTN_NORM "attn_norm.weight"
#define DG_TENSOR_ATTN_Q "attn_q.weight"
#define DG_TENSOR_ATTN_Q_NORM "attn_q_norm.weight"
#define DG_TENSOR_ATTN_K "attn_k.weight"
#define DG_TENSOR_ATTN_K_NORM "attn_k_norm.weight"
#define DG_TENSOR_ATTN_V "attn_v.weight"  // sliding layers only
#define DG_TENSOR_ATTN_OUTPUT "attn_output.weight"
#define DG_TENSOR_POST_ATTN_NORM "post_attention_norm.weight"
#define DG_TENSOR_FFN_NORM "ffn_norm.weight"
#define DG_TENSOR_FFN_GATE "ffn_gate.weight"
#define DG_TENSOR_FFN_UP "ffn_up.weight"
#define DG_TENSOR_FFN_DOWN "ffn_down.weight"
#define DG_TENSOR_POST_FFW_NORM_1 "post_ffw_norm_1.weight"
#define DG_TENSOR_ROUTER "ffn_gate_inp.weight"
#define DG_TENSOR_ROUTER_SCALE "ffn_gate_inp.scale"
#define DG_TENSOR_PRE_FFW_NORM_2 "pre_ffw_norm_2.weight"
#define DG_TENSOR_GATE_UP_EXPS "ffn_gate_up_exps.weight"
#define DG_TENSOR_DOWN_EXPS "ffn_down_exps.weight"
#define DG_TENSOR_EXPERT_SCALE "ffn_down_exps.scale"
#define DG_TENSOR_POST_FFW_NORM_2 "post_ffw_norm_2.weight"
#define DG_TENSOR_POST_FFW_NORM "post_ffw_norm.weight"
#define DG_TENSOR_LAYER_SCALE "layer_output_scale.weight"
#define DG_TENSOR_ENC_LAYER_SCALE "enc_layer_output_scale.weight"
#define DG_EXPERTS_MARK "_exps"  // in the name of every routed-expert tensor
#define DG_WEIGHT_SUFFIX ".weight"  // of every matrix (and norm) name

// Names other writers use, loaded as well (the converter writes the ones above): the split form of the fused
// gate/up experts (as adapters name their targets too), and older spellings of two tensors.
#define DG_TENSOR_GATE_EXPS_SPLIT "ffn_gate_exps.weight"
#define DG_TENSOR_UP_EXPS_SPLIT "ffn_up_exps.weight"
#define DG_TENSOR_SC_NORM_OLD "self_cond_norm.weight"
#define DG_TENSOR_ENC_LAYER_SCALE_OLD "enc_layer_out_scale.weight"

// LoRA adapters (llama.cpp's keys): general.type "adapter", adapter.type "lora", the alpha; tensor names with an
// optional pass prefix before the base tensor's name, then the factor suffix
#define DG_LORA_PREFIX_ENCODER "enc."
#define DG_LORA_PREFIX_DECODER "dec."
#define DG_LORA_SUFFIX_A ".lora_a"
#define DG_LORA_SUFFIX_B ".lora_b"
#define DG_KEY_GENERAL_TYPE "general.type"
#define DG_KEY_ADAPTER_TYPE "adapter.type"
#define DG_KEY_LORA_ALPHA "adapter.lora.alpha"
