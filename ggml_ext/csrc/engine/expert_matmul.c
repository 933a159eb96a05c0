// F32 expert matmul: the ggml_mul_mat_id of an F32 mixture of experts as a ggml custom op with register-tiled kernels.
//
// Why: ggml's CPU mul_mat_id computes every output with one vector dot product (no tiling), about a third of the rate
// of its own F32 GEMM; with F32 weights the experts were the largest cost of a decoder step. Here each thread takes a
// slice of every expert's output rows, and multiplies those weight rows with all of the expert's routed input rows in
// register tiles (4 weight rows × up to 6 input rows), so that each weight row is read from memory once per step and
// each loaded vector feeds several FMAs.
// Quantized weights keep ggml's mul_mat_id (its quantized dot products are the fast path there).
//
// Semantics equal ggml_mul_mat_id(w, x, ids): w [Kd, N, E], x [Kd, X1, T] with X1 = 1 (broadcast) or ids->ne[0],
// ids [K, T] I32 → y [N, K, T], y[:, k, t] = w[:, :, ids[k, t]]ᵀ · x[:, k % X1, t]. Only the summation order differs.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define DG_X86 1
#endif

// One expert's work for one thread: rows [n0, n1) of w_e against the n_rows routed input rows.
typedef struct {
    const float *w;    // w_e, row j at w + j·ldw
    size_t ldw;        // in floats
    const float **x;   // routed input rows
    float **y;         // matching output rows (element j at y[r][j])
    int64_t n_rows, n0, n1, kd;
} expert_job;

#ifdef DG_X86
// acc[a][b] += w_row[a] · x_row[b] over kd, then y[b][j + a] = Σ acc[a][b]. MR ≤ 4 and NR ≤ NR_MAX are constants
// after inlining, so the accumulators live in registers. A full 4-row tile is reduced four sums at a time (SUM4);
// the horizontal sums would otherwise cost as much as the FMAs when kd is small (the down projection's kd = FFe).
#define DEFINE_TILE_KERNEL(ISA, TARGET, NR_MAX, VEC, WIDTH, ZERO, LOAD, FMA, HSUM, SUM4)                             \
    __attribute__((target(TARGET), always_inline)) static inline void tile_##ISA(                                  \
        const float *w, size_t ldw, const float **x, float **y, int64_t j, int64_t kd, const int MR, const int NR) { \
        VEC acc[4][6];                                                                                         \
        for (int a = 0; a < MR; a++)                                                                                \
            for (int b = 0; b < NR; b++) acc[a][b] = ZERO();                                                        \
        const float *wr[4];                                                                                         \
        for (int a = 0; a < MR; a++) wr[a] = w + (size_t)(j + a) * ldw;                                             \
        int64_t i = 0;                                                                                              \
        for (; i + WIDTH <= kd; i += WIDTH) {                                                                       \
            VEC xv[6];                                                                                         \
            for (int b = 0; b < NR; b++) xv[b] = LOAD(x[b] + i);                                                    \
            for (int a = 0; a < MR; a++) {                                                                          \
                const VEC wv = LOAD(wr[a] + i);                                                                     \
                for (int b = 0; b < NR; b++) acc[a][b] = FMA(wv, xv[b], acc[a][b]);                                 \
            }                                                                                                       \
        }                                                                                                           \
        for (int b = 0; b < NR; b++) {                                                                              \
            if (MR == 4) {                                                                                          \
                float s[4];                                                                                         \
                _mm_storeu_ps(s, SUM4(acc[0][b], acc[1][b], acc[2][b], acc[3][b]));                                 \
                for (int a = 0; a < 4; a++) {                                                                       \
                    for (int64_t t = i; t < kd; t++) s[a] += wr[a][t] * x[b][t];                                    \
                    y[b][j + a] = s[a];                                                                             \
                }                                                                                                   \
            } else {                                                                                                \
                for (int a = 0; a < MR; a++) {                                                                      \
                    float s = HSUM(acc[a][b]);                                                                      \
                    for (int64_t t = i; t < kd; t++) s += wr[a][t] * x[b][t];                                       \
                    y[b][j + a] = s;                                                                                \
                }                                                                                                   \
            }                                                                                                       \
        }                                                                                                           \
    }                                                                                                               \
    __attribute__((target(TARGET))) static void run_job_##ISA(const expert_job *job) {                             \
        int64_t j = job->n0;                                                                                        \
        for (; j + 4 <= job->n1; j += 4) {                                                                          \
            int64_t r = 0;                                                                                          \
            for (; r + NR_MAX <= job->n_rows; r += NR_MAX)                                                          \
                tile_##ISA(job->w, job->ldw, job->x + r, job->y + r, j, job->kd, 4, NR_MAX);                        \
            switch (job->n_rows - r) {  /* the remainder, fewer than NR_MAX rows */                           \
            case 5: if (5 < NR_MAX) tile_##ISA(job->w, job->ldw, job->x + r, job->y + r, j, job->kd, 4, 5); break;  \
            case 4: if (4 < NR_MAX) tile_##ISA(job->w, job->ldw, job->x + r, job->y + r, j, job->kd, 4, 4); break;  \
            case 3: if (3 < NR_MAX) tile_##ISA(job->w, job->ldw, job->x + r, job->y + r, j, job->kd, 4, 3); break;  \
            case 2: tile_##ISA(job->w, job->ldw, job->x + r, job->y + r, j, job->kd, 4, 2); break;                  \
            case 1: tile_##ISA(job->w, job->ldw, job->x + r, job->y + r, j, job->kd, 4, 1); break;                  \
            }                                                                                                       \
        }                                                                                                           \
        for (; j < job->n1; j++)                                                                                    \
            for (int64_t r = 0; r < job->n_rows; r++)                                                               \
                tile_##ISA(job->w, job->ldw, job->x + r, job->y + r, j, job->kd, 1, 1);                             \
    }

// (Σv0, Σv1, Σv2, Σv3) of four vectors: pairwise unpack/add trees, then the 128-bit lanes folded together
__attribute__((target("avx2,fma"))) static inline __m128 sum4_256(__m256 v0, __m256 v1, __m256 v2, __m256 v3) {
    const __m256 s01 = _mm256_add_ps(_mm256_unpacklo_ps(v0, v1), _mm256_unpackhi_ps(v0, v1));
    const __m256 s23 = _mm256_add_ps(_mm256_unpacklo_ps(v2, v3), _mm256_unpackhi_ps(v2, v3));
    const __m256 s = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(s01), _mm256_castps_pd(s23))),
                                   _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(s01), _mm256_castps_pd(s23))));
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

__attribute__((target("avx512f"))) static inline __m128 sum4_512(__m512 v0, __m512 v1, __m512 v2, __m512 v3) {
    const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(v0, v1), _mm512_unpackhi_ps(v0, v1));
    const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(v2, v3), _mm512_unpackhi_ps(v2, v3));
    const __m512 s = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23))),
                                   _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23))));
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1)));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

__attribute__((target("avx2,fma"))) static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// 4×6 tiles with AVX-512 (24 accumulators of 32 registers); 4×3 with AVX2 (12 of 16)
DEFINE_TILE_KERNEL(avx512, "avx512f", 6, __m512, 16, _mm512_setzero_ps, _mm512_loadu_ps, _mm512_fmadd_ps,
                   _mm512_reduce_add_ps, sum4_512)
DEFINE_TILE_KERNEL(avx2, "avx2,fma", 3, __m256, 8, _mm256_setzero_ps, _mm256_loadu_ps, _mm256_fmadd_ps, hsum256,
                   sum4_256)

typedef enum { ISA_NONE, ISA_AVX2, ISA_AVX512 } cpu_isa;

static cpu_isa detect_isa(void) {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return ISA_AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return ISA_AVX2;
    return ISA_NONE;
}
#else
typedef enum { ISA_NONE } cpu_isa;
static cpu_isa detect_isa(void) { return ISA_NONE; }
#endif

// Thread ith of nth: every expert's output rows [n0, n1), split evenly (in whole tiles) so that the threads share
// the weight traffic and the FMAs alike whatever the routing.
static void expert_matmul_op(struct ggml_tensor *dst, int ith, int nth, void *userdata) {
    const struct ggml_tensor *w = dst->src[0], *x = dst->src[1], *ids = dst->src[2];
    const int64_t kd = w->ne[0], N = w->ne[1], E = w->ne[2], X1 = x->ne[1], K = ids->ne[0], T = ids->ne[1];
    const int64_t tiles = (N + 3) / 4;  // split in whole 4-row tiles
    const int64_t n0 = tiles * ith / nth * 4;
    const int64_t n1 = tiles * (ith + 1) / nth * 4 < N ? tiles * (ith + 1) / nth * 4 : N;
    if (n0 >= n1) return;

    // bucket the (k, t) pairs by expert: counting sort, same order on every thread
    const int64_t pairs = K * T;
    int64_t *start = calloc((size_t)E + 1, sizeof(int64_t));
    const float **xs = malloc(sizeof(*xs) * (size_t)pairs);
    float **ys = malloc(sizeof(*ys) * (size_t)pairs);
    if (!start || !xs || !ys) abort();  // a few KiB: the process is out of memory anyway
    for (int64_t t = 0; t < T; t++)
        for (int64_t k = 0; k < K; k++) {
            const int32_t e = *(const int32_t *)((const char *)ids->data + k * ids->nb[0] + t * ids->nb[1]);
            if (e >= 0 && e < E) start[e + 1]++;
        }
    for (int64_t e = 0; e < E; e++) start[e + 1] += start[e];
    int64_t *fill = malloc(sizeof(int64_t) * (size_t)E);
    if (!fill) abort();
    memcpy(fill, start, sizeof(int64_t) * (size_t)E);
    for (int64_t t = 0; t < T; t++)
        for (int64_t k = 0; k < K; k++) {
            const int32_t e = *(const int32_t *)((const char *)ids->data + k * ids->nb[0] + t * ids->nb[1]);
            if (e < 0 || e >= E) continue;
            const int64_t p = fill[e]++;
            xs[p] = (const float *)((const char *)x->data + (k % X1) * x->nb[1] + t * x->nb[2]);
            ys[p] = (float *)((char *)dst->data + k * dst->nb[1] + t * dst->nb[2]);
        }

    const cpu_isa isa = (cpu_isa)(intptr_t)userdata;
    for (int64_t e = 0; e < E; e++) {
        const expert_job job = {
            (const float *)((const char *)w->data + e * w->nb[2]), w->nb[1] / sizeof(float), xs + start[e],
            ys + start[e], start[e + 1] - start[e], n0, n1, kd};
        if (job.n_rows == 0) continue;
#ifdef DG_X86
        if (isa == ISA_AVX512) run_job_avx512(&job);
        else run_job_avx2(&job);
#else
        (void)isa;
#endif
    }
    free(fill);
    free(ys);
    free(xs);
    free(start);
}

static cpu_isa best_isa(void) {
    static int isa = -1;  // a benign race: every thread computes the same value
    if (isa < 0) isa = (int)detect_isa();
    return (cpu_isa)isa;
}

static struct ggml_tensor *build_with_isa(struct ggml_context *ctx, struct ggml_tensor *w, struct ggml_tensor *x,
                                          struct ggml_tensor *ids, cpu_isa isa) {
    const bool tiled = isa != ISA_NONE && w->type == GGML_TYPE_F32 && x->type == GGML_TYPE_F32 &&
                       w->nb[0] == sizeof(float) && x->nb[0] == sizeof(float) && ids->type == GGML_TYPE_I32;
    if (!tiled) return ggml_mul_mat_id(ctx, w, x, ids);
    struct ggml_tensor *args[3] = {w, x, ids};
    return ggml_custom_4d(ctx, GGML_TYPE_F32, w->ne[1], ids->ne[0], ids->ne[1], 1, args, 3, expert_matmul_op,
                          GGML_N_TASKS_MAX, (void *)(intptr_t)isa);
}

struct ggml_tensor *dg_build_expert_matmul(struct ggml_context *ctx, struct ggml_tensor *w, struct ggml_tensor *x,
                                           struct ggml_tensor *ids) {
    return build_with_isa(ctx, w, x, ids, best_isa());
}

static float lcg_uniform(uint64_t *s) {  // in [-0.5, 0.5)
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return (float)(*s >> 40) / (float)(1 << 24) - 0.5f;
}

// Test hook: the tiled op (isa 1 = AVX2, 2 = AVX-512) against ggml_mul_mat_id on the same random F32 data
// (w [kd, n, n_expert], x [kd, x1, t], n_used distinct experts per token). Returns max |Δ| / max |y| (relative to the
// output's scale); -1 for invalid arguments, -2 when this CPU lacks that instruction set.
DG_API double dg_check_expert_matmul(int64_t kd, int64_t n, int n_expert, int n_used, int64_t t, int x1, int n_threads,
                                     uint64_t seed, int isa) {
    if (kd < 1 || n < 1 || t < 1 || n_expert < 1 || n_used < 1 || n_used > n_expert || (x1 != 1 && x1 != n_used) ||
        isa < 1 || isa > 2)
        return -1;
    if ((int)best_isa() < isa) return -2;
    struct ggml_init_params ip = {ggml_tensor_overhead() * 8 + ggml_graph_overhead(), NULL, true};
    struct ggml_context *ctx = ggml_init(ip);
    ggml_backend_t backend = ggml_backend_cpu_init();
    if (!ctx || !backend) return -1;
    ggml_backend_cpu_set_n_threads(backend, n_threads);
    struct ggml_tensor *w = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, kd, n, n_expert);
    struct ggml_tensor *x = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, kd, x1, t);
    struct ggml_tensor *ids = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, n_used, t);
    struct ggml_tensor *tiled = build_with_isa(ctx, w, x, ids, (cpu_isa)isa);
    struct ggml_tensor *ref = ggml_mul_mat_id(ctx, w, x, ids);
    double result = -1;
    if (tiled->op != GGML_OP_CUSTOM) goto done;
    struct ggml_cgraph *gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, tiled);
    ggml_build_forward_expand(gf, ref);
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, backend);
    if (!buf) goto done;
    uint64_t s = seed;
    for (int64_t i = 0; i < ggml_nelements(w); i++) ((float *)w->data)[i] = lcg_uniform(&s);
    for (int64_t i = 0; i < ggml_nelements(x); i++) ((float *)x->data)[i] = lcg_uniform(&s);
    for (int64_t r = 0; r < t; r++) {  // n_used distinct experts from a random start: uneven counts per expert
        const int start = (int)((lcg_uniform(&s) + 0.5f) * (float)n_expert) % n_expert;
        for (int k = 0; k < n_used; k++) ((int32_t *)ids->data)[r * n_used + k] = (start + k) % n_expert;
    }
    ggml_backend_graph_compute(backend, gf);
    double max_diff = 0, max_abs = 0;
    for (int64_t i = 0; i < ggml_nelements(ref); i++) {
        const double a = ((float *)tiled->data)[i], b = ((float *)ref->data)[i];
        if (fabs(a - b) > max_diff || a != a) max_diff = a != a ? INFINITY : fabs(a - b);
        if (fabs(b) > max_abs) max_abs = fabs(b);
    }
    result = max_abs > 0 ? max_diff / max_abs : max_diff;
    ggml_backend_buffer_free(buf);
done:
    ggml_backend_free(backend);
    ggml_free(ctx);
    return result;
}
