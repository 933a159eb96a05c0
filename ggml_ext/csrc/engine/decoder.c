// The decoder step: the canvas through every layer against the cached context, then the LM head and the softcap.
//
// Graphs are built once per (n_past, canvas rows) in variants [self-conditioning][output buffer][sampling]: the step
// writes into one of two persistent buffers and, with self-conditioning, reads the previous step's from the other, so
// they never leave engine memory. A plain step writes its softcapped logits there (the host gets a copy when they
// live on a device); a sampling step (dg_step_reduced) writes the tempered probabilities instead and reduces each row
// in the graph to what the sampler needs, so only O(rows) numbers cross to the host (docs/engine.md#what-crosses).
// A step may hold several candidate canvases (num_canvases): their rows follow one another in the scratch slots
// after n_past, all at the positions n_past.., and each attends to the cached context and its own rows only, gathered
// into the layout one canvas alone would see, so every candidate is computed as it would be alone.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine.h"

// Tokens' rows of the embedding gathered per chunk: at most this many rows of H floats live at once, unless that
// takes more than TOPK_CHUNKS chunks (their nodes count against the graph's size, dg_graph_nodes).
#define TOPK_GATHER_ROWS 16384
#define TOPK_CHUNKS 64

// P·E from each row's k most probable tokens, renormalised, from standard ops (any backend): top_k, the rows'
// probabilities and the embedding rows gathered (get_rows), one weighted sum per token as a matrix product batched
// over the tokens, chunk by chunk over k. The embedding is the output's copy of a tied one when there is one.
static struct ggml_tensor *soft_embedding_topk_graph(struct ggml_context *ctx, const dg_model *m,
                                                     struct ggml_tensor *p, int k) {
    const int64_t V = p->ne[0], H = m->hp.n_embd, n = p->ne[1];
    struct ggml_tensor *embd = m->place.lm_head ? m->place.lm_head : m->tok_embd;
    struct ggml_tensor *idx = ggml_top_k(ctx, p, k);                                            // [k, n] I32
    struct ggml_tensor *top = ggml_reshape_2d(ctx, ggml_get_rows(ctx, ggml_reshape_3d(ctx, p, 1, V, n), idx), k, n);
    struct ggml_tensor *w = ggml_div(ctx, top, ggml_sum_rows(ctx, top));                        // renormalised
    int64_t kc_max = TOPK_GATHER_ROWS / n > 0 ? TOPK_GATHER_ROWS / n : 1;
    if (kc_max * TOPK_CHUNKS < k) kc_max = (k + TOPK_CHUNKS - 1) / TOPK_CHUNKS;
    struct ggml_tensor *sum = NULL;
    for (int64_t j0 = 0; j0 < k; j0 += kc_max) {
        const int64_t kc = k - j0 < kc_max ? k - j0 : kc_max;
        struct ggml_tensor *ids = ggml_cont(ctx, ggml_view_2d(ctx, idx, kc, n, idx->nb[1], (size_t)j0 * idx->nb[0]));
        struct ggml_tensor *rows = ggml_get_rows(ctx, embd, ggml_reshape_1d(ctx, ids, kc * n));  // [H, kc·n]
        rows = ggml_cont(ctx, ggml_permute(ctx, ggml_reshape_3d(ctx, rows, H, kc, n), 1, 0, 2, 3));  // [kc, H, n]
        struct ggml_tensor *wc = ggml_cont(ctx, ggml_view_3d(ctx, w, kc, 1, n, w->nb[1], w->nb[1],
                                                             (size_t)j0 * w->nb[0]));             // [kc, 1, n]
        struct ggml_tensor *part = ggml_mul_mat(ctx, rows, wc);                                 // [H, 1, n]
        sum = sum ? ggml_add(ctx, sum, part) : part;
    }
    return ggml_reshape_2d(ctx, sum, H, n);
}

// P·E for probabilities p [V, n]: [H, n]. F32 files: slice by slice of the transposed copy (see
// dg_make_transposed_embedding); one slice on the CPU is the F32 weight product (f32_matmul.c) over the V valid rows,
// which needs no padding. Otherwise the soft-embedding op on the stored embedding, one slice per thread. top_k in
// [1, V): from each row's k most probable tokens (the CPU op on the stored embedding, else standard ops).
static struct ggml_tensor *soft_embedding(struct ggml_context *ctx, const dg_model *m, struct ggml_tensor *p,
                                          int top_k) {
    if (top_k > 0 && top_k < m->hp.n_vocab) {
        return !m->embd_t ? dg_build_soft_embedding_topk(ctx, m->tok_embd, p, top_k)
                          : soft_embedding_topk_graph(ctx, m, p, top_k);
    }
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

// The largest float below 1 whose product with a positive float is below it (1 - 2^-23; 1 - 2^-24 can round up
// to the float itself): clamping the uniforms to it keeps every draw's target below the row's total.
#define DG_UNIFORM_MAX 0x1.fffffcp-1f

static void pin(dg_step_graph *g, struct ggml_tensor *t, int device) {
    if (g->n_pins < DG_STEP_PINS) g->pins[g->n_pins++] = (dg_pin){t, device};  // sized for every pin below
}

// The width of the blocks a sampling step splits each row into: the largest power of two up to 512 that divides V.
// Broadcasting a per-row number over blocks of that width keeps ggml's CPU binary ops on whole vectors (over [1, n]
// they take one call per element), and the draw's cumulative sums run per block (short rows: better parallel on a
// GPU, smaller rounding), then over the row's block sums.
static int64_t reduction_block(int64_t V) {
    int64_t b = 1;
    while (b < 512 && V % (2 * b) == 0) b *= 2;
    return b;
}

// Per row of raw [V, n] at 1/T (the sample softmax's scale, rewritten before each run): the tempered probabilities,
// written into dst for the next step's self-conditioning, and the reductions the sampler needs (read_reductions turns
// them into argmax, entropy and draw). Every node is pinned to the output's device, so nothing [V, n] crosses.
static void build_reductions(dg_context *c, dg_step_graph *g, struct ggml_tensor *raw, struct ggml_tensor *dst) {
    struct ggml_context *ctx = g->ctx;
    const int64_t V = raw->ne[0], n = raw->ne[1], B = reduction_block(V), NB = V / B;
    const int dev = c->model->place.unit_device[c->model->hp.n_layer];
#define PIN(t) (pin(g, (t), dev), (t))
    g->uniforms = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, 1, n);
    ggml_set_input(g->uniforms);
    g->sample_softmax = PIN(ggml_soft_max_ext(ctx, raw, NULL, 1.0f, 0.0f));
    struct ggml_tensor *p = PIN(ggml_cpy(ctx, g->sample_softmax, dst));
    // argmax: ggml's (on the CPU the last of equal maxima; the host sampler takes the first)
    g->argmax = PIN(ggml_argmax(ctx, raw));  // [n] I32
    struct ggml_tensor *idx = ggml_reshape_2d(ctx, g->argmax, 1, n);
    // entropy = log S − Σ p·(z − z_max), z = raw/T, S = Σ exp(z − z_max) = 1 / p_max: the row's maximum and its
    // probability are gathered at the argmax, and Σ p·(raw − raw_max) ≤ 0 is summed without cancellation
    struct ggml_tensor *raw_max = PIN(ggml_get_rows(ctx, ggml_reshape_3d(ctx, raw, 1, V, n), idx));  // [1, 1, n]
    g->p_max = PIN(ggml_get_rows(ctx, ggml_reshape_3d(ctx, p, 1, V, n), idx));
    struct ggml_tensor *max_b = PIN(ggml_repeat_4d(ctx, ggml_reshape_2d(ctx, raw_max, 1, n), B, n, 1, 1));
    struct ggml_tensor *shifted = PIN(ggml_sub(ctx, raw, max_b));
    // one dot product per row: a matrix product batched over the rows, no [V, n] product tensor
    g->shifted_sum = PIN(ggml_mul_mat(ctx, ggml_reshape_3d(ctx, p, V, 1, n),
                                      ggml_reshape_3d(ctx, shifted, V, 1, n)));
    // The draw is the first token whose cumulative probability exceeds u · total (the inverse CDF). Cumulative sums
    // per block, then over the blocks' totals (each block's last cumulative sum, so both levels agree): the block is
    // the count of block sums ≤ u · total, the token within it the count of prefix + cumulative sum ≤ u · total.
    // Sums of non-negative floats never decrease, so each count is the first crossing, and it lands on a token of
    // non-zero probability.
    struct ggml_tensor *local = PIN(ggml_cumsum(ctx, ggml_reshape_2d(ctx, p, B, NB * n)));  // [B, NB·n]
    struct ggml_tensor *block_sum = PIN(ggml_cont(ctx, ggml_view_2d(ctx, local, 1, NB * n, local->nb[1],
                                                                    (size_t)(B - 1) * sizeof(float))));
    struct ggml_tensor *block_cdf = PIN(ggml_cumsum(ctx, ggml_reshape_2d(ctx, block_sum, NB, n)));  // [NB, n]
    struct ggml_tensor *total = PIN(ggml_cont(ctx, ggml_view_2d(ctx, block_cdf, 1, n, block_cdf->nb[1],
                                                                (size_t)(NB - 1) * sizeof(float))));
    struct ggml_tensor *target = PIN(ggml_mul(ctx, total, g->uniforms));  // [1, n]
    struct ggml_tensor *blocks_over = PIN(ggml_sub(ctx, block_cdf, target));
    blocks_over = PIN(ggml_sum_rows(ctx, PIN(ggml_step(ctx, blocks_over))));
    // block = NB − blocks over the target, kept in range (it is already, unless the logits hold a NaN)
    g->block = PIN(ggml_clamp(ctx, PIN(ggml_scale_bias(ctx, blocks_over, -1.0f, (float)NB)), 0.0f, (float)(NB - 1)));
    struct ggml_tensor *block_i = PIN(ggml_cast(ctx, g->block, GGML_TYPE_I32));  // [1, n]
    struct ggml_tensor *in_block = PIN(ggml_get_rows(ctx, ggml_reshape_3d(ctx, local, B, NB, n), block_i));
    // the cumulative sum before each block: block_cdf shifted by one, a zero first
    struct ggml_tensor *zero = PIN(ggml_scale(ctx, total, 0.0f));
    struct ggml_tensor *before = PIN(ggml_concat(ctx, zero, block_cdf, 0));  // [NB + 1, n]
    struct ggml_tensor *prefix = PIN(ggml_get_rows(ctx, ggml_reshape_3d(ctx, before, 1, NB + 1, n), block_i));
    struct ggml_tensor *cdf = PIN(ggml_add(ctx, in_block, prefix));  // [B, 1, n]
    struct ggml_tensor *over = PIN(ggml_sub(ctx, cdf, ggml_reshape_3d(ctx, target, 1, 1, n)));
    g->above = PIN(ggml_sum_rows(ctx, PIN(ggml_step(ctx, over))));  // [1, 1, n]
#undef PIN
    struct ggml_tensor *outputs[] = {g->argmax, g->p_max, g->shifted_sum, g->block, g->above};
    for (size_t i = 0; i < sizeof(outputs) / sizeof(outputs[0]); i++) {
        ggml_set_output(outputs[i]);
        ggml_build_forward_expand(g->gf, outputs[i]);
    }
}

static bool build_step_graph(dg_context *c, dg_step_graph *g, int sc_mode, int out, bool reduce, int n,
                             int n_canvases) {
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
    if (sc_mode != DG_SC_NONE) {
        // previous step's tempered distribution -> soft embedding -> SC gated MLP (docs/model.md#self-conditioning)
        struct ggml_tensor *prev = c->logits[1 - out];
        struct ggml_tensor *p = ggml_view_2d(ctx, prev, V, n, prev->nb[1], 0);
        if (sc_mode == DG_SC_LOGITS) {
            // softmax(prev · 1/T) in one op; 1/T changes every step, so dg_step rewrites the op's scale parameter
            p = g->sc_softmax = ggml_soft_max_ext(ctx, p, NULL, 1.0f, 0.0f);  // [V, n]
        }
        struct ggml_tensor *soft = ggml_scale(ctx, soft_embedding(ctx, m, p, c->sc_top_k), m->embd_scale);  // [H, n]
        struct ggml_tensor *u = dg_build_rmsw(ctx, m, soft, m->sc_pre_norm);
        e = ggml_add(ctx, e, dg_build_self_cond_mlp(ctx, m, u));
    }
    struct ggml_tensor *x = ggml_rms_norm(ctx, e, m->hp.rms_eps);  // weight-less post_norm

    const int rows_per = n / n_canvases;
    for (int il = 0; il < m->hp.n_layer; il++) {
        // several candidates: each attends as one canvas alone would (graph.c gathers its keys and values)
        dg_attn_span span = dg_kv_span(c, il, c->n_past, rows_per);
        span.canvases = n_canvases;
        const int kind = m->layers[il].sliding;
        const bool masked = span.padding > 0 || span.tail > 0;  // the mask only hides padding slots
        if (masked && !g->mask[kind]) {
            // every row hides the same slots: one row crosses to the device, repeated there
            g->mask_row[kind] = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, span.len);
            ggml_set_input(g->mask_row[kind]);
            g->mask[kind] = ggml_repeat_4d(ctx, g->mask_row[kind], span.len, rows_per, 1, 1);
            pin(g, g->mask[kind], m->place.unit_device[il]);
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
    if (reduce) build_reductions(c, g, dg_build_softcap(ctx, logits, cap, head_fast), dst);
    else ggml_build_forward_expand(g->gf, dg_build_softcap_into(ctx, logits, cap, dst, head_fast));
    return true;
}

// Decoder mask row of one layer kind (one canvas's layout; every row and candidate attends over the same): the
// padding slots hidden, everything else visible.
static void fill_decoder_mask(float *mask, dg_attn_span span) {
    for (int j = 0; j < span.len; j++) {
        const bool visible = j >= span.padding && j < span.len - span.tail;
        mask[j] = visible ? 0.0f : -INFINITY;
    }
}

// What a sampling step (dg_step_reduced) takes and gives, per row.
typedef struct {
    float inv_temp;         // this step's 1/T
    const float *uniforms;  // [n] in [0, 1)
    int32_t *argmax;        // [n]
    float *entropy;         // [n], nats
    int32_t *draw;          // [n]
} dg_reduce_io;

// Argmax, entropy and draw per row from the graph's reductions: the O(n) numbers that cross to the host.
static bool read_reductions(dg_context *c, const dg_step_graph *g, const dg_reduce_io *red, int n, char *err,
                            size_t err_len) {
    const int32_t V = c->model->hp.n_vocab;
    const int64_t B = reduction_block(V);
    float *buf = malloc(sizeof(float) * 4 * (size_t)n);
    if (!buf) {
        dg_set_err(err, err_len, "out of memory");
        return false;
    }
    float *p_max = buf, *shifted_sum = buf + n, *block = buf + 2 * (size_t)n, *above = buf + 3 * (size_t)n;
    dg_tensor_get(c, g->argmax, red->argmax, 0, sizeof(int32_t) * (size_t)n);
    dg_tensor_get(c, g->p_max, p_max, 0, sizeof(float) * (size_t)n);
    dg_tensor_get(c, g->shifted_sum, shifted_sum, 0, sizeof(float) * (size_t)n);
    dg_tensor_get(c, g->block, block, 0, sizeof(float) * (size_t)n);
    dg_tensor_get(c, g->above, above, 0, sizeof(float) * (size_t)n);
    for (int i = 0; i < n; i++) {
        if (red->argmax[i] < 0 || red->argmax[i] >= V) red->argmax[i] = 0;  // only NaN logits get here
        const double h = -log((double)p_max[i]) - (double)red->inv_temp * (double)shifted_sum[i];
        red->entropy[i] = (float)(h > 0.0 ? h : 0.0);  // as the host sampler: rounding below 0 (and NaN) is 0
        const double first = (double)block[i] * (double)B + (double)B - (double)above[i];  // exact: below 2^24
        red->draw[i] = !(first >= 0.0) ? 0 : first > V - 1 ? V - 1 : (int32_t)first;
    }
    free(buf);
    return true;
}

// n rows = n_canvases canvases of n / n_canvases rows each, all at positions n_past..; logits rows in the same order.
// Self-conditioning reads the previous step's rows, which must have been the same layout (logits, tempered by
// sc_inv_temp, or the probabilities a sampling step left). profile non-NULL: timed node by node, seconds[class] +=
// each node's time (DG_PROFILE_COUNT entries, dg_profile_class). red non-NULL: a sampling step.
static bool run_step(dg_context *c, const int32_t *ids, int n, int n_canvases, int use_self_cond, float sc_inv_temp,
                     const dg_reduce_io *red, double *profile, char *err, size_t err_len) {
    if (err && err_len) err[0] = 0;
    const dg_model *m = c->model;
    if (n_canvases < 1 || n_canvases > c->max_canvases) {
        dg_set_err(err, err_len, "%d canvases in one step; this context holds 1..%d", n_canvases, c->max_canvases);
        return false;
    }
    const int rows_per = n / n_canvases;
    if (n < 1 || n % n_canvases != 0 || rows_per > m->hp.canvas_length) {
        dg_set_err(err, err_len, "canvas has %d tokens; 1..%d allowed", n_canvases > 1 ? rows_per : n,
                   m->hp.canvas_length);
        return false;
    }
    if (rows_per > c->n_ctx - c->n_past || n > c->n_slots - c->n_past) {
        dg_set_err(err, err_len, "a %d-token canvas does not fit after %d cached tokens (n_ctx %d)", rows_per,
                   c->n_past, c->n_ctx);
        return false;
    }
    if (!dg_ids_ok(m, ids, n, err, err_len)) return false;
    const bool sc = use_self_cond && m->hp.has_self_cond;
    if (sc) {
        if (c->last < 0 || c->last_rows != n) {
            dg_set_err(err, err_len, "self-conditioning needs the previous step's logits for %d canvas rows", n);
            return false;
        }
        if (!c->holds_probs[c->last] && (!(sc_inv_temp > 0.0f) || !isfinite(sc_inv_temp))) {
            dg_set_err(err, err_len, "self-conditioning temperature must be positive and finite");
            return false;
        }
    }
    if (red) {
        if (!(red->inv_temp > 0.0f) || !isfinite(red->inv_temp)) {
            dg_set_err(err, err_len, "the sampling temperature must be positive and finite");
            return false;
        }
        for (int i = 0; i < n; i++) {
            if (!(red->uniforms[i] >= 0.0f && red->uniforms[i] < 1.0f)) {
                dg_set_err(err, err_len, "uniform %d is not in [0, 1)", i);
                return false;
            }
        }
    }
    if (!dg_kv_make_room(c, n, err, err_len)) return false;
    // graphs view cache slots: a move of the sliding caches (swa_base) or another geometry needs new ones
    if (c->steps_n_past != c->n_past || c->steps_swa_base != c->swa_base || c->steps_n_rows != n ||
        c->steps_n_canvases != n_canvases) {
        dg_free_step_graphs(c);
        c->steps_n_past = c->n_past;
        c->steps_swa_base = c->swa_base;
        c->steps_n_rows = n;
        c->steps_n_canvases = n_canvases;
    }
    if (!c->steps_tails_clear) {  // nothing writes them while these graphs live: steps keep n_past
        dg_kv_clear_tail(c, c->n_past, n);
        c->steps_tails_clear = true;
    }
    const int out = c->last == 0 ? 1 : 0;  // never overwrite the logits the self-conditioning reads
    const int sc_mode = !sc ? DG_SC_NONE : c->holds_probs[c->last] ? DG_SC_PROBS : DG_SC_LOGITS;
    dg_step_graph *g = &c->steps[sc_mode][out][red != NULL];
    if (!g->gf && !build_step_graph(c, g, sc_mode, out, red != NULL, n, n_canvases)) {
        dg_set_err(err, err_len, "out of memory while building the decoder graph");
        return false;
    }
    if (!dg_place_graph(c, g->ctx, g->gf, g->pins, g->n_pins, err, err_len)) return false;
    dg_count_split_copies(c, g->gf);
    const size_t mask_floats = g->mask[0] && g->mask[1] ? (size_t)(g->span[0].len > g->span[1].len ? g->span[0].len
                                                                                                     : g->span[1].len)
                                                        : g->mask[0] ? (size_t)g->span[0].len
                                                        : g->mask[1] ? (size_t)g->span[1].len : 0;
    // one scratch for positions, mask rows and uniforms (n ≤ rows of a step, spans ≤ cache slots + padding)
    const size_t scratch_n = (size_t)n > mask_floats ? (size_t)n : mask_floats;
    int32_t *pos = malloc(sizeof(int32_t) * (size_t)n);
    float *scratch = malloc(sizeof(float) * scratch_n);
    if (!pos || !scratch) {
        free(pos);
        free(scratch);
        dg_set_err(err, err_len, "out of memory");
        return false;
    }
    for (int i = 0; i < n; i++) pos[i] = c->n_past + i % rows_per;
    dg_tensor_set(c, g->ids, ids, 0, ggml_nbytes(g->ids));
    dg_tensor_set(c, g->pos, pos, 0, ggml_nbytes(g->pos));
    free(pos);
    if (sc_mode == DG_SC_LOGITS) memcpy(&g->sc_softmax->op_params[0], &sc_inv_temp, sizeof(float));  // scale, bias
    for (int kind = 0; kind < 2; kind++) {
        if (!g->mask[kind]) continue;
        fill_decoder_mask(scratch, g->span[kind]);
        dg_tensor_set(c, g->mask_row[kind], scratch, 0, ggml_nbytes(g->mask_row[kind]));
    }
    if (red) {
        memcpy(&g->sample_softmax->op_params[0], &red->inv_temp, sizeof(float));
        for (int i = 0; i < n; i++) scratch[i] = red->uniforms[i] < DG_UNIFORM_MAX ? red->uniforms[i] : DG_UNIFORM_MAX;
        dg_tensor_set(c, g->uniforms, scratch, 0, ggml_nbytes(g->uniforms));
    }
    free(scratch);
    bool ok = dg_compute(c, g->gf, profile, err, err_len);
    if (ok && red) ok = read_reductions(c, g, red, n, err, err_len);
    if (ok) dg_graph_report(c, g->gf, c->step_report, sizeof(c->step_report));
    if (c->model->place.n_devices > 1) {
        // the scheduler rewires the sources of nodes that read another device's tensors to its copies, which live
        // until the next split: a graph spanning devices is used once and rebuilt (building costs well under 1 ms)
        ggml_free(g->ctx);
        memset(g, 0, sizeof(*g));
    }
    if (!ok) return false;
    c->last = out;
    c->last_rows = n;
    c->holds_probs[out] = red != NULL;
    if (!red && c->logits_host[out])
        dg_tensor_get(c, c->logits[out], c->logits_host[out], 0, sizeof(float) * (size_t)n * (size_t)m->hp.n_vocab);
    return true;
}

float *dg_step(dg_context *c, const int32_t *ids, int n, int n_canvases, int use_self_cond, float inv_temp,
               double *profile, char *err, size_t err_len) {
    c->counting = true;
    const bool ok = run_step(c, ids, n, n_canvases, use_self_cond, inv_temp, NULL, profile, err, err_len);
    c->counting = false;
    if (!ok) return NULL;
    c->xfer_steps++;
    return c->logits_host[c->last] ? c->logits_host[c->last] : c->logits[c->last]->data;
}

int dg_step_reduced(dg_context *c, const int32_t *ids, int n, int n_canvases, int use_self_cond, float sc_inv_temp,
                    float inv_temp, const float *uniforms, int32_t *argmax, float *entropy, int32_t *draw,
                    char *err, size_t err_len) {
    const dg_reduce_io red = {inv_temp, uniforms, argmax, entropy, draw};
    c->counting = true;
    const bool ok = run_step(c, ids, n, n_canvases, use_self_cond, sc_inv_temp, &red, NULL, err, err_len);
    c->counting = false;
    if (!ok) return -1;
    c->xfer_steps++;
    return 0;
}

// Move canvas rows within a device buffer on the device itself: one copy node per moved canvas, in order (each
// target slot lies before its source and after every earlier source, so no source is overwritten before it is read).
static bool move_canvases_on_device(dg_context *c, struct ggml_tensor *t, const uint8_t *keep, int n_canvases,
                                    int64_t canvas_rows, char *err, size_t err_len) {
    struct ggml_context *gctx = dg_new_graph_ctx(c->model);
    if (!gctx) {
        dg_set_err(err, err_len, "out of memory");
        return false;
    }
    struct ggml_cgraph *gf = ggml_new_graph_custom(gctx, dg_graph_nodes(c->model), false);
    const int64_t V = t->ne[0];
    const size_t canvas_bytes = t->nb[1] * (size_t)canvas_rows;
    int kept = 0;
    for (int k = 0; k < n_canvases; k++) {
        if (!keep[k]) continue;
        if (k != kept) {
            struct ggml_tensor *from = ggml_view_2d(gctx, t, V, canvas_rows, t->nb[1], (size_t)k * canvas_bytes);
            struct ggml_tensor *to = ggml_view_2d(gctx, t, V, canvas_rows, t->nb[1], (size_t)kept * canvas_bytes);
            ggml_build_forward_expand(gf, ggml_cpy(gctx, from, to));
        }
        kept++;
    }
    bool ok = true;
    if (ggml_graph_n_nodes(gf) > 0) {
        ok = dg_place_graph(c, gctx, gf, NULL, 0, err, err_len) && dg_compute(c, gf, NULL, err, err_len);
    }
    ggml_free(gctx);
    return ok;
}

// Drop finished candidates: of the last step's n_canvases canvases, keep those with keep[k] != 0, moving their logits
// (or probabilities) rows to the front in order, so the next step (self-conditioned) runs on the kept canvases alone.
int dg_keep_canvases(dg_context *c, const uint8_t *keep, int n_canvases, char *err, size_t err_len) {
    if (err && err_len) err[0] = 0;
    if (c->last < 0 || n_canvases < 1 || c->last_rows % n_canvases != 0) {
        dg_set_err(err, err_len, "keep_canvases needs the last step's %d canvases", n_canvases);
        return -1;
    }
    int kept = 0;
    for (int k = 0; k < n_canvases; k++) kept += keep[k] != 0;
    if (kept == 0) {
        dg_set_err(err, err_len, "keep_canvases must keep at least one canvas");
        return -1;
    }
    const int64_t canvas_rows = c->last_rows / n_canvases;
    const size_t canvas_bytes = sizeof(float) * (size_t)c->model->hp.n_vocab * (size_t)canvas_rows;
    struct ggml_tensor *t = c->logits[c->last];
    if (!ggml_backend_buffer_is_host(t->buffer) &&
        !move_canvases_on_device(c, t, keep, n_canvases, canvas_rows, err, err_len))
        return -1;
    // the host's bytes: the buffer itself on the CPU, else the copy of a plain step's logits (a sampling step keeps
    // none)
    char *bytes = ggml_backend_buffer_is_host(t->buffer) ? (char *)t->data
                  : c->holds_probs[c->last]             ? NULL
                                                         : (char *)c->logits_host[c->last];
    for (int k = 0, to = 0; bytes && k < n_canvases; k++) {
        if (!keep[k]) continue;
        if (k != to) memmove(bytes + (size_t)to * canvas_bytes, bytes + (size_t)k * canvas_bytes, canvas_bytes);
        to++;
    }
    c->last_rows = kept * (int)canvas_rows;
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
    c->holds_probs[target] = false;
    return 0;
}

// Logits of the last step (or set_self_cond), NULL if none (or the last step was a sampling step: it kept none).
float *dg_last_logits(const dg_context *c) {
    if (c->last < 0 || c->holds_probs[c->last]) return NULL;
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
    struct ggml_tensor *soft = soft_embedding(gctx, m, p, c->sc_top_k);
    ggml_set_output(soft);
    ggml_build_forward_expand(gf, soft);
    bool ok = dg_place_graph(c, gctx, gf, NULL, 0, err, err_len);
    if (ok) {
        ggml_backend_tensor_set(p, probs, 0, ggml_nbytes(p));
        ok = dg_compute(c, gf, NULL, err, err_len);
        if (ok) ggml_backend_tensor_get(soft, out, 0, ggml_nbytes(soft));
    }
    ggml_free(gctx);
    return ok ? 0 : -1;
}

// Self-conditioning from each row's k most probable tokens, renormalised (0, or k ≥ V: every token, exact).
int dg_set_self_cond_top_k(dg_context *c, int k, char *err, size_t err_len) {
    if (err && err_len) err[0] = 0;
    if (k < 0 || k > DG_MAX_SC_TOP_K) {
        dg_set_err(err, err_len, "self_cond_top_k must be between 0 and %d, got %d", DG_MAX_SC_TOP_K, k);
        return -1;
    }
    if (k >= c->model->hp.n_vocab) k = 0;
    if (k != c->sc_top_k) dg_free_step_graphs(c);  // the graphs hold the product
    c->sc_top_k = k;
    return 0;
}
