// Load a DiffusionGemma GGUF: map it read-only, validate it, point the weight tensors into the mapping.
//
// Order matters for hostile files: (1) dg_gguf_check walks the raw bytes, (2) ggml parses them, (3) every hparam is
// read with its type checked first (ggml's typed getters abort on a type mismatch), (4) every tensor is looked up
// and its shape and type checked against the hparams (docs/gguf.md#loader-checks). Only then are tensors used.
#define _GNU_SOURCE  // O_CLOEXEC, MAP_* under -std=c11
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "engine.h"
#include "gguf_names.h"

typedef struct loader {
    dg_model *m;
    char *err;
    size_t err_len;
} loader;

// ---------------------------------------------------------------------------------------------------------------
// metadata: typed reads that never hit ggml's asserting getters with the wrong type

static bool is_int_type(enum gguf_type t) {
    return t == GGUF_TYPE_UINT8 || t == GGUF_TYPE_INT8 || t == GGUF_TYPE_UINT16 || t == GGUF_TYPE_INT16 ||
           t == GGUF_TYPE_UINT32 || t == GGUF_TYPE_INT32 || t == GGUF_TYPE_UINT64 || t == GGUF_TYPE_INT64;
}

static size_t int_type_size(enum gguf_type t) {
    switch (t) {
        case GGUF_TYPE_UINT8: case GGUF_TYPE_INT8: case GGUF_TYPE_BOOL: return 1;
        case GGUF_TYPE_UINT16: case GGUF_TYPE_INT16: return 2;
        case GGUF_TYPE_UINT32: case GGUF_TYPE_INT32: return 4;
        default: return 8;
    }
}

static int64_t int_at(enum gguf_type t, const void *p) {
    switch (t) {
        case GGUF_TYPE_UINT8: return *(const uint8_t *)p;
        case GGUF_TYPE_INT8: return *(const int8_t *)p;
        case GGUF_TYPE_UINT16: return *(const uint16_t *)p;
        case GGUF_TYPE_INT16: return *(const int16_t *)p;
        case GGUF_TYPE_UINT32: return *(const uint32_t *)p;
        case GGUF_TYPE_INT32: return *(const int32_t *)p;
        case GGUF_TYPE_UINT64: {
            uint64_t v = *(const uint64_t *)p;
            return v > (uint64_t)INT64_MAX ? -1 : (int64_t)v;
        }
        case GGUF_TYPE_INT64: return *(const int64_t *)p;
        case GGUF_TYPE_BOOL: return *(const int8_t *)p != 0;
        default: return -1;
    }
}

// The key's id, -1 when it is absent and optional; false (with the error set) when a required key is absent.
static bool find_kv(loader *ld, const char *key, bool required, int64_t *id) {
    *id = gguf_find_key(ld->m->gguf, key);
    if (*id < 0 && required) {
        dg_set_err(ld->err, ld->err_len, "GGUF is missing the required key '%s'", key);
        return false;
    }
    return true;
}

// Integer key in [lo, hi]. Missing + !required -> def.
static bool kv_int(loader *ld, const char *key, bool required, int64_t def, int64_t lo, int64_t hi, int32_t *out) {
    const struct gguf_context *g = ld->m->gguf;
    int64_t id, v = def;
    if (!find_kv(ld, key, required, &id)) return false;
    if (id >= 0) {
        enum gguf_type t = gguf_get_kv_type(g, id);
        if (!is_int_type(t)) {
            dg_set_err(ld->err, ld->err_len, "GGUF key '%s' has type %s, expected an integer", key, gguf_type_name(t));
            return false;
        }
        v = int_at(t, gguf_get_val_data(g, id));
    }
    if (v < lo || v > hi) {
        dg_set_err(ld->err, ld->err_len, "GGUF key '%s' = %lld is out of range [%lld, %lld]", key, (long long)v,
                   (long long)lo, (long long)hi);
        return false;
    }
    *out = (int32_t)v;
    return true;
}

static bool kv_float(loader *ld, const char *key, bool required, double def, double lo, double hi, float *out) {
    const struct gguf_context *g = ld->m->gguf;
    int64_t id;
    double v = def;
    if (!find_kv(ld, key, required, &id)) return false;
    if (id >= 0) {
        enum gguf_type t = gguf_get_kv_type(g, id);
        if (t == GGUF_TYPE_FLOAT32) v = gguf_get_val_f32(g, id);
        else if (t == GGUF_TYPE_FLOAT64) v = gguf_get_val_f64(g, id);
        else {
            dg_set_err(ld->err, ld->err_len, "GGUF key '%s' has type %s, expected a float", key, gguf_type_name(t));
            return false;
        }
    }
    if (!(v >= lo && v <= hi)) {  // also rejects NaN
        dg_set_err(ld->err, ld->err_len, "GGUF key '%s' = %g is out of range [%g, %g]", key, v, lo, hi);
        return false;
    }
    *out = (float)v;
    return true;
}

// Per-layer integer array (or one scalar for all layers) of exactly n entries.
static bool kv_layer_ints(loader *ld, const char *key, int n, int64_t lo, int64_t hi, int32_t *out) {
    const struct gguf_context *g = ld->m->gguf;
    int64_t id;
    if (!find_kv(ld, key, true, &id)) return false;
    enum gguf_type t = gguf_get_kv_type(g, id);
    if (t != GGUF_TYPE_ARRAY) {
        int32_t v;
        if (!kv_int(ld, key, true, 0, lo, hi, &v)) return false;
        for (int i = 0; i < n; i++) out[i] = v;
        return true;
    }
    enum gguf_type at = gguf_get_arr_type(g, id);
    if (!is_int_type(at) && at != GGUF_TYPE_BOOL) {
        dg_set_err(ld->err, ld->err_len, "GGUF key '%s' is an array of %s, expected integers", key, gguf_type_name(at));
        return false;
    }
    if (gguf_get_arr_n(g, id) != (size_t)n) {
        dg_set_err(ld->err, ld->err_len, "GGUF key '%s' has %zu entries, expected block_count = %d", key,
                   gguf_get_arr_n(g, id), n);
        return false;
    }
    const uint8_t *data = gguf_get_arr_data(g, id);
    size_t es = int_type_size(at);
    for (int i = 0; i < n; i++) {
        int64_t v = int_at(at, data + (size_t)i * es);
        if (v < lo || v > hi) {
            dg_set_err(ld->err, ld->err_len, "GGUF key '%s'[%d] = %lld is out of range [%lld, %lld]", key, i,
                       (long long)v, (long long)lo, (long long)hi);
            return false;
        }
        out[i] = (int32_t)v;
    }
    return true;
}

static bool read_hparams(loader *ld) {
    dg_model *m = ld->m;
    dg_hparams *hp = &m->hp;
    const struct gguf_context *g = m->gguf;

    int64_t id = gguf_find_key(g, DG_KEY_ARCHITECTURE);
    if (id < 0 || gguf_get_kv_type(g, id) != GGUF_TYPE_STRING) {
        dg_set_err(ld->err, ld->err_len, "GGUF has no general.architecture string");
        return false;
    }
    const char *arch = gguf_get_val_str(g, id);
    if (strcmp(arch, DG_GGUF_ARCH) != 0) {
        dg_set_err(ld->err, ld->err_len, "unsupported model architecture '%.64s' (expected '" DG_GGUF_ARCH "')", arch);
        return false;
    }
    int32_t n_rot_full = 0, n_rot_swa = 0, v_len = 0, v_len_swa = 0;
    if (!kv_int(ld, DG_KEY_BLOCK_COUNT, true, 0, 1, DG_MAX_LAYERS, &hp->n_layer) ||
        !kv_int(ld, DG_KEY_CONTEXT_LENGTH, true, 0, 1, INT32_MAX, &hp->n_ctx_train) ||
        !kv_int(ld, DG_KEY_EMBEDDING_LENGTH, true, 0, 1, 1 << 16, &hp->n_embd) ||
        !kv_int(ld, DG_KEY_FEED_FORWARD_LENGTH, true, 0, 1, 1 << 20, &hp->n_ff) ||
        !kv_int(ld, DG_KEY_EXPERT_FEED_FORWARD_LENGTH, true, 0, 1, 1 << 20, &hp->n_ff_exp) ||
        !kv_int(ld, DG_KEY_EXPERT_COUNT, true, 0, 1, 4096, &hp->n_expert) ||
        !kv_int(ld, DG_KEY_EXPERT_USED_COUNT, true, 0, 1, 4096, &hp->n_expert_used) ||
        !kv_int(ld, DG_KEY_HEAD_COUNT, true, 0, 1, 4096, &hp->n_head) ||
        !kv_int(ld, DG_KEY_KEY_LENGTH, true, 0, 2, 1 << 14, &hp->head_dim_full) ||
        !kv_int(ld, DG_KEY_KEY_LENGTH_SWA, true, 0, 2, 1 << 14, &hp->head_dim_swa) ||
        !kv_int(ld, DG_KEY_VALUE_LENGTH, false, hp->head_dim_full, 1, 1 << 14, &v_len) ||
        !kv_int(ld, DG_KEY_VALUE_LENGTH_SWA, false, hp->head_dim_swa, 1, 1 << 14, &v_len_swa) ||
        !kv_int(ld, DG_KEY_SLIDING_WINDOW, true, 0, 1, INT32_MAX, &hp->sliding_window) ||
        !kv_int(ld, DG_KEY_ROPE_DIMENSION_COUNT, false, hp->head_dim_full, 1, 1 << 14, &n_rot_full) ||
        !kv_int(ld, DG_KEY_ROPE_DIMENSION_COUNT_SWA, false, hp->head_dim_swa, 1, 1 << 14, &n_rot_swa) ||
        !kv_int(ld, DG_KEY_CANVAS_LENGTH, true, 0, 1, DG_MAX_CANVAS, &hp->canvas_length) ||
        !kv_float(ld, DG_KEY_RMS_EPS, true, 0, 1e-30, 1.0, &hp->rms_eps) ||
        !kv_float(ld, DG_KEY_ROPE_FREQ_BASE, true, 0, 1.0, 1e30, &hp->rope_base_full) ||
        !kv_float(ld, DG_KEY_ROPE_FREQ_BASE_SWA, true, 0, 1.0, 1e30, &hp->rope_base_swa) ||
        !kv_float(ld, DG_KEY_LOGIT_SOFTCAP, false, 30.0, 1e-3, 1e6, &hp->logit_softcap)) {
        return false;
    }
    if (hp->n_expert_used > hp->n_expert) {
        dg_set_err(ld->err, ld->err_len, "expert_used_count %d exceeds expert_count %d", hp->n_expert_used, hp->n_expert);
        return false;
    }
    if (v_len != hp->head_dim_full || v_len_swa != hp->head_dim_swa) {
        dg_set_err(ld->err, ld->err_len, "value_length must equal key_length (V is the raw K projection on full layers)");
        return false;
    }
    if (n_rot_full != hp->head_dim_full || n_rot_swa != hp->head_dim_swa || hp->head_dim_full % 2 || hp->head_dim_swa % 2) {
        dg_set_err(ld->err, ld->err_len, "rope dimension counts (%d, %d) must equal the even head dims (%d, %d)",
                   n_rot_full, n_rot_swa, hp->head_dim_full, hp->head_dim_swa);
        return false;
    }
    int32_t pattern[DG_MAX_LAYERS];
    if (!kv_layer_ints(ld, DG_KEY_SLIDING_WINDOW_PATTERN, hp->n_layer, 0, 1, pattern) ||
        !kv_layer_ints(ld, DG_KEY_HEAD_COUNT_KV, hp->n_layer, 1, hp->n_head, hp->n_head_kv)) {
        return false;
    }
    for (int il = 0; il < hp->n_layer; il++) {
        hp->is_sliding[il] = (uint8_t)pattern[il];
        if (hp->n_head % hp->n_head_kv[il] != 0) {
            dg_set_err(ld->err, ld->err_len, "layer %d: head_count %d is not a multiple of head_count_kv %d", il,
                       hp->n_head, hp->n_head_kv[il]);
            return false;
        }
    }
    return true;
}

// ---------------------------------------------------------------------------------------------------------------
// tensors

enum tensor_kind { VEC_F32, MATRIX, ROUTER };

static bool matrix_type_ok(enum ggml_type t) {
    switch (t) {
        case GGML_TYPE_F32: case GGML_TYPE_F16: case GGML_TYPE_BF16:
        case GGML_TYPE_Q4_0: case GGML_TYPE_Q4_1: case GGML_TYPE_Q5_0: case GGML_TYPE_Q5_1: case GGML_TYPE_Q8_0:
        case GGML_TYPE_Q2_K: case GGML_TYPE_Q3_K: case GGML_TYPE_Q4_K: case GGML_TYPE_Q5_K: case GGML_TYPE_Q6_K:
        case GGML_TYPE_IQ2_XXS: case GGML_TYPE_IQ2_XS: case GGML_TYPE_IQ3_XXS: case GGML_TYPE_IQ1_S:
        case GGML_TYPE_IQ4_NL: case GGML_TYPE_IQ3_S: case GGML_TYPE_IQ2_S: case GGML_TYPE_IQ4_XS: case GGML_TYPE_IQ1_M:
            return true;
        default:
            return false;
    }
}

// Find a tensor and check it. ne2 = 0 means "2-D" (ne[2] == 1); ne1 = 0 means 1-D.
static struct ggml_tensor *want(loader *ld, bool required, const char *name, enum tensor_kind kind, int64_t ne0,
                                int64_t ne1, int64_t ne2) {
    struct ggml_tensor *t = ggml_get_tensor(ld->m->ctx_file, name);
    if (t == NULL) {
        if (required && ld->err[0] == 0) dg_set_err(ld->err, ld->err_len, "GGUF is missing tensor '%s'", name);
        return NULL;
    }
    int64_t want_ne[4] = {ne0, ne1 ? ne1 : 1, ne2 ? ne2 : 1, 1};
    if (t->ne[0] != want_ne[0] || t->ne[1] != want_ne[1] || t->ne[2] != want_ne[2] || t->ne[3] != 1) {
        dg_set_err(ld->err, ld->err_len, "tensor '%s' has shape [%lld, %lld, %lld, %lld], expected [%lld, %lld, %lld]",
                   name, (long long)t->ne[0], (long long)t->ne[1], (long long)t->ne[2], (long long)t->ne[3],
                   (long long)want_ne[0], (long long)want_ne[1], (long long)want_ne[2]);
        return NULL;
    }
    bool type_ok = kind == VEC_F32 ? t->type == GGML_TYPE_F32
                 : kind == ROUTER  ? (t->type == GGML_TYPE_F32 || t->type == GGML_TYPE_F16 || t->type == GGML_TYPE_BF16)
                                   : matrix_type_ok(t->type);
    if (!type_ok) {
        dg_set_err(ld->err, ld->err_len, "tensor '%s' has unsupported type %s for its role", name, ggml_type_name(t->type));
        return NULL;
    }
    return t;
}

static void warn(dg_model *m, const char *msg) {
    size_t used = strlen(m->warnings);
    snprintf(m->warnings + used, sizeof(m->warnings) - used, "%s%s", used ? "\n" : "", msg);
}

static bool bind_tensors(loader *ld) {
    dg_model *m = ld->m;
    dg_hparams *hp = &m->hp;
    const int64_t H = hp->n_embd, FF = hp->n_ff, FFe = hp->n_ff_exp, E = hp->n_expert;
    char name[128];

    m->tok_embd = ggml_get_tensor(m->ctx_file, DG_TENSOR_TOKEN_EMBD);
    if (!m->tok_embd) {
        dg_set_err(ld->err, ld->err_len, "GGUF is missing tensor 'token_embd.weight'");
        return false;
    }
    if (m->tok_embd->ne[1] > INT32_MAX) {
        dg_set_err(ld->err, ld->err_len, DG_TENSOR_TOKEN_EMBD " has too many rows");
        return false;
    }
    hp->n_vocab = (int32_t)m->tok_embd->ne[1];
    const int64_t V = hp->n_vocab;
    if (!want(ld, true, DG_TENSOR_TOKEN_EMBD, MATRIX, H, V, 0)) return false;
    // the vocabulary must match the embedding rows (the sampler draws uniformly over them)
    int64_t tid = gguf_find_key(m->gguf, DG_KEY_TOKENS);
    if (tid >= 0 && (gguf_get_kv_type(m->gguf, tid) != GGUF_TYPE_ARRAY || gguf_get_arr_n(m->gguf, tid) != (size_t)V)) {
        dg_set_err(ld->err, ld->err_len, DG_KEY_TOKENS " does not have %lld entries (" DG_STEM_TOKEN_EMBD " rows)", (long long)V);
        return false;
    }
    m->output = want(ld, false, DG_TENSOR_OUTPUT, MATRIX, H, V, 0);
    if (ld->err[0]) return false;
    hp->has_output = m->output != NULL;
    if (!(m->output_norm = want(ld, true, DG_TENSOR_OUTPUT_NORM, VEC_F32, H, 0, 0))) return false;

    bool any_full = false;
    for (int il = 0; il < hp->n_layer; il++) any_full |= !hp->is_sliding[il];
    m->rope_freqs = want(ld, false, DG_TENSOR_ROPE_FREQS, VEC_F32, hp->head_dim_full / 2, 0, 0);
    if (ld->err[0]) return false;
    if (any_full && !m->rope_freqs) {
        dg_set_err(ld->err, ld->err_len, "GGUF is missing tensor 'rope_freqs.weight' (partial rotary of full layers)");
        return false;
    }

    m->sc_pre_norm = want(ld, false, DG_TENSOR_SC_PRE_NORM, VEC_F32, H, 0, 0);
    if (!m->sc_pre_norm && !ld->err[0]) m->sc_pre_norm = want(ld, false, DG_TENSOR_SC_NORM_OLD, VEC_F32, H, 0, 0);
    m->sc_gate = want(ld, false, DG_TENSOR_SC_GATE, MATRIX, H, FF, 0);
    m->sc_up = want(ld, false, DG_TENSOR_SC_UP, MATRIX, H, FF, 0);
    m->sc_down = want(ld, false, DG_TENSOR_SC_DOWN, MATRIX, FF, H, 0);
    if (ld->err[0]) return false;
    int n_sc = !!m->sc_pre_norm + !!m->sc_gate + !!m->sc_up + !!m->sc_down;
    if (n_sc != 0 && n_sc != 4) {
        dg_set_err(ld->err, ld->err_len, "GGUF has only some of the self_cond_* tensors (need all four or none)");
        return false;
    }
    hp->has_self_cond = n_sc == 4;
    if (!hp->has_self_cond) warn(m, "GGUF has no self-conditioning tensors: self-conditioning disabled (not the reference model)");

    m->layers = calloc((size_t)hp->n_layer, sizeof(dg_layer));
    if (!m->layers) {
        dg_set_err(ld->err, ld->err_len, "out of memory");
        return false;
    }
    int missing_enc = 0;
    for (int il = 0; il < hp->n_layer; il++) {
        dg_layer *L = &m->layers[il];
        L->sliding = hp->is_sliding[il];
        L->n_head_kv = hp->n_head_kv[il];
        L->head_dim = L->sliding ? hp->head_dim_swa : hp->head_dim_full;
        const int64_t hd = L->head_dim, q_out = (int64_t)hp->n_head * hd, kv_out = (int64_t)L->n_head_kv * hd;
#define T(field, suffix, kind, a, b, c)                                             \
        snprintf(name, sizeof(name), DG_BLOCK suffix, il);                         \
        if (!(L->field = want(ld, true, name, kind, a, b, c))) return false;
        T(attn_norm, DG_TENSOR_ATTN_NORM, VEC_F32, H, 0, 0);
        T(wq, DG_TENSOR_ATTN_Q, MATRIX, H, q_out, 0);
        T(q_norm, DG_TENSOR_ATTN_Q_NORM, VEC_F32, hd, 0, 0);
        T(wk, DG_TENSOR_ATTN_K, MATRIX, H, kv_out, 0);
        T(k_norm, DG_TENSOR_ATTN_K_NORM, VEC_F32, hd, 0, 0);
        T(wo, DG_TENSOR_ATTN_OUTPUT, MATRIX, q_out, H, 0);
        T(post_attn_norm, DG_TENSOR_POST_ATTN_NORM, VEC_F32, H, 0, 0);
        T(ffn_norm, DG_TENSOR_FFN_NORM, VEC_F32, H, 0, 0);
        T(ffn_gate, DG_TENSOR_FFN_GATE, MATRIX, H, FF, 0);
        T(ffn_up, DG_TENSOR_FFN_UP, MATRIX, H, FF, 0);
        T(ffn_down, DG_TENSOR_FFN_DOWN, MATRIX, FF, H, 0);
        T(post_ffw_norm_1, DG_TENSOR_POST_FFW_NORM_1, VEC_F32, H, 0, 0);
        T(router, DG_TENSOR_ROUTER, ROUTER, H, E, 0);
        T(router_scale, DG_TENSOR_ROUTER_SCALE, VEC_F32, H, 0, 0);
        T(pre_ffw_norm_2, DG_TENSOR_PRE_FFW_NORM_2, VEC_F32, H, 0, 0);
        T(down_exps, DG_TENSOR_DOWN_EXPS, MATRIX, FFe, H, E);
        T(expert_scale, DG_TENSOR_EXPERT_SCALE, VEC_F32, E, 0, 0);
        T(post_ffw_norm_2, DG_TENSOR_POST_FFW_NORM_2, VEC_F32, H, 0, 0);
        T(post_ffw_norm, DG_TENSOR_POST_FFW_NORM, VEC_F32, H, 0, 0);
        T(dec_scale, DG_TENSOR_LAYER_SCALE, VEC_F32, 1, 0, 0);
#undef T
        snprintf(name, sizeof(name), DG_BLOCK DG_TENSOR_ATTN_V, il);
        L->wv = want(ld, L->sliding, name, MATRIX, H, kv_out, 0);
        if (L->sliding && !L->wv) return false;
        if (!L->sliding && L->wv) {
            warn(m, "attn_v present on a full-attention layer: ignored (V is the raw K projection there)");
            L->wv = NULL;
        }
        if (ld->err[0]) return false;

        snprintf(name, sizeof(name), DG_BLOCK DG_TENSOR_GATE_UP_EXPS, il);
        L->gate_up_exps = want(ld, false, name, MATRIX, H, 2 * FFe, E);
        if (ld->err[0]) return false;
        char gname[128], uname[128];
        snprintf(gname, sizeof(gname), DG_BLOCK DG_TENSOR_GATE_EXPS_SPLIT, il);
        snprintf(uname, sizeof(uname), DG_BLOCK DG_TENSOR_UP_EXPS_SPLIT, il);
        bool has_split = ggml_get_tensor(m->ctx_file, gname) || ggml_get_tensor(m->ctx_file, uname);
        if (L->gate_up_exps && has_split) {
            dg_set_err(ld->err, ld->err_len, "layer %d has both fused and split expert tensors", il);
            return false;
        }
        if (!L->gate_up_exps) {
            if (!has_split) {
                dg_set_err(ld->err, ld->err_len, "GGUF is missing tensor '%s' (or the split ffn_gate_exps/ffn_up_exps pair)", name);
                return false;
            }
            if (!(L->gate_exps = want(ld, true, gname, MATRIX, H, FFe, E))) return false;
            if (!(L->up_exps = want(ld, true, uname, MATRIX, H, FFe, E))) return false;
            hp->split_experts = 1;
        }

        snprintf(name, sizeof(name), DG_BLOCK DG_TENSOR_ENC_LAYER_SCALE, il);
        L->enc_scale = want(ld, false, name, VEC_F32, 1, 0, 0);
        if (!L->enc_scale && !ld->err[0]) {
            snprintf(name, sizeof(name), DG_BLOCK DG_TENSOR_ENC_LAYER_SCALE_OLD, il);
            L->enc_scale = want(ld, false, name, VEC_F32, 1, 0, 0);
        }
        if (ld->err[0]) return false;
        if (!L->enc_scale) {
            L->enc_scale = L->dec_scale;
            missing_enc++;
        }
    }
    hp->has_enc_scale = missing_enc == 0;
    if (missing_enc) warn(m, "GGUF has no encoder layer scalars (enc_layer_output_scale): using the decoder's for encoder passes");
    return true;
}

// Self-conditioning contracts soft probabilities [V] with the embedding, so ggml's matmul needs E with V as the
// contiguous dimension. F32 files get an exact F32 copy at load (what the fidelity goldens were recorded with). Any
// other type is read where it lies by the CPU's soft-embedding op (soft_embedding.c), which costs no memory; only
// when self-conditioning runs off that op (on an accelerator, or the standard-op graph) does placement ask for an F16
// copy (half the memory of F32; the probabilities are then rounded to F16 by ggml's matmul, within quantisation noise).
// ggml's F32 GEMM has no blocking along the contraction and slows down ~3x at V = 32768, so the copy is split into
// sc_chunks slices of sc_chunk vocabulary rows, ne [sc_chunk, H, sc_chunks] (zero rows pad the last slice); the
// step multiplies slice by slice and sums. At most SC_MAX_CHUNKS slices bound the partial sums' memory.
enum { SC_MIN_CHUNK = 2048, SC_MAX_CHUNKS = 32 };

bool dg_make_transposed_embedding(dg_model *m, char *err, size_t err_len) {
    const int64_t V = m->hp.n_vocab, H = m->hp.n_embd;
    const enum ggml_type src_type = m->tok_embd->type;
    const enum ggml_type dst_type = src_type == GGML_TYPE_F32 ? GGML_TYPE_F32 : GGML_TYPE_F16;
    int64_t target = (V + SC_MAX_CHUNKS - 1) / SC_MAX_CHUNKS;
    if (target < SC_MIN_CHUNK) target = SC_MIN_CHUNK;
    m->sc_chunks = (V + target - 1) / target;
    m->sc_chunk = ((V + m->sc_chunks - 1) / m->sc_chunks + 15) / 16 * 16;  // even slices, 16-aligned for the GEMM
    const int64_t KC = m->sc_chunk;

    struct ggml_init_params ip = {ggml_tensor_overhead() * 4, NULL, true};
    m->ctx_extra = ggml_init(ip);
    if (!m->ctx_extra) {
        dg_set_err(err, err_len, "out of memory");
        return false;
    }
    m->embd_t = ggml_new_tensor_3d(m->ctx_extra, dst_type, KC, H, m->sc_chunks);
    ggml_set_name(m->embd_t, DG_STEM_TOKEN_EMBD "_t");
    m->buf_extra = ggml_backend_alloc_ctx_tensors_from_buft(m->ctx_extra, ggml_backend_cpu_buffer_type());
    if (!m->buf_extra) {
        dg_set_err(err, err_len, "cannot allocate %.1f MiB for the transposed embedding",
                   ggml_nbytes(m->embd_t) / 1048576.0);
        m->embd_t = NULL;
        return false;
    }
    const ggml_to_float_t to_float = ggml_get_type_traits(src_type)->to_float;
    const size_t row_bytes = m->tok_embd->nb[1];
    enum { BLOCK = 64 };
    float *tmp = malloc(sizeof(float) * BLOCK * (size_t)H);
    if (!tmp) {
        dg_set_err(err, err_len, "out of memory");
        return false;
    }
    const char *src = m->tok_embd->data;
    memset(m->embd_t->data, 0, ggml_nbytes(m->embd_t));  // padding rows of the last slice
    for (int64_t v0 = 0; v0 < V; v0 += BLOCK) {
        const int64_t nb = V - v0 < BLOCK ? V - v0 : BLOCK;
        for (int64_t r = 0; r < nb; r++) {
            const void *row = src + (size_t)(v0 + r) * row_bytes;
            if (src_type == GGML_TYPE_F32) memcpy(tmp + r * H, row, sizeof(float) * (size_t)H);
            else to_float(row, tmp + r * H, H);
        }
        for (int64_t r = 0; r < nb; r++) {
            const int64_t v = v0 + r, chunk = v / KC, row = v % KC;
            const size_t base = (size_t)chunk * (size_t)(H * KC) + (size_t)row;  // element (row, h, chunk) at base + h·KC
            if (dst_type == GGML_TYPE_F32) {
                float *dst = (float *)m->embd_t->data + base;
                for (int64_t h = 0; h < H; h++) dst[h * KC] = tmp[r * H + h];
            } else {
                ggml_fp16_t *dst = (ggml_fp16_t *)m->embd_t->data + base;
                for (int64_t h = 0; h < H; h++) dst[h * KC] = ggml_fp32_to_fp16(tmp[r * H + h]);
            }
        }
    }
    free(tmp);
    return true;
}

dg_model *dg_model_load_impl(const char *path, int n_threads, bool check_only, char *err, size_t err_len) {
    if (err && err_len) err[0] = 0;
    if (n_threads > GGML_MAX_N_THREADS) {  // its graph holds a soft-embedding slice per thread
        dg_set_err(err, err_len, "n_threads must be at most %d (ggml's limit), got %d", GGML_MAX_N_THREADS, n_threads);
        return NULL;
    }
    dg_model *m = calloc(1, sizeof(dg_model));
    if (!m) {
        dg_set_err(err, err_len, "out of memory");
        return NULL;
    }
    loader ld = {m, err, err_len};
    m->n_threads = n_threads;
    m->map = MAP_FAILED;

    if (!dg_gguf_map(path, &m->map, &m->map_size, &m->gguf, &m->ctx_file, err, err_len)) goto fail;
    if (!read_hparams(&ld) || !bind_tensors(&ld)) goto fail;
    if (check_only) return m;  // every check a load makes is done; what follows allocates and cannot fail on the file

    // point every file tensor at its bytes inside the mapping (no copy: RSS grows only with pages touched)
    m->buf_file = ggml_backend_cpu_buffer_from_ptr(m->map, m->map_size);
    if (!m->buf_file) {
        dg_set_err(err, err_len, "cannot wrap the mapping in a ggml buffer");
        goto fail;
    }
    const size_t data_offset = gguf_get_data_offset(m->gguf);
    for (int64_t i = 0; i < gguf_get_n_tensors(m->gguf); i++) {
        struct ggml_tensor *t = ggml_get_tensor(m->ctx_file, gguf_get_tensor_name(m->gguf, i));
        const size_t off = data_offset + gguf_get_tensor_offset(m->gguf, i);
        if (!t || off > m->map_size || ggml_nbytes(t) > m->map_size - off) {  // checked before; never trust twice-parsed data
            dg_set_err(err, err_len, "tensor %lld lies outside the file", (long long)i);
            goto fail;
        }
        ggml_backend_tensor_alloc(m->buf_file, t, (char *)m->map + off);
    }
    if (m->hp.has_self_cond && m->tok_embd->type == GGML_TYPE_F32 && !dg_make_transposed_embedding(m, err, err_len)) goto fail;
    m->embd_scale = sqrtf((float)m->hp.n_embd);
    return m;
fail:
    dg_model_free_impl(m);
    return NULL;
}

void dg_model_free_impl(dg_model *m) {
    if (!m) return;
    if (m->buf_extra) ggml_backend_buffer_free(m->buf_extra);
    if (m->ctx_extra) ggml_free(m->ctx_extra);
    if (m->buf_file) ggml_backend_buffer_free(m->buf_file);
    dg_gguf_unmap(m->map, m->map_size, m->gguf, m->ctx_file);
    free(m->layers);
    free(m);
}
