// dgemma engine: DiffusionGemma on ggml's backends (the CPU, plus any accelerator or RPC device in ggml's registry).
//
// One model = one memory-mapped GGUF whose weight tensors point straight into the mapping, plus a transposed copy of
// the token embedding (self-conditioning contracts over the vocabulary). One context = a K/V cache, the ping-pong
// logits buffers and the decoder graphs of the current (context length, canvas length).
// Every exported function reports failure through a caller-provided error buffer; nothing aborts on bad input.
#pragma once

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "gguf.h"

#define DG_API __attribute__((visibility("default")))
#define DG_MAX_LAYERS 512
#define DG_MAX_CANVAS 4096  // longer canvases cost minutes per step and gigabytes of activations
#define DG_MAX_CANDIDATES 64  // canvases denoised together in one decoder step (num_canvases)
#define DG_MAX_SC_TOP_K 4096  // self_cond_top_k: beyond this the dense product is as cheap (and exact)
#define DG_MAX_DEVICES 17   // the CPU + up to 16 accelerators (ggml's RPC backend allows 16 servers)

// Hyper-parameters as read from the GGUF (mirrored by ctypes in model.py: keep the field order).
typedef struct dg_hparams {
    int32_t n_vocab;
    int32_t n_embd;
    int32_t n_layer;
    int32_t n_head;
    int32_t n_ff;          // dense MLP width = self-conditioning MLP width
    int32_t n_ff_exp;      // per-expert width
    int32_t n_expert;
    int32_t n_expert_used;
    int32_t canvas_length;
    int32_t sliding_window;  // W, tokens including self
    int32_t n_ctx_train;
    int32_t head_dim_full;
    int32_t head_dim_swa;
    float rms_eps;
    float logit_softcap;
    float rope_base_full;
    float rope_base_swa;
    int32_t has_self_cond;
    int32_t has_output;      // untied LM head present
    int32_t split_experts;   // ffn_gate_exps + ffn_up_exps instead of the fused ffn_gate_up_exps
    int32_t has_enc_scale;   // encoder layer scalars present (else the decoder's are used)
    uint8_t is_sliding[DG_MAX_LAYERS];
    int32_t n_head_kv[DG_MAX_LAYERS];
} dg_hparams;

// LoRA targets of a layer (lora.c, docs/gguf.md#lora-adapters). Every adapter's delta of one target in one pass is
// folded into a single pair at load: ranks concatenated, each adapter's alpha/r·scale multiplied into its B columns.
enum dg_lora_target {
    DG_LORA_Q, DG_LORA_K, DG_LORA_V, DG_LORA_O, DG_LORA_GATE, DG_LORA_UP, DG_LORA_DOWN, DG_LORA_ROUTER,
    DG_LORA_GATE_UP_EXPS, DG_LORA_GATE_EXPS, DG_LORA_UP_EXPS, DG_LORA_DOWN_EXPS, DG_LORA_TARGETS
};
enum { DG_PASS_ENCODER, DG_PASS_DECODER, DG_PASSES };

// delta(W)·x = b·(a·x): a [n_in, R(, E)], b [R, n_out(, E)], both F32; NULL when no adapter touches the target
typedef struct dg_lora {
    struct ggml_tensor *a, *b;
} dg_lora;

typedef struct dg_layer {
    bool sliding;
    int n_head_kv;
    int head_dim;

    struct ggml_tensor *attn_norm, *wq, *q_norm, *wk, *k_norm, *wv, *wo, *post_attn_norm;
    struct ggml_tensor *ffn_norm, *ffn_gate, *ffn_up, *ffn_down, *post_ffw_norm_1;
    struct ggml_tensor *router, *router_scale, *pre_ffw_norm_2;
    struct ggml_tensor *gate_up_exps, *gate_exps, *up_exps, *down_exps, *expert_scale;
    struct ggml_tensor *post_ffw_norm_2, *post_ffw_norm;
    struct ggml_tensor *dec_scale, *enc_scale;  // layer scalars (decoder λ, encoder λ)
    dg_lora lora[DG_PASSES][DG_LORA_TARGETS];
} dg_layer;

// Where each layer's weights live (devices.c). Device 0 is the CPU; zero-initialised = everything on the CPU, which
// is the mmapped fast path. Unit n_layer is the output: final norm, LM head, logits buffers and self-conditioning.
typedef struct dg_placement {
    int n_devices;                           // 1 + accelerators in use
    ggml_backend_dev_t devices[DG_MAX_DEVICES];
    uint8_t unit_device[DG_MAX_LAYERS + 1];  // per layer, then the output
    uint8_t expert_device[DG_MAX_LAYERS];    // the routed experts' device (the CPU with num_cpu_moe)
    struct ggml_context *ctx[DG_MAX_DEVICES];  // device copies of the weights placed there
    ggml_backend_buffer_t buf[DG_MAX_DEVICES];
    size_t weight_bytes[DG_MAX_DEVICES];     // weights copied to each accelerator ([0] unused: the CPU maps the file)
    struct ggml_tensor *lm_head;             // device copy of a tied LM head (else NULL: output or tok_embd)
    bool standard_ops;                       // DGEMMA_STANDARD_OPS: the standard-op graph on the CPU too
} dg_placement;

typedef struct dg_model {
    dg_hparams hp;
    struct gguf_context *gguf;
    struct ggml_context *ctx_file;   // tensor metadata of the file (data points into the mapping)
    void *map;
    size_t map_size;
    ggml_backend_buffer_t buf_file;  // wraps the mapping, never owns it
    struct ggml_context *ctx_extra;  // tensors made at load time
    ggml_backend_buffer_t buf_extra;

    struct ggml_tensor *tok_embd, *embd_t, *output, *output_norm, *rope_freqs;
    struct ggml_tensor *sc_pre_norm, *sc_gate, *sc_up, *sc_down;
    dg_layer *layers;
    int64_t sc_chunk;   // F32 files only (else embd_t is NULL): embd_t is split along the vocabulary into sc_chunks slices of sc_chunk rows (see model.c)
    int64_t sc_chunks;
    float embd_scale;  // sqrt(H) in fp32 (the fixtures are fp32 transformers runs)
    int n_threads;
    char warnings[1024];
    dg_placement place;
    dg_lora sc_lora[DG_LORA_TARGETS];  // the self-conditioning MLP's deltas (decoder only): GATE, UP, DOWN
    struct ggml_context *ctx_lora;  // the adapters' folded factors (lora.c), on the CPU until placement copies them
    ggml_backend_buffer_t buf_lora;
    int n_adapters;
    int lora_graph_nodes;  // extra nodes the adapters add to one graph
} dg_model;

typedef struct dg_attn_span {
    int first;   // first cache slot the queries attend to
    int len;     // number of slots (context + new rows)
    int padding; // leading slots included only to round len up for ggml's GEMM; always masked out
    int tail;    // trailing (unused, zeroed) slots doing the same where no earlier slots exist; always masked out
    int canvases; // > 1: the new rows are that many candidate canvases, each attending to the context and its own
                  // rows; first/len/padding/tail then describe one canvas's layout [context | own rows | tail]
} dg_attn_span;

// A node the scheduler must run on a given placement device (custom ops are pinned to the CPU in any case).
typedef struct dg_pin {
    struct ggml_tensor *t;
    int device;
} dg_pin;
#define DG_STEP_PINS 40

// Where a step's self-conditioning input comes from: none (a canvas's first step), the previous step's raw logits
// (tempered by a softmax in the graph), or the tempered probabilities a sampling step left in the buffer.
enum { DG_SC_NONE, DG_SC_LOGITS, DG_SC_PROBS, DG_SC_MODES };

// Graph inputs and output of one decoder step variant.
typedef struct dg_step_graph {
    struct ggml_context *ctx;
    struct ggml_cgraph *gf;
    struct ggml_tensor *ids, *pos, *sc_softmax;
    struct ggml_tensor *mask[2];      // [full, sliding] layers' padding masks, NULL when that kind has no padding
    struct ggml_tensor *mask_row[2];  // their one row (every row hides the same slots), the input
    dg_attn_span span[2];
    // a sampling step (dg_step_reduced): the uniforms in, the softmax whose scale is 1/T, the reductions out
    struct ggml_tensor *uniforms, *sample_softmax, *argmax, *p_max, *shifted_sum, *block, *above;
    dg_pin pins[DG_STEP_PINS];
    int n_pins;
} dg_step_graph;

typedef struct dg_context {
    dg_model *model;
    int n_ctx;
    int n_past;
    int max_canvases;  // candidate canvases one decoder step may hold: their rows follow n_past as scratch
    int image_rows;    // the longest image block one encoder pass must take whole (0: text only)
    int n_slots;       // slots of a full layer's cache: n_ctx + (max_canvases - 1) canvases of scratch
    ggml_backend_t backends[DG_MAX_DEVICES];  // per placement device; [0] = the CPU
    ggml_backend_sched_t sched;                // runs every graph: accelerators first, the CPU last

    struct ggml_context *ctx_state[DG_MAX_DEVICES];
    ggml_backend_buffer_t buf_state[DG_MAX_DEVICES];  // each layer's cache on its device, logits on the output's
    struct ggml_tensor **k_cache;  // per layer: [head_dim, n_head_kv, slots]
    struct ggml_tensor **v_cache;  // per layer, transposed: [slots, head_dim, n_head_kv]
    int swa_cap;                   // slots of a sliding layer's cache (full layers: n_ctx)
    int swa_base;                  // position held by slot 0 of the sliding caches (full layers: 0)
    struct ggml_tensor *logits[2]; // ping-pong [n_vocab, max_canvases * canvas_length]
    float *logits_host[2];         // host copies when the logits live on an accelerator (else NULL)
    int last;                      // buffer holding the previous step's raw logits, -1 if none
    int last_rows;

    bool holds_probs[2];           // that buffer holds a sampling step's tempered probabilities, not raw logits
    int sc_top_k;                  // self-conditioning from each row's k most probable tokens (0: all, exact)

    // decoder graphs of the current geometry, [self-conditioning input][output buffer][sampling step]
    dg_step_graph steps[DG_SC_MODES][2][2];
    bool steps_tails_clear;  // the trailing padding slots of this geometry's spans are zeroed
    int steps_n_past;
    int steps_swa_base;
    int steps_n_rows;
    int steps_n_canvases;
    double *profile;  // while a profiled step runs: seconds per class (dg_profile_class; the eval callback adds to it)
    double profile_t0;

    // Bytes copied between the host and the devices by decoder steps (and keep_canvases), summed since the context
    // was made: the engine's own reads and writes of tensors outside host memory (dg_tensor_get/set), and the
    // scheduler's copies of split inputs (dg_count_split_copies; device to device counts as to_device).
    char step_report[2048];  // where the last decoder step ran (dg_graph_report)
    bool counting;  // inside a step: dg_tensor_get/set count
    uint64_t xfer_to_device, xfer_from_device;
    int64_t xfer_steps;
} dg_context;

// Where a profiled step's time goes (dg_context_step_profiled; bench/real_shapes.py names them in this order).
typedef enum {
    DG_PROFILE_EXPERTS,    // expert products and their activation quantization
    DG_PROFILE_DENSE,      // the layers' dense weight products (attention projections, dense MLP, router)
    DG_PROFILE_ATTENTION,  // q·k, softmax, p·v
    DG_PROFILE_LM_HEAD,    // the output product and the softcap
    DG_PROFILE_SELF_COND,  // softmax over the vocabulary, the soft embedding, the self-conditioning MLP
    DG_PROFILE_OTHER,      // norms, RoPE, routing, copies, ...
    DG_PROFILE_COUNT
} dg_profile_class;

// Internal interfaces, by file, bottom up (cpu.h and qkernels.h have their own headers). api.c holds every exported
// function and calls into the others; no file calls back into one that calls it (tests/test_c_layout.py).

// error.c: the one way errors are reported (into the caller's buffer, truncated)
void dg_set_err(char *err, size_t err_len, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

// gguf_check.c: validate the raw bytes of a GGUF before ggml parses it.
bool dg_gguf_check(const uint8_t *data, size_t size, char *err, size_t err_len);
// map, check and parse a GGUF file (what the model and the projector loaders share); see gguf_check.c
bool dg_gguf_map(const char *path, void **map, size_t *map_size, struct gguf_context **gguf,
                 struct ggml_context **ctx_file, char *err, size_t err_len);
void dg_gguf_unmap(void *map, size_t map_size, struct gguf_context *gguf, struct ggml_context *ctx_file);

// model.c
// check_only: parse and bind every tensor as a load does, but allocate nothing (what `create` runs on a file).
dg_model *dg_model_load_impl(const char *path, int n_threads, bool check_only, char *err, size_t err_len);
// the vocabulary-contiguous copy of the embedding for self-conditioning through ggml's matmul (see model.c)
bool dg_make_transposed_embedding(dg_model *m, char *err, size_t err_len);
// frees what the loader made; the adapters (dg_lora_free) and the placement (dg_placement_free) are freed first
void dg_model_free_impl(dg_model *m);

// lora.c: GGUF LoRA adapters (docs/gguf.md#lora-adapters), loaded before placement.
// 0 on success; else 1 + the index of the adapter at fault (n + 1 when none is), err set.
int dg_lora_load(dg_model *m, const char *const *paths, const float *scales, int n, char *err, size_t err_len);
// every check loading the adapter at `path` onto m makes, allocating nothing
bool dg_lora_check(dg_model *m, const char *path, char *err, size_t err_len);
void dg_lora_free(dg_model *m);

// devices.c: ggml's device registry, RPC servers, per-layer weight placement
// loads the registry with stderr captured into out (what backends print as they load); returns the device count
int dg_registry_load(char *out, size_t out_len);
bool dg_rpc_has_backend(void);
bool dg_rpc_add(const char *endpoint, char *err, size_t err_len);
// serves this process's CPU; returns only when the server cannot start (err set)
void dg_rpc_serve(const char *endpoint, int n_threads, char *err, size_t err_len);
// one "name\tdescription\ttype\tfree\ttotal" line per device in ggml's registry; returns the device count
int dg_devices_list(char *out, size_t out_len);
bool dg_model_place(dg_model *m, int num_gpu, int num_cpu_moe, char *err, size_t err_len);
void dg_placement_free(dg_placement *p);
// the fast CPU-only custom ops (fused GELU, tiled experts) may be used for this unit's nodes / its experts
bool dg_unit_fast(const dg_model *m, int unit);
bool dg_experts_fast(const dg_model *m, int il);
struct ggml_tensor *dg_lm_head(const dg_model *m);

// f32_matmul.c: ggml_mul_mat(w, x) for a 2-D F32 weight and F32 x [K, T] as a panel-packed custom op (AVX2 + FMA or
// AVX-512, the best dg_cpu_isa() allows); NULL where it does not apply (then ggml's own matmul)
struct ggml_tensor *dg_build_f32_matmul(struct ggml_context *ctx, struct ggml_tensor *w, struct ggml_tensor *x);
// the same at a given dg_isa level (AVX-VNNI: the AVX2 path); NULL also when dg_cpu_isa() is below that level
struct ggml_tensor *dg_build_f32_matmul_isa(struct ggml_context *ctx, struct ggml_tensor *w, struct ggml_tensor *x,
                                            int isa);

// soft_embedding.c: P [V, n] · E for an embedding E [H, V] of any dequantizable type, in E's stored layout:
// [H, n]. `slices` vocabulary ranges are summed separately (one per thread); isa a dg_isa level (cpu.h): none
// portable, AVX2 (AVX-VNNI: the same) or AVX-512, capped at dg_soft_embedding_isa(), the best this CPU runs.
struct ggml_tensor *dg_build_soft_embedding(struct ggml_context *ctx, struct ggml_tensor *embd, struct ggml_tensor *p,
                                            int slices, int isa);
int dg_soft_embedding_isa(void);
// the same from each token's k most probable rows, renormalised (self_cond_top_k; 1 ≤ k < V, k ≤ DG_MAX_SC_TOP_K): [H, n]
struct ggml_tensor *dg_build_soft_embedding_topk(struct ggml_context *ctx, struct ggml_tensor *embd,
                                                 struct ggml_tensor *p, int k);
// its row dequantizer for `type` (NULL for F32: a copy); bit-identical to ggml's to_float
ggml_to_float_t dg_row_dequantizer(enum ggml_type type, bool avx2);

// expert_matmul.c: ggml_mul_mat_id, with a register-tiled custom op for F32 weights on x86 (AVX2 / AVX-512)
struct ggml_tensor *dg_build_expert_matmul(struct ggml_context *ctx, struct ggml_tensor *w, struct ggml_tensor *x,
                                           struct ggml_tensor *ids);
// the same with a given instruction set (0 none = ggml's op, 1 AVX2, 2 AVX-512), and the best this CPU has
struct ggml_tensor *dg_build_expert_matmul_isa(struct ggml_context *ctx, struct ggml_tensor *w, struct ggml_tensor *x,
                                               struct ggml_tensor *ids, int isa);
int dg_expert_matmul_isa(void);

// ops.c: ggml_mul_mat(w, x) of a weight; fast (its node runs on the CPU): through the engine's quantized kernels
// (qkernels.c) where they cover the weight's type, F32 weights through f32_matmul.c
struct ggml_tensor *dg_build_weight_matmul(struct ggml_context *ctx, struct ggml_tensor *w, struct ggml_tensor *x,
                                           bool fast);
// gelu_tanh(gate)·up; fast: one CPU pass (custom op), else the same f32 arithmetic from standard ops (any backend)
struct ggml_tensor *dg_build_gelu_mul(struct ggml_context *ctx, struct ggml_tensor *gate, struct ggml_tensor *up,
                                      bool fast);
// softcap(x) as a new tensor; fast: one CPU pass (custom op), else ggml's ops
struct ggml_tensor *dg_build_softcap(struct ggml_context *ctx, struct ggml_tensor *x, float cap, bool fast);
// writes softcap(x) into dst; fast with dst in host memory: one CPU pass, else ggml's ops and a copy
struct ggml_tensor *dg_build_softcap_into(struct ggml_context *ctx, struct ggml_tensor *x, float cap,
                                          struct ggml_tensor *dst, bool fast);

// graph.c
// the scaled token embeddings of ids
struct ggml_tensor *dg_build_embed(struct ggml_context *ctx, const dg_model *m, struct ggml_tensor *ids);
struct ggml_tensor *dg_build_layer(struct ggml_context *ctx, struct ggml_cgraph *gf, const dg_model *m,
                                   const dg_context *c, int il, struct ggml_tensor *x, struct ggml_tensor *pos,
                                   struct ggml_tensor *mask, int slot0, dg_attn_span span, bool encoder,
                                   bool kv_only);
struct ggml_tensor *dg_build_rmsw(struct ggml_context *ctx, const dg_model *m, struct ggml_tensor *x,
                                  struct ggml_tensor *w);
// the self-conditioning MLP on x [H, n] with its adapters' deltas; on the CPU with the fused GELU custom op, else
// the same arithmetic from standard ops (any backend)
struct ggml_tensor *dg_build_self_cond_mlp(struct ggml_context *ctx, const dg_model *m, struct ggml_tensor *x);

// transfers.c: ggml_backend_tensor_set/get, counted in the context's transfer totals while c->counting when t's
// memory is not the host's; and after dg_place_graph, the bytes of the split inputs the scheduler copies when gf runs
void dg_tensor_set(dg_context *c, struct ggml_tensor *t, const void *data, size_t offset, size_t size);
void dg_tensor_get(dg_context *c, const struct ggml_tensor *t, void *data, size_t offset, size_t size);
void dg_count_split_copies(dg_context *c, struct ggml_cgraph *gf);

// kv_cache.c: the K/V ring
int dg_encode_chunk_rows(const dg_model *m);  // rows per encoder pass
// slots of a sliding layer's cache: the visible tail plus one pass of max(canvases, chunk, image_rows) new rows
int dg_kv_sliding_slots(const dg_model *m, int max_canvases, int image_rows, int n_slots);
int dg_kv_pass_rows(const dg_context *c);  // the most new rows one encoder pass may hold (the sliding caches' room)
int dg_kv_slot(const dg_context *c, int il, int pos);  // the cache slot of position pos in layer il
// room in the sliding caches for n rows after n_past (moves the still-visible tail to the front: swa_base changes)
bool dg_kv_make_room(dg_context *c, int n, char *err, size_t err_len);
// the slots that n_new rows after n_past attend to in layer il, padded for ggml's GEMM
dg_attn_span dg_kv_span(const dg_context *c, int il, int n_past, int n_new);
void dg_kv_clear_tail(dg_context *c, int n_past, int n_new);  // zero the trailing padding slots of those spans

// context.c: a context's lifecycle, placing and running its graphs, profiling
// image_rows: the longest image block the context must encode in one pass (0 for text only)
dg_context *dg_context_create(dg_model *m, int n_ctx, int n_threads, int max_canvases, int image_rows, char *err,
                              size_t err_len);
void dg_context_destroy(dg_context *c);
void dg_context_clear(dg_context *c);  // forget every cached token and logits
size_t dg_graph_nodes(const dg_model *m);
struct ggml_context *dg_new_graph_ctx(const dg_model *m);
// pins: nodes to run on given devices (NULL, 0: none beyond the custom ops, always on the CPU)
bool dg_place_graph(dg_context *c, struct ggml_context *gctx, struct ggml_cgraph *gf, const dg_pin *pins, int n_pins,
                    char *err, size_t err_len);
// profile: NULL, or DG_PROFILE_COUNT seconds to add each node's time to (node by node, slower)
bool dg_compute(dg_context *c, struct ggml_cgraph *gf, double *profile, char *err, size_t err_len);
bool dg_ids_ok(const dg_model *m, const int32_t *ids, int n, char *err, size_t err_len);
void dg_free_step_graphs(dg_context *c);
// Where gf, placed by the scheduler, runs: "splits\tN" then one "op\treason\tcount" line per kind of computing node
// the scheduler gave the CPU while accelerators are in use.
void dg_graph_report(const dg_context *c, struct ggml_cgraph *gf, char *out, size_t out_len);


// Image rows of an encoder pass: n_spans (first row, rows) pairs over the ids, ascending and disjoint, and their
// embeddings (float32 [Σ rows, n_embd], span after span), which replace those rows' scaled token embeddings; each
// span is one bidirectional block of the encoder mask.
typedef struct dg_image_rows {
    const int32_t *spans;
    int n_spans;
    const float *embd;
} dg_image_rows;

// encoder.c: encode n tokens after the cached ones (0, or -1 with err set); images NULL: text only
int dg_encode(dg_context *c, const int32_t *ids, int n, const dg_image_rows *images, char *err, size_t err_len);

// decoder.c: the decoder step and the logits buffers it reads and writes
float *dg_step(dg_context *c, const int32_t *ids, int n, int n_canvases, int use_self_cond, float inv_temp,
               double *profile, char *err, size_t err_len);
// A sampling step: the step's softcapped logits stay on the output's device as tempered probabilities (softmax at
// inv_temp, the next step's self-conditioning input); per row only the argmax, the entropy (nats) and the inverse-CDF
// draw at uniforms[i] come back. 0, or -1 with err set.
int dg_step_reduced(dg_context *c, const int32_t *ids, int n, int n_canvases, int use_self_cond, float sc_inv_temp,
                    float inv_temp, const float *uniforms, int32_t *argmax, float *entropy, int32_t *draw,
                    char *err, size_t err_len);
int dg_keep_canvases(dg_context *c, const uint8_t *keep, int n_canvases, char *err, size_t err_len);
int dg_set_self_cond(dg_context *c, const float *data, int rows, char *err, size_t err_len);
int dg_set_self_cond_top_k(dg_context *c, int k, char *err, size_t err_len);
float *dg_last_logits(const dg_context *c);
// out [n, H] = probs [n, V] · E through the step's soft-embedding graph (no embedding scale)
int dg_run_soft_embedding(dg_context *c, const float *probs, int n, float *out, char *err, size_t err_len);

// ---------------------------------------------------------------------------------------------------------------
// vision.c: Gemma 4's vision tower + embed_vision from a projector GGUF (llama.cpp's mtmd "gemma4v" layout,
// docs/engine.md#vision-encoder), on its own CPU backend; independent of the text model.

enum { DG_V_LINEARS = 7 };  // the clippable linears of a layer: q, k, v, out, gate, up, down

// Hyper-parameters as read from the projector (mirrored by ctypes in vision.py: keep the field order).
typedef struct dg_vision_hparams {
    int32_t n_embd;
    int32_t n_ff;
    int32_t n_layer;
    int32_t n_head;
    int32_t n_head_kv;
    int32_t head_dim;
    int32_t patch_size;
    int32_t pooling;          // k: each soft token is the mean of a k×k block of patches
    int32_t n_pos_table;      // rows of each (x and y) position table
    int32_t n_embd_text;      // the projection's output width (the text model's hidden size)
    int32_t max_soft_tokens;  // the image budget: at most max_soft_tokens·k² patches per image
    float eps;
    float rope_base;
    int32_t has_standardize;
    int32_t has_clip;         // some linear has clip bounds (Gemma4ClippableLinear)
} dg_vision_hparams;

typedef struct dg_vision_layer {
    struct ggml_tensor *ln1, *q_norm, *k_norm, *attn_post_norm, *ln2, *ffn_post_norm;
    struct ggml_tensor *w[DG_V_LINEARS];  // q, k, v, out, gate, up, down
    float bounds[DG_V_LINEARS][4];        // input min, max, output min, max (±INFINITY: unbounded)
} dg_vision_layer;

typedef struct dg_vision_model {
    dg_vision_hparams hp;
    struct gguf_context *gguf;
    struct ggml_context *ctx_file;
    void *map;
    size_t map_size;
    ggml_backend_buffer_t buf_file;  // wraps the mapping
    struct ggml_tensor *patch_embd, *pos_embd, *std_bias, *std_scale, *input_proj;
    dg_vision_layer *layers;
    ggml_backend_t backend;          // the CPU
    int n_threads;
} dg_vision_model;

dg_vision_model *dg_vision_load_impl(const char *path, int n_threads, char *err, size_t err_len);
void dg_vision_free_impl(dg_vision_model *m);
// patches [n, 3·p·p] in the HF processor's order (row, column, channel; values in [0, 1]), positions [n, 2] (x, y);
// writes [n / k², n_embd_text] floats to out (room for out_rows rows). Returns the soft-token count, or -1 with err.
int dg_vision_encode(dg_vision_model *m, const float *patches, const int32_t *positions, int n_patches, float *out,
                     int out_rows, char *err, size_t err_len);
