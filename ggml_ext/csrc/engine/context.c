// A generation context: K/V cache, encoder passes (prefill and commit), decoder steps with self-conditioning.
//
// Cache: one F32 K and one transposed F32 V tensor per layer. Full layers: slot = position, n_ctx slots. Sliding
// layers only ever read the last W−1 context positions (exactly what transformers' DynamicCache retains), so their
// cache holds W−1 + alignment + one chunk of rows; when it is full, the still-visible tail moves to the front
// (swa_base = position of slot 0). The decoder writes its canvas K/V into the free slots after n_past as scratch
// (never committed: n_past is unchanged). A step may hold several candidate canvases (num_canvases): their rows follow
// one another in the scratch slots, all at the positions n_past.., and each attends to the cached context and its own
// rows only, gathered into the layout one canvas alone would see, so every candidate is computed as it would be alone.
//
// Decoder graphs are built once per (n_past, canvas rows) in four variants [self-conditioning][output buffer]: the
// step writes its softcapped logits into one of two persistent buffers and, with self-conditioning, reads the
// previous step's logits from the other, so they never leave engine memory.
#define _POSIX_C_SOURCE 200809L  // clock_gettime, sysconf under -std=c11
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "engine.h"

enum { MIN_ENCODE_CHUNK = 32 };

static size_t graph_nodes(const dg_model *m) {
    return 1024 + (size_t)m->hp.n_layer * (128 + 4 * (size_t)m->hp.n_expert_used) + (size_t)m->lora_graph_nodes;
}

static struct ggml_context *new_graph_ctx(const dg_model *m) {
    const size_t n = graph_nodes(m);
    struct ggml_init_params ip = {ggml_tensor_overhead() * n * 2 + ggml_graph_overhead_custom(n, false), NULL, true};
    return ggml_init(ip);
}

// Place a graph with the scheduler: every node on a device, split inputs copied, compute buffers allocated. A graph
// may have been placed before in buffers that have since been re-planned for another graph, so its compute tensors
// are detached first and placed again. Custom ops (fused GELU, tiled experts) are CPU code: pinned to the CPU.
static bool place_graph(dg_context *c, struct ggml_context *gctx, struct ggml_cgraph *gf, char *err, size_t err_len) {
    for (struct ggml_tensor *t = ggml_get_first_tensor(gctx); t; t = ggml_get_next_tensor(gctx, t)) {
        t->data = NULL;
        t->buffer = NULL;
    }
    ggml_backend_sched_reset(c->sched);
    for (int i = 0; i < ggml_graph_n_nodes(gf); i++) {
        struct ggml_tensor *node = ggml_graph_node(gf, i);
        if (node->op == GGML_OP_CUSTOM) ggml_backend_sched_set_tensor_backend(c->sched, node, c->backends[0]);
    }
    if (!ggml_backend_sched_alloc_graph(c->sched, gf)) {
        dg_set_err(err, err_len, "cannot allocate the compute graph (out of memory)");
        return false;
    }
    return true;
}

// Attention with scale 1.0 and sharp softmaxes produce many subnormal probabilities; x86 handles those in microcode,
// up to 100x slower (one full-attention P·V took a second instead of 15 ms). Flush them to zero while the graph runs:
// they are below 1.2e-38, far under any tolerance. ggml's worker threads are created inside the compute call and
// inherit this floating-point mode; the caller's mode is restored afterwards.
#if defined(__SSE__) || defined(__x86_64__)
#include <xmmintrin.h>
#define FLUSH_SUBNORMALS 0x8040u  // MXCSR flush-to-zero | denormals-are-zero
static unsigned int enter_fast_fp(void) {
    const unsigned int saved = _mm_getcsr();
    _mm_setcsr(saved | FLUSH_SUBNORMALS);
    return saved;
}
static void leave_fast_fp(unsigned int saved) { _mm_setcsr(saved); }
#else
static unsigned int enter_fast_fp(void) { return 0; }
static void leave_fast_fp(unsigned int saved) { (void)saved; }
#endif

static bool compute(dg_context *c, struct ggml_cgraph *gf, char *err, size_t err_len) {
    const unsigned int fp_mode = enter_fast_fp();
    const enum ggml_status status = ggml_backend_sched_graph_compute(c->sched, gf);
    leave_fast_fp(fp_mode);
    if (status != GGML_STATUS_SUCCESS) {
        dg_set_err(err, err_len, "ggml graph computation failed");
        return false;
    }
    return true;
}

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static bool is_weight(const struct ggml_tensor *t) {
    return t->buffer && ggml_backend_buffer_get_usage(t->buffer) == GGML_BACKEND_BUFFER_USAGE_WEIGHTS;
}

// The class of a node by the weight it reads (activation quantization nodes carry their weight's name).
static dg_profile_class profile_class(const struct ggml_tensor *node, int64_t n_vocab) {
    const char *w = NULL;
    for (int i = 0; i < GGML_MAX_SRC && node->src[i] && !w; i++)
        if (is_weight(node->src[i]) && ggml_nelements(node->src[i]) > node->src[i]->ne[0]) w = node->src[i]->name;
    const bool quantizes = !w && strstr(node->name, ".weight");  // only the output product quantizes for token_embd
    if (quantizes) w = node->name;
    if (w && node->op != GGML_OP_GET_ROWS) {
        if (strstr(w, "_exps")) return DG_PROFILE_EXPERTS;
        if (strstr(w, "self_cond")) return DG_PROFILE_SELF_COND;
        if (!strncmp(w, "token_embd", 10) || !strncmp(w, "output.", 7))
            return quantizes || node->ne[0] == n_vocab ? DG_PROFILE_LM_HEAD : DG_PROFILE_SELF_COND;  // soft embedding
        if (!strncmp(w, "blk.", 4)) return DG_PROFILE_DENSE;
    }
    if (node->ne[0] == n_vocab) return node->op == GGML_OP_SOFT_MAX ? DG_PROFILE_SELF_COND : DG_PROFILE_LM_HEAD;
    if (node->op == GGML_OP_MUL_MAT || node->op == GGML_OP_SOFT_MAX) return DG_PROFILE_ATTENTION;
    return DG_PROFILE_OTHER;
}

// The scheduler computes a node on its own when this callback asks to observe it (ask), then hands it over: the time
// in between is the node's wall time (with its split's input copies, on the first node of a split).
static bool profile_node(struct ggml_tensor *node, bool ask, void *user) {
    dg_context *c = user;
    if (ask) {
        c->profile_t0 = now_s();
        return true;
    }
    const double dt = now_s() - c->profile_t0;
    const dg_profile_class cls = profile_class(node, c->model->hp.n_vocab);
    c->profile[cls] += dt;
    if (getenv("DGEMMA_PROFILE_NODES")) {  // one line per node, for bench notes
        const struct ggml_tensor *a = node->src[0] ? node->src[0] : node;
        fprintf(stderr, "class %d %s %s: %s [%lld,%lld,%lld] -> [%lld,%lld,%lld] %.6f s\n", (int)cls,
                ggml_op_desc(node), node->name, ggml_type_name(a->type), (long long)a->ne[0], (long long)a->ne[1],
                (long long)a->ne[2], (long long)node->ne[0], (long long)node->ne[1], (long long)node->ne[2], dt);
    }
    return true;
}

// Profiling variant (bench/real_shapes.py): the graph node by node, adding each node's wall time to its class.
static bool compute_profiled(dg_context *c, struct ggml_cgraph *gf, double *seconds, char *err, size_t err_len) {
    c->profile = seconds;
    ggml_backend_sched_set_eval_callback(c->sched, profile_node, c);
    const bool ok = compute(c, gf, err, err_len);
    ggml_backend_sched_set_eval_callback(c->sched, NULL, NULL);
    c->profile = NULL;
    return ok;
}

// ggml's fast F32 GEMM (llamafile sgemm) needs the contraction length to be a multiple of 16; in P·V that is the
// number of keys (else ggml falls back to one dot product per output, ~10x slower). Spans are rounded up with earlier
// (valid, cached) slots where a sliding layer has them, else with unused slots after the new rows; the mask hides both.
enum { KEY_MULTIPLE = 16 };

// Rows per encoder pass = the most rows a sliding cache must take after its retained tail (a canvas fits too).
static int encode_chunk_rows(const dg_model *m) {
    return m->hp.canvas_length > MIN_ENCODE_CHUNK ? m->hp.canvas_length : MIN_ENCODE_CHUNK;
}

// Cache slot of position `pos` in layer il.
static int slot_of(const dg_context *c, int il, int pos) {
    return c->model->layers[il].sliding ? pos - c->swa_base : pos;
}

// Make room in the sliding caches for rows at positions [n_past, n_past + n): keep the last W−1 context positions
// (+ up to KEY_MULTIPLE−1 for padding) and move them to the front. Graph views point at slots: drop the graphs.
static void free_step_graphs(dg_context *c);

// A cache tensor's bytes on the host: its own memory on the CPU, else a copy (device caches; write_back after).
static void *host_bytes(struct ggml_tensor *t) {
    if (ggml_backend_buffer_is_host(t->buffer)) return t->data;
    void *copy = malloc(ggml_nbytes(t));
    if (copy) ggml_backend_tensor_get(t, copy, 0, ggml_nbytes(t));
    return copy;
}

static void write_back(struct ggml_tensor *t, void *bytes) {
    if (bytes == t->data) return;
    ggml_backend_tensor_set(t, bytes, 0, ggml_nbytes(t));
    free(bytes);
}

static bool make_sliding_room(dg_context *c, int n, char *err, size_t err_len) {
    const dg_model *m = c->model;
    if (c->n_past + n - c->swa_base <= c->swa_cap) return true;
    const int visible = m->hp.sliding_window - 1 + KEY_MULTIPLE - 1;
    const int keep = c->n_past < visible ? c->n_past : visible;
    const int shift = c->n_past - keep - c->swa_base;
    for (int il = 0; il < m->hp.n_layer; il++) {
        if (!m->layers[il].sliding) continue;
        struct ggml_tensor *kc = c->k_cache[il], *vc = c->v_cache[il];
        char *k = host_bytes(kc);
        float *v = host_bytes(vc);
        if (!k || !v) {
            if (k != kc->data) free(k);
            if (v != vc->data) free(v);
            dg_set_err(err, err_len, "out of memory");
            return false;
        }
        memmove(k, k + (size_t)shift * kc->nb[2], (size_t)keep * kc->nb[2]);
        for (int64_t r = 0; r < vc->ne[1] * vc->ne[2]; r++) {  // V is transposed: every (dim, head) row holds slots
            float *row = v + r * vc->ne[0];
            memmove(row, row + shift, sizeof(float) * (size_t)keep);
        }
        write_back(kc, k);
        write_back(vc, v);
    }
    c->swa_base += shift;
    free_step_graphs(c);
    return true;
}

static dg_attn_span span_for(const dg_context *c, int il, int n_past, int n_new) {
    const dg_model *m = c->model;
    const bool sliding = m->layers[il].sliding;
    dg_attn_span s = {0, n_past + n_new, 0, 0};
    if (sliding) {
        const int keep = m->hp.sliding_window - 1;  // context positions a sliding layer sees
        const int first_pos = n_past > keep ? n_past - keep : 0;
        s.first = first_pos - c->swa_base;
        s.len = n_past + n_new - first_pos;
    }
    const int pad = (KEY_MULTIPLE - s.len % KEY_MULTIPLE) % KEY_MULTIPLE;
    if (pad == 0) return s;
    if (sliding && s.first >= pad) {  // earlier cached slots, hidden by the mask
        s.first -= pad;
        s.len += pad;
        s.padding = pad;
    } else if (s.first + s.len + pad <= (sliding ? c->swa_cap : c->n_slots)) {  // unused slots after the new rows
        s.len += pad;
        s.tail = pad;
    }
    return s;
}

// Trailing padding slots hold no K/V yet: zero them, since a masked score is added to whatever K gives there and a
// zero probability times a NaN in V would still be NaN. A few slots per layer, before a graph that reads them runs.
static void clear_tail_slots(dg_context *c, int n_past, int n_new) {
    for (int il = 0; il < c->model->hp.n_layer; il++) {
        const dg_attn_span s = span_for(c, il, n_past, n_new);
        if (s.tail == 0) continue;
        struct ggml_tensor *kc = c->k_cache[il], *vc = c->v_cache[il];
        const int from = s.first + s.len - s.tail;
        ggml_backend_tensor_memset(kc, 0, (size_t)from * kc->nb[2], (size_t)s.tail * kc->nb[2]);
        for (int64_t r = 0; r < vc->ne[1] * vc->ne[2]; r++) {  // V is transposed: every (dim, head) row holds slots
            ggml_backend_tensor_memset(vc, 0, sizeof(float) * (size_t)(r * vc->ne[0] + from), sizeof(float) * (size_t)s.tail);
        }
    }
}

static struct ggml_tensor *embed(struct ggml_context *ctx, const dg_model *m, struct ggml_tensor *ids) {
    return ggml_scale(ctx, ggml_get_rows(ctx, m->tok_embd, ids), m->embd_scale);
}

static bool ids_ok(const dg_model *m, const int32_t *ids, int n, char *err, size_t err_len) {
    for (int i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= m->hp.n_vocab) {
            dg_set_err(err, err_len, "token id %d at index %d is outside the vocabulary [0, %d)", ids[i], i,
                       m->hp.n_vocab);
            return false;
        }
    }
    return true;
}

static void fill_positions(int32_t *pos, int first, int n) {
    for (int i = 0; i < n; i++) pos[i] = first + i;
}

// ---------------------------------------------------------------------------------------------------------------
// encoder

// Causal mask for n rows at positions n_past.. over the slots of `span`; sliding layers also hide keys ≤ p − W
// (which covers leading padding slots: they precede n_past − (W − 1)); trailing padding slots lie after every row.
static void fill_encoder_mask(float *mask, dg_attn_span span, int base, int n_past, int n, int window, bool sliding) {
    for (int t = 0; t < n; t++) {
        const int p = n_past + t;
        for (int j = 0; j < span.len; j++) {
            const int s = base + span.first + j;  // position held by the slot
            const bool visible = s <= p && (!sliding || s > p - window);
            mask[(size_t)t * span.len + j] = visible ? 0.0f : -INFINITY;
        }
    }
}

static bool encode_chunk(dg_context *c, const int32_t *ids, int n, char *err, size_t err_len) {
    const dg_model *m = c->model;
    struct ggml_context *gctx = new_graph_ctx(m);
    if (!gctx) {
        dg_set_err(err, err_len, "out of memory");
        return false;
    }
    struct ggml_cgraph *gf = ggml_new_graph_custom(gctx, graph_nodes(m), false);
    struct ggml_tensor *ids_t = ggml_new_tensor_1d(gctx, GGML_TYPE_I32, n);
    struct ggml_tensor *pos_t = ggml_new_tensor_1d(gctx, GGML_TYPE_I32, n);
    ggml_set_input(ids_t);
    ggml_set_input(pos_t);

    // masks only for layer kinds whose attention runs (the last layer stores K/V only)
    int sliding_layer = -1, full_layer = -1;
    for (int il = 0; il < m->hp.n_layer - 1; il++) {
        if (m->layers[il].sliding && sliding_layer < 0) sliding_layer = il;
        if (!m->layers[il].sliding && full_layer < 0) full_layer = il;
    }
    struct ggml_tensor *mask[2] = {NULL, NULL};  // [full, sliding]
    dg_attn_span spans[2] = {{0, 0, 0, 0}, {0, 0, 0, 0}};
    for (int kind = 0; kind < 2; kind++) {
        int il = kind ? sliding_layer : full_layer;
        if (il < 0) continue;
        spans[kind] = span_for(c, il, c->n_past, n);
        mask[kind] = ggml_new_tensor_2d(gctx, GGML_TYPE_F32, spans[kind].len, n);
        ggml_set_input(mask[kind]);
    }
    for (int il = 0; il < m->hp.n_layer; il++) spans[m->layers[il].sliding] = span_for(c, il, c->n_past, n);

    struct ggml_tensor *x = embed(gctx, m, ids_t);
    for (int il = 0; il < m->hp.n_layer; il++) {
        const int kind = m->layers[il].sliding;
        const bool last = il == m->hp.n_layer - 1;  // its output feeds nothing: store K/V only
        x = dg_build_layer(gctx, gf, m, c, il, x, pos_t, mask[kind], slot_of(c, il, c->n_past), spans[kind], true,
                           last);
    }

    bool ok = place_graph(c, gctx, gf, err, err_len);
    if (ok) {
        int32_t *pos = malloc(sizeof(int32_t) * (size_t)n);
        ok = pos != NULL;
        if (ok) {
            fill_positions(pos, c->n_past, n);
            ggml_backend_tensor_set(ids_t, ids, 0, ggml_nbytes(ids_t));
            ggml_backend_tensor_set(pos_t, pos, 0, ggml_nbytes(pos_t));
            free(pos);
            for (int kind = 0; ok && kind < 2; kind++) {
                if (!mask[kind]) continue;
                float *host = malloc(ggml_nbytes(mask[kind]));
                ok = host != NULL;
                if (!ok) break;
                fill_encoder_mask(host, spans[kind], kind == 1 ? c->swa_base : 0, c->n_past, n, m->hp.sliding_window,
                                  kind == 1);
                ggml_backend_tensor_set(mask[kind], host, 0, ggml_nbytes(mask[kind]));
                free(host);
            }
            if (ok) {
                clear_tail_slots(c, c->n_past, n);
                ok = compute(c, gf, err, err_len);
            } else {
                dg_set_err(err, err_len, "out of memory");
            }
        } else {
            dg_set_err(err, err_len, "out of memory");
        }
    }
    ggml_free(gctx);
    if (ok) c->n_past += n;
    return ok;
}

// ---------------------------------------------------------------------------------------------------------------
// decoder

static void free_step_graphs(dg_context *c) {
    for (int s = 0; s < 2; s++) {
        for (int o = 0; o < 2; o++) {
            dg_step_graph *g = &c->steps[s][o];
            if (g->ctx) ggml_free(g->ctx);
            memset(g, 0, sizeof(*g));
        }
    }
    c->steps_n_past = -1;
    c->steps_n_rows = -1;
    c->steps_n_canvases = -1;
}

// P·E for probabilities p [V, n]: [H, n]. F32 files: slice by slice of the transposed copy (see
// dg_make_transposed_embedding); one slice on the CPU is the F32 weight product (f32_matmul.c) over the V valid rows,
// which needs no padding. Otherwise the soft-embedding op on the stored embedding, one slice per thread.
static struct ggml_tensor *soft_embedding(struct ggml_context *ctx, const dg_model *m, struct ggml_tensor *p) {
    if (!m->embd_t) return dg_build_soft_embedding(ctx, m->tok_embd, p, m->n_threads, dg_soft_embedding_isa());
    const int64_t V = m->hp.n_vocab, H = m->hp.n_embd, n = p->ne[1], KC = m->sc_chunk, NCH = m->sc_chunks;
    if (NCH == 1 && dg_unit_fast(m, m->hp.n_layer)) {
        struct ggml_tensor *e = ggml_view_2d(ctx, m->embd_t, V, H, m->embd_t->nb[1], 0);
        struct ggml_tensor *y = dg_build_f32_matmul(ctx, e, p);
        if (y) return y;
    }
    if (KC * NCH != V) p = ggml_pad(ctx, p, (int)(KC * NCH - V), 0, 0, 0);  // zero probabilities for padding rows
    p = ggml_cont(ctx, ggml_permute(ctx, ggml_reshape_3d(ctx, p, KC, NCH, n), 0, 2, 1, 3));  // [KC, n, NCH]
    struct ggml_tensor *parts = ggml_mul_mat(ctx, m->embd_t, p);                             // [H, n, NCH]
    struct ggml_tensor *sum = ggml_view_2d(ctx, parts, H, n, parts->nb[1], 0);
    for (int64_t i = 1; i < NCH; i++) {  // in slice order; cheaper than transposing the partial sums for sum_rows
        sum = ggml_add(ctx, sum, ggml_view_2d(ctx, parts, H, n, parts->nb[1], (size_t)i * parts->nb[2]));
    }
    return sum;
}

static bool build_step_graph(dg_context *c, dg_step_graph *g, bool self_cond, int out, int n, int n_canvases) {
    const dg_model *m = c->model;
    const int64_t V = m->hp.n_vocab;
    g->ctx = new_graph_ctx(m);
    if (!g->ctx) return false;
    struct ggml_context *ctx = g->ctx;
    g->gf = ggml_new_graph_custom(ctx, graph_nodes(m), false);
    g->ids = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n);
    g->pos = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n);
    ggml_set_input(g->ids);
    ggml_set_input(g->pos);

    struct ggml_tensor *e = embed(ctx, m, g->ids);
    if (self_cond) {
        // previous step's tempered distribution -> soft embedding -> SC gated MLP (docs/model.md#self-conditioning)
        struct ggml_tensor *prev = c->logits[1 - out];
        prev = ggml_view_2d(ctx, prev, V, n, prev->nb[1], 0);
        // softmax(prev · 1/T) in one op; 1/T changes every step, so step_impl rewrites the op's scale parameter
        struct ggml_tensor *p = g->sc_softmax = ggml_soft_max_ext(ctx, prev, NULL, 1.0f, 0.0f);  // [V, n]
        struct ggml_tensor *soft = ggml_scale(ctx, soft_embedding(ctx, m, p), m->embd_scale);  // [H, n]
        struct ggml_tensor *u = dg_build_rmsw(ctx, m, soft, m->sc_pre_norm);
        e = ggml_add(ctx, e, dg_build_self_cond_mlp(ctx, m, u));
    }
    struct ggml_tensor *x = ggml_rms_norm(ctx, e, m->hp.rms_eps);  // weight-less post_norm

    clear_tail_slots(c, c->n_past, n);  // nothing writes them while this graph lives: steps keep n_past
    const int rows_per = n / n_canvases;
    for (int il = 0; il < m->hp.n_layer; il++) {
        // several candidates: each attends as one canvas alone would (graph.c gathers its keys and values)
        dg_attn_span span = span_for(c, il, c->n_past, rows_per);
        span.canvases = n_canvases;
        const int kind = m->layers[il].sliding;
        const bool masked = span.padding > 0 || span.tail > 0;  // the mask only hides padding slots
        if (masked && !g->mask[kind]) {
            g->mask[kind] = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, span.len, rows_per);
            ggml_set_input(g->mask[kind]);
            g->span[kind] = span;
        }
        x = dg_build_layer(ctx, g->gf, m, c, il, x, g->pos, masked ? g->mask[kind] : NULL,
                           slot_of(c, il, c->n_past), span, false, false);
    }
    x = dg_build_rmsw(ctx, m, x, m->output_norm);
    const bool head_fast = dg_unit_fast(m, m->hp.n_layer);
    struct ggml_tensor *logits = dg_build_weight_matmul(ctx, dg_lm_head(m), x, head_fast);  // [V, n]
    const float cap = m->hp.logit_softcap;
    struct ggml_tensor *dst = ggml_view_2d(ctx, c->logits[out], V, n, c->logits[out]->nb[1], 0);
    ggml_build_forward_expand(g->gf, dg_build_softcap_into(ctx, logits, cap, dst, head_fast));
    return true;
}

// ---------------------------------------------------------------------------------------------------------------
// exported API

DG_API dg_model *dg_model_load(const char *path, int n_threads, char *err, size_t err_len) {
    return dg_model_load_impl(path, n_threads, false, err, err_len);
}

DG_API int dg_model_check(const char *path, char *err, size_t err_len) {
    dg_model *m = dg_model_load_impl(path, 1, true, err, err_len);
    dg_model_free_impl(m);
    return m != NULL;
}

DG_API void dg_model_free(dg_model *m) { dg_model_free_impl(m); }

DG_API const dg_hparams *dg_model_hparams(const dg_model *m) { return &m->hp; }

DG_API const struct gguf_context *dg_model_gguf(const dg_model *m) { return m->gguf; }

DG_API const char *dg_model_warnings(const dg_model *m) { return m->warnings; }

DG_API size_t dg_model_file_size(const dg_model *m) { return m->map_size; }

DG_API size_t dg_hparams_size(void) { return sizeof(dg_hparams); }

DG_API void dg_context_free(dg_context *c);

// One backend per placement device, and the scheduler over them: accelerators first, the CPU last (its lowest
// priority: nodes run where their weights are, the rest follows its neighbours).
static bool init_backends(dg_context *c, int n_threads, char *err, size_t err_len) {
    const dg_placement *p = &c->model->place;
    const int n = p->n_devices > 0 ? p->n_devices : 1;
    c->backends[0] = ggml_backend_cpu_init();
    if (!c->backends[0]) {
        dg_set_err(err, err_len, "cannot initialise the CPU backend");
        return false;
    }
    ggml_backend_cpu_set_n_threads(c->backends[0], n_threads);
    ggml_backend_t order[DG_MAX_DEVICES];
    for (int d = 1; d < n; d++) {
        c->backends[d] = ggml_backend_dev_init(p->devices[d], NULL);
        if (!c->backends[d]) {
            dg_set_err(err, err_len, "cannot initialise the device %s", ggml_backend_dev_name(p->devices[d]));
            return false;
        }
        order[d - 1] = c->backends[d];
    }
    order[n - 1] = c->backends[0];
    c->sched = ggml_backend_sched_new(order, NULL, n, 2 * graph_nodes(c->model) + 1024, false, false);
    if (!c->sched) {
        dg_set_err(err, err_len, "cannot create the graph scheduler");
        return false;
    }
    return true;
}

// K/V cache of each layer on the layer's device, the logits ping-pong buffers on the output's.
static bool alloc_state(dg_context *c, char *err, size_t err_len) {
    const dg_model *m = c->model;
    const dg_placement *p = &m->place;
    const int L = m->hp.n_layer, n = p->n_devices > 0 ? p->n_devices : 1, n_slots = c->n_slots;
    c->k_cache = calloc((size_t)L, sizeof(struct ggml_tensor *));
    c->v_cache = calloc((size_t)L, sizeof(struct ggml_tensor *));
    if (!c->k_cache || !c->v_cache) {
        dg_set_err(err, err_len, "out of memory");
        return false;
    }
    for (int d = 0; d < n; d++) {
        struct ggml_init_params ip = {ggml_tensor_overhead() * (2 * (size_t)L + 2), NULL, true};
        if (!(c->ctx_state[d] = ggml_init(ip))) {
            dg_set_err(err, err_len, "out of memory");
            return false;
        }
    }
    const int64_t step_rows = (int64_t)c->max_canvases * m->hp.canvas_length;
    const int64_t new_rows = step_rows > encode_chunk_rows(m) ? step_rows : encode_chunk_rows(m);
    const int64_t swa_cap = (int64_t)m->hp.sliding_window - 1 + KEY_MULTIPLE - 1 + new_rows;
    c->swa_cap = swa_cap < n_slots ? (int)swa_cap : n_slots;
    for (int il = 0; il < L; il++) {
        const dg_layer *ly = &m->layers[il];
        struct ggml_context *ctx = c->ctx_state[p->unit_device[il]];
        const int slots = ly->sliding ? c->swa_cap : n_slots;
        c->k_cache[il] = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, ly->head_dim, ly->n_head_kv, slots);
        c->v_cache[il] = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, slots, ly->head_dim, ly->n_head_kv);
    }
    const int out_dev = p->unit_device[L];
    for (int i = 0; i < 2; i++) {
        c->logits[i] = ggml_new_tensor_2d(c->ctx_state[out_dev], GGML_TYPE_F32, m->hp.n_vocab, step_rows);
    }
    for (int d = 0; d < n; d++) {
        if (!ggml_get_first_tensor(c->ctx_state[d])) continue;
        c->buf_state[d] = ggml_backend_alloc_ctx_tensors(c->ctx_state[d], c->backends[d]);
        if (!c->buf_state[d]) {
            size_t bytes = 0;
            for (struct ggml_tensor *t = ggml_get_first_tensor(c->ctx_state[d]); t;
                 t = ggml_get_next_tensor(c->ctx_state[d], t)) {
                bytes += ggml_nbytes(t);
            }
            dg_set_err(err, err_len, "cannot allocate %.1f MiB for the K/V cache and logits (n_ctx %d, %d canvases)",
                       bytes / 1048576.0, c->n_ctx, c->max_canvases);
            return false;
        }
    }
    for (int i = 0; i < 2; i++) {
        ggml_backend_tensor_memset(c->logits[i], 0, 0, ggml_nbytes(c->logits[i]));
        if (!ggml_backend_buffer_is_host(c->logits[i]->buffer)) {
            c->logits_host[i] = calloc(ggml_nelements(c->logits[i]), sizeof(float));
            if (!c->logits_host[i]) {
                dg_set_err(err, err_len, "out of memory");
                return false;
            }
        }
    }
    return true;
}

// max_canvases: the most candidate canvases one step may hold (1 for plain generation).
DG_API dg_context *dg_context_new_multi(dg_model *m, int n_ctx, int n_threads, int max_canvases, char *err,
                                        size_t err_len) {
    if (err && err_len) err[0] = 0;
    if (n_ctx < 1 || n_ctx > (1 << 24)) {
        dg_set_err(err, err_len, "n_ctx must be in [1, %d], got %d", 1 << 24, n_ctx);
        return NULL;
    }
    if (max_canvases < 1 || max_canvases > DG_MAX_CANDIDATES) {
        dg_set_err(err, err_len, "max_canvases must be in [1, %d], got %d", DG_MAX_CANDIDATES, max_canvases);
        return NULL;
    }
    const int64_t scratch = (int64_t)(max_canvases - 1) * m->hp.canvas_length;
    if (n_ctx + scratch > (1 << 24)) {
        dg_set_err(err, err_len, "n_ctx %d with %d canvases of scratch exceeds %d cache slots", n_ctx, max_canvases,
                   1 << 24);
        return NULL;
    }
    dg_context *c = calloc(1, sizeof(dg_context));
    if (!c) {
        dg_set_err(err, err_len, "out of memory");
        return NULL;
    }
    c->model = m;
    c->n_ctx = n_ctx;
    c->max_canvases = max_canvases;
    c->n_slots = (int)(n_ctx + scratch);
    c->last = -1;
    c->steps_n_past = c->steps_n_rows = c->steps_n_canvases = -1;
    if (n_threads <= 0) n_threads = m->n_threads > 0 ? m->n_threads : (int)sysconf(_SC_NPROCESSORS_ONLN);
    if (n_threads <= 0) n_threads = 1;

    if (!init_backends(c, n_threads, err, err_len) || !alloc_state(c, err, err_len)) {
        dg_context_free(c);
        return NULL;
    }
    return c;
}

DG_API dg_context *dg_context_new(dg_model *m, int n_ctx, int n_threads, char *err, size_t err_len) {
    return dg_context_new_multi(m, n_ctx, n_threads, 1, err, err_len);
}

DG_API void dg_context_free(dg_context *c) {
    if (!c) return;
    free_step_graphs(c);
    if (c->sched) ggml_backend_sched_free(c->sched);
    for (int d = 0; d < DG_MAX_DEVICES; d++) {
        if (c->buf_state[d]) ggml_backend_buffer_free(c->buf_state[d]);
        if (c->ctx_state[d]) ggml_free(c->ctx_state[d]);
        if (c->backends[d]) ggml_backend_free(c->backends[d]);
    }
    free(c->logits_host[0]);
    free(c->logits_host[1]);
    free(c->k_cache);
    free(c->v_cache);
    free(c);
}

DG_API int dg_context_n_past(const dg_context *c) { return c->n_past; }

// Test hook: out [n, H] = probs [n, V] · E through the step's sliced soft-embedding graph (no embedding scale).
DG_API int dg_context_soft_embedding(dg_context *c, const float *probs, int n, float *out, char *err, size_t err_len) {
    const dg_model *m = c->model;
    if (!m->hp.has_self_cond || n < 1 || n > m->hp.canvas_length) {
        dg_set_err(err, err_len, "soft embedding needs self-conditioning weights and 1..canvas_length rows");
        return -1;
    }
    struct ggml_context *gctx = new_graph_ctx(m);
    if (!gctx) return -1;
    struct ggml_cgraph *gf = ggml_new_graph_custom(gctx, graph_nodes(m), false);
    struct ggml_tensor *p = ggml_new_tensor_2d(gctx, GGML_TYPE_F32, m->hp.n_vocab, n);
    ggml_set_input(p);
    struct ggml_tensor *soft = soft_embedding(gctx, m, p);
    ggml_set_output(soft);
    ggml_build_forward_expand(gf, soft);
    bool ok = place_graph(c, gctx, gf, err, err_len);
    if (ok) {
        ggml_backend_tensor_set(p, probs, 0, ggml_nbytes(p));
        ok = compute(c, gf, err, err_len);
        if (ok) ggml_backend_tensor_get(soft, out, 0, ggml_nbytes(soft));
    }
    ggml_free(gctx);
    return ok ? 0 : -1;
}

DG_API void dg_context_reset(dg_context *c) {
    c->n_past = 0;
    c->swa_base = 0;
    c->last = -1;
    c->last_rows = 0;
    free_step_graphs(c);
}

DG_API int dg_context_encode(dg_context *c, const int32_t *ids, int n, char *err, size_t err_len) {
    if (err && err_len) err[0] = 0;
    if (n < 0) {
        dg_set_err(err, err_len, "negative token count");
        return -1;
    }
    if (n > c->n_ctx - c->n_past) {
        dg_set_err(err, err_len, "encoding %d tokens would exceed the context: %d cached, n_ctx %d", n, c->n_past,
                   c->n_ctx);
        return -1;
    }
    if (!ids_ok(c->model, ids, n, err, err_len)) return -1;
    const int chunk = encode_chunk_rows(c->model);
    for (int off = 0; off < n; off += chunk) {
        const int nc = n - off < chunk ? n - off : chunk;
        if (!make_sliding_room(c, nc, err, err_len)) return -1;
        if (!encode_chunk(c, ids + off, nc, err, err_len)) return -1;
    }
    return 0;
}

// Decoder mask of one layer kind for one canvas of `rows` rows: the padding slots hidden, everything else visible
// (several candidates share it: each attends over its own copy of this layout).
static void fill_decoder_mask(float *mask, dg_attn_span span, int rows) {
    for (int t = 0; t < rows; t++) {
        for (int j = 0; j < span.len; j++) {
            const bool visible = j >= span.padding && j < span.len - span.tail;
            mask[(size_t)t * span.len + j] = visible ? 0.0f : -INFINITY;
        }
    }
}

// n rows = n_canvases canvases of n / n_canvases rows each, all at positions n_past...
static float *step_impl(dg_context *c, const int32_t *ids, int n, int n_canvases, int use_self_cond, float inv_temp,
                        double *profile, char *err, size_t err_len) {
    if (err && err_len) err[0] = 0;
    const dg_model *m = c->model;
    if (n_canvases < 1 || n_canvases > c->max_canvases) {
        dg_set_err(err, err_len, "%d canvases in one step; this context holds 1..%d", n_canvases, c->max_canvases);
        return NULL;
    }
    const int rows_per = n / n_canvases;
    if (n < 1 || n % n_canvases != 0 || rows_per > m->hp.canvas_length) {
        dg_set_err(err, err_len, "canvas has %d tokens; 1..%d allowed", n_canvases > 1 ? rows_per : n,
                   m->hp.canvas_length);
        return NULL;
    }
    if (rows_per > c->n_ctx - c->n_past || n > c->n_slots - c->n_past) {
        dg_set_err(err, err_len, "a %d-token canvas does not fit after %d cached tokens (n_ctx %d)", rows_per, c->n_past,
                   c->n_ctx);
        return NULL;
    }
    if (!ids_ok(m, ids, n, err, err_len)) return NULL;
    const bool sc = use_self_cond && m->hp.has_self_cond;
    if (sc) {
        if (c->last < 0 || c->last_rows != n) {
            dg_set_err(err, err_len, "self-conditioning needs the previous step's logits for %d canvas rows", n);
            return NULL;
        }
        if (!(inv_temp > 0.0f) || !isfinite(inv_temp)) {
            dg_set_err(err, err_len, "self-conditioning temperature must be positive and finite");
            return NULL;
        }
    }
    if (!make_sliding_room(c, n, err, err_len)) return NULL;
    if (c->steps_n_past != c->n_past || c->steps_n_rows != n || c->steps_n_canvases != n_canvases) {
        free_step_graphs(c);
        c->steps_n_past = c->n_past;
        c->steps_n_rows = n;
        c->steps_n_canvases = n_canvases;
    }
    const int out = c->last == 0 ? 1 : 0;  // never overwrite the logits the self-conditioning reads
    dg_step_graph *g = &c->steps[sc][out];
    if (!g->gf && !build_step_graph(c, g, sc, out, n, n_canvases)) {
        dg_set_err(err, err_len, "out of memory while building the decoder graph");
        return NULL;
    }
    if (!place_graph(c, g->ctx, g->gf, err, err_len)) return NULL;
    int32_t *pos = malloc(sizeof(int32_t) * (size_t)n);
    if (!pos) {
        dg_set_err(err, err_len, "out of memory");
        return NULL;
    }
    for (int k = 0; k < n_canvases; k++) fill_positions(pos + (size_t)k * rows_per, c->n_past, rows_per);
    ggml_backend_tensor_set(g->ids, ids, 0, ggml_nbytes(g->ids));
    ggml_backend_tensor_set(g->pos, pos, 0, ggml_nbytes(g->pos));
    free(pos);
    if (sc) memcpy(&g->sc_softmax->op_params[0], &inv_temp, sizeof(float));  // soft_max_ext's params: scale, bias
    for (int kind = 0; kind < 2; kind++) {
        if (!g->mask[kind]) continue;
        float *mask = malloc(ggml_nbytes(g->mask[kind]));
        if (!mask) {
            dg_set_err(err, err_len, "out of memory");
            return NULL;
        }
        fill_decoder_mask(mask, g->span[kind], rows_per);
        ggml_backend_tensor_set(g->mask[kind], mask, 0, ggml_nbytes(g->mask[kind]));
        free(mask);
    }
    const bool ok = profile ? compute_profiled(c, g->gf, profile, err, err_len) : compute(c, g->gf, err, err_len);
    if (c->model->place.n_devices > 1) {
        // the scheduler rewires the sources of nodes that read another device's tensors to its copies, which live
        // until the next split: a graph spanning devices is used once and rebuilt (building costs well under 1 ms)
        ggml_free(g->ctx);
        memset(g, 0, sizeof(*g));
    }
    if (!ok) return NULL;
    c->last = out;
    c->last_rows = n;
    if (!c->logits_host[out]) return c->logits[out]->data;
    ggml_backend_tensor_get(c->logits[out], c->logits_host[out], 0, sizeof(float) * (size_t)n * (size_t)m->hp.n_vocab);
    return c->logits_host[out];
}

DG_API float *dg_context_step(dg_context *c, const int32_t *ids, int n, int use_self_cond, float inv_temp, char *err,
                              size_t err_len) {
    return step_impl(c, ids, n, 1, use_self_cond, inv_temp, NULL, err, err_len);
}

// One step over n_canvases candidate canvases of n / n_canvases rows each (ids: canvas after canvas); logits rows in
// the same order. Self-conditioning reads the previous step's rows, which must have been the same layout.
DG_API float *dg_context_step_canvases(dg_context *c, const int32_t *ids, int n, int n_canvases, int use_self_cond,
                                       float inv_temp, char *err, size_t err_len) {
    return step_impl(c, ids, n, n_canvases, use_self_cond, inv_temp, NULL, err, err_len);
}

// Drop finished candidates: of the last step's n_canvases canvases, keep those with keep[k] != 0, moving their logits
// rows to the front in order, so the next step (self-conditioned) runs on the kept canvases alone.
DG_API int dg_context_keep_canvases(dg_context *c, const uint8_t *keep, int n_canvases, char *err, size_t err_len) {
    if (err && err_len) err[0] = 0;
    if (c->last < 0 || n_canvases < 1 || c->last_rows % n_canvases != 0) {
        dg_set_err(err, err_len, "keep_canvases needs the last step's %d canvases", n_canvases);
        return -1;
    }
    const size_t row_bytes = sizeof(float) * (size_t)c->model->hp.n_vocab;
    const size_t canvas_bytes = row_bytes * (size_t)(c->last_rows / n_canvases);
    struct ggml_tensor *t = c->logits[c->last];
    float *host = c->logits_host[c->last];
    char *bytes = host ? (char *)host : (char *)t->data;
    int kept = 0;
    for (int k = 0; k < n_canvases; k++) {
        if (!keep[k]) continue;
        if (k != kept) memmove(bytes + (size_t)kept * canvas_bytes, bytes + (size_t)k * canvas_bytes, canvas_bytes);
        kept++;
    }
    if (kept == 0) {
        dg_set_err(err, err_len, "keep_canvases must keep at least one canvas");
        return -1;
    }
    if (host) ggml_backend_tensor_set(t, host, 0, (size_t)kept * canvas_bytes);
    c->last_rows = kept * (c->last_rows / n_canvases);
    return kept;
}

// The same step, timed node by node: seconds[class] += each node's time (DG_PROFILE_COUNT entries, dg_profile_class).
DG_API float *dg_context_step_profiled(dg_context *c, const int32_t *ids, int n, int use_self_cond, float inv_temp,
                                       double *seconds, char *err, size_t err_len) {
    return step_impl(c, ids, n, 1, use_self_cond, inv_temp, seconds, err, err_len);
}

// Overwrite "the previous step's raw logits" (rows × n_vocab floats). Written into the buffer the last step did not
// use, so a view of the last step's logits stays valid until the next step.
DG_API int dg_context_set_self_cond(dg_context *c, const float *data, int rows, char *err, size_t err_len) {
    if (err && err_len) err[0] = 0;
    const int max_rows = c->max_canvases * c->model->hp.canvas_length;
    if (rows < 1 || rows > max_rows) {
        dg_set_err(err, err_len, "self-conditioning logits have %d rows; 1..%d allowed", rows, max_rows);
        return -1;
    }
    const int target = c->last == 0 ? 1 : 0;
    const size_t bytes = sizeof(float) * (size_t)rows * (size_t)c->model->hp.n_vocab;
    ggml_backend_tensor_set(c->logits[target], data, 0, bytes);
    if (c->logits_host[target]) memcpy(c->logits_host[target], data, bytes);
    c->last = target;
    c->last_rows = rows;
    return 0;
}

// Logits of the last step (or set_self_cond), NULL if none.
DG_API float *dg_context_logits(const dg_context *c) {
    if (c->last < 0) return NULL;
    return c->logits_host[c->last] ? c->logits_host[c->last] : c->logits[c->last]->data;
}

DG_API int dg_context_logits_rows(const dg_context *c) { return c->last < 0 ? 0 : c->last_rows; }
