// Gemma 4's vision encoder from a projector GGUF (llama.cpp's mtmd "gemma4v" layout; docs/engine.md#vision-encoder):
// load and validate the file like model.c (raw byte check, typed keys, every tensor's shape and type), then encode one
// image per call on a CPU backend of its own with standard ggml ops plus the engine's exact-f32 GELU and matmul ops.
//
// The graph is transformers' Gemma4VisionModel + Gemma4MultimodalEmbedder: patch projection of 2·(x − 0.5), x and y
// position rows summed; per layer RMSNorm·w, q/k/v with per-head q_norm·w / k_norm·w and a weightless v norm, 2-D RoPE
// (each head's first half rotated NEOX-style by the x position, the second by y), attention with scale 1 and no mask,
// post norms, gated GELU-tanh MLP; then the mean over each k×k block of patches (one matmul with a host-built
// averaging matrix), ×sqrt(H), the optional standardize, a weightless RMSNorm and the projection to the text width.
#define _GNU_SOURCE  // O_CLOEXEC, MAP_* under -std=c11
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "cpu.h"
#include "engine.h"
#include "vision_names.h"

static const char *const LINEAR_STEMS[DG_V_LINEARS] = {DG_V_ATTN_Q, DG_V_ATTN_K, DG_V_ATTN_V, DG_V_ATTN_OUT,
                                                       DG_V_FFN_GATE, DG_V_FFN_UP, DG_V_FFN_DOWN};
static const char *const BOUND_NAMES[4] = {DG_V_BOUND_INPUT_MIN, DG_V_BOUND_INPUT_MAX, DG_V_BOUND_OUTPUT_MIN,
                                           DG_V_BOUND_OUTPUT_MAX};
enum { L_Q, L_K, L_V, L_OUT, L_GATE, L_UP, L_DOWN };

typedef struct vloader {
    dg_vision_model *m;
    char *err;
    size_t err_len;
} vloader;

// ---------------------------------------------------------------------------------------------------------------
// metadata: typed reads (ggml's getters abort on a type mismatch, so the type is checked first)

static bool v_int(vloader *ld, const char *key, bool required, int64_t def, int64_t lo, int64_t hi, int32_t *out) {
    const int64_t id = gguf_find_key(ld->m->gguf, key);
    int64_t v = def;
    if (id < 0 && required) {
        dg_set_err(ld->err, ld->err_len, "projector GGUF is missing the required key '%s'", key);
        return false;
    }
    if (id >= 0) {
        switch (gguf_get_kv_type(ld->m->gguf, id)) {
            case GGUF_TYPE_UINT8: v = gguf_get_val_u8(ld->m->gguf, id); break;
            case GGUF_TYPE_INT8: v = gguf_get_val_i8(ld->m->gguf, id); break;
            case GGUF_TYPE_UINT16: v = gguf_get_val_u16(ld->m->gguf, id); break;
            case GGUF_TYPE_INT16: v = gguf_get_val_i16(ld->m->gguf, id); break;
            case GGUF_TYPE_UINT32: v = gguf_get_val_u32(ld->m->gguf, id); break;
            case GGUF_TYPE_INT32: v = gguf_get_val_i32(ld->m->gguf, id); break;
            case GGUF_TYPE_UINT64: {
                const uint64_t u = gguf_get_val_u64(ld->m->gguf, id);
                v = u > (uint64_t)INT64_MAX ? -1 : (int64_t)u;
                break;
            }
            case GGUF_TYPE_INT64: v = gguf_get_val_i64(ld->m->gguf, id); break;
            default:
                dg_set_err(ld->err, ld->err_len, "projector GGUF key '%s' has type %s, expected an integer", key,
                           gguf_type_name(gguf_get_kv_type(ld->m->gguf, id)));
                return false;
        }
    }
    if (v < lo || v > hi) {
        dg_set_err(ld->err, ld->err_len, "projector GGUF key '%s' = %lld is out of range [%lld, %lld]", key,
                   (long long)v, (long long)lo, (long long)hi);
        return false;
    }
    *out = (int32_t)v;
    return true;
}

static bool v_float(vloader *ld, const char *key, bool required, double def, double lo, double hi, float *out) {
    const int64_t id = gguf_find_key(ld->m->gguf, key);
    double v = def;
    if (id < 0 && required) {
        dg_set_err(ld->err, ld->err_len, "projector GGUF is missing the required key '%s'", key);
        return false;
    }
    if (id >= 0) {
        const enum gguf_type t = gguf_get_kv_type(ld->m->gguf, id);
        if (t == GGUF_TYPE_FLOAT32) v = gguf_get_val_f32(ld->m->gguf, id);
        else if (t == GGUF_TYPE_FLOAT64) v = gguf_get_val_f64(ld->m->gguf, id);
        else {
            dg_set_err(ld->err, ld->err_len, "projector GGUF key '%s' has type %s, expected a float", key,
                       gguf_type_name(t));
            return false;
        }
    }
    if (!(v > lo && v <= hi)) {  // also rejects NaN
        dg_set_err(ld->err, ld->err_len, "projector GGUF key '%s' = %g is out of range (%g, %g]", key, v, lo, hi);
        return false;
    }
    *out = (float)v;
    return true;
}

// A string key, or NULL (err set when required and absent or not a string).
static const char *v_string(vloader *ld, const char *key) {
    const int64_t id = gguf_find_key(ld->m->gguf, key);
    if (id < 0 || gguf_get_kv_type(ld->m->gguf, id) != GGUF_TYPE_STRING) {
        dg_set_err(ld->err, ld->err_len, "projector GGUF has no '%s' string", key);
        return NULL;
    }
    return gguf_get_val_str(ld->m->gguf, id);
}

static bool read_vision_hparams(vloader *ld) {
    dg_vision_hparams *hp = &ld->m->hp;
    const char *arch = v_string(ld, DG_V_KEY_ARCHITECTURE);
    if (!arch) return false;
    if (strcmp(arch, DG_V_ARCH) != 0) {
        dg_set_err(ld->err, ld->err_len, "not a vision projector: general.architecture is '%.64s' (expected '" DG_V_ARCH
                   "')", arch);
        return false;
    }
    const char *type = v_string(ld, DG_V_KEY_PROJECTOR_TYPE);
    if (!type) return false;
    if (strcmp(type, DG_V_PROJECTOR_GEMMA4V) != 0) {
        dg_set_err(ld->err, ld->err_len, "unsupported projector type '%.64s' (dgemma runs '" DG_V_PROJECTOR_GEMMA4V
                   "', Gemma 4's vision tower)", type);
        return false;
    }
    const int64_t enc = gguf_find_key(ld->m->gguf, DG_V_KEY_HAS_VISION_ENCODER);
    if (enc < 0 || gguf_get_kv_type(ld->m->gguf, enc) != GGUF_TYPE_BOOL || !gguf_get_val_bool(ld->m->gguf, enc)) {
        dg_set_err(ld->err, ld->err_len, "projector GGUF has no vision encoder (" DG_V_KEY_HAS_VISION_ENCODER ")");
        return false;
    }
    if (!v_int(ld, DG_V_KEY_EMBEDDING_LENGTH, true, 0, 1, 1 << 16, &hp->n_embd) ||
        !v_int(ld, DG_V_KEY_FEED_FORWARD_LENGTH, true, 0, 1, 1 << 20, &hp->n_ff) ||
        !v_int(ld, DG_V_KEY_BLOCK_COUNT, true, 0, 1, DG_MAX_LAYERS, &hp->n_layer) ||
        !v_int(ld, DG_V_KEY_HEAD_COUNT, true, 0, 1, 4096, &hp->n_head) ||
        !v_int(ld, DG_V_KEY_HEAD_COUNT_KV, false, hp->n_head, 1, hp->n_head, &hp->n_head_kv) ||
        !v_int(ld, DG_V_KEY_HEAD_DIM, false, hp->n_embd / hp->n_head, 4, 1 << 14, &hp->head_dim) ||
        !v_int(ld, DG_V_KEY_PATCH_SIZE, true, 0, 1, 1024, &hp->patch_size) ||
        !v_int(ld, DG_V_KEY_POOLING, false, 3, 1, 64, &hp->pooling) ||  // mtmd's default for gemma4v
        !v_int(ld, DG_V_KEY_PROJECTION_DIM, true, 0, 1, 1 << 16, &hp->n_embd_text) ||
        !v_int(ld, DG_V_KEY_MAX_SOFT_TOKENS, false, 280, 1, 1 << 16, &hp->max_soft_tokens) ||
        !v_float(ld, DG_V_KEY_LAYER_NORM_EPS, true, 0, 0.0, 1.0, &hp->eps) ||
        !v_float(ld, DG_V_KEY_ROPE_FREQ_BASE, false, 100.0, 1.0, 1e30, &hp->rope_base)) {  // mtmd hard-codes 100
        return false;
    }
    if (hp->head_dim % 4 || hp->n_head % hp->n_head_kv) {
        dg_set_err(ld->err, ld->err_len, "vision head_dim %d must be a multiple of 4 and head_count %d a multiple of "
                   "head_count_kv %d", hp->head_dim, hp->n_head, hp->n_head_kv);
        return false;
    }
    if ((int64_t)hp->max_soft_tokens * hp->pooling * hp->pooling > (1 << 20)) {
        dg_set_err(ld->err, ld->err_len, "vision max_soft_tokens %d × pooling² is too large", hp->max_soft_tokens);
        return false;
    }
    return true;
}

// ---------------------------------------------------------------------------------------------------------------
// tensors

enum vkind { V_VEC_F32, V_FLOAT, V_MATRIX };

static bool vision_matrix_type(enum ggml_type t) {
    switch (t) {
        case GGML_TYPE_F32: case GGML_TYPE_F16: case GGML_TYPE_BF16: case GGML_TYPE_Q8_0: case GGML_TYPE_Q4_0:
        case GGML_TYPE_Q4_1: case GGML_TYPE_Q5_0: case GGML_TYPE_Q5_1: case GGML_TYPE_Q4_K: case GGML_TYPE_Q5_K:
        case GGML_TYPE_Q6_K:
            return true;
        default:
            return false;
    }
}

// The tensor `name` with ne [a, b, c, d] (0 = 1) of the kind's types; NULL (err set when required or misshapen).
static struct ggml_tensor *vwant(vloader *ld, bool required, const char *name, enum vkind kind, int64_t a, int64_t b,
                                 int64_t c, int64_t d) {
    struct ggml_tensor *t = ggml_get_tensor(ld->m->ctx_file, name);
    if (!t) {
        if (required) dg_set_err(ld->err, ld->err_len, "projector GGUF is missing tensor '%s'", name);
        return NULL;
    }
    const int64_t ne[4] = {a, b ? b : 1, c ? c : 1, d ? d : 1};
    if (t->ne[0] != ne[0] || t->ne[1] != ne[1] || t->ne[2] != ne[2] || t->ne[3] != ne[3]) {
        dg_set_err(ld->err, ld->err_len, "tensor '%s' has shape [%lld, %lld, %lld, %lld], expected [%lld, %lld, %lld, "
                   "%lld]", name, (long long)t->ne[0], (long long)t->ne[1], (long long)t->ne[2], (long long)t->ne[3],
                   (long long)ne[0], (long long)ne[1], (long long)ne[2], (long long)ne[3]);
        return NULL;
    }
    const bool is_float = t->type == GGML_TYPE_F32 || t->type == GGML_TYPE_F16 || t->type == GGML_TYPE_BF16;
    const bool ok = kind == V_VEC_F32 ? t->type == GGML_TYPE_F32 : kind == V_FLOAT ? is_float : vision_matrix_type(t->type);
    if (!ok) {
        dg_set_err(ld->err, ld->err_len, "tensor '%s' has unsupported type %s for its role", name,
                   ggml_type_name(t->type));
        return NULL;
    }
    return t;
}

// Clip bounds of one linear (1-element F32 tensors, read from the mapping); absent ones stay unbounded.
static bool read_bounds(vloader *ld, int il, int lin, float bounds[4]) {
    char name[128];
    for (int b = 0; b < 4; b++) {
        bounds[b] = b % 2 ? INFINITY : -INFINITY;
        snprintf(name, sizeof(name), DG_V_BLOCK "%s.%s", il, LINEAR_STEMS[lin], BOUND_NAMES[b]);
        const int64_t id = gguf_find_tensor(ld->m->gguf, name);
        if (id < 0) continue;
        struct ggml_tensor *t = vwant(ld, true, name, V_VEC_F32, 1, 0, 0, 0);
        if (!t) return false;
        memcpy(&bounds[b], (const char *)ld->m->map + gguf_get_data_offset(ld->m->gguf) +
                               gguf_get_tensor_offset(ld->m->gguf, id), sizeof(float));
        if (isnan(bounds[b])) {
            dg_set_err(ld->err, ld->err_len, "clip bound '%s' is NaN", name);
            return false;
        }
        ld->m->hp.has_clip = 1;
    }
    if (bounds[0] > bounds[1] || bounds[2] > bounds[3]) {
        dg_set_err(ld->err, ld->err_len, "layer %d: the clip bounds of %s have min > max", il, LINEAR_STEMS[lin]);
        return false;
    }
    return true;
}

static bool bind_vision_tensors(vloader *ld) {
    dg_vision_model *m = ld->m;
    dg_vision_hparams *hp = &m->hp;
    const int64_t H = hp->n_embd, FF = hp->n_ff, p = hp->patch_size, hd = hp->head_dim;
    const int64_t q_out = (int64_t)hp->n_head * hd, kv_out = (int64_t)hp->n_head_kv * hd;

    if (!(m->patch_embd = vwant(ld, true, DG_V_TENSOR_PATCH_EMBD, V_FLOAT, p, p, 3, H))) return false;
    struct ggml_tensor *pos = ggml_get_tensor(m->ctx_file, DG_V_TENSOR_POSITION_EMBD);
    const int64_t P = pos ? pos->ne[1] : 0;
    if (pos && (P < 1 || P > (1 << 20))) {
        dg_set_err(ld->err, ld->err_len, DG_V_TENSOR_POSITION_EMBD " has %lld rows per table", (long long)P);
        return false;
    }
    if (!(m->pos_embd = vwant(ld, true, DG_V_TENSOR_POSITION_EMBD, V_VEC_F32, H, P, 2, 0))) return false;
    hp->n_pos_table = (int32_t)P;
    m->std_bias = vwant(ld, false, DG_V_TENSOR_STD_BIAS, V_VEC_F32, H, 0, 0, 0);
    m->std_scale = vwant(ld, false, DG_V_TENSOR_STD_SCALE, V_VEC_F32, H, 0, 0, 0);
    if (ld->err[0]) return false;
    if (!m->std_bias != !m->std_scale) {
        dg_set_err(ld->err, ld->err_len, "projector GGUF has only one of v.std_bias and v.std_scale");
        return false;
    }
    hp->has_standardize = m->std_bias != NULL;
    if (!(m->input_proj = vwant(ld, true, DG_V_TENSOR_INPUT_PROJECTION, V_MATRIX, H, hp->n_embd_text, 0, 0)))
        return false;

    m->layers = calloc((size_t)hp->n_layer, sizeof(dg_vision_layer));
    if (!m->layers) {
        dg_set_err(ld->err, ld->err_len, "out of memory");
        return false;
    }
    const int64_t lin_ne[DG_V_LINEARS][2] = {{H, q_out}, {H, kv_out}, {H, kv_out}, {q_out, H},
                                             {H, FF},    {H, FF},     {FF, H}};
    char name[128];
    for (int il = 0; il < hp->n_layer; il++) {
        dg_vision_layer *L = &m->layers[il];
#define VEC(field, suffix, n)                                                         \
        snprintf(name, sizeof(name), DG_V_BLOCK suffix, il);                         \
        if (!(L->field = vwant(ld, true, name, V_VEC_F32, n, 0, 0, 0))) return false;
        VEC(ln1, DG_V_LN1, H);
        VEC(q_norm, DG_V_ATTN_Q_NORM, hd);
        VEC(k_norm, DG_V_ATTN_K_NORM, hd);
        VEC(attn_post_norm, DG_V_ATTN_POST_NORM, H);
        VEC(ln2, DG_V_LN2, H);
        VEC(ffn_post_norm, DG_V_FFN_POST_NORM, H);
#undef VEC
        for (int lin = 0; lin < DG_V_LINEARS; lin++) {
            snprintf(name, sizeof(name), DG_V_BLOCK "%s.weight", il, LINEAR_STEMS[lin]);
            if (!(L->w[lin] = vwant(ld, true, name, V_MATRIX, lin_ne[lin][0], lin_ne[lin][1], 0, 0))) return false;
            if (!read_bounds(ld, il, lin, L->bounds[lin])) return false;
        }
    }
    return true;
}

void dg_vision_free_impl(dg_vision_model *m) {
    if (!m) return;
    if (m->backend) ggml_backend_free(m->backend);
    if (m->buf_file) ggml_backend_buffer_free(m->buf_file);
    dg_gguf_unmap(m->map, m->map_size, m->gguf, m->ctx_file);
    free(m->layers);
    free(m);
}

dg_vision_model *dg_vision_load_impl(const char *path, int n_threads, char *err, size_t err_len) {
    if (err && err_len) err[0] = 0;
    dg_vision_model *m = calloc(1, sizeof(dg_vision_model));
    if (!m) {
        dg_set_err(err, err_len, "out of memory");
        return NULL;
    }
    vloader ld = {m, err, err_len};
    m->map = MAP_FAILED;
    m->n_threads = n_threads > 0 ? n_threads : 1;

    if (!dg_gguf_map(path, &m->map, &m->map_size, &m->gguf, &m->ctx_file, err, err_len)) goto fail;
    // every tensor lies inside the file (dg_gguf_check walked them; never trust twice-parsed data)
    const size_t data_offset = gguf_get_data_offset(m->gguf);
    for (int64_t i = 0; i < gguf_get_n_tensors(m->gguf); i++) {
        struct ggml_tensor *t = ggml_get_tensor(m->ctx_file, gguf_get_tensor_name(m->gguf, i));
        const size_t off = data_offset + gguf_get_tensor_offset(m->gguf, i);
        if (!t || off > m->map_size || ggml_nbytes(t) > m->map_size - off) {
            dg_set_err(err, err_len, "tensor %lld lies outside the file", (long long)i);
            goto fail;
        }
    }
    if (!read_vision_hparams(&ld) || !bind_vision_tensors(&ld)) goto fail;

    m->buf_file = ggml_backend_cpu_buffer_from_ptr(m->map, m->map_size);
    if (!m->buf_file) {
        dg_set_err(err, err_len, "cannot wrap the mapping in a ggml buffer");
        goto fail;
    }
    for (int64_t i = 0; i < gguf_get_n_tensors(m->gguf); i++) {
        struct ggml_tensor *t = ggml_get_tensor(m->ctx_file, gguf_get_tensor_name(m->gguf, i));
        ggml_backend_tensor_alloc(m->buf_file, t, (char *)m->map + data_offset + gguf_get_tensor_offset(m->gguf, i));
    }
    m->backend = ggml_backend_cpu_init();
    if (!m->backend) {
        dg_set_err(err, err_len, "cannot start ggml's CPU backend");
        goto fail;
    }
    ggml_backend_cpu_set_n_threads(m->backend, m->n_threads);
    return m;
fail:
    dg_vision_free_impl(m);
    return NULL;
}

// ---------------------------------------------------------------------------------------------------------------
// the graph

typedef struct vgraph {
    struct ggml_context *ctx;
    const dg_vision_model *m;
    struct ggml_tensor *pos_x, *pos_y;
} vgraph;

static struct ggml_tensor *norm_w(vgraph *g, struct ggml_tensor *x, struct ggml_tensor *w) {
    struct ggml_tensor *y = ggml_rms_norm(g->ctx, x, g->m->hp.eps);
    return w ? ggml_mul(g->ctx, y, w) : y;
}

// A Gemma4ClippableLinear: clamp the input, project, clamp the output (each only where the file has bounds).
static struct ggml_tensor *linear(vgraph *g, const dg_vision_layer *L, int lin, struct ggml_tensor *x) {
    const float *b = L->bounds[lin];
    if (isfinite(b[0]) || isfinite(b[1])) x = ggml_clamp(g->ctx, x, b[0], b[1]);
    struct ggml_tensor *y = dg_build_weight_matmul(g->ctx, L->w[lin], x, true);
    if (isfinite(b[2]) || isfinite(b[3])) y = ggml_clamp(g->ctx, y, b[2], b[3]);
    return y;
}

// 2-D RoPE on x [hd, heads, n]: the first half of each head NEOX-rotated by the x positions, the second by y.
static struct ggml_tensor *rope_2d(vgraph *g, struct ggml_tensor *x) {
    const int64_t hd = x->ne[0], half = hd / 2;
    struct ggml_tensor *parts[2];
    struct ggml_tensor *pos[2] = {g->pos_x, g->pos_y};
    for (int i = 0; i < 2; i++) {
        struct ggml_tensor *v = ggml_view_3d(g->ctx, x, half, x->ne[1], x->ne[2], x->nb[1], x->nb[2],
                                             (size_t)i * half * ggml_element_size(x));
        parts[i] = ggml_rope_ext(g->ctx, v, pos[i], NULL, (int)half, GGML_ROPE_TYPE_NEOX, 0, g->m->hp.rope_base, 1.0f,
                                 0.0f, 1.0f, 0.0f, 0.0f);
    }
    return ggml_concat(g->ctx, parts[0], parts[1], 0);
}

// softmax(k·q)·v of one head: k [hd, n], q [hd, n] (rows of hd), v [n, hd] -> [hd, n], through the engine's F32
// panel product (ggml's F32 matmul vectorises along hd = 72 and ran the released tower's attention 2-3x slower);
// NULL where that product does not apply (no AVX2), and the caller keeps ggml's batched form.
static struct ggml_tensor *head_attention(struct ggml_context *ctx, struct ggml_tensor *k, struct ggml_tensor *q,
                                          struct ggml_tensor *v) {
    struct ggml_tensor *kq = dg_build_f32_matmul(ctx, k, q);
    if (!kq) return NULL;
    return dg_build_f32_matmul(ctx, v, ggml_soft_max_ext(ctx, kq, NULL, 1.0f, 0.0f));  // scale 1, no mask
}

// Column-wise concatenation of parts[0..n) along dim 0, as a balanced tree (each level copies the whole once).
static struct ggml_tensor *concat_rows(struct ggml_context *ctx, struct ggml_tensor **parts, int n) {
    if (n == 1) return parts[0];
    return ggml_concat(ctx, concat_rows(ctx, parts, n / 2), concat_rows(ctx, parts + n / 2, n - n / 2), 0);
}

static struct ggml_tensor *attention(vgraph *g, const dg_vision_layer *L, struct ggml_tensor *x, int64_t n) {
    const dg_vision_hparams *hp = &g->m->hp;
    struct ggml_context *ctx = g->ctx;
    const int64_t hd = hp->head_dim;
    struct ggml_tensor *q = ggml_reshape_3d(ctx, linear(g, L, L_Q, x), hd, hp->n_head, n);
    struct ggml_tensor *k = ggml_reshape_3d(ctx, linear(g, L, L_K, x), hd, hp->n_head_kv, n);
    struct ggml_tensor *v = ggml_reshape_3d(ctx, linear(g, L, L_V, x), hd, hp->n_head_kv, n);
    q = rope_2d(g, norm_w(g, q, L->q_norm));
    k = rope_2d(g, norm_w(g, k, L->k_norm));
    v = norm_w(g, v, NULL);
    struct ggml_tensor *Kt = ggml_cont(ctx, ggml_permute(ctx, k, 0, 2, 1, 3));  // [hd, n, kv heads]
    struct ggml_tensor *Vt = ggml_cont(ctx, ggml_permute(ctx, v, 1, 2, 0, 3));  // [n, hd, kv heads]
    struct ggml_tensor *heads[4096];  // n_head <= 4096 (read_vision_hparams)
    const int group = hp->n_head / hp->n_head_kv;  // query heads per K/V head, as transformers' repeat_kv
    bool per_head = true;
    for (int h = 0; per_head && h < hp->n_head; h++) {
        const int kv = h / group;
        struct ggml_tensor *qh = ggml_view_2d(ctx, q, hd, n, q->nb[2], (size_t)h * q->nb[1]);
        struct ggml_tensor *kh = ggml_view_2d(ctx, Kt, hd, n, Kt->nb[1], (size_t)kv * Kt->nb[2]);
        struct ggml_tensor *vh = ggml_view_2d(ctx, Vt, n, hd, Vt->nb[1], (size_t)kv * Vt->nb[2]);
        per_head = (heads[h] = head_attention(ctx, kh, qh, vh)) != NULL;
    }
    struct ggml_tensor *out;
    if (per_head) {
        out = concat_rows(ctx, heads, hp->n_head);  // [hd · heads, n]
    } else {
        struct ggml_tensor *Q = ggml_permute(ctx, q, 0, 2, 1, 3);  // [hd, n, heads]
        struct ggml_tensor *kq = ggml_soft_max_ext(ctx, ggml_mul_mat(ctx, Kt, Q), NULL, 1.0f, 0.0f);  // scale 1
        out = ggml_mul_mat(ctx, Vt, kq);                             // [hd, n, heads]
        out = ggml_cont_2d(ctx, ggml_permute(ctx, out, 0, 2, 1, 3), hd * hp->n_head, n);
    }
    return linear(g, L, L_OUT, out);
}

static struct ggml_tensor *mlp(vgraph *g, const dg_vision_layer *L, struct ggml_tensor *x) {
    struct ggml_tensor *act = dg_build_gelu_mul(g->ctx, linear(g, L, L_GATE, x), linear(g, L, L_UP, x), true);
    return linear(g, L, L_DOWN, act);
}

// The soft-token index of each patch: its k×k block in the grid of blocks, row-major, as transformers' pooler
// numbers them ((x / k) + (max_x + 1) / k · (y / k)). -1 with err when the positions are out of the tables or do not
// tile n / k² full blocks.
static int pooling_targets(const dg_vision_model *m, const int32_t *positions, int n, int32_t *target, char *err,
                           size_t err_len) {
    const int k = m->hp.pooling, k2 = k * k, n_soft = n / k2;
    int32_t max_x = 0;
    for (int i = 0; i < n; i++) {
        const int32_t x = positions[2 * i], y = positions[2 * i + 1];
        if (x < 0 || y < 0 || x >= m->hp.n_pos_table || y >= m->hp.n_pos_table) {
            dg_set_err(err, err_len, "patch %d has position (%d, %d) outside the position table (0..%d)", i, x, y,
                       m->hp.n_pos_table - 1);
            return -1;
        }
        if (x > max_x) max_x = x;
    }
    int32_t *count = calloc((size_t)n_soft, sizeof(int32_t));
    if (!count) {
        dg_set_err(err, err_len, "out of memory");
        return -1;
    }
    const int64_t blocks_x = ((int64_t)max_x + 1) / k;
    for (int i = 0; i < n; i++) {
        const int64_t t = positions[2 * i] / k + blocks_x * (positions[2 * i + 1] / k);
        if (t >= n_soft || count[t] == k2) {
            free(count);
            dg_set_err(err, err_len, "patch positions do not tile %d full %d×%d blocks", n_soft, k, k);
            return -1;
        }
        count[t]++;
        target[i] = (int32_t)t;
    }
    free(count);
    return n_soft;
}

// Nodes of one image's graph: per layer ~60 plus ~12 per head (views, two products, a softmax, the concatenation).
static size_t graph_nodes(const dg_vision_hparams *hp) { return (64 + 12 * (size_t)hp->n_head) * hp->n_layer + 256; }

static struct ggml_cgraph *build_vision_graph(vgraph *g, int64_t n, int64_t n_soft, struct ggml_tensor **inp,
                                              struct ggml_tensor **pool, struct ggml_tensor **result) {
    const dg_vision_model *m = g->m;
    const dg_vision_hparams *hp = &m->hp;
    struct ggml_context *ctx = g->ctx;
    struct ggml_cgraph *gf = ggml_new_graph_custom(ctx, graph_nodes(hp), false);
    const int64_t H = hp->n_embd, p = hp->patch_size;

    *inp = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, 3 * p * p, n);  // 2·(x − 0.5), channel-major per patch
    g->pos_x = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n);
    g->pos_y = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, n);
    *pool = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n, n_soft);  // column j: 1/k² on the patches of soft token j
    ggml_set_input(*inp);
    ggml_set_input(g->pos_x);
    ggml_set_input(g->pos_y);
    ggml_set_input(*pool);

    // the patch kernel [p, p, 3, H] is one [3·p·p, H] matrix over the channel-major patch
    struct ggml_tensor *w_patch = ggml_reshape_2d(ctx, m->patch_embd, 3 * p * p, H);
    struct ggml_tensor *x = dg_build_weight_matmul(ctx, w_patch, *inp, true);
    const size_t row = m->pos_embd->nb[1];
    struct ggml_tensor *tab_x = ggml_view_2d(ctx, m->pos_embd, H, hp->n_pos_table, row, 0);
    struct ggml_tensor *tab_y = ggml_view_2d(ctx, m->pos_embd, H, hp->n_pos_table, row, row * hp->n_pos_table);
    x = ggml_add(ctx, x, ggml_add(ctx, ggml_get_rows(ctx, tab_x, g->pos_x), ggml_get_rows(ctx, tab_y, g->pos_y)));

    for (int il = 0; il < hp->n_layer; il++) {
        const dg_vision_layer *L = &m->layers[il];
        struct ggml_tensor *a = attention(g, L, norm_w(g, x, L->ln1), n);
        x = ggml_add(ctx, x, norm_w(g, a, L->attn_post_norm));
        struct ggml_tensor *f = mlp(g, L, norm_w(g, x, L->ln2));
        x = ggml_add(ctx, x, norm_w(g, f, L->ffn_post_norm));
    }

    // pooling: [H, n] · [n, n_soft] as mul_mat(xᵀ [n, H], pool [n, n_soft]) = [H, n_soft], then ×sqrt(H)
    struct ggml_tensor *pooled = ggml_mul_mat(ctx, ggml_cont(ctx, ggml_transpose(ctx, x)), *pool);
    pooled = ggml_scale(ctx, pooled, (float)sqrt((double)H));
    if (m->std_bias) pooled = ggml_mul(ctx, ggml_sub(ctx, pooled, m->std_bias), m->std_scale);
    struct ggml_tensor *out = dg_build_weight_matmul(ctx, m->input_proj, norm_w(g, pooled, NULL), true);
    ggml_set_output(out);
    ggml_build_forward_expand(gf, out);
    *result = out;
    return gf;
}

int dg_vision_encode(dg_vision_model *m, const float *patches, const int32_t *positions, int n_patches, float *out,
                     int out_rows, char *err, size_t err_len) {
    const dg_vision_hparams *hp = &m->hp;
    const int k2 = hp->pooling * hp->pooling, p = hp->patch_size, pp = p * p;
    const int max_patches = hp->max_soft_tokens * k2;
    if (n_patches < k2 || n_patches % k2 || n_patches > max_patches) {
        dg_set_err(err, err_len, "an image must have a positive multiple of %d patches, at most %d (max_soft_tokens "
                   "%d × %d²); got %d", k2, max_patches, hp->max_soft_tokens, hp->pooling, n_patches);
        return -1;
    }
    const int n_soft = n_patches / k2;
    if (out_rows < n_soft) {
        dg_set_err(err, err_len, "output has room for %d soft tokens, the image makes %d", out_rows, n_soft);
        return -1;
    }
    int32_t *target = malloc(sizeof(int32_t) * (size_t)n_patches);
    int32_t *px = malloc(sizeof(int32_t) * (size_t)n_patches), *py = malloc(sizeof(int32_t) * (size_t)n_patches);
    float *inp_host = malloc(sizeof(float) * (size_t)n_patches * 3 * pp);
    float *pool_host = calloc((size_t)n_patches * n_soft, sizeof(float));
    struct ggml_context *ctx = NULL;
    ggml_gallocr_t galloc = NULL;
    int result = -1;
    if (!target || !px || !py || !inp_host || !pool_host) {
        dg_set_err(err, err_len, "out of memory");
        goto done;
    }
    if (pooling_targets(m, positions, n_patches, target, err, err_len) < 0) goto done;
    for (int i = 0; i < n_patches; i++) {
        px[i] = positions[2 * i];
        py[i] = positions[2 * i + 1];
        pool_host[(size_t)target[i] * n_patches + i] = 1.0f / (float)k2;
        // HF order (row, column, channel) -> the kernel's (channel, row, column); the embedder's 2·(x − 0.5)
        const float *src = patches + (size_t)i * 3 * pp;
        float *dst = inp_host + (size_t)i * 3 * pp;
        for (int c = 0; c < 3; c++)
            for (int r = 0; r < pp; r++) dst[c * pp + r] = 2.0f * (src[r * 3 + c] - 0.5f);
    }

    const size_t n_nodes = graph_nodes(hp);
    struct ggml_init_params ip = {ggml_tensor_overhead() * n_nodes + ggml_graph_overhead_custom(n_nodes, false), NULL,
                                  true};
    ctx = ggml_init(ip);
    if (!ctx) {
        dg_set_err(err, err_len, "out of memory");
        goto done;
    }
    vgraph g = {ctx, m, NULL, NULL};
    struct ggml_tensor *inp, *pool, *res;
    struct ggml_cgraph *gf = build_vision_graph(&g, n_patches, n_soft, &inp, &pool, &res);
    galloc = ggml_gallocr_new(ggml_backend_cpu_buffer_type());
    if (!galloc || !ggml_gallocr_alloc_graph(galloc, gf)) {
        dg_set_err(err, err_len, "cannot allocate the vision graph (%d patches)", n_patches);
        goto done;
    }
    ggml_backend_tensor_set(inp, inp_host, 0, ggml_nbytes(inp));
    ggml_backend_tensor_set(g.pos_x, px, 0, ggml_nbytes(g.pos_x));
    ggml_backend_tensor_set(g.pos_y, py, 0, ggml_nbytes(g.pos_y));
    ggml_backend_tensor_set(pool, pool_host, 0, ggml_nbytes(pool));
    const unsigned int fp_mode = dg_fp_enter_fast();  // as the text graphs: subnormals flushed
    const enum ggml_status status = ggml_backend_graph_compute(m->backend, gf);
    dg_fp_leave(fp_mode);
    if (status != GGML_STATUS_SUCCESS) {
        dg_set_err(err, err_len, "the vision graph failed (ggml status %d)", (int)status);
        goto done;
    }
    ggml_backend_tensor_get(res, out, 0, sizeof(float) * (size_t)n_soft * hp->n_embd_text);
    result = n_soft;
done:
    if (galloc) ggml_gallocr_free(galloc);
    if (ctx) ggml_free(ctx);
    free(target);
    free(px);
    free(py);
    free(inp_host);
    free(pool_host);
    return result;
}
