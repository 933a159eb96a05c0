// The K/V ring: which cache slot holds which position, room in the sliding layers' caches, attention spans.
//
// One F32 K and one transposed F32 V tensor per layer (allocated with the context, context.c). Full layers: slot =
// position, n_slots slots. Sliding layers only ever read the last W−1 context positions (exactly what transformers'
// DynamicCache retains), so their cache holds W−1 + alignment + one chunk of rows; when it is full, the still-visible
// tail moves to the front (swa_base = position of slot 0). The decoder writes its canvas K/V into the free slots after
// n_past as scratch (never committed: n_past is unchanged).
#include <stdlib.h>
#include <string.h>

#include "engine.h"

enum { MIN_ENCODE_CHUNK = 32 };

// ggml's fast F32 GEMM (llamafile sgemm) needs the contraction length to be a multiple of 16; in P·V that is the
// number of keys (else ggml falls back to one dot product per output, ~10x slower). Spans are rounded up with earlier
// (valid, cached) slots where a sliding layer has them, else with unused slots after the new rows; the mask hides both.
enum { KEY_MULTIPLE = 16 };

int dg_encode_chunk_rows(const dg_model *m) {
    return m->hp.canvas_length > MIN_ENCODE_CHUNK ? m->hp.canvas_length : MIN_ENCODE_CHUNK;
}

int dg_kv_sliding_slots(const dg_model *m, int max_canvases, int image_rows, int n_slots) {
    const int64_t step_rows = (int64_t)max_canvases * m->hp.canvas_length;
    int64_t new_rows = step_rows > dg_encode_chunk_rows(m) ? step_rows : dg_encode_chunk_rows(m);
    if (image_rows > new_rows) new_rows = image_rows;  // an image block is encoded in one pass (encoder.c)
    const int64_t swa_cap = (int64_t)m->hp.sliding_window - 1 + KEY_MULTIPLE - 1 + new_rows;
    return swa_cap < n_slots ? (int)swa_cap : n_slots;
}

// dg_kv_make_room keeps at most W − 1 + KEY_MULTIPLE − 1 visible slots; the rest of a sliding cache takes new rows.
// A cache as large as the whole context never moves, so any pass fits; so does any pass of a model without sliding
// layers.
int dg_kv_pass_rows(const dg_context *c) {
    bool any_sliding = false;
    for (int il = 0; il < c->model->hp.n_layer; il++) any_sliding = any_sliding || c->model->layers[il].sliding;
    if (!any_sliding || c->swa_cap >= c->n_slots) return c->n_ctx;
    return c->swa_cap - (c->model->hp.sliding_window - 1 + KEY_MULTIPLE - 1);
}

int dg_kv_slot(const dg_context *c, int il, int pos) {
    return c->model->layers[il].sliding ? pos - c->swa_base : pos;
}

// A cache tensor's bytes on the host: its own memory on the CPU, else a copy (device caches; write_back after).
static void *host_bytes(dg_context *c, struct ggml_tensor *t) {
    if (ggml_backend_buffer_is_host(t->buffer)) return t->data;
    void *copy = malloc(ggml_nbytes(t));
    if (copy) dg_tensor_get(c, t, copy, 0, ggml_nbytes(t));
    return copy;
}

static void write_back(dg_context *c, struct ggml_tensor *t, void *bytes) {
    if (bytes == t->data) return;
    dg_tensor_set(c, t, bytes, 0, ggml_nbytes(t));
    free(bytes);
}

bool dg_kv_make_room(dg_context *c, int n, char *err, size_t err_len) {
    const dg_model *m = c->model;
    if (c->n_past + n - c->swa_base <= c->swa_cap) return true;
    const int visible = m->hp.sliding_window - 1 + KEY_MULTIPLE - 1;
    const int keep = c->n_past < visible ? c->n_past : visible;
    const int shift = c->n_past - keep - c->swa_base;
    for (int il = 0; il < m->hp.n_layer; il++) {
        if (!m->layers[il].sliding) continue;
        struct ggml_tensor *kc = c->k_cache[il], *vc = c->v_cache[il];
        char *k = host_bytes(c, kc);
        float *v = host_bytes(c, vc);
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
        write_back(c, kc, k);
        write_back(c, vc, v);
    }
    c->swa_base += shift;
    return true;
}

dg_attn_span dg_kv_span(const dg_context *c, int il, int n_past, int n_new) {
    const dg_model *m = c->model;
    const bool sliding = m->layers[il].sliding;
    dg_attn_span s = {.first = 0, .len = n_past + n_new};
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
void dg_kv_clear_tail(dg_context *c, int n_past, int n_new) {
    for (int il = 0; il < c->model->hp.n_layer; il++) {
        const dg_attn_span s = dg_kv_span(c, il, n_past, n_new);
        if (s.tail == 0) continue;
        struct ggml_tensor *kc = c->k_cache[il], *vc = c->v_cache[il];
        const int from = s.first + s.len - s.tail;
        ggml_backend_tensor_memset(kc, 0, (size_t)from * kc->nb[2], (size_t)s.tail * kc->nb[2]);
        for (int64_t r = 0; r < vc->ne[1] * vc->ne[2]; r++) {  // V is transposed: every (dim, head) row holds slots
            ggml_backend_tensor_memset(vc, 0, sizeof(float) * (size_t)(r * vc->ne[0] + from), sizeof(float) * (size_t)s.tail);
        }
    }
}
