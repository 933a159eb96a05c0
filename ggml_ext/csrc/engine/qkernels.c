// Quantized weight products as ggml custom ops: activation quantization node, expert / dense product node, the
// choice of instruction set, and the portable kernels. The AVX2 kernels are in qkernels_avx2.c.
//
// Why: ggml's CPU mul_mat_id computes every output with one vector dot product and re-reads each weight row once per
// routed token; here a thread multiplies a slice of an expert's rows with all of the expert's routed rows in register
// tiles, so a weight row is read (and unpacked) once per tile of tokens. The activations are quantized by ggml's own
// quantizer (the same integers as ggml's mul_mat_id), so the integer dot products are exact and only the order of
// the float sums differs from ggml.
#include <stdlib.h>
#include <string.h>

#include "cpu.h"
#include "qkernels.h"

static float dg_qk_half(uint16_t h) {  // IEEE binary16 -> binary32
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else {  // subnormal: normalise
        int e = -1;
        uint32_t m = man;
        do { e++; m <<= 1; } while (!(m & 0x400));
        bits = sign | ((uint32_t)(112 - e) << 23) | ((m & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

// ---------------------------------------------------------------------------------------------------------------
// types and paths

typedef struct {
    enum ggml_type type, act;  // weight type, ggml's vec_dot_type for it
    int64_t block;             // elements per (super-)block
    size_t block_bytes;
} qtype;

static bool qtype_of(enum ggml_type type, qtype *out) {
    switch (type) {
        case GGML_TYPE_Q8_0: *out = (qtype){type, GGML_TYPE_Q8_0, DG_QK, sizeof(dg_block_q8_0)}; break;
        case GGML_TYPE_Q5_0: *out = (qtype){type, GGML_TYPE_Q8_0, DG_QK, sizeof(dg_block_q5_0)}; break;
        case GGML_TYPE_Q4_K: *out = (qtype){type, GGML_TYPE_Q8_K, DG_QK_K, sizeof(dg_block_q4_K)}; break;
        case GGML_TYPE_Q6_K: *out = (qtype){type, GGML_TYPE_Q8_K, DG_QK_K, sizeof(dg_block_q6_K)}; break;
        case GGML_TYPE_IQ4_NL: *out = (qtype){type, GGML_TYPE_Q8_0, DG_QK, sizeof(dg_block_iq4_nl)}; break;
        case GGML_TYPE_IQ4_XS: *out = (qtype){type, GGML_TYPE_Q8_K, DG_QK_K, sizeof(dg_block_iq4_xs)}; break;
        default: return false;
    }
    // our block structs must be ggml's, and ggml must still pair the type with that activation type
    const struct ggml_type_traits_cpu *cpu = ggml_get_type_traits_cpu(type);
    const struct ggml_type_traits_cpu *act = ggml_get_type_traits_cpu(out->act);
    const size_t act_block = out->act == GGML_TYPE_Q8_0 ? sizeof(dg_block_q8_0) : sizeof(dg_block_q8_K);
    return ggml_type_size(type) == out->block_bytes && ggml_blck_size(type) == out->block &&
           ggml_type_size(out->act) == act_block && ggml_blck_size(out->act) == out->block && cpu &&
           cpu->vec_dot_type == out->act && act && act->from_float;
}

bool dg_qk_supports(enum ggml_type type, int64_t kd) {
    qtype q;
    return qtype_of(type, &q) && kd > 0 && kd % q.block == 0 && kd / q.block <= (1 << 16);
}

bool dg_qk_path_available(dg_qk_path path) {
    switch (path) {
        case DG_QK_SCALAR: return true;
        case DG_QK_AVX2: return dg_cpu_has_isa(DG_ISA_AVX2);
        case DG_QK_AVXVNNI: return dg_cpu_has_isa(DG_ISA_AVXVNNI);
        case DG_QK_AVX512: return dg_cpu_has_isa(DG_ISA_AVX512);
        default: return false;  // DG_QK_OFF is not a kernel path
    }
}

dg_qk_path dg_qk_default_path(void) {
    const char *v = getenv("DGEMMA_QKERNELS");
    if (v && !strcmp(v, "off")) return DG_QK_OFF;
    if (v && !strcmp(v, "scalar")) return DG_QK_SCALAR;
    if (v && !strcmp(v, "avx2")) return DG_QK_AVX2;
    if (v && !strcmp(v, "avxvnni")) return DG_QK_AVXVNNI;
    if (v && !strcmp(v, "avx512")) return DG_QK_AVX512;
    // the portable kernels are slower than ggml's SIMD dot products: auto never picks them
    switch (dg_cpu_isa()) {
        case DG_ISA_AVX512: return DG_QK_AVX512;
        case DG_ISA_AVXVNNI: return DG_QK_AVXVNNI;
        case DG_ISA_AVX2: return DG_QK_AVX2;
        default: return DG_QK_OFF;
    }
}

static dg_qk_kernel kernel_for(dg_qk_path path, enum ggml_type type) {
    if (!dg_qk_path_available(path)) return NULL;
    switch (path) {
        case DG_QK_SCALAR: return dg_qk_scalar_kernel(type);
        case DG_QK_AVX2: return dg_qk_avx2_kernel(type);
        case DG_QK_AVXVNNI: return dg_qk_avxvnni_kernel(type);
        case DG_QK_AVX512: return dg_qk_avx512_kernel(type);
        default: return NULL;
    }
}

// ---------------------------------------------------------------------------------------------------------------
// activation layout: per activation row, ggml's blocks of the activation type, then the side floats (qkernels.h),
// each part starting on a 32-byte boundary

typedef struct {
    size_t blocks_bytes, side, stride;
    int64_t nb;
} act_layout;

static size_t round32(size_t n) { return (n + 31) & ~(size_t)31; }

static act_layout layout_of(const qtype *q, int64_t kd) {
    act_layout l;
    l.nb = kd / q->block;
    l.blocks_bytes = ggml_row_size(q->act, kd);
    l.side = round32(l.blocks_bytes);
    const size_t side_floats = q->act == GGML_TYPE_Q8_0 ? 10 * (size_t)l.nb : 8 * (size_t)l.nb;
    l.stride = round32(l.side + sizeof(float) * side_floats);
    return l;
}

static void side_floats(const qtype *q, const act_layout *l, uint8_t *row) {
    float *side = (float *)(row + l->side);
    if (q->act == GGML_TYPE_Q8_0) {
        const dg_block_q8_0 *b = (const dg_block_q8_0 *)row;
        int32_t *lanes = (int32_t *)(side + l->nb), *neg128 = lanes + 8 * l->nb;
        for (int64_t i = 0; i < l->nb; i++) {
            side[i] = dg_qk_half(b[i].d);
            neg128[i] = 0;
            for (int lane = 0; lane < 8; lane++) {
                const int8_t *q = b[i].qs + 4 * lane;
                lanes[8 * i + lane] = 16 * (q[0] + q[1] + q[2] + q[3]);
                neg128[i] -= 128 * (q[0] + q[1] + q[2] + q[3]);
            }
        }
    } else {
        const dg_block_q8_K *b = (const dg_block_q8_K *)row;
        for (int64_t i = 0; i < l->nb; i++)
            for (int j = 0; j < 8; j++)
                side[8 * i + j] = b[i].d * (float)(b[i].bsums[2 * j] + b[i].bsums[2 * j + 1]);
    }
}

// userdata of both nodes: the weight type and the path
static void *pack(enum ggml_type type, dg_qk_path path) { return (void *)(intptr_t)((int)path << 8 | (int)type); }
static enum ggml_type unpack_type(void *u) { return (enum ggml_type)((intptr_t)u & 0xff); }
static dg_qk_path unpack_path(void *u) { return (dg_qk_path)((intptr_t)u >> 8); }

// dst [stride, X1, T] I8 <- x [kd, X1, T] F32, rows split between the threads
static void quantize_op(struct ggml_tensor *dst, int ith, int nth, void *userdata) {
    const struct ggml_tensor *x = dst->src[0];
    qtype q;
    if (!qtype_of(unpack_type(userdata), &q)) abort();  // checked when the node was built
    const act_layout l = layout_of(&q, x->ne[0]);
    const ggml_from_float_t quantize = ggml_get_type_traits_cpu(q.act)->from_float;
    const int64_t rows = x->ne[1] * x->ne[2];
    for (int64_t r = rows * ith / nth; r < rows * (ith + 1) / nth; r++) {
        const int64_t i1 = r % x->ne[1], i2 = r / x->ne[1];
        uint8_t *out = (uint8_t *)dst->data + i1 * dst->nb[1] + i2 * dst->nb[2];
        quantize((const float *)((const char *)x->data + i1 * x->nb[1] + i2 * x->nb[2]), out, x->ne[0]);
        side_floats(&q, &l, out);
    }
}

// named after the weight (a profiled step counts it with its product)
static struct ggml_tensor *build_quantize(struct ggml_context *ctx, const qtype *q, const struct ggml_tensor *w,
                                          struct ggml_tensor *x, dg_qk_path path) {
    const act_layout l = layout_of(q, x->ne[0]);
    struct ggml_tensor *args[1] = {x};
    struct ggml_tensor *xq = ggml_custom_4d(ctx, GGML_TYPE_I8, (int64_t)l.stride, x->ne[1], x->ne[2], 1, args, 1,
                                            quantize_op, GGML_N_TASKS_MAX, pack(q->type, path));
    return ggml_set_name(xq, w->name);
}

// ---------------------------------------------------------------------------------------------------------------
// the product node

// Thread ith of nth: output rows [n0, n1) of every expert, in whole 16-row groups (the widest interleaved tile), so
// that the threads share the weight traffic and the work alike whatever the routing.
static void product_op(struct ggml_tensor *dst, int ith, int nth, void *userdata) {
    const struct ggml_tensor *w = dst->src[0], *xq = dst->src[1], *ids = dst->src[2];  // ids NULL: dense
    const enum ggml_type type = unpack_type(userdata);
    qtype q;
    const dg_qk_kernel kernel = kernel_for(unpack_path(userdata), type);
    if (!kernel || !qtype_of(type, &q)) abort();  // checked when the node was built
    const act_layout l = layout_of(&q, w->ne[0]);
    const int64_t N = w->ne[1], E = ids ? w->ne[2] : 1, X1 = xq->ne[1];
    const int64_t K = ids ? ids->ne[0] : 1, T = ids ? ids->ne[1] : xq->ne[1];
    const int64_t groups = (N + 15) / 16;
    const int64_t n0 = groups * ith / nth * 16;
    const int64_t n1 = groups * (ith + 1) / nth * 16 < N ? groups * (ith + 1) / nth * 16 : N;
    if (n0 >= n1) return;

    // bucket the (k, t) pairs by expert (counting sort; every thread builds the same lists): the rows of expert e are
    // [start[e], start[e + 1]) in xs / ys. One small allocation per call and thread (KiBs) plus the kernel scratch.
    const int64_t pairs = K * T;
    const size_t lists = sizeof(int64_t) * (size_t)(E + 2) + 2 * sizeof(void *) * (size_t)pairs;
    const size_t scratch_bytes = DG_QK_SCRATCH_BYTES * (size_t)w->ne[0];
    void *block = malloc(lists + 64 + scratch_bytes);
    if (!block) abort();  // a custom op cannot report failure; out of memory for a few KiB the process is lost anyway
    int64_t *start = block;
    const uint8_t **xs = (const uint8_t **)(start + E + 2);
    float **ys = (float **)(xs + pairs);
    float *scratch = (float *)(((uintptr_t)block + lists + 63) & ~(uintptr_t)63);
    memset(start, 0, sizeof(int64_t) * (size_t)(E + 2));
    const int32_t *expert_of = ids ? ids->data : NULL;  // ids is contiguous [K, T] (checked when built)
    for (int64_t p = 0; p < pairs; p++) {
        const int32_t e = expert_of ? expert_of[p] : 0;
        start[(e >= 0 && e < E ? e : E) + 1]++;  // an id out of range goes to bucket E, never computed
    }
    for (int64_t e = 0; e <= E; e++) start[e + 1] += start[e];
    for (int64_t p = 0; p < pairs; p++) {  // start[e] advances to the end of e's rows ...
        const int32_t e = expert_of ? expert_of[p] : 0;
        const int64_t k = p % K, t = p / K, slot = start[e >= 0 && e < E ? e : E]++;
        xs[slot] = ids ? (const uint8_t *)xq->data + (k % X1) * xq->nb[1] + t * xq->nb[2]
                       : (const uint8_t *)xq->data + t * xq->nb[1];
        ys[slot] = (float *)((char *)dst->data + (ids ? k * dst->nb[1] + t * dst->nb[2] : t * dst->nb[1]));
    }
    memmove(start + 1, start, sizeof(int64_t) * (size_t)(E + 1));  // ... so shifting by one restores the starts
    start[0] = 0;

    for (int64_t e = 0; e < E; e++) {
        const dg_qk_job job = {(const uint8_t *)w->data + e * w->nb[2], w->nb[1], xs + start[e], ys + start[e],
                               start[e + 1] - start[e], n0, n1, l.nb, l.side, scratch};
        if (job.n_rows > 0) kernel(&job);
    }
    for (int64_t s = start[E]; s < start[E + 1]; s++)  // rows of out-of-range ids: NaN, visibly wrong
        for (int64_t j = n0; j < n1; j++) ys[s][j] = __builtin_nanf("");
    free(block);
}

static bool weight_ok(struct ggml_tensor *w, struct ggml_tensor *x, dg_qk_path path, qtype *q) {
    return path != DG_QK_OFF && kernel_for(path, w->type) && qtype_of(w->type, q) &&
           dg_qk_supports(w->type, w->ne[0]) &&
           x->type == GGML_TYPE_F32 && x->ne[0] == w->ne[0] && x->nb[0] == sizeof(float) &&
           w->nb[1] == ggml_row_size(w->type, w->ne[0]) && w->nb[2] >= w->nb[1] * (size_t)w->ne[1] &&
           w->ne[1] > 0 && w->ne[3] == 1 && x->ne[3] == 1 &&
           (!w->buffer || ggml_backend_buffer_is_host(w->buffer));  // a CPU kernel never reads device memory
}

struct ggml_tensor *dg_build_qexpert_matmul(struct ggml_context *ctx, struct ggml_tensor *w, struct ggml_tensor *x,
                                            struct ggml_tensor *ids, dg_qk_path path) {
    qtype q;
    if (!weight_ok(w, x, path, &q) || !ids || ids->type != GGML_TYPE_I32 || !ggml_is_contiguous(ids) ||
        ids->ne[2] != 1 || ids->ne[3] != 1 || ids->ne[0] < 1 || ids->ne[1] != x->ne[2] ||
        (x->ne[1] != 1 && x->ne[1] != ids->ne[0]) || w->ne[2] < 1 || w->ne[2] > INT32_MAX)
        return NULL;
    struct ggml_tensor *args[3] = {w, build_quantize(ctx, &q, w, x, path), ids};
    return ggml_custom_4d(ctx, GGML_TYPE_F32, w->ne[1], ids->ne[0], ids->ne[1], 1, args, 3, product_op,
                          GGML_N_TASKS_MAX, pack(w->type, path));
}

struct ggml_tensor *dg_build_qmatmul(struct ggml_context *ctx, struct ggml_tensor *w, struct ggml_tensor *x,
                                     dg_qk_path path) {
    qtype q;
    if (!weight_ok(w, x, path, &q) || w->ne[2] != 1 || x->ne[2] != 1 || x->ne[1] < 1) return NULL;
    struct ggml_tensor *args[2] = {w, build_quantize(ctx, &q, w, x, path)};
    return ggml_custom_4d(ctx, GGML_TYPE_F32, w->ne[1], x->ne[1], 1, 1, args, 2, product_op, GGML_N_TASKS_MAX,
                          pack(w->type, path));
}

// ---------------------------------------------------------------------------------------------------------------
// portable kernels: one output at a time, the same integer sums and float steps as ggml's scalar dot products

static float dot_q8_0(const uint8_t *wrow, const uint8_t *xrow, const dg_qk_job *job) {
    const dg_block_q8_0 *w = (const dg_block_q8_0 *)wrow, *x = (const dg_block_q8_0 *)xrow;
    const float *dx = (const float *)(xrow + job->side);
    float sum = 0;
    for (int64_t i = 0; i < job->nb; i++) {
        int s = 0;
        for (int k = 0; k < DG_QK; k++) s += w[i].qs[k] * x[i].qs[k];
        sum += (float)s * (dg_qk_half(w[i].d) * dx[i]);
    }
    return sum;
}

static float dot_q5_0(const uint8_t *wrow, const uint8_t *xrow, const dg_qk_job *job) {
    const dg_block_q5_0 *w = (const dg_block_q5_0 *)wrow;
    const dg_block_q8_0 *x = (const dg_block_q8_0 *)xrow;
    const float *dx = (const float *)(xrow + job->side);
    float sum = 0;
    for (int64_t i = 0; i < job->nb; i++) {
        uint32_t qh;
        memcpy(&qh, w[i].qh, sizeof qh);
        int s = 0;
        for (int k = 0; k < DG_QK / 2; k++) {
            const int lo = (w[i].qs[k] & 0xf) | (int)(((qh >> k) & 1) << 4);
            const int hi = (w[i].qs[k] >> 4) | (int)(((qh >> (k + 16)) & 1) << 4);
            s += (lo - 16) * x[i].qs[k] + (hi - 16) * x[i].qs[k + 16];
        }
        sum += (float)s * (dg_qk_half(w[i].d) * dx[i]);
    }
    return sum;
}

static float dot_q4_K(const uint8_t *wrow, const uint8_t *xrow, const dg_qk_job *job) {
    const dg_block_q4_K *w = (const dg_block_q4_K *)wrow;
    const dg_block_q8_K *x = (const dg_block_q8_K *)xrow;
    float sum = 0;
    for (int64_t i = 0; i < job->nb; i++) {
        int sumi = 0, summ = 0;
        for (int j = 0; j < 8; j++) {
            int sc, m;
            dg_qk_q4k_scale_min(w[i].scales, j, &sc, &m);
            const uint8_t *qs = w[i].qs + 32 * (j / 2);
            const int8_t *xs = x[i].qs + 32 * j;
            int s = 0;
            for (int k = 0; k < 32; k++) s += ((j & 1) ? qs[k] >> 4 : qs[k] & 0xf) * xs[k];
            sumi += sc * s;
            summ += m * (x[i].bsums[2 * j] + x[i].bsums[2 * j + 1]);
        }
        sum += x[i].d * dg_qk_half(w[i].d) * (float)sumi - x[i].d * dg_qk_half(w[i].dmin) * (float)summ;
    }
    return sum;
}

// element e (0..255) of a Q6_K block, minus 32
static int q6k_value(const dg_block_q6_K *b, int e) {
    const int half = e / 128, r = e % 128, quarter = r / 32, l = r % 32;
    const uint8_t ql = b->ql[64 * half + l + 32 * (quarter & 1)];
    const int low = quarter < 2 ? ql & 0xf : ql >> 4;
    const int high = (b->qh[32 * half + l] >> (2 * quarter)) & 3;
    return (low | high << 4) - 32;
}

static float dot_q6_K(const uint8_t *wrow, const uint8_t *xrow, const dg_qk_job *job) {
    const dg_block_q6_K *w = (const dg_block_q6_K *)wrow;
    const dg_block_q8_K *x = (const dg_block_q8_K *)xrow;
    float sum = 0;
    for (int64_t i = 0; i < job->nb; i++) {
        int sumi = 0;
        for (int g = 0; g < 16; g++) {
            int s = 0;
            for (int k = 0; k < 16; k++) s += q6k_value(&w[i], 16 * g + k) * x[i].qs[16 * g + k];
            sumi += w[i].scales[g] * s;
        }
        sum += x[i].d * dg_qk_half(w[i].d) * (float)sumi;
    }
    return sum;
}

static float dot_iq4_nl(const uint8_t *wrow, const uint8_t *xrow, const dg_qk_job *job) {
    const dg_block_iq4_nl *w = (const dg_block_iq4_nl *)wrow;
    const dg_block_q8_0 *x = (const dg_block_q8_0 *)xrow;
    const float *dx = (const float *)(xrow + job->side);
    float sum = 0;
    for (int64_t i = 0; i < job->nb; i++) {
        int s = 0;
        for (int k = 0; k < DG_QK / 2; k++)
            s += dg_qk_iq4_values[w[i].qs[k] & 0xf] * x[i].qs[k] + dg_qk_iq4_values[w[i].qs[k] >> 4] * x[i].qs[k + 16];
        sum += (float)s * (dg_qk_half(w[i].d) * dx[i]);
    }
    return sum;
}

static float dot_iq4_xs(const uint8_t *wrow, const uint8_t *xrow, const dg_qk_job *job) {
    const dg_block_iq4_xs *w = (const dg_block_iq4_xs *)wrow;
    const dg_block_q8_K *x = (const dg_block_q8_K *)xrow;
    float sum = 0;
    for (int64_t i = 0; i < job->nb; i++) {
        int sumi = 0;
        for (int j = 0; j < 8; j++) {
            const uint8_t *qs = w[i].qs + 16 * j;
            const int8_t *xs = x[i].qs + 32 * j;
            int s = 0;
            for (int k = 0; k < 16; k++)
                s += dg_qk_iq4_values[qs[k] & 0xf] * xs[k] + dg_qk_iq4_values[qs[k] >> 4] * xs[k + 16];
            sumi += dg_qk_iq4xs_scale(&w[i], j) * s;
        }
        sum += x[i].d * dg_qk_half(w[i].d) * (float)sumi;
    }
    return sum;
}

#define DEFINE_SCALAR_JOB(T)                                                                       \
    static void scalar_job_##T(const dg_qk_job *job) {                                             \
        for (int64_t j = job->n0; j < job->n1; j++)                                                \
            for (int64_t r = 0; r < job->n_rows; r++)                                              \
                job->y[r][j] = dot_##T(job->w + (size_t)j * job->w_row, job->x[r], job);           \
    }
DEFINE_SCALAR_JOB(q8_0)
DEFINE_SCALAR_JOB(q5_0)
DEFINE_SCALAR_JOB(q4_K)
DEFINE_SCALAR_JOB(q6_K)
DEFINE_SCALAR_JOB(iq4_nl)
DEFINE_SCALAR_JOB(iq4_xs)

dg_qk_kernel dg_qk_scalar_kernel(enum ggml_type type) {
    switch (type) {
        case GGML_TYPE_Q8_0: return scalar_job_q8_0;
        case GGML_TYPE_Q5_0: return scalar_job_q5_0;
        case GGML_TYPE_Q4_K: return scalar_job_q4_K;
        case GGML_TYPE_Q6_K: return scalar_job_q6_K;
        case GGML_TYPE_IQ4_NL: return scalar_job_iq4_nl;
        case GGML_TYPE_IQ4_XS: return scalar_job_iq4_xs;
        default: return NULL;
    }
}
