// F32 weight products on the CPU as a ggml custom op: y = wᵀ·x for an F32 weight w [K, N] (ggml's layout: row j
// holds output j's K weights) and F32 activations x [K, T] → y [N, T].
//
// Why: ggml's F32 GEMM vectorises along K. Each output then needs a horizontal sum, and the activations stream from L2
// through 4-row weight tiles. At the bundled Sudoku model's shapes (K 128-256, T = 81) that runs at ~50 GFLOP/s per
// Zen 3 core. Here each thread copies 16 weight rows at a time into a K-major panel (8×8 transposes, kept in L1),
// then multiplies the panel with 6 activation rows at a time. Two 8-wide weight loads and six broadcasts feed twelve
// FMAs, with no horizontal sums: ~80 GFLOP/s on the same shapes.
// Each output is one FMA chain over k in order, so a result does not depend on the tiling or the thread count. The
// order differs from ggml's lane-wise sums (tests/test_f32_matmul.py bounds the difference).
// Without AVX2, FMA and F16C (the quantized kernels' CPU check, cpu.c) the graph keeps ggml's own matmul.
#include <stdlib.h>
#include <string.h>

#include "cpu.h"
#include "engine.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

enum { PANEL = 16, ROWS = 6 };

// Weight rows [j0, j0 + nv) of w (row stride ldw floats) as a K-major panel: panel[k·16 + i] = w[j0 + i][k], zero for
// i ≥ nv. Full panels go through 8×8 register transposes.
__attribute__((target("avx2,fma"))) static void pack_panel(const float *w, size_t ldw, int64_t K, int64_t j0,
                                                            int64_t nv, float *panel) {
    int64_t k0 = 0;
    if (nv == PANEL) {
        for (; k0 + 8 <= K; k0 += 8) {
            for (int h = 0; h < 2; h++) {
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
                float *dst = panel + (size_t)k0 * PANEL + h * 8;  // column k0 + c of the 8 rows -> dst + c·16
                _mm256_storeu_ps(dst + 0 * PANEL, _mm256_permute2f128_ps(u0, u4, 0x20));
                _mm256_storeu_ps(dst + 1 * PANEL, _mm256_permute2f128_ps(u1, u5, 0x20));
                _mm256_storeu_ps(dst + 2 * PANEL, _mm256_permute2f128_ps(u2, u6, 0x20));
                _mm256_storeu_ps(dst + 3 * PANEL, _mm256_permute2f128_ps(u3, u7, 0x20));
                _mm256_storeu_ps(dst + 4 * PANEL, _mm256_permute2f128_ps(u0, u4, 0x31));
                _mm256_storeu_ps(dst + 5 * PANEL, _mm256_permute2f128_ps(u1, u5, 0x31));
                _mm256_storeu_ps(dst + 6 * PANEL, _mm256_permute2f128_ps(u2, u6, 0x31));
                _mm256_storeu_ps(dst + 7 * PANEL, _mm256_permute2f128_ps(u3, u7, 0x31));
            }
        }
    }
    for (int64_t k = k0; k < K; k++)
        for (int64_t i = 0; i < PANEL; i++) panel[k * PANEL + i] = i < nv ? w[(size_t)(j0 + i) * ldw + k] : 0.0f;
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

// Thread ith of nth: the panels [p0, p1) of the output, each packed once and multiplied with every activation row.
static void f32_matmul_op(struct ggml_tensor *dst, int ith, int nth, void *userdata) {
    (void)userdata;
    const struct ggml_tensor *w = dst->src[0], *x = dst->src[1];
    const int64_t K = w->ne[0], N = w->ne[1], T = x->ne[1];
    const int64_t panels = (N + PANEL - 1) / PANEL, p0 = panels * ith / nth, p1 = panels * (ith + 1) / nth;
    if (p0 >= p1) return;
    // one panel and the row pointers per call and thread (K·64 bytes + T·16): a custom op cannot report failure, and
    // out of memory for that little the process is lost anyway
    void *block = malloc(sizeof(float) * (size_t)(K * PANEL) + sizeof(float *) * 2 * (size_t)T);
    if (!block) abort();
    float *panel = block;
    const float **xs = (const float **)(panel + K * PANEL);
    float **ys = (float **)(xs + T);
    for (int64_t t = 0; t < T; t++) {
        xs[t] = (const float *)((const char *)x->data + t * x->nb[1]);
        ys[t] = (float *)((char *)dst->data + t * dst->nb[1]);
    }
    const size_t ldw = w->nb[1] / sizeof(float);
    for (int64_t p = p0; p < p1; p++) {
        const int64_t j0 = p * PANEL, nv = N - j0 < PANEL ? N - j0 : PANEL;
        pack_panel(w->data, ldw, K, j0, nv, panel);
        panel_product(panel, K, xs, ys, T, j0, nv);
    }
    free(block);
}

#endif

struct ggml_tensor *dg_build_f32_matmul(struct ggml_context *ctx, struct ggml_tensor *w, struct ggml_tensor *x) {
#if defined(__x86_64__) && defined(__GNUC__)
    const bool fits = w->type == GGML_TYPE_F32 && x->type == GGML_TYPE_F32 && w->ne[0] == x->ne[0] &&
                      w->ne[2] == 1 && w->ne[3] == 1 && x->ne[2] == 1 && x->ne[3] == 1 && w->nb[0] == sizeof(float) &&
                      x->nb[0] == sizeof(float) && w->nb[1] % sizeof(float) == 0;
    if (!fits || dg_cpu_isa() < DG_ISA_AVX2) return NULL;
    struct ggml_tensor *args[2] = {w, x};
    return ggml_custom_4d(ctx, GGML_TYPE_F32, w->ne[1], x->ne[1], 1, 1, args, 2, f32_matmul_op, GGML_N_TASKS_MAX,
                          NULL);
#else
    (void)ctx;
    (void)w;
    (void)x;
    return NULL;
#endif
}
