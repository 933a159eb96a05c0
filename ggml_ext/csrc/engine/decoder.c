// The decoder step: the canvas through every layer against the cached context, then the LM head and the softcap.
//
// Graphs are built once per (n_past, canvas rows) in four variants [self-conditioning][output buffer]: the step
// writes its softcapped logits into one of two persistent buffers and, with self-conditioning, reads the previous
// step's logits from the other, so they never leave engine memory. A step may hold several candidate canvases
// (num_canvases): their rows follow one another in the scratch slots after n_past, all at the positions n_past.., and
// each attends to the cached context and its own rows only, gathered into the layout one canvas alone would see, so
// every candidate is computed as it would be alone.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine.h"

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
    g->ctx = dg_new_graph_ctx(m);
    if (!g->ctx) return false;
    struct ggml_context *ctx = g->ctx;
    g->gf = ggml_new_graph_custom(ctx, dg_graph_nodes(m), false);
    g->ids = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n);
    g->pos = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n);
    ggml_set_input(g->ids);
    ggml_set_input(g->pos);

    struct ggml_tensor *e = dg_build_embed(ctx, m, g->ids);
    if (self_cond) {
        // previous step's tempered distribution -> soft embedding -> SC gated MLP (docs/model.md#self-conditioning)
        struct ggml_tensor *prev = c->logits[1 - out];
        prev = ggml_view_2d(ctx, prev, V, n, prev->nb[1], 0);
        // softmax(prev · 1/T) in one op; 1/T changes every step, so dg_step rewrites the op's scale parameter
        struct ggml_tensor *p = g->sc_softmax = ggml_soft_max_ext(ctx, prev, NULL, 1.0f, 0.0f);  // [V, n]
        struct ggml_tensor *soft = ggml_scale(ctx, soft_embedding(ctx, m, p), m->embd_scale);  // [H, n]
        struct ggml_tensor *u = dg_build_rmsw(ctx, m, soft, m->sc_pre_norm);
        e = ggml_add(ctx, e, dg_build_self_cond_mlp(ctx, m, u));
    }
    struct ggml_tensor *x = ggml_rms_norm(ctx, e, m->hp.rms_eps);  // weight-less post_norm

    dg_kv_clear_tail(c, c->n_past, n);  // nothing writes them while this graph lives: steps keep n_past
    const int rows_per = n / n_canvases;
    for (int il = 0; il < m->hp.n_layer; il++) {
        // several candidates: each attends as one canvas alone would (graph.c gathers its keys and values)
        dg_attn_span span = dg_kv_span(c, il, c->n_past, rows_per);
        span.canvases = n_canvases;
        const int kind = m->layers[il].sliding;
        const bool masked = span.padding > 0 || span.tail > 0;  // the mask only hides padding slots
        if (masked && !g->mask[kind]) {
            g->mask[kind] = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, span.len, rows_per);
            ggml_set_input(g->mask[kind]);
            g->span[kind] = span;
        }
        x = dg_build_layer(ctx, g->gf, m, c, il, x, g->pos, masked ? g->mask[kind] : NULL,
                           dg_kv_slot(c, il, c->n_past), span, false, false);
    }
    x = dg_build_rmsw(ctx, m, x, m->output_norm);
    const bool head_fast = dg_unit_fast(m, m->hp.n_layer);
    struct ggml_tensor *logits = dg_build_weight_matmul(ctx, dg_lm_head(m), x, head_fast);  // [V, n]
    const float cap = m->hp.logit_softcap;
    struct ggml_tensor *dst = ggml_view_2d(ctx, c->logits[out], V, n, c->logits[out]->nb[1], 0);
    ggml_build_forward_expand(g->gf, dg_build_softcap_into(ctx, logits, cap, dst, head_fast));
    return true;
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

// n rows = n_canvases canvases of n / n_canvases rows each, all at positions n_past..; logits rows in the same order.
// Self-conditioning reads the previous step's rows, which must have been the same layout. profile non-NULL: timed
// node by node, seconds[class] += each node's time (DG_PROFILE_COUNT entries, dg_profile_class).
static float *step_counted(dg_context *c, const int32_t *ids, int n, int n_canvases, int use_self_cond,
                          float inv_temp, double *profile, char *err, size_t err_len);

float *dg_step(dg_context *c, const int32_t *ids, int n, int n_canvases, int use_self_cond, float inv_temp,
               double *profile, char *err, size_t err_len) {
    c->counting = true;
    float *out = step_counted(c, ids, n, n_canvases, use_self_cond, inv_temp, profile, err, err_len);
    c->counting = false;
    if (out) c->xfer_steps++;
    return out;
}

static float *step_counted(dg_context *c, const int32_t *ids, int n, int n_canvases, int use_self_cond,
                          float inv_temp, double *profile, char *err, size_t err_len) {
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
    if (!dg_ids_ok(m, ids, n, err, err_len)) return NULL;
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
    if (!dg_kv_make_room(c, n, err, err_len)) return NULL;
    // graphs view cache slots: a move of the sliding caches (swa_base) or another geometry needs new ones
    if (c->steps_n_past != c->n_past || c->steps_swa_base != c->swa_base || c->steps_n_rows != n ||
        c->steps_n_canvases != n_canvases) {
        dg_free_step_graphs(c);
        c->steps_n_past = c->n_past;
        c->steps_swa_base = c->swa_base;
        c->steps_n_rows = n;
        c->steps_n_canvases = n_canvases;
    }
    const int out = c->last == 0 ? 1 : 0;  // never overwrite the logits the self-conditioning reads
    dg_step_graph *g = &c->steps[sc][out];
    if (!g->gf && !build_step_graph(c, g, sc, out, n, n_canvases)) {
        dg_set_err(err, err_len, "out of memory while building the decoder graph");
        return NULL;
    }
    if (!dg_place_graph(c, g->ctx, g->gf, err, err_len)) return NULL;
    dg_count_split_copies(c, g->gf);
    int32_t *pos = malloc(sizeof(int32_t) * (size_t)n);
    if (!pos) {
        dg_set_err(err, err_len, "out of memory");
        return NULL;
    }
    for (int i = 0; i < n; i++) pos[i] = c->n_past + i % rows_per;
    dg_tensor_set(c, g->ids, ids, 0, ggml_nbytes(g->ids));
    dg_tensor_set(c, g->pos, pos, 0, ggml_nbytes(g->pos));
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
        dg_tensor_set(c, g->mask[kind], mask, 0, ggml_nbytes(g->mask[kind]));
        free(mask);
    }
    const bool ok = dg_compute(c, g->gf, profile, err, err_len);
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
    dg_tensor_get(c, c->logits[out], c->logits_host[out], 0, sizeof(float) * (size_t)n * (size_t)m->hp.n_vocab);
    return c->logits_host[out];
}

// Drop finished candidates: of the last step's n_canvases canvases, keep those with keep[k] != 0, moving their logits
// rows to the front in order, so the next step (self-conditioned) runs on the kept canvases alone.
int dg_keep_canvases(dg_context *c, const uint8_t *keep, int n_canvases, char *err, size_t err_len) {
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
    c->counting = true;
    if (host) dg_tensor_set(c, t, host, 0, (size_t)kept * canvas_bytes);
    c->counting = false;
    c->last_rows = kept * (c->last_rows / n_canvases);
    return kept;
}

// Overwrite "the previous step's raw logits" (rows × n_vocab floats). Written into the buffer the last step did not
// use, so a view of the last step's logits stays valid until the next step.
int dg_set_self_cond(dg_context *c, const float *data, int rows, char *err, size_t err_len) {
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
float *dg_last_logits(const dg_context *c) {
    if (c->last < 0) return NULL;
    return c->logits_host[c->last] ? c->logits_host[c->last] : c->logits[c->last]->data;
}

// The soft embedding a step computes (sliced as it is), for the engine's tests.
int dg_run_soft_embedding(dg_context *c, const float *probs, int n, float *out, char *err, size_t err_len) {
    const dg_model *m = c->model;
    if (!m->hp.has_self_cond || n < 1 || n > m->hp.canvas_length) {
        dg_set_err(err, err_len, "soft embedding needs self-conditioning weights and 1..canvas_length rows");
        return -1;
    }
    struct ggml_context *gctx = dg_new_graph_ctx(m);
    if (!gctx) return -1;
    struct ggml_cgraph *gf = ggml_new_graph_custom(gctx, dg_graph_nodes(m), false);
    struct ggml_tensor *p = ggml_new_tensor_2d(gctx, GGML_TYPE_F32, m->hp.n_vocab, n);
    ggml_set_input(p);
    struct ggml_tensor *soft = soft_embedding(gctx, m, p);
    ggml_set_output(soft);
    ggml_build_forward_expand(gf, soft);
    bool ok = dg_place_graph(c, gctx, gf, err, err_len);
    if (ok) {
        ggml_backend_tensor_set(p, probs, 0, ggml_nbytes(p));
        ok = dg_compute(c, gf, NULL, err, err_len);
        if (ok) ggml_backend_tensor_get(soft, out, 0, ggml_nbytes(soft));
    }
    ggml_free(gctx);
    return ok ? 0 : -1;
}
