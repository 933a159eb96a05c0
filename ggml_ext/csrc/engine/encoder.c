// The encoder pass (prefill and commit): the context's tokens through every layer in chunks, each chunk's K/V written
// into the cache (kv_cache.c) at its positions; n_past advances by the tokens encoded. The last layer's output feeds
// nothing, so it only stores K/V.
#include <math.h>
#include <stdlib.h>

#include "engine.h"

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
    struct ggml_context *gctx = dg_new_graph_ctx(m);
    if (!gctx) {
        dg_set_err(err, err_len, "out of memory");
        return false;
    }
    struct ggml_cgraph *gf = ggml_new_graph_custom(gctx, dg_graph_nodes(m), false);
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
    dg_attn_span spans[2] = {{0}, {0}};
    for (int kind = 0; kind < 2; kind++) {
        int il = kind ? sliding_layer : full_layer;
        if (il < 0) continue;
        spans[kind] = dg_kv_span(c, il, c->n_past, n);
        mask[kind] = ggml_new_tensor_2d(gctx, GGML_TYPE_F32, spans[kind].len, n);
        ggml_set_input(mask[kind]);
    }
    for (int il = 0; il < m->hp.n_layer; il++) spans[m->layers[il].sliding] = dg_kv_span(c, il, c->n_past, n);

    struct ggml_tensor *x = dg_build_embed(gctx, m, ids_t);
    for (int il = 0; il < m->hp.n_layer; il++) {
        const int kind = m->layers[il].sliding;
        const bool last = il == m->hp.n_layer - 1;  // its output feeds nothing: store K/V only
        x = dg_build_layer(gctx, gf, m, c, il, x, pos_t, mask[kind], dg_kv_slot(c, il, c->n_past), spans[kind], true,
                           last);
    }

    bool ok = dg_place_graph(c, gctx, gf, NULL, 0, err, err_len);
    if (ok) {
        int32_t *pos = malloc(sizeof(int32_t) * (size_t)n);
        ok = pos != NULL;
        if (ok) {
            for (int i = 0; i < n; i++) pos[i] = c->n_past + i;
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
                dg_kv_clear_tail(c, c->n_past, n);
                ok = dg_compute(c, gf, NULL, err, err_len);
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

// Encodes n tokens after the cached ones, in chunks that fit a sliding cache after its retained tail.
int dg_encode(dg_context *c, const int32_t *ids, int n, char *err, size_t err_len) {
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
    if (!dg_ids_ok(c->model, ids, n, err, err_len)) return -1;
    const int chunk = dg_encode_chunk_rows(c->model);
    for (int off = 0; off < n; off += chunk) {
        const int nc = n - off < chunk ? n - off : chunk;
        if (!dg_kv_make_room(c, nc, err, err_len)) return -1;
        if (!encode_chunk(c, ids + off, nc, err, err_len)) return -1;
    }
    return 0;
}
