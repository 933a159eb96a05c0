// F32 weight products on the CPU as a ggml custom op: y = wᵀ·x for an F32 weight w [K, N] (ggml's layout: row j
// holds output j's K weights) and F32 activations x [K, T] → y [N, T].
//
// Why: ggml's F32 GEMM vectorises along K. Each output then needs a horizontal sum, and the activations stream from L2
// through 4-row weight tiles. At the bundled Sudoku model's shapes (K 128-256, T = 81) that runs at ~50 GFLOP/s per
// Zen 3 core. Here each thread copies 16 weight rows at a time into a K-major panel (8×8 transposes, kept in L1),
// then multiplies the panel with 6 activation rows at a time. Two 8-wide weight loads and six broadcasts feed twelve
// FMAs, with no horizontal sums: ~80 GFLOP/s on the same shapes.
// With AVX-512 (dg_cpu_isa(), chosen when the graph is built and passed to the op) the panels hold 32 rows and a tile
// 12 activation rows: two 16-wide weight loads and twelve broadcasts feed 24 FMAs.
// Each output is one FMA chain over k in order, so a result does not depend on the tiling, the thread count or the
// instruction set: the AVX-512 and AVX2 paths give the same bits (tests/test_f32_matmul.py). The order differs from
// ggml's lane-wise sums (the same test bounds the difference).
// Without AVX2, FMA and F16C (the quantized kernels' CPU check, cpu.c) the graph keeps ggml's own matmul.
#include <stdlib.h>
#include <string.h>

#include "cpu.h"
#include "engine.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

// AVX2: 16-row panels, 6 activation rows × 2 ymm per tile. AVX-512: 32-row panels, 12 activation rows × 2 zmm (24 of
// the 32 registers accumulate); on an Intel Xeon that ran within a few % of 64 × 6, and 15-30 % faster than 16 × 12
// (one weight load per twelve broadcasts) and than 48 × 8 at K = 256.
enum { PANEL = 16, ROWS = 6, PANEL512 = 32, ROWS512 = 12 };
#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))

// Weight rows [j0, j0 + nv) of w (row stride ldw floats) as a K-major panel of P rows (a constant after inlining):
// panel[k·P + i] = w[j0 + i][k], zero for i ≥ nv. Full panels go through 8×8 register transposes.
__attribute__((target("avx2,fma"), always_inline)) static inline void pack_panel(const float *w, size_t ldw,
                                                                                int64_t K, int64_t j0, int64_t nv,
                                                                                float *panel, const int P) {
    int64_t k0 = 0;
    if (nv == P) {
        for (; k0 + 8 <= K; k0 += 8) {
            for (int h = 0; h < P / 8; h++) {
                __m256 r[8];
                for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(w + (size_t)(j0 + h * 8 + i) * ldw + k0);
                const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
                const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
                const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
                const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
                const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
                const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
                const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
                const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
                float *dst = panel + (size_t)k0 * P + h * 8;  // column k0 + c of the 8 rows -> dst + c·P
                _mm256_storeu_ps(dst + 0 * P, _mm256_permute2f128_ps(u0, u4, 0x20));
                _mm256_storeu_ps(dst + 1 * P, _mm256_permute2f128_ps(u1, u5, 0x20));
                _mm256_storeu_ps(dst + 2 * P, _mm256_permute2f128_ps(u2, u6, 0x20));
                _mm256_storeu_ps(dst + 3 * P, _mm256_permute2f128_ps(u3, u7, 0x20));
                _mm256_storeu_ps(dst + 4 * P, _mm256_permute2f128_ps(u0, u4, 0x31));
                _mm256_storeu_ps(dst + 5 * P, _mm256_permute2f128_ps(u1, u5, 0x31));
                _mm256_storeu_ps(dst + 6 * P, _mm256_permute2f128_ps(u2, u6, 0x31));
                _mm256_storeu_ps(dst + 7 * P, _mm256_permute2f128_ps(u3, u7, 0x31));
            }
        }
    }
    for (int64_t k = k0; k < K; k++)
        for (int64_t i = 0; i < P; i++) panel[k * P + i] = i < nv ? w[(size_t)(j0 + i) * ldw + k] : 0.0f;
}

// y[r][j0 + i] = Σ_k panel[k][i] · x[r][k] for R (≤ ROWS, a constant after inlining) activation rows, i < nv
__attribute__((target("avx2,fma"), always_inline)) static inline void panel_rows(const float *panel, int64_t K,
                                                                                const float *const *x,
                                                                                float *const *y, int64_t j0,
                                                                                int64_t nv, const int R) {
    __m256 acc[ROWS][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        const __m256 w0 = _mm256_loadu_ps(panel + k * PANEL), w1 = _mm256_loadu_ps(panel + k * PANEL + 8);
        for (int r = 0; r < R; r++) {
            const __m256 b = _mm256_broadcast_ss(x[r] + k);
            acc[r][0] = _mm256_fmadd_ps(w0, b, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(w1, b, acc[r][1]);
        }
    }
    for (int r = 0; r < R; r++) {
        if (nv == PANEL) {
            _mm256_storeu_ps(y[r] + j0, acc[r][0]);
            _mm256_storeu_ps(y[r] + j0 + 8, acc[r][1]);
        } else {
            float out[PANEL];
            _mm256_storeu_ps(out, acc[r][0]);
            _mm256_storeu_ps(out + 8, acc[r][1]);
            memcpy(y[r] + j0, out, sizeof(float) * (size_t)nv);
        }
    }
}

__attribute__((target("avx2,fma"))) static void panel_product(const float *panel, int64_t K, const float *const *x,
                                                               float *const *y, int64_t T, int64_t j0, int64_t nv) {
    int64_t t = 0;
    for (; t + ROWS <= T; t += ROWS) panel_rows(panel, K, x + t, y + t, j0, nv, ROWS);
    switch (T - t) {
    case 5: panel_rows(panel, K, x + t, y + t, j0, nv, 5); break;
    case 4: panel_rows(panel, K, x + t, y + t, j0, nv, 4); break;
    case 3: panel_rows(panel, K, x + t, y + t, j0, nv, 3); break;
    case 2: panel_rows(panel, K, x + t, y + t, j0, nv, 2); break;
    case 1: panel_rows(panel, K, x + t, y + t, j0, nv, 1); break;
    }
}

__attribute__((target("avx2,fma"))) static void pack_panel16(const float *w, size_t ldw, int64_t K, int64_t j0,
                                                              int64_t nv, float *panel) {
    pack_panel(w, ldw, K, j0, nv, panel, PANEL);
}

// The AVX-512 tile: as panel_rows with PANEL512 / 16 zmm per row. Each output is the same chain (zero, one fmadd per
// k in order), so the same bits as the AVX2 path; a partial panel's rows are stored under a mask.
AVX512 __attribute__((always_inline)) static inline void panel_rows512(const float *panel, int64_t K,
                                                                        const float *const *x, float *const *y,
                                                                        int64_t j0, int64_t nv, const int R) {
    enum { V = PANEL512 / 16 };
    __m512 acc[ROWS512][V];
    for (int r = 0; r < R; r++)
        for (int v = 0; v < V; v++) acc[r][v] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        __m512 wv[V];
        for (int v = 0; v < V; v++) wv[v] = _mm512_load_ps(panel + k * PANEL512 + 16 * v);
        for (int r = 0; r < R; r++) {
            const __m512 b = _mm512_set1_ps(x[r][k]);
            for (int v = 0; v < V; v++) acc[r][v] = _mm512_fmadd_ps(wv[v], b, acc[r][v]);
        }
    }
    for (int v = 0; v < V; v++) {
        const int64_t left = nv - 16 * v;
        const __mmask16 m = left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
        for (int r = 0; r < R; r++) _mm512_mask_storeu_ps(y[r] + j0 + 16 * v, m, acc[r][v]);
    }
}

AVX512 static void panel_product512(const float *panel, int64_t K, const float *const *x, float *const *y, int64_t T,
                                    int64_t j0, int64_t nv) {
    int64_t t = 0;
    for (; t + ROWS512 <= T; t += ROWS512) panel_rows512(panel, K, x + t, y + t, j0, nv, ROWS512);
#define DG_F32_REST(R) \
    case R: panel_rows512(panel, K, x + t, y + t, j0, nv, R); break;
    switch (T - t) {
        DG_F32_REST(11) DG_F32_REST(10) DG_F32_REST(9) DG_F32_REST(8) DG_F32_REST(7) DG_F32_REST(6)
        DG_F32_REST(5) DG_F32_REST(4) DG_F32_REST(3) DG_F32_REST(2) DG_F32_REST(1)
    }
#undef DG_F32_REST
}

AVX512 static void pack_panel512(const float *w, size_t ldw, int64_t K, int64_t j0, int64_t nv, float *panel) {
    pack_panel(w, ldw, K, j0, nv, panel, PANEL512);
}

// Thread ith of nth: the panels [p0, p1) of the output, each packed once and multiplied with every activation row.
// userdata: the dg_isa level chosen at build time (DG_ISA_AVX2 or DG_ISA_AVX512).
static void f32_matmul_op(struct ggml_tensor *dst, int ith, int nth, void *userdata) {
    const bool avx512 = (dg_isa)(intptr_t)userdata == DG_ISA_AVX512;
    const int64_t P = avx512 ? PANEL512 : PANEL;
    const struct ggml_tensor *w = dst->src[0], *x = dst->src[1];
    const int64_t K = w->ne[0], N = w->ne[1], T = x->ne[1];
    const int64_t panels = (N + P - 1) / P, p0 = panels * ith / nth, p1 = panels * (ith + 1) / nth;
    if (p0 >= p1) return;
    // one panel and the row pointers per call and thread (K·4·P bytes + T·16): a custom op cannot report failure,
    // and out of memory for that little the process is lost anyway
    const size_t panel_bytes = (sizeof(float) * (size_t)(K * P) + 63) / 64 * 64;
    void *block = aligned_alloc(64, panel_bytes + (sizeof(float *) * 2 * (size_t)T + 63) / 64 * 64);
    if (!block) abort();
    float *panel = block;
    const float **xs = (const float **)((char *)block + panel_bytes);
    float **ys = (float **)(xs + T);
    for (int64_t t = 0; t < T; t++) {
        xs[t] = (const float *)((const char *)x->data + t * x->nb[1]);
        ys[t] = (float *)((char *)dst->data + t * dst->nb[1]);
    }
    const size_t ldw = w->nb[1] / sizeof(float);
    for (int64_t p = p0; p < p1; p++) {
        const int64_t j0 = p * P, nv = N - j0 < P ? N - j0 : P;
        if (avx512) {
            pack_panel512(w->data, ldw, K, j0, nv, panel);
            panel_product512(panel, K, xs, ys, T, j0, nv);
        } else {
            pack_panel16(w->data, ldw, K, j0, nv, panel);
            panel_product(panel, K, xs, ys, T, j0, nv);
        }
    }
    free(block);
}

#endif

struct ggml_tensor *dg_build_f32_matmul_isa(struct ggml_context *ctx, struct ggml_tensor *w, struct ggml_tensor *x,
                                            int isa) {
#if defined(__x86_64__) && defined(__GNUC__)
    const bool fits = w->type == GGML_TYPE_F32 && x->type == GGML_TYPE_F32 && w->ne[0] == x->ne[0] &&
                      w->ne[2] == 1 && w->ne[3] == 1 && x->ne[2] == 1 && x->ne[3] == 1 && w->nb[0] == sizeof(float) &&
                      x->nb[0] == sizeof(float) && w->nb[1] % sizeof(float) == 0;
    // AVX-VNNI adds nothing to F32 products: it runs the AVX2 path
    const dg_isa level = isa >= DG_ISA_AVX512 ? DG_ISA_AVX512 : isa >= DG_ISA_AVX2 ? DG_ISA_AVX2 : DG_ISA_NONE;
    if (!fits || level == DG_ISA_NONE || level > dg_cpu_isa()) return NULL;
    struct ggml_tensor *args[2] = {w, x};
    return ggml_custom_4d(ctx, GGML_TYPE_F32, w->ne[1], x->ne[1], 1, 1, args, 2, f32_matmul_op, GGML_N_TASKS_MAX,
                          (void *)(intptr_t)level);
#else
    (void)ctx;
    (void)w;
    (void)x;
    (void)isa;
    return NULL;
#endif
}

struct ggml_tensor *dg_build_f32_matmul(struct ggml_context *ctx, struct ggml_tensor *w, struct ggml_tensor *x) {
    return dg_build_f32_matmul_isa(ctx, w, x, dg_cpu_isa());
}
