// GGUF LoRA adapters (docs/gguf.md#lora-adapters): llama.cpp's layout, with a pass prefix for DiffusionGemma.
//
// A file holds `[enc.|dec.]blk.N.<target>.weight.lora_a` (ne [n_in, r(, E)]) and `….lora_b` (ne [r, n_out(, E)]);
// delta(W)·x = B·(A·x)·alpha/r·scale. `enc.` applies in the encoder pass only (prefill, commit), `dec.` in the
// decoder pass only (denoising steps), no prefix in both; `[dec.]self_cond_{gate,up,down}.weight.lora_*` adapt the
// self-conditioning MLP (decoder only). Every file is checked completely (header bytes, metadata,
// each tensor's name, type and shape against the base) before anything is allocated; then, per layer, pass and
// target, all adapters are folded into one F32 pair: ranks concatenated, each adapter's alpha/r·scale multiplied into
// its B. The graph adds b·(a·x) to the base matmul (graph.c), whatever the base weight's type: quantized bases are
// never requantized. A fused gate_up expert delta on a base with split gate/up experts is split along its B rows (and
// the other way round), so an adapter fits either form of the base.
#define _GNU_SOURCE  // O_CLOEXEC, MAP_* under -std=c11
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "engine.h"
#include "gguf_names.h"

enum { MAX_RANK = 1 << 16, SCOPES = 3 };  // scope 0: both passes, 1: encoder only ("enc."), 2: decoder only ("dec.")

static const char *const TARGET_NAMES[DG_LORA_TARGETS] = {
    DG_TENSOR_ATTN_Q, DG_TENSOR_ATTN_K, DG_TENSOR_ATTN_V, DG_TENSOR_ATTN_OUTPUT, DG_TENSOR_FFN_GATE, DG_TENSOR_FFN_UP,
    DG_TENSOR_FFN_DOWN, DG_TENSOR_ROUTER, DG_TENSOR_GATE_UP_EXPS, DG_TENSOR_GATE_EXPS_SPLIT, DG_TENSOR_UP_EXPS_SPLIT,
    DG_TENSOR_DOWN_EXPS,
};
static const char *const SCOPE_PREFIX[SCOPES] = {"", DG_LORA_PREFIX_ENCODER, DG_LORA_PREFIX_DECODER};
static const char *const SELF_COND_NAMES[DG_LORA_TARGETS] = {
    [DG_LORA_GATE] = DG_TENSOR_SC_GATE, [DG_LORA_UP] = DG_TENSOR_SC_UP, [DG_LORA_DOWN] = DG_TENSOR_SC_DOWN,
};
// Units: layers 0..n_layer-1, then unit n_layer = the self-conditioning MLP (targets GATE, UP, DOWN).

typedef struct lora_pair {
    const struct ggml_tensor *a, *b;  // metadata in the file's context (no data)
    const uint8_t *a_data, *b_data;   // their bytes in the mapping
} lora_pair;

typedef struct lora_file {
    void *map;
    size_t size;
    struct gguf_context *gguf;
    struct ggml_context *ctx;
    float alpha, scale;
    lora_pair *pairs;  // [unit][target][scope]
} lora_file;

// Where part of an adapter's delta goes: rows [src_row, src_row + rows) of its B become rows [dst_row, …) of the
// folded delta of `slot` (the same target, except across the fused and split forms of the gate/up experts).
typedef struct lora_piece {
    int slot;
    int64_t src_row, rows, dst_row;
} lora_piece;

static lora_pair *pair_at(const lora_file *f, int unit, int target, int scope) {
    return &f->pairs[((size_t)unit * DG_LORA_TARGETS + (size_t)target) * SCOPES + (size_t)scope];
}

// The base weight a folded delta of `slot` is added to (NULL where the unit has no such weight).
static struct ggml_tensor *base_of(const dg_model *m, int unit, int slot) {
    if (unit == m->hp.n_layer) {
        return slot == DG_LORA_GATE ? m->sc_gate : slot == DG_LORA_UP ? m->sc_up : slot == DG_LORA_DOWN ? m->sc_down
                                                                                                        : NULL;
    }
    const dg_layer *L = &m->layers[unit];
    switch (slot) {
        case DG_LORA_Q: return L->wq;
        case DG_LORA_K: return L->wk;
        case DG_LORA_V: return L->wv;
        case DG_LORA_O: return L->wo;
        case DG_LORA_GATE: return L->ffn_gate;
        case DG_LORA_UP: return L->ffn_up;
        case DG_LORA_DOWN: return L->ffn_down;
        case DG_LORA_ROUTER: return L->router;
        case DG_LORA_GATE_UP_EXPS: return L->gate_up_exps;
        case DG_LORA_GATE_EXPS: return L->gate_exps;
        case DG_LORA_UP_EXPS: return L->up_exps;
        case DG_LORA_DOWN_EXPS: return L->down_exps;
        default: return NULL;
    }
}

// Where the folded delta of (unit, pass, slot) lives: NULL for the self-conditioning MLP in the encoder pass
static dg_lora *dest_of(dg_model *m, int unit, int pass, int slot) {
    if (unit == m->hp.n_layer) return pass == DG_PASS_DECODER ? &m->sc_lora[slot] : NULL;
    return &m->layers[unit].lora[pass][slot];
}

// Pieces of an adapter target on this unit: 0 when the base has no weight for it.
static int pieces_of(const dg_model *m, int unit, int target, lora_piece out[2]) {
    const int64_t F = m->hp.n_ff_exp;
    const dg_layer *L = unit < m->hp.n_layer ? &m->layers[unit] : NULL;  // NULL: the self-conditioning MLP
    if (L && target == DG_LORA_GATE_UP_EXPS && !L->gate_up_exps) {
        out[0] = (lora_piece){DG_LORA_GATE_EXPS, 0, F, 0};
        out[1] = (lora_piece){DG_LORA_UP_EXPS, F, F, 0};
        return 2;
    }
    if (L && (target == DG_LORA_GATE_EXPS || target == DG_LORA_UP_EXPS) && L->gate_up_exps) {
        out[0] = (lora_piece){DG_LORA_GATE_UP_EXPS, 0, F, target == DG_LORA_GATE_EXPS ? 0 : F};
        return 1;
    }
    const struct ggml_tensor *w = base_of(m, unit, target);
    if (!w) return 0;
    out[0] = (lora_piece){target, 0, w->ne[1], 0};
    return 1;
}

static bool factor_type_ok(enum ggml_type t) {
    return t == GGML_TYPE_F32 || t == GGML_TYPE_F16 || t == GGML_TYPE_BF16 || t == GGML_TYPE_Q8_0;
}

// ---------------------------------------------------------------------------------------------------------------
// one file: map, check the bytes, the metadata and every tensor

static void close_file(lora_file *f) {
    free(f->pairs);
    if (f->ctx) ggml_free(f->ctx);
    if (f->gguf) gguf_free(f->gguf);
    if (f->map && f->map != MAP_FAILED) munmap(f->map, f->size);
    memset(f, 0, sizeof(*f));
}

static bool map_file(lora_file *f, const char *path, char *err, size_t err_len) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        dg_set_err(err, err_len, "cannot open the adapter file");
        return false;
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || st.st_size < 24) {
        close(fd);
        dg_set_err(err, err_len, "the adapter is not a GGUF file");
        return false;
    }
    f->size = (size_t)st.st_size;
    f->map = mmap(NULL, f->size, PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (f->map == MAP_FAILED) {
        f->map = NULL;
        dg_set_err(err, err_len, "cannot memory-map the adapter file");
        return false;
    }
    if (!dg_gguf_check(f->map, f->size, err, err_len)) return false;
    struct gguf_init_params gp = {true, &f->ctx};
    f->gguf = gguf_init_from_buffer(f->map, f->size, gp);
    if (!f->gguf || !f->ctx) {
        dg_set_err(err, err_len, "ggml could not parse the adapter GGUF");
        return false;
    }
    return true;
}

static bool key_string_is(const lora_file *f, const char *key, const char *want, char *err, size_t err_len) {
    const int64_t id = gguf_find_key(f->gguf, key);
    if (id < 0 || gguf_get_kv_type(f->gguf, id) != GGUF_TYPE_STRING) {
        dg_set_err(err, err_len, "not a LoRA adapter: the GGUF has no %s string", key);
        return false;
    }
    const char *v = gguf_get_val_str(f->gguf, id);
    if (strcmp(v, want) != 0) {
        const bool arch = strcmp(key, DG_KEY_ARCHITECTURE) == 0;
        dg_set_err(err, err_len, "%s: %s is '%.64s', expected '%s'",
                   arch ? "the adapter was made for another architecture" : "not a LoRA adapter", key, v, want);
        return false;
    }
    return true;
}

static bool read_metadata(lora_file *f, char *err, size_t err_len) {
    if (!key_string_is(f, DG_KEY_GENERAL_TYPE, "adapter", err, err_len) ||
        !key_string_is(f, DG_KEY_ADAPTER_TYPE, "lora", err, err_len) ||
        !key_string_is(f, DG_KEY_ARCHITECTURE, DG_GGUF_ARCH, err, err_len)) {
        return false;
    }
    const int64_t id = gguf_find_key(f->gguf, DG_KEY_LORA_ALPHA);
    const enum gguf_type t = id < 0 ? GGUF_TYPE_COUNT : gguf_get_kv_type(f->gguf, id);
    if (t != GGUF_TYPE_FLOAT32 && t != GGUF_TYPE_FLOAT64) {
        dg_set_err(err, err_len, "the adapter has no " DG_KEY_LORA_ALPHA " float");
        return false;
    }
    const double alpha = t == GGUF_TYPE_FLOAT32 ? gguf_get_val_f32(f->gguf, id) : gguf_get_val_f64(f->gguf, id);
    if (!(alpha > 0.0 && alpha <= 1e6)) {  // also rejects NaN
        dg_set_err(err, err_len, DG_KEY_LORA_ALPHA " = %g is out of range (0, 1e6]", alpha);
        return false;
    }
    f->alpha = (float)alpha;
    return true;
}

static bool strip_factor_suffix(const char *name, size_t *len, bool *is_b) {
    const size_t n = strlen(name), slen = strlen(DG_LORA_SUFFIX_A);  // both suffixes have this length
    if (n <= slen || (strcmp(name + n - slen, DG_LORA_SUFFIX_A) != 0 && strcmp(name + n - slen, DG_LORA_SUFFIX_B) != 0))
        return false;
    *is_b = name[n - 1] == 'b';
    *len = n - slen;
    return true;
}

static int target_named(const char *const *names, const char *name, size_t len) {
    for (int t = 0; t < DG_LORA_TARGETS; t++) {
        if (names[t] && strlen(names[t]) == len && strncmp(name, names[t], len) == 0) return t;
    }
    return -1;
}

// "[enc.|dec.]blk.N.<target>.lora_{a,b}" or "[enc.|dec.]self_cond_*.weight.lora_{a,b}" -> unit, target, scope, factor
static bool parse_name(const char *name, int n_layer, int *il, int *target, int *scope, bool *is_b) {
    *scope = 0;
    for (int s = 1; s < SCOPES; s++) {
        const size_t n = strlen(SCOPE_PREFIX[s]);
        if (strncmp(name, SCOPE_PREFIX[s], n) == 0) {
            *scope = s;
            name += n;
            break;
        }
    }
    size_t len;
    if (strncmp(name, DG_SELF_COND_PREFIX, strlen(DG_SELF_COND_PREFIX)) == 0) {
        *il = n_layer;
        return strip_factor_suffix(name, &len, is_b) && (*target = target_named(SELF_COND_NAMES, name, len)) >= 0;
    }
    if (strncmp(name, DG_BLOCK_PREFIX, strlen(DG_BLOCK_PREFIX)) != 0) return false;
    name += strlen(DG_BLOCK_PREFIX);
    int layer = 0, digits = 0;
    while (*name >= '0' && *name <= '9' && digits < 4) layer = layer * 10 + (*name++ - '0'), digits++;
    if (digits == 0 || *name != '.' || layer >= n_layer || (digits > 1 && name[-digits] == '0')) return false;
    name++;
    *il = layer;
    return strip_factor_suffix(name, &len, is_b) && (*target = target_named(TARGET_NAMES, name, len)) >= 0;
}

static bool collect_tensors(const dg_model *m, lora_file *f, char *err, size_t err_len) {
    const int n_layer = m->hp.n_layer;
    f->pairs = calloc((size_t)(n_layer + 1) * DG_LORA_TARGETS * SCOPES, sizeof(lora_pair));
    if (!f->pairs) {
        dg_set_err(err, err_len, "out of memory");
        return false;
    }
    const int64_t n = gguf_get_n_tensors(f->gguf);
    if (n == 0) {
        dg_set_err(err, err_len, "the adapter has no LoRA tensors");
        return false;
    }
    const uint8_t *data = (const uint8_t *)f->map + gguf_get_data_offset(f->gguf);
    for (int64_t i = 0; i < n; i++) {
        const char *name = gguf_get_tensor_name(f->gguf, i);
        int il, target, scope;
        bool is_b;
        if (!parse_name(name, n_layer, &il, &target, &scope, &is_b)) {
            dg_set_err(err, err_len, "adapter tensor '%s' is not a LoRA factor of a weight this model has", name);
            return false;
        }
        const struct ggml_tensor *t = ggml_get_tensor(f->ctx, name);
        if (!t) {
            dg_set_err(err, err_len, "adapter tensor '%s' cannot be read", name);
            return false;
        }
        if (!factor_type_ok(t->type)) {
            dg_set_err(err, err_len, "adapter tensor '%s' has type %s (F32, F16, BF16 or Q8_0 allowed)", name,
                       ggml_type_name(t->type));
            return false;
        }
        lora_pair *p = pair_at(f, il, target, scope);
        if (is_b ? p->b != NULL : p->a != NULL) {  // another spelling of a name already seen
            dg_set_err(err, err_len, "adapter tensor '%s' duplicates another tensor's name", name);
            return false;
        }
        if (is_b) {
            p->b = t;
            p->b_data = data + gguf_get_tensor_offset(f->gguf, i);
        } else {
            p->a = t;
            p->a_data = data + gguf_get_tensor_offset(f->gguf, i);
        }
    }
    return true;
}

static bool shape_is(const struct ggml_tensor *t, int64_t ne0, int64_t ne1, int64_t ne2) {
    return t->ne[0] == ne0 && t->ne[1] == ne1 && t->ne[2] == ne2 && t->ne[3] == 1;
}

// Each pair complete, its rank consistent and its shape that of the base weight it adapts.
static bool check_pairs(const dg_model *m, const lora_file *f, char *err, size_t err_len) {
    for (int il = 0; il <= m->hp.n_layer; il++) {
        for (int target = 0; target < DG_LORA_TARGETS; target++) {
            for (int scope = 0; scope < SCOPES; scope++) {
                const lora_pair *p = pair_at(f, il, target, scope);
                if (!p->a && !p->b) continue;
                const lora_pair *both = pair_at(f, il, target, 0);
                char name[96];
                if (il == m->hp.n_layer) snprintf(name, sizeof(name), "%s%s", SCOPE_PREFIX[scope], SELF_COND_NAMES[target]);
                else snprintf(name, sizeof(name), "%s" DG_BLOCK "%s", SCOPE_PREFIX[scope], il, TARGET_NAMES[target]);
                if (scope != 0 && (both->a || both->b)) {
                    dg_set_err(err, err_len, "the adapter has both %s.* and %s.*: use one form per weight",
                               name + strlen(SCOPE_PREFIX[scope]), name);
                    return false;
                }
                if (!p->a || !p->b) {
                    dg_set_err(err, err_len, "adapter tensor '%s.%s' is missing (LoRA factors come in pairs)", name,
                               p->a ? "lora_b" : "lora_a");
                    return false;
                }
                lora_piece pieces[2];
                const int np = pieces_of(m, il, target, pieces);
                if (np == 0) {
                    dg_set_err(err, err_len, "the adapter targets '%s', which this model does not have", name);
                    return false;
                }
                if (il == m->hp.n_layer && scope == 1) {
                    dg_set_err(err, err_len, "the adapter targets '%s', but the encoder has no self-conditioning", name);
                    return false;
                }
                const struct ggml_tensor *w = base_of(m, il, pieces[0].slot);
                const int64_t n_in = w->ne[0], n_exp = w->ne[2];
                const int64_t n_out = pieces[np - 1].src_row + pieces[np - 1].rows;
                const int64_t r = p->a->ne[1];
                if (p->b->ne[0] != r) {
                    dg_set_err(err, err_len, "adapter '%s': lora_a has rank %lld but lora_b has rank %lld", name,
                               (long long)r, (long long)p->b->ne[0]);
                    return false;
                }
                if (r < 1 || r > MAX_RANK) {
                    dg_set_err(err, err_len, "adapter '%s': rank %lld is out of range [1, %d]", name, (long long)r,
                               MAX_RANK);
                    return false;
                }
                if (!shape_is(p->a, n_in, r, n_exp) || !shape_is(p->b, r, n_out, n_exp)) {
                    dg_set_err(err, err_len,
                               "adapter '%s' has lora_a [%lld, %lld, %lld] and lora_b [%lld, %lld, %lld], expected "
                               "[%lld, r, %lld] and [r, %lld, %lld] for the model's weight",
                               name, (long long)p->a->ne[0], (long long)p->a->ne[1], (long long)p->a->ne[2],
                               (long long)p->b->ne[0], (long long)p->b->ne[1], (long long)p->b->ne[2],
                               (long long)n_in, (long long)n_exp, (long long)n_out, (long long)n_exp);
                    return false;
                }
            }
        }
    }
    return true;
}

static bool open_adapter(const dg_model *m, lora_file *f, const char *path, float scale, char *err, size_t err_len) {
    if (!isfinite(scale)) {
        dg_set_err(err, err_len, "the adapter scale must be finite");
        return false;
    }
    f->scale = scale;
    return map_file(f, path, err, err_len) && read_metadata(f, err, err_len) && collect_tensors(m, f, err, err_len) &&
           check_pairs(m, f, err, err_len);
}

// ---------------------------------------------------------------------------------------------------------------
// folding: one F32 pair per (layer, pass, slot)

// scopes whose pairs apply in a pass: both-pass pairs and the pass's own
static bool scope_applies(int scope, int pass) { return scope == 0 || scope == 1 + pass; }

// One factor row as F32 (ggml's dequantizer; F32 rows copied)
static void row_to_f32(const struct ggml_tensor *t, const uint8_t *src, float *dst, int64_t n) {
    if (t->type == GGML_TYPE_F32) memcpy(dst, src, sizeof(float) * (size_t)n);
    else ggml_get_type_traits(t->type)->to_float(src, dst, n);
}

// Write one pair's piece into the folded delta at rank columns [r0, r0 + r): A's rows as they are, B's rows of the
// piece times the pair's scale s (tmp: r floats).
static void copy_piece(const lora_pair *p, const lora_piece *piece, const dg_lora *dst, int64_t r0, float s,
                       float *tmp) {
    const int64_t r = p->a->ne[1], n_in = dst->a->ne[0], R = dst->a->ne[1], n_out = dst->b->ne[1];
    for (int64_t e = 0; e < dst->a->ne[2]; e++) {
        for (int64_t j = 0; j < r; j++) {
            float *row = (float *)dst->a->data + ((size_t)e * R + (size_t)(r0 + j)) * n_in;
            row_to_f32(p->a, p->a_data + j * p->a->nb[1] + e * p->a->nb[2], row, n_in);
        }
        for (int64_t o = 0; o < piece->rows; o++) {
            row_to_f32(p->b, p->b_data + (piece->src_row + o) * p->b->nb[1] + e * p->b->nb[2], tmp, r);
            float *row = (float *)dst->b->data + ((size_t)e * n_out + (size_t)(piece->dst_row + o)) * R + r0;
            for (int64_t j = 0; j < r; j++) row[j] = tmp[j] * s;
        }
    }
}

// Total rank of the folded delta of (unit, pass, slot) over all files, in file, target, scope order; with dst, also
// write the factors there.
static int64_t fold(dg_model *m, const lora_file *files, int n_files, int il, int pass, int slot, const dg_lora *dst,
                    float *tmp) {
    if (!dest_of(m, il, pass, slot)) return 0;
    int64_t r0 = 0;
    for (int fi = 0; fi < n_files; fi++) {
        for (int target = 0; target < DG_LORA_TARGETS; target++) {
            lora_piece pieces[2];
            const int np = pieces_of(m, il, target, pieces);
            for (int scope = 0; scope < SCOPES; scope++) {
                const lora_pair *p = pair_at(&files[fi], il, target, scope);
                if (!p->a || !scope_applies(scope, pass)) continue;
                const int64_t r = p->a->ne[1];
                for (int k = 0; k < np; k++) {
                    if (pieces[k].slot != slot) continue;
                    if (dst) copy_piece(p, &pieces[k], dst, r0, files[fi].alpha / (float)r * files[fi].scale, tmp);
                    r0 += r;
                }
            }
        }
    }
    return r0;
}

static const char *const SLOT_SHORT[DG_LORA_TARGETS] = {"q", "k", "v", "o", "gate", "up", "down", "router",
                                                        "gate_up_exps", "gate_exps", "up_exps", "down_exps"};

static bool fold_all(dg_model *m, const lora_file *files, int n_files, char *err, size_t err_len) {
    const int L = m->hp.n_layer;
    size_t n_pairs = 0;
    int64_t max_rank = 1;
    for (int il = 0; il <= L; il++) {
        for (int pass = 0; pass < DG_PASSES; pass++) {
            for (int slot = 0; slot < DG_LORA_TARGETS; slot++) {
                const int64_t R = fold(m, files, n_files, il, pass, slot, NULL, NULL);
                n_pairs += R > 0;
                if (R > max_rank) max_rank = R;
            }
        }
    }
    struct ggml_init_params ip = {ggml_tensor_overhead() * (2 * n_pairs + 1), NULL, true};
    m->ctx_lora = ggml_init(ip);
    float *tmp = malloc(sizeof(float) * (size_t)max_rank);
    if (!m->ctx_lora || !tmp) {
        free(tmp);
        dg_set_err(err, err_len, "out of memory");
        return false;
    }
    for (int il = 0; il <= L; il++) {
        for (int pass = 0; pass < DG_PASSES; pass++) {
            for (int slot = 0; slot < DG_LORA_TARGETS; slot++) {
                const int64_t R = fold(m, files, n_files, il, pass, slot, NULL, NULL);
                if (R == 0) continue;
                const struct ggml_tensor *w = base_of(m, il, slot);
                dg_lora *d = dest_of(m, il, pass, slot);
                d->a = ggml_new_tensor_3d(m->ctx_lora, GGML_TYPE_F32, w->ne[0], R, w->ne[2]);
                d->b = ggml_new_tensor_3d(m->ctx_lora, GGML_TYPE_F32, R, w->ne[1], w->ne[2]);
                ggml_format_name(d->a, "lora.%s.%d.%s.a", pass ? "dec" : "enc", il, SLOT_SHORT[slot]);
                ggml_format_name(d->b, "lora.%s.%d.%s.b", pass ? "dec" : "enc", il, SLOT_SHORT[slot]);
            }
        }
    }
    if (n_pairs > 0) {
        m->buf_lora = ggml_backend_alloc_ctx_tensors_from_buft(m->ctx_lora, ggml_backend_cpu_buffer_type());
        if (!m->buf_lora) {
            free(tmp);
            dg_set_err(err, err_len, "cannot allocate memory for the adapters");
            return false;
        }
        ggml_backend_buffer_clear(m->buf_lora, 0);  // B blocks no piece writes stay zero
    }
    for (int il = 0; il <= L; il++) {
        for (int pass = 0; pass < DG_PASSES; pass++) {
            for (int slot = 0; slot < DG_LORA_TARGETS; slot++) {
                const dg_lora *d = dest_of(m, il, pass, slot);
                if (d && d->a) fold(m, files, n_files, il, pass, slot, d, tmp);
            }
        }
    }
    free(tmp);
    m->lora_graph_nodes = (int)(4 * n_pairs);  // a·x, b·(…), the add (and a reshape to spare)
    return true;
}

void dg_lora_free(dg_model *m) {
    if (m->buf_lora) ggml_backend_buffer_free(m->buf_lora);
    if (m->ctx_lora) ggml_free(m->ctx_lora);
    m->buf_lora = NULL;
    m->ctx_lora = NULL;
    for (int il = 0; m->layers && il < m->hp.n_layer; il++) memset(m->layers[il].lora, 0, sizeof(m->layers[il].lora));
    memset(m->sc_lora, 0, sizeof(m->sc_lora));
    m->lora_graph_nodes = 0;
    m->n_adapters = 0;
}

// Returns false with err set; *failed = index of the file at fault (n when no single file is).
static bool load_all(dg_model *m, const char *const *paths, const float *scales, int n, bool check_only,
                     int *failed, char *err, size_t err_len) {
    *failed = n;
    if (n < 1 || n > 64) {
        dg_set_err(err, err_len, "between 1 and 64 adapters can be loaded, got %d", n);
        return false;
    }
    if (m->n_adapters > 0 || m->place.n_devices > 0) {
        dg_set_err(err, err_len, "adapters must be loaded once, before the weights are placed");
        return false;
    }
    lora_file *files = calloc((size_t)n, sizeof(lora_file));
    if (!files) {
        dg_set_err(err, err_len, "out of memory");
        return false;
    }
    bool ok = true;
    for (int i = 0; ok && i < n; i++) {
        ok = open_adapter(m, &files[i], paths[i], scales[i], err, err_len);
        if (!ok) *failed = i;
    }
    if (ok && !check_only) {
        ok = fold_all(m, files, n, err, err_len);
        if (ok) m->n_adapters = n;
        else dg_lora_free(m);
    }
    for (int i = 0; i < n; i++) close_file(&files[i]);
    free(files);
    return ok;
}

int dg_lora_load(dg_model *m, const char *const *paths, const float *scales, int n, char *err, size_t err_len) {
    int failed;
    return load_all(m, paths, scales, n, false, &failed, err, err_len) ? 0 : failed + 1;
}

bool dg_lora_check(dg_model *m, const char *path, char *err, size_t err_len) {
    const float one = 1.0f;
    int failed;
    return load_all(m, &path, &one, 1, true, &failed, err, err_len);
}
