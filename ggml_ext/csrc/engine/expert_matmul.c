// F32 expert matmul: the ggml_mul_mat_id of an F32 mixture of experts as a ggml custom op with register-tiled kernels.
//
// Why: ggml's CPU mul_mat_id computes every output with one vector dot product (no tiling), about a third of the rate
// of its own F32 GEMM; with F32 weights the experts were the largest cost of a decoder step. Here each thread takes a
// slice of every expert's output rows, and multiplies those weight rows with all of the expert's routed input rows in
// register tiles (4 weight rows × up to 6 input rows), so that each weight row is read from memory once per step and
// each loaded vector feeds several FMAs.
// Quantized weights go to qkernels.c (integer dot products), or to ggml's mul_mat_id for types it does not cover.
//
// Semantics equal ggml_mul_mat_id(w, x, ids): w [Kd, N, E], x [Kd, X1, T] with X1 = 1 (broadcast) or ids->ne[0],
// ids [K, T] I32 → y [N, K, T], y[:, k, t] = w[:, :, ids[k, t]]ᵀ · x[:, k % X1, t]. Only the summation order differs.
#include <stdlib.h>
#include <string.h>

#include "cpu.h"
#include "engine.h"
#include "qkernels.h"

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
    const dg_isa isa = dg_cpu_isa();
    return isa >= DG_ISA_AVX512 ? ISA_AVX512 : isa >= DG_ISA_AVX2 ? ISA_AVX2 : ISA_NONE;
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

    // bucket the (k, t) pairs by expert (counting sort; every thread builds the same lists): the rows of expert e are
    // [start[e], start[e + 1]) in xs / ys. One small allocation per call and thread (KiBs).
    const int64_t pairs = K * T;
    void *block = malloc(sizeof(int64_t) * (size_t)(E + 1) + (sizeof(float *) + sizeof(float *)) * (size_t)pairs);
    if (!block) abort();  // a custom op cannot report failure; out of memory for a few KiB the process is lost anyway
    int64_t *start = block;
    const float **xs = (const float **)(start + E + 1);
    float **ys = (float **)(xs + pairs);
    memset(start, 0, sizeof(int64_t) * (size_t)(E + 1));
    const int32_t *expert_of = ids->data;  // ids is contiguous [K, T] (top_k output)
    for (int64_t p = 0; p < pairs; p++) start[expert_of[p] + 1]++;
    for (int64_t e = 0; e < E; e++) start[e + 1] += start[e];
    for (int64_t p = 0; p < pairs; p++) {  // start[e] advances to the end of e's rows ...
        const int64_t k = p % K, t = p / K, slot = start[expert_of[p]]++;
        xs[slot] = (const float *)((const char *)x->data + (k % X1) * x->nb[1] + t * x->nb[2]);
        ys[slot] = (float *)((char *)dst->data + k * dst->nb[1] + t * dst->nb[2]);
    }
    memmove(start + 1, start, sizeof(int64_t) * (size_t)E);  // ... so shifting by one restores the starts
    start[0] = 0;

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
    free(block);
}

struct ggml_tensor *dg_build_expert_matmul_isa(struct ggml_context *ctx, struct ggml_tensor *w, struct ggml_tensor *x,
                                               struct ggml_tensor *ids, int isa) {
    const bool tiled = isa != ISA_NONE && w->type == GGML_TYPE_F32 && x->type == GGML_TYPE_F32 &&
                       w->nb[0] == sizeof(float) && x->nb[0] == sizeof(float) && ids->type == GGML_TYPE_I32 &&
                       ggml_is_contiguous(ids);
    if (!tiled) return ggml_mul_mat_id(ctx, w, x, ids);
    struct ggml_tensor *args[3] = {w, x, ids};
    return ggml_custom_4d(ctx, GGML_TYPE_F32, w->ne[1], ids->ne[0], ids->ne[1], 1, args, 3, expert_matmul_op,
                          GGML_N_TASKS_MAX, (void *)(intptr_t)isa);
}

int dg_expert_matmul_isa(void) { return (int)detect_isa(); }

// Quantized experts go to the integer kernels (qkernels.c) where they cover the type, F32 experts to the tiles above.
struct ggml_tensor *dg_build_expert_matmul(struct ggml_context *ctx, struct ggml_tensor *w, struct ggml_tensor *x,
                                           struct ggml_tensor *ids) {
    struct ggml_tensor *q = dg_build_qexpert_matmul(ctx, w, x, ids, dg_qk_default_path());
    return q ? q : dg_build_expert_matmul_isa(ctx, w, x, ids, dg_expert_matmul_isa());
}
