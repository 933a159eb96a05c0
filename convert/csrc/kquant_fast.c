// Q4_K and Q5_K quantization without an importance matrix, byte-identical to ggml's quantize_row_q4_K_ref /
// quantize_row_q5_K_ref, several times faster (docs/convert.md#fast-k-quants).
//
// ggml fits a scale and a min to each of the 8 sub-blocks (32 values) of a 256-value super-block with a grid search
// (`make_qkx2_quants`), one sub-block after the other, in scalar float code. Here the 8 sub-blocks run side by side,
// one AVX2 lane each: every lane performs exactly the scalar code's float operations in exactly its order (no FMA:
// this file is compiled with -ffp-contract=off, and ggml-base itself is plain SSE2 code without FMA), so every
// intermediate value, and therefore every output byte, is the same. Per-lane branches become masks. The scale
// packing and the FP16 rounding stay scalar and call ggml's own conversions.
//
// Without AVX2 at run time, dgq_quantize returns 0 and the caller uses ggml_quantize_chunk.

#include <math.h>
#include <stdint.h>
#include <string.h>

#include <ggml.h>

#include "ggml_blocks.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define DGQ_X86 1
#include <immintrin.h>
#endif

#define DGQ_API __attribute__((visibility("default")))

enum { QK_K = 256, SUB = 32, N_SUB = QK_K / SUB };

typedef dg_block_q4_K block_q4_k;
typedef dg_block_q5_K block_q5_k;
typedef dg_block_q6_K block_q6_k;

#ifdef DGQ_X86  // everything below up to the exported functions: x86-64 only

// The grid-search parameters ggml passes to make_qkx2_quants for each type.
typedef struct {
    int nmax;
    float rmin, rdelta;
    int nstep;
} search_params;

static const search_params Q4_K_SEARCH = {15, -1.0f, 0.1f, 20};
static const search_params Q5_K_SEARCH = {31, -0.5f, 0.1f, 15};

// ggml's nearest_int: round to nearest even through the float adder, then reinterpret the bits.
static inline int nearest_int(float fval) {
    float val = fval + 12582912.f;
    int i;
    memcpy(&i, &val, sizeof(int));
    return (i & 0x007fffff) - 0x00400000;
}

static inline void get_scale_min_k4(int j, const uint8_t *q, uint8_t *d, uint8_t *m) {
    if (j < 4) {
        *d = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j - 0] >> 6) << 4);
    }
}

// The super-block's scales and mins (per sub-block) -> 6-bit codes, d and dmin; as quantize_row_q4_K_ref.
static void pack_scales(const float *scales, const float *mins, uint8_t *out_scales, uint16_t *d, uint16_t *dmin) {
    float max_scale = 0, max_min = 0;
    for (int j = 0; j < N_SUB; ++j) {
        if (scales[j] > max_scale) max_scale = scales[j];
        if (mins[j] > max_min) max_min = mins[j];
    }
    float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f;
    float inv_min = max_min > 0 ? 63.f / max_min : 0.f;
    for (int j = 0; j < N_SUB; ++j) {
        uint8_t ls = (uint8_t)nearest_int(inv_scale * scales[j]);
        uint8_t lm = (uint8_t)nearest_int(inv_min * mins[j]);
        ls = ls < 63 ? ls : 63;
        lm = lm < 63 ? lm : 63;
        if (j < 4) {
            out_scales[j] = ls;
            out_scales[j + 4] = lm;
        } else {
            out_scales[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4);
            out_scales[j - 4] |= ((ls >> 4) << 6);
            out_scales[j - 0] |= ((lm >> 4) << 6);
        }
    }
    *d = ggml_fp32_to_fp16(max_scale / 63.f);
    *dmin = ggml_fp32_to_fp16(max_min / 63.f);
}

// Q5_K's layout of 256 levels 0..31: low nibbles in qs, the fifth bits in qh.
static void pack_q5(const uint8_t *L, uint8_t *qh, uint8_t *ql) {
    memset(qh, 0, QK_K / 8);
    uint8_t m1 = 1, m2 = 2;
    for (int n = 0; n < QK_K; n += 64) {
        for (int j = 0; j < 32; ++j) {
            int l1 = L[n + j];
            if (l1 > 15) {
                l1 -= 16;
                qh[j] |= m1;
            }
            int l2 = L[n + j + 32];
            if (l2 > 15) {
                l2 -= 16;
                qh[j] |= m2;
            }
            ql[j] = l1 | (l2 << 4);
        }
        m1 <<= 2;
        m2 <<= 2;
        ql += 32;
    }
}

// Q6_K's layout of 256 levels 0..63: low nibbles in ql, the two high bits in qh.
static void pack_q6(const uint8_t *L, uint8_t *ql, uint8_t *qh) {
    for (int j = 0; j < QK_K; j += 128) {
        for (int l = 0; l < 32; ++l) {
            const uint8_t q1 = L[j + l + 0] & 0xF;
            const uint8_t q2 = L[j + l + 32] & 0xF;
            const uint8_t q3 = L[j + l + 64] & 0xF;
            const uint8_t q4 = L[j + l + 96] & 0xF;
            ql[l + 0] = q1 | (q3 << 4);
            ql[l + 32] = q2 | (q4 << 4);
            qh[l] = (L[j + l] >> 4) | ((L[j + l + 32] >> 4) << 2) | ((L[j + l + 64] >> 4) << 4) |
                    ((L[j + l + 96] >> 4) << 6);
        }
        ql += 64;
        qh += 32;
    }
}

static void pack_q4(const uint8_t *L, uint8_t *q) {
    for (int j = 0; j < QK_K; j += 64) {
        for (int l = 0; l < 32; ++l) q[l] = L[j + l] | (L[j + l + 32] << 4);
        q += 32;
    }
}

#define AVX2 __attribute__((target("avx2")))

AVX2 static inline __m256i nearest_int8(__m256 v) {
    __m256i bits = _mm256_castps_si256(_mm256_add_ps(v, _mm256_set1_ps(12582912.f)));
    return _mm256_sub_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x007fffff)), _mm256_set1_epi32(0x00400000));
}

AVX2 static inline __m256i clamp8(__m256i l, int nmax) {
    return _mm256_max_epi32(_mm256_setzero_si256(), _mm256_min_epi32(_mm256_set1_epi32(nmax), l));
}

AVX2 static inline __m256 select8(__m256 if_false, __m256 if_true, __m256 mask) {
    return _mm256_blendv_ps(if_false, if_true, mask);
}

// Sum over the sub-block of w * (scale*L + min - x)^2, in index order (make_qkx2_quants' error, use_mad false).
AVX2 static inline __m256 weighted_error(const __m256 *x, const __m256 *w, const __m256i *L, __m256 scale, __m256 min) {
    __m256 err = _mm256_setzero_ps();
    for (int i = 0; i < SUB; ++i) {
        __m256 diff = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(scale, _mm256_cvtepi32_ps(L[i])), min), x[i]);
        err = _mm256_add_ps(err, _mm256_mul_ps(w[i], _mm256_mul_ps(diff, diff)));
    }
    return err;
}

// quantize_row_q*_K_ref's weights (sqrt of the mean square plus |x|) and make_qkx2_quants, for 8 sub-blocks at
// once: x[i] holds element i of sub-block j in lane j. Writes the levels L[i] and each lane's scale and -min.
AVX2 static void search_8(const __m256 *x, search_params p, __m256i *L, float *scale_out, float *min_out) {
    __m256 w[SUB];
    __m256 sum_x2 = _mm256_setzero_ps();
    for (int l = 0; l < SUB; ++l) sum_x2 = _mm256_add_ps(sum_x2, _mm256_mul_ps(x[l], x[l]));
    const __m256 av_x = _mm256_sqrt_ps(_mm256_div_ps(sum_x2, _mm256_set1_ps(32.f)));
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int l = 0; l < SUB; ++l) w[l] = _mm256_add_ps(av_x, _mm256_and_ps(x[l], abs_mask));

    const __m256 zero = _mm256_setzero_ps();
    __m256 min = x[0], max = x[0];
    __m256 sum_w = w[0];
    __m256 sum_x = _mm256_mul_ps(sum_w, x[0]);
    for (int i = 1; i < SUB; ++i) {
        min = _mm256_min_ps(x[i], min);  // x < min ? x : min, as `if (x[i] < min) min = x[i]`
        max = _mm256_max_ps(x[i], max);
        sum_w = _mm256_add_ps(sum_w, w[i]);
        sum_x = _mm256_add_ps(sum_x, _mm256_mul_ps(w[i], x[i]));
    }
    min = select8(min, zero, _mm256_cmp_ps(min, zero, _CMP_GT_OQ));
    const __m256 flat = _mm256_cmp_ps(max, min, _CMP_EQ_OQ);  // these lanes return L = 0, scale 0
    const __m256 flat_min = min;

    __m256 iscale = _mm256_div_ps(_mm256_set1_ps((float)p.nmax), _mm256_sub_ps(max, min));
    __m256 scale = _mm256_div_ps(_mm256_set1_ps(1.f), iscale);
    for (int i = 0; i < SUB; ++i) L[i] = clamp8(nearest_int8(_mm256_mul_ps(iscale, _mm256_sub_ps(x[i], min))), p.nmax);
    __m256 best_error = weighted_error(x, w, L, scale, min);

    __m256i Laux[SUB];
    for (int is = 0; is <= p.nstep; ++is) {
        const float grid = p.rmin + p.rdelta * is + p.nmax;
        iscale = _mm256_div_ps(_mm256_set1_ps(grid), _mm256_sub_ps(max, min));  // min: the best fit so far
        __m256 sum_l = zero, sum_l2 = zero, sum_xl = zero;
        for (int i = 0; i < SUB; ++i) {
            Laux[i] = clamp8(nearest_int8(_mm256_mul_ps(iscale, _mm256_sub_ps(x[i], min))), p.nmax);
            const __m256 wl = _mm256_mul_ps(w[i], _mm256_cvtepi32_ps(Laux[i]));
            sum_l = _mm256_add_ps(sum_l, wl);
            sum_l2 = _mm256_add_ps(sum_l2, _mm256_mul_ps(wl, _mm256_cvtepi32_ps(Laux[i])));
            sum_xl = _mm256_add_ps(sum_xl, _mm256_mul_ps(wl, x[i]));
        }
        const __m256 D = _mm256_sub_ps(_mm256_mul_ps(sum_w, sum_l2), _mm256_mul_ps(sum_l, sum_l));
        const __m256 solvable = _mm256_cmp_ps(D, zero, _CMP_GT_OQ);
        if (_mm256_movemask_ps(solvable) == 0) continue;
        __m256 this_scale = _mm256_div_ps(_mm256_sub_ps(_mm256_mul_ps(sum_w, sum_xl), _mm256_mul_ps(sum_x, sum_l)), D);
        __m256 this_min = _mm256_div_ps(_mm256_sub_ps(_mm256_mul_ps(sum_l2, sum_x), _mm256_mul_ps(sum_l, sum_xl)), D);
        const __m256 min_positive = _mm256_cmp_ps(this_min, zero, _CMP_GT_OQ);
        if (_mm256_movemask_ps(min_positive) != 0) {  // only those lanes divide (the scalar code divides only there)
            this_scale = select8(this_scale, _mm256_div_ps(sum_xl, sum_l2), min_positive);
            this_min = select8(this_min, zero, min_positive);
        }
        const __m256 cur_error = weighted_error(x, w, Laux, this_scale, this_min);
        const __m256 better = _mm256_and_ps(solvable, _mm256_cmp_ps(cur_error, best_error, _CMP_LT_OQ));
        if (_mm256_movemask_ps(better) == 0) continue;
        const __m256i better_i = _mm256_castps_si256(better);
        for (int i = 0; i < SUB; ++i) L[i] = _mm256_blendv_epi8(L[i], Laux[i], better_i);
        best_error = select8(best_error, cur_error, better);
        scale = select8(scale, this_scale, better);
        min = select8(min, this_min, better);
    }
    const __m256i flat_i = _mm256_castps_si256(flat);
    for (int i = 0; i < SUB; ++i) L[i] = _mm256_andnot_si256(flat_i, L[i]);
    scale = select8(scale, zero, flat);
    min = select8(min, flat_min, flat);
    _mm256_storeu_ps(scale_out, scale);
    _mm256_storeu_ps(min_out, _mm256_xor_ps(min, _mm256_set1_ps(-0.f)));  // *the_min = -min
}

// The second pass of quantize_row_q*_K_ref: levels from the packed scales; sub-blocks with d == 0 keep the search's.
AVX2 static void requantize_levels(const float *x, const uint8_t *packed, uint16_t d16, uint16_t dmin16, int nmax,
                                   uint8_t *L) {
    const float d_all = ggml_fp16_to_fp32(d16), dmin_all = ggml_fp16_to_fp32(dmin16);
    for (int j = 0; j < N_SUB; ++j) {
        uint8_t sc, m;
        get_scale_min_k4(j, packed, &sc, &m);
        const float d = d_all * sc;
        if (!d) continue;
        const float dm = dmin_all * m;
        for (int ii = 0; ii < SUB; ii += 8) {
            __m256 v = _mm256_div_ps(_mm256_add_ps(_mm256_loadu_ps(x + SUB * j + ii), _mm256_set1_ps(dm)),
                                     _mm256_set1_ps(d));
            int32_t l[8];
            _mm256_storeu_si256((__m256i *)l, clamp8(nearest_int8(v), nmax));
            for (int k = 0; k < 8; ++k) L[SUB * j + ii + k] = (uint8_t)l[k];
        }
    }
}

// One super-block up to the packing: search, scales, requantization. L gets the 256 levels in natural order.
AVX2 static void superblock(const float *x, search_params p, uint8_t *packed, uint16_t *d, uint16_t *dmin,
                            uint8_t *L) {
    __m256 xt[SUB];  // transposed: xt[i] lane j = x[32*j + i]
    const __m256i stride = _mm256_setr_epi32(0, 32, 64, 96, 128, 160, 192, 224);
    for (int i = 0; i < SUB; ++i) xt[i] = _mm256_i32gather_ps(x + i, stride, 4);
    __m256i Lt[SUB];
    float scales[N_SUB], mins[N_SUB];
    search_8(xt, p, Lt, scales, mins);
    for (int i = 0; i < SUB; ++i) {
        int32_t l[8];
        _mm256_storeu_si256((__m256i *)l, Lt[i]);
        for (int j = 0; j < N_SUB; ++j) L[SUB * j + i] = (uint8_t)l[j];
    }
    memset(packed, 0, 12);
    pack_scales(scales, mins, packed, d, dmin);
    requantize_levels(x, packed, *d, *dmin, p.nmax, L);
}

AVX2 static void quantize_q4_k_avx2(const float *x, block_q4_k *y, int64_t nb) {
    uint8_t L[QK_K];
    for (int64_t i = 0; i < nb; ++i, x += QK_K) {
        superblock(x, Q4_K_SEARCH, y[i].scales, &y[i].d, &y[i].dmin, L);
        pack_q4(L, y[i].qs);
    }
}

AVX2 static void quantize_q5_k_avx2(const float *x, block_q5_k *y, int64_t nb) {
    uint8_t L[QK_K];
    for (int64_t i = 0; i < nb; ++i, x += QK_K) {
        superblock(x, Q5_K_SEARCH, y[i].scales, &y[i].d, &y[i].dmin, L);
        pack_q5(L, y[i].qh, y[i].qs);
    }
}

// ---- Q6_K: make_qx_quants(16, 32, x, L, rmse_type 1, no weights) for 8 sub-blocks of 16 at once -------------------

enum { Q6_SUB = 16, Q6_N_SUB = QK_K / Q6_SUB, Q6_NMAX = 32 };
#define GROUP_MAX_EPS 1e-15f  // ggml-quants.c's threshold for an all-zero group

// Levels at one inverse scale, and the weighted sums (weights x^2): l = clamp(nearest_int(iscale*x), -32, 31).
AVX2 static inline void q6_levels(const __m256 *x, const __m256 *w, __m256 iscale, __m256i *l, __m256 *sumlx,
                                  __m256 *suml2) {
    const __m256i lo = _mm256_set1_epi32(-Q6_NMAX), hi = _mm256_set1_epi32(Q6_NMAX - 1);
    __m256 slx = _mm256_setzero_ps(), sl2 = _mm256_setzero_ps();
    for (int i = 0; i < Q6_SUB; ++i) {
        l[i] = _mm256_max_epi32(lo, _mm256_min_epi32(hi, nearest_int8(_mm256_mul_ps(iscale, x[i]))));
        const __m256 lf = _mm256_cvtepi32_ps(l[i]);
        slx = _mm256_add_ps(slx, _mm256_mul_ps(_mm256_mul_ps(w[i], x[i]), lf));  // w*x[i]*l
        sl2 = _mm256_add_ps(sl2, _mm256_mul_ps(_mm256_mul_ps(w[i], lf), lf));    // w*l*l
    }
    *sumlx = slx;
    *suml2 = sl2;
}

// x[i] lane j = element i of sub-block j; L[i] gets levels + 32 (0..63); the lanes' scales go to scale_out.
AVX2 static void q6_search_8(const __m256 *x, __m256i *L, float *scale_out) {
    const __m256 zero = _mm256_setzero_ps();
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 w[Q6_SUB];
    __m256 amax = zero, max = zero;
    for (int i = 0; i < Q6_SUB; ++i) {
        const __m256 bigger = _mm256_cmp_ps(_mm256_and_ps(x[i], abs_mask), amax, _CMP_GT_OQ);
        amax = select8(amax, _mm256_and_ps(x[i], abs_mask), bigger);
        max = select8(max, x[i], bigger);
        w[i] = _mm256_mul_ps(x[i], x[i]);
    }
    const __m256 all_zero = _mm256_cmp_ps(amax, _mm256_set1_ps(GROUP_MAX_EPS), _CMP_LT_OQ);

    __m256i l[Q6_SUB];
    __m256 sumlx, suml2;
    q6_levels(x, w, _mm256_div_ps(_mm256_set1_ps((float)-Q6_NMAX), max), L, &sumlx, &suml2);
    // scale = suml2 ? sumlx/suml2 : 0
    __m256 scale = select8(_mm256_div_ps(sumlx, suml2), zero, _mm256_cmp_ps(suml2, zero, _CMP_EQ_OQ));
    __m256 best = _mm256_mul_ps(scale, sumlx);
    for (int is = -9; is <= 9; ++is) {
        if (is == 0) continue;
        const float grid = -(Q6_NMAX + 0.1f * is);
        q6_levels(x, w, _mm256_div_ps(_mm256_set1_ps(grid), max), l, &sumlx, &suml2);
        const __m256 better = _mm256_and_ps(_mm256_cmp_ps(suml2, zero, _CMP_GT_OQ),
                                            _mm256_cmp_ps(_mm256_mul_ps(sumlx, sumlx), _mm256_mul_ps(best, suml2),
                                                          _CMP_GT_OQ));
        if (_mm256_movemask_ps(better) == 0) continue;
        const __m256i better_i = _mm256_castps_si256(better);
        for (int i = 0; i < Q6_SUB; ++i) L[i] = _mm256_blendv_epi8(L[i], l[i], better_i);
        scale = select8(scale, _mm256_div_ps(sumlx, suml2), better);
        best = select8(best, _mm256_mul_ps(scale, sumlx), better);
    }
    const __m256i zero_i = _mm256_castps_si256(all_zero);
    for (int i = 0; i < Q6_SUB; ++i)  // L = l + nmax, and 0 for an all-zero group
        L[i] = _mm256_andnot_si256(zero_i, _mm256_add_epi32(L[i], _mm256_set1_epi32(Q6_NMAX)));
    _mm256_storeu_ps(scale_out, select8(scale, zero, all_zero));
}

// quantize_row_q6_K_ref for one super-block.
AVX2 static void q6_superblock(const float *x, block_q6_k *y) {
    const __m256i stride = _mm256_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112);
    float scales[Q6_N_SUB];
    uint8_t L[QK_K];
    for (int half = 0; half < 2; ++half) {  // sub-blocks 0..7, then 8..15
        __m256 xt[Q6_SUB];
        __m256i Lt[Q6_SUB];
        const float *xh = x + half * 8 * Q6_SUB;
        for (int i = 0; i < Q6_SUB; ++i) xt[i] = _mm256_i32gather_ps(xh + i, stride, 4);
        q6_search_8(xt, Lt, scales + half * 8);
        for (int i = 0; i < Q6_SUB; ++i) {
            int32_t l[8];
            _mm256_storeu_si256((__m256i *)l, Lt[i]);
            for (int j = 0; j < 8; ++j) L[(half * 8 + j) * Q6_SUB + i] = (uint8_t)l[j];
        }
    }
    float max_scale = 0, max_abs_scale = 0;
    for (int ib = 0; ib < Q6_N_SUB; ++ib) {
        const float abs_scale = fabsf(scales[ib]);
        if (abs_scale > max_abs_scale) {
            max_abs_scale = abs_scale;
            max_scale = scales[ib];
        }
    }
    if (max_abs_scale < GROUP_MAX_EPS) {
        memset(y, 0, sizeof(*y));
        y->d = ggml_fp32_to_fp16(0.f);
        return;
    }
    const float iscale = -128.f / max_scale;
    y->d = ggml_fp32_to_fp16(1 / iscale);
    for (int ib = 0; ib < Q6_N_SUB; ++ib) {
        const int l = nearest_int(iscale * scales[ib]);
        y->scales[ib] = (int8_t)(l < 127 ? l : 127);
    }
    const float d_all = ggml_fp16_to_fp32(y->d);
    const __m256i lo = _mm256_set1_epi32(-32), hi = _mm256_set1_epi32(31);
    for (int j = 0; j < Q6_N_SUB; ++j) {
        const float d = d_all * y->scales[j];
        if (!d) continue;
        for (int ii = 0; ii < Q6_SUB; ii += 8) {
            __m256 v = _mm256_div_ps(_mm256_loadu_ps(x + Q6_SUB * j + ii), _mm256_set1_ps(d));
            int32_t l[8];
            _mm256_storeu_si256((__m256i *)l, _mm256_max_epi32(lo, _mm256_min_epi32(hi, nearest_int8(v))));
            for (int k = 0; k < 8; ++k) L[Q6_SUB * j + ii + k] = (uint8_t)(l[k] + 32);
        }
    }
    pack_q6(L, y->ql, y->qh);
}

AVX2 static void quantize_q6_k_avx2(const float *x, block_q6_k *y, int64_t nb) {
    for (int64_t i = 0; i < nb; ++i, x += QK_K) q6_superblock(x, y + i);
}

static int have_avx2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2");
}

#else

static int have_avx2(void) { return 0; }

#endif

// 1 when dgq_quantize handles this GGML type on this CPU (Q4_K, Q5_K, Q6_K with AVX2), else 0.
DGQ_API int dgq_supported(int type) {
    return (type == GGML_TYPE_Q4_K || type == GGML_TYPE_Q5_K || type == GGML_TYPE_Q6_K) && have_avx2();
}

// Quantize n_rows rows of n_per_row floats (a multiple of 256) like ggml_quantize_chunk without an importance
// matrix. Returns the bytes written, or 0 when the type or the row length is not handled here (nothing written).
DGQ_API size_t dgq_quantize(int type, const float *src, void *dst, int64_t n_rows, int64_t n_per_row) {
    if (!dgq_supported(type) || n_rows < 0 || n_per_row <= 0 || n_per_row % QK_K != 0) return 0;
    const int64_t nb = n_rows * (n_per_row / QK_K);
#ifdef DGQ_X86
    if (type == GGML_TYPE_Q4_K) {
        quantize_q4_k_avx2(src, (block_q4_k *)dst, nb);
        return (size_t)nb * sizeof(block_q4_k);
    }
    if (type == GGML_TYPE_Q6_K) {
        quantize_q6_k_avx2(src, (block_q6_k *)dst, nb);
        return (size_t)nb * sizeof(block_q6_k);
    }
    quantize_q5_k_avx2(src, (block_q5_k *)dst, nb);
    return (size_t)nb * sizeof(block_q5_k);
#else
    (void)src; (void)dst; (void)nb;
    return 0;
#endif
}
