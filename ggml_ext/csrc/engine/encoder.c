// The encoder pass (prefill and commit): the context's tokens through every layer in chunks, each chunk's K/V written
// into the cache (kv_cache.c) at its positions; n_past advances by the tokens encoded. The last layer's output feeds
// nothing, so it only stores K/V.
//
// Images: an image's soft-token rows take the projector's embeddings (not scaled) instead of their tokens' scaled
// embeddings, and attend bidirectionally within the image (its block); everything else stays causal. A block is
// never split across chunks: a row must see every key of its block, and a later chunk's keys do not exist yet.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine.h"

// Image rows of one chunk: block[t] = image index of row t (−1 for text); rows of an image in order take embd.
typedef struct chunk_images {
    const int *block;   // n entries, NULL when the chunk has no image rows
    const float *embd;  // [n_rows, n_embd]: the image rows' embeddings, in row order
    int n_rows;
} chunk_images;

// Mask for n rows at positions n_past.. over the slots of `span`, as transformers builds it for generate(): causal,
// sliding layers also hide keys ≤ p − W (which covers leading padding slots: they precede n_past − (W − 1)), and
// then, in every layer, a row sees every key of its own image block (block ids ≥ 0), even a later one or one beyond
// the window. Keys of a block all lie in this chunk; trailing padding slots lie after every row.
static void fill_encoder_mask(float *mask, dg_attn_span span, int base, int n_past, int n, int window, bool sliding,
                              const int *block) {
    for (int t = 0; t < n; t++) {
        const int p = n_past + t;
        for (int j = 0; j < span.len; j++) {
            const int s = base + span.first + j;  // position held by the slot
            bool visible = s <= p && (!sliding || s > p - window);
            if (!visible && block && block[t] >= 0 && s >= n_past && s < n_past + n) {
                visible = block[s - n_past] == block[t];
            }
            mask[(size_t)t * span.len + j] = visible ? 0.0f : -INFINITY;
        }
    }
}

// The chunk's input rows: the tokens' scaled embeddings, or for image rows the given embeddings. Both sets go into
// one [n_embd, n + n_img] tensor and get_rows picks each row from it: a pure copy, so text rows are bit-identical to
// a text-only pass and image rows are the projector's values exactly (standard ops: every backend runs them).
static struct ggml_tensor *build_inputs(struct ggml_context *gctx, const dg_model *m, struct ggml_tensor *ids_t,
                                        int n, int n_img, struct ggml_tensor **img_t, struct ggml_tensor **pick_t) {
    struct ggml_tensor *x = dg_build_embed(gctx, m, ids_t);
    if (n_img == 0) return x;
    *img_t = ggml_new_tensor_2d(gctx, GGML_TYPE_F32, m->hp.n_embd, n_img);
    *pick_t = ggml_new_tensor_1d(gctx, GGML_TYPE_I32, n);
    ggml_set_input(*img_t);
    ggml_set_input(*pick_t);
    return ggml_get_rows(gctx, ggml_concat(gctx, x, *img_t, 1), *pick_t);
}

static bool set_image_inputs(struct ggml_tensor *img_t, struct ggml_tensor *pick_t, const chunk_images *im, int n) {
    int32_t *pick = malloc(sizeof(int32_t) * (size_t)n);
    if (!pick) return false;
    for (int t = 0, k = 0; t < n; t++) pick[t] = im->block[t] >= 0 ? n + k++ : t;  // image rows follow the n token rows
    ggml_backend_tensor_set(pick_t, pick, 0, ggml_nbytes(pick_t));
    ggml_backend_tensor_set(img_t, im->embd, 0, ggml_nbytes(img_t));
    free(pick);
    return true;
}

static bool encode_chunk(dg_context *c, const int32_t *ids, int n, const chunk_images *im, char *err, size_t err_len) {
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

    struct ggml_tensor *img_t = NULL, *pick_t = NULL;
    struct ggml_tensor *x = build_inputs(gctx, m, ids_t, n, im->block ? im->n_rows : 0, &img_t, &pick_t);
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
            if (img_t) ok = set_image_inputs(img_t, pick_t, im, n);
            for (int kind = 0; ok && kind < 2; kind++) {
                if (!mask[kind]) continue;
                float *host = malloc(ggml_nbytes(mask[kind]));
                ok = host != NULL;
                if (!ok) break;
                fill_encoder_mask(host, spans[kind], kind == 1 ? c->swa_base : 0, c->n_past, n, m->hp.sliding_window,
                                  kind == 1, im->block);
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

// The image spans must be ascending, disjoint, inside the ids, and each must fit one pass (dg_kv_pass_rows).
static bool images_ok(const dg_context *c, int n, const dg_image_rows *images, char *err, size_t err_len) {
    if (images->n_spans < 0 || (images->n_spans > 0 && (!images->spans || !images->embd))) {
        dg_set_err(err, err_len, "image spans: %d spans without their rows or embeddings", images->n_spans);
        return false;
    }
    const int pass = dg_kv_pass_rows(c);
    int64_t end = 0;
    for (int i = 0; i < images->n_spans; i++) {
        const int64_t first = images->spans[2 * i], rows = images->spans[2 * i + 1];
        if (rows < 1 || first < end || first + rows > n) {
            dg_set_err(err, err_len, "image %d: rows %lld..%lld are not inside the %d tokens after the previous image",
                       i, (long long)first, (long long)(first + rows - 1), n);
            return false;
        }
        if (rows > pass) {
            dg_set_err(err, err_len,
                       "image %d has %lld soft tokens but one encoder pass of this context takes at most %d (its "
                       "sliding-window cache); make the context for images of up to %lld tokens",
                       i, (long long)rows, pass, (long long)rows);
            return false;
        }
        end = first + rows;
    }
    return true;
}

// Where the chunk that starts at row `off` ends: at most `chunk` rows, cut before an image block that would
// straddle its end, or stretched to hold a block that starts at `off` whole. *next_span: the first span not before off.
static int chunk_end(const dg_image_rows *images, int *next_span, int off, int n, int chunk) {
    int end = off + chunk < n ? off + chunk : n;
    while (*next_span < images->n_spans && images->spans[2 * *next_span] + images->spans[2 * *next_span + 1] <= off) {
        (*next_span)++;
    }
    for (int i = *next_span; i < images->n_spans; i++) {
        const int first = images->spans[2 * i], last = first + images->spans[2 * i + 1];
        if (first >= end) break;
        if (last > end) return first > off ? first : last;  // straddles: end before it, or take it whole
    }
    return end;
}

// Encodes n tokens after the cached ones, in chunks that fit a sliding cache after its retained tail.
int dg_encode(dg_context *c, const int32_t *ids, int n, const dg_image_rows *images, char *err, size_t err_len) {
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
    const dg_image_rows none = {0};
    if (!images) images = &none;
    if (!images_ok(c, n, images, err, err_len)) return -1;
    int *block = NULL;  // image index per row, -1 for text rows
    if (images->n_spans > 0) {
        if (!(block = malloc(sizeof(int) * (size_t)n))) {
            dg_set_err(err, err_len, "out of memory");
            return -1;
        }
        for (int t = 0; t < n; t++) block[t] = -1;
        for (int i = 0; i < images->n_spans; i++) {
            for (int r = 0; r < images->spans[2 * i + 1]; r++) block[images->spans[2 * i] + r] = i;
        }
    }
    const int chunk = dg_encode_chunk_rows(c->model);
    const size_t n_embd = (size_t)c->model->hp.n_embd;
    const float *embd = images->embd;  // the next image row's embedding
    int next_span = 0, rc = 0;
    for (int off = 0; off < n;) {
        const int end = chunk_end(images, &next_span, off, n, chunk);
        const int nc = end - off;
        chunk_images im = {.block = NULL, .embd = embd, .n_rows = 0};
        if (block) {
            for (int t = off; t < end; t++) im.n_rows += block[t] >= 0;
            if (im.n_rows > 0) im.block = block + off;
        }
        if (!dg_kv_make_room(c, nc, err, err_len) || !encode_chunk(c, ids + off, nc, &im, err, err_len)) {
            rc = -1;
            break;
        }
        embd += (size_t)im.n_rows * n_embd;
        off = end;
    }
    free(block);
    return rc;
}
