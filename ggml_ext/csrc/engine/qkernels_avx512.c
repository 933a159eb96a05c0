// AVX-512 VNNI kernels of the quantized products (qkernels.h): sixteen weight rows per instruction.
//
// Per group of sixteen weight rows, each (super-)block is decoded to bytes with the AVX2 decoders (qkernels_avx2.h)
// and interleaved into the scratch: vector c holds elements 4c..4c+3 of all sixteen rows. One vpdpbusd then
// multiplies four elements of sixteen rows with four broadcast activations (64 multiply-adds), and the sixteen s32
// lanes are the sixteen rows' sums; the float scaling is one set of instructions for sixteen outputs. vpdpbusd takes
// u8 × s8, so signed weights go in as w + 128 (Q8_0, Q5_0 as q − 16, IQ4_NL, IQ4_XS) and 128 · Σx is taken back
// out per block or sub-block; Q4_K (0..15) and Q6_K (0..63) are unsigned already (Q6_K's offset of 32 is taken out
// the same way). K-quant sub-block scales multiply each sub-block's s32 sums (vpmulld) before they are added, so every
// integer is ggml's; the floats are one scaling per block (32-element types, the same operations as the AVX2 eight-row
// tile) or per super-block.
//
// Rows after the last whole group of sixteen (at most 15 per thread and expert) go to the AVX2 kernels.
#include <string.h>

#include "qkernels.h"
#include "qkernels_avx2.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")))
#define INLINE TARGET __attribute__((always_inline)) static inline
#define W_ROW(T, j) ((const T *)(job->w + (size_t)(j) * job->w_row))

// Calls TILE(n) for the activation rows in groups of NR_MAX (≤ 8), then once for the remainder, each tile height a
// constant so that the accumulators stay in registers.
#define FOR_EACH_TILE(NR_MAX, n_rows, TILE)                             \
    do {                                                                \
        int64_t r = 0;                                                  \
        for (; r + (NR_MAX) <= (n_rows); r += (NR_MAX)) TILE(NR_MAX);  \
        switch ((n_rows) - r) {                                         \
            case 7: if (7 < (NR_MAX)) TILE(7); break;                   \
            case 6: if (6 < (NR_MAX)) TILE(6); break;                   \
            case 5: if (5 < (NR_MAX)) TILE(5); break;                   \
            case 4: if (4 < (NR_MAX)) TILE(4); break;                   \
            case 3: TILE(3); break;                                     \
            case 2: TILE(2); break;                                     \
            case 1: TILE(1); break;                                     \
        }                                                               \
    } while (0)

// Sixteen rows' 32-element parts (element k in byte k) -> out[c], c = 0..7: bytes 4c..4c+3 of row r in lane r.
INLINE void interleave16(__m256i v[16], __m512i *out) {
    dg_transpose8x32_avx2(v);
    dg_transpose8x32_avx2(v + 8);
    for (int c = 0; c < 8; c++) _mm512_store_si512(out + c, _mm512_inserti64x4(_mm512_castsi256_si512(v[c]), v[8 + c], 1));
}

// bytes 4c..4c+3 of an activation block, in every lane
INLINE __m512i quad(const int8_t *qs, int c) {
    int32_t four;
    memcpy(&four, qs + 4 * c, sizeof four);
    return _mm512_set1_epi32(four);
}

// the rows [j, n1) after the last group of sixteen
static void rest_avx2(const dg_qk_job *job, int64_t j, enum ggml_type type) {
    if (j >= job->n1) return;
    dg_qk_job rest = *job;
    rest.n0 = j;
    dg_qk_avx2_kernel(type)(&rest);
}

// ---------------------------------------------------------------------------------------------------------------
// 32-element types (Q8_0, Q5_0, IQ4_NL) × Q8_0 activations

typedef struct {
    __m512i w[8];  // w + 128, interleaved
    float d[16];
} block16;

INLINE void tile16(const block16 *wb, const uint8_t **x, float **y, int64_t j0, int64_t nb, size_t side, const int NR) {
    __m512 acc[8];
    const dg_block_q8_0 *xb[8];
    const float *dx[8];
    const int32_t *neg128[8];
    for (int b = 0; b < NR; b++) {
        acc[b] = _mm512_setzero_ps();
        xb[b] = (const dg_block_q8_0 *)x[b];
        dx[b] = (const float *)(x[b] + side);
        neg128[b] = (const int32_t *)(dx[b] + 9 * nb);  // after dx[nb] and lanes16[8·nb]
    }
    for (int64_t i = 0; i < nb; i++) {
        __m512i si[8];
        for (int b = 0; b < NR; b++) si[b] = _mm512_set1_epi32(neg128[b][i]);
#pragma GCC unroll 8
        for (int c = 0; c < 8; c++) {
            const __m512i w = _mm512_load_si512(wb[i].w + c);
            for (int b = 0; b < NR; b++) si[b] = _mm512_dpbusd_epi32(si[b], w, quad(xb[b][i].qs, c));
        }
        const __m512 d = _mm512_load_ps(wb[i].d);
        for (int b = 0; b < NR; b++)
            acc[b] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(dx[b][i])), _mm512_cvtepi32_ps(si[b]), acc[b]);
    }
    for (int b = 0; b < NR; b++) _mm512_storeu_ps(y[b] + j0, acc[b]);
}

#define DEFINE_BLOCK32_JOB(NAME, BLOCK, TYPE)                                                             \
    TARGET static void NAME##_job(const dg_qk_job *job) {                                                 \
        block16 *wb = (block16 *)job->scratch;                                                            \
        const __m256i bias = _mm256_set1_epi8((char)0x80);                                                \
        int64_t j = job->n0;                                                                              \
        for (; j + 16 <= job->n1; j += 16) {                                                              \
            for (int64_t i = 0; i < job->nb; i++) {                                                       \
                __m256i v[16];                                                                            \
                for (int r = 0; r < 16; r++) {                                                            \
                    const BLOCK *b = W_ROW(BLOCK, j + r) + i;                                             \
                    v[r] = _mm256_xor_si256(dg_##NAME##_signed_avx2(b), bias);                            \
                    wb[i].d[r] = _cvtsh_ss(b->d);                                                         \
                }                                                                                         \
                interleave16(v, wb[i].w);                                                                 \
            }                                                                                             \
            FOR_EACH_TILE(8, job->n_rows, TILE16);                                                        \
        }                                                                                                 \
        rest_avx2(job, j, TYPE);                                                                          \
    }
#define TILE16(n) tile16(wb, job->x + r, job->y + r, j, job->nb, job->side, n)
DEFINE_BLOCK32_JOB(q8_0, dg_block_q8_0, GGML_TYPE_Q8_0)
DEFINE_BLOCK32_JOB(q5_0, dg_block_q5_0, GGML_TYPE_Q5_0)
DEFINE_BLOCK32_JOB(iq4_nl, dg_block_iq4_nl, GGML_TYPE_IQ4_NL)

// ---------------------------------------------------------------------------------------------------------------
// K-quants (Q4_K, Q6_K, IQ4_XS) × Q8_K activations

typedef enum { KIND_Q4_K, KIND_Q6_K, KIND_IQ4_XS } kquant_kind;

typedef struct {
    __m512i w[64];         // the super-block's 256 values (Q4_K, Q6_K as stored; IQ4_XS + 128), interleaved
    int32_t scale[16][16];  // scale of group g of row r (Q6_K: 16 groups of 16; the others: 8 of 32)
    int32_t pairs[8][16];   // s16 pairs per row: Q4_K mins (m_2p, m_2p+1), p < 4; Q6_K / IQ4_XS scales (2p, 2p+1)
    float d[16], dmin[16];
} sblock16;

INLINE int32_t pack16(int lo, int hi) { return (int32_t)((uint32_t)(uint16_t)(int16_t)lo | (uint32_t)hi << 16); }

TARGET static void q4_K_prep(const dg_qk_job *job, int64_t j0, sblock16 *out) {
    for (int64_t i = 0; i < job->nb; i++, out++) {
        for (int u = 0; u < 8; u++) {
            __m256i v[16];
            for (int r = 0; r < 16; r++) v[r] = dg_q4_K_sub_avx2(W_ROW(dg_block_q4_K, j0 + r) + i, u);
            interleave16(v, out->w + 8 * u);
        }
        for (int r = 0; r < 16; r++) {
            const dg_block_q4_K *b = W_ROW(dg_block_q4_K, j0 + r) + i;
            int sc[8], m[8];
            for (int g = 0; g < 8; g++) {
                dg_qk_q4k_scale_min(b->scales, g, &sc[g], &m[g]);
                out->scale[g][r] = sc[g];
            }
            for (int p = 0; p < 4; p++) out->pairs[p][r] = pack16(m[2 * p], m[2 * p + 1]);
            out->d[r] = _cvtsh_ss(b->d);
            out->dmin[r] = _cvtsh_ss(b->dmin);
        }
    }
}

TARGET static void q6_K_prep(const dg_qk_job *job, int64_t j0, sblock16 *out) {
    for (int64_t i = 0; i < job->nb; i++, out++) {
        for (int u = 0; u < 8; u++) {
            __m256i v[16];
            for (int r = 0; r < 16; r++) v[r] = dg_q6_K_quarter_avx2(W_ROW(dg_block_q6_K, j0 + r) + i, u / 4, u % 4);
            interleave16(v, out->w + 8 * u);
        }
        for (int r = 0; r < 16; r++) {
            const dg_block_q6_K *b = W_ROW(dg_block_q6_K, j0 + r) + i;
            for (int g = 0; g < 16; g++) out->scale[g][r] = b->scales[g];
            for (int p = 0; p < 8; p++) out->pairs[p][r] = pack16(b->scales[2 * p], b->scales[2 * p + 1]);
            out->d[r] = _cvtsh_ss(b->d);
        }
    }
}

TARGET static void iq4_xs_prep(const dg_qk_job *job, int64_t j0, sblock16 *out) {
    const __m256i grid = dg_iq4_grid_avx2(), bias = _mm256_set1_epi8((char)0x80);
    for (int64_t i = 0; i < job->nb; i++, out++) {
        for (int u = 0; u < 8; u++) {
            __m256i v[16];
            for (int r = 0; r < 16; r++)
                v[r] = _mm256_xor_si256(dg_iq4_values16_avx2(W_ROW(dg_block_iq4_xs, j0 + r)[i].qs + 16 * u, grid), bias);
            interleave16(v, out->w + 8 * u);
        }
        for (int r = 0; r < 16; r++) {
            const dg_block_iq4_xs *b = W_ROW(dg_block_iq4_xs, j0 + r) + i;
            int sc[8];
            for (int g = 0; g < 8; g++) out->scale[g][r] = sc[g] = dg_qk_iq4xs_scale(b, g);
            for (int p = 0; p < 4; p++) out->pairs[p][r] = pack16(sc[2 * p], sc[2 * p + 1]);
            out->d[r] = _cvtsh_ss(b->d);
        }
    }
}

// Σ_p pairs[p] · (a[2p], a[2p + 1]) over n pairs: a row's scales (or mins) against an activation's group sums
INLINE __m512i pair_dot(const sblock16 *sb, const int16_t *a, int n) {
    __m512i s = _mm512_setzero_si512();
    for (int p = 0; p < n; p++) {
        int32_t two;
        memcpy(&two, a + 2 * p, sizeof two);
        s = _mm512_dpwssd_epi32(s, _mm512_load_si512(sb->pairs[p]), _mm512_set1_epi32(two));
    }
    return s;
}

INLINE void ktile16(const sblock16 *wb, const uint8_t **x, float **y, int64_t j0, int64_t nb, const kquant_kind kind,
                    const int NR) {
    const int groups = kind == KIND_Q6_K ? 16 : 8, steps = 64 / groups;  // vpdpbusd steps per scale group
    __m512 acc[6];
    const dg_block_q8_K *xb[6];
    for (int b = 0; b < NR; b++) {
        acc[b] = _mm512_setzero_ps();
        xb[b] = (const dg_block_q8_K *)x[b];
    }
    for (int64_t i = 0; i < nb; i++) {
        const sblock16 *sb = wb + i;
        __m512i si[6];
        for (int b = 0; b < NR; b++) si[b] = _mm512_setzero_si512();
#pragma GCC unroll 1
        for (int g = 0; g < groups; g++) {
            __m512i t[6];
            for (int b = 0; b < NR; b++) t[b] = _mm512_setzero_si512();
#pragma GCC unroll 8
            for (int s = 0; s < steps; s++) {
                const int c = g * steps + s;
                const __m512i w = _mm512_load_si512(sb->w + c);
                for (int b = 0; b < NR; b++) t[b] = _mm512_dpbusd_epi32(t[b], w, quad(xb[b][i].qs, c));
            }
            const __m512i scale = _mm512_load_si512(sb->scale[g]);
            for (int b = 0; b < NR; b++) si[b] = _mm512_add_epi32(si[b], _mm512_mullo_epi32(t[b], scale));
        }
        const __m512 d = _mm512_load_ps(sb->d);
        for (int b = 0; b < NR; b++) {
            const __m512 dd = _mm512_mul_ps(d, _mm512_set1_ps(xb[b][i].d));
            if (kind == KIND_Q6_K) {  // − 32 · Σ_g scale_g · (Σ x over group g)
                si[b] = _mm512_sub_epi32(si[b], _mm512_slli_epi32(pair_dot(sb, xb[b][i].bsums, 8), 5));
                acc[b] = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(si[b]), acc[b]);
                continue;
            }
            int16_t sums[8];  // Σ x over each 32-element sub-block
            for (int g = 0; g < 8; g++) sums[g] = (int16_t)(xb[b][i].bsums[2 * g] + xb[b][i].bsums[2 * g + 1]);
            const __m512i p = pair_dot(sb, sums, 4);
            if (kind == KIND_IQ4_XS) {  // − 128 · Σ_j scale_j · (Σ x over sub-block j)
                si[b] = _mm512_sub_epi32(si[b], _mm512_slli_epi32(p, 7));
                acc[b] = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(si[b]), acc[b]);
            } else {  // Q4_K: d·dx·Σ scale·q·x − dmin·dx·Σ min·(Σ x)
                acc[b] = _mm512_fmadd_ps(dd, _mm512_cvtepi32_ps(si[b]), acc[b]);
                const __m512 dm = _mm512_mul_ps(_mm512_load_ps(sb->dmin), _mm512_set1_ps(xb[b][i].d));
                acc[b] = _mm512_fnmadd_ps(dm, _mm512_cvtepi32_ps(p), acc[b]);
            }
        }
    }
    for (int b = 0; b < NR; b++) _mm512_storeu_ps(y[b] + j0, acc[b]);
}

#define DEFINE_KQUANT_JOB(NAME, KIND, TYPE)                                                               \
    TARGET static void NAME##_job(const dg_qk_job *job) {                                                 \
        sblock16 *wb = (sblock16 *)job->scratch;                                                          \
        int64_t j = job->n0;                                                                              \
        for (; j + 16 <= job->n1; j += 16) {                                                              \
            NAME##_prep(job, j, wb);                                                                      \
            FOR_EACH_TILE(6, job->n_rows, NAME##_TILE);                                                   \
        }                                                                                                 \
        rest_avx2(job, j, TYPE);                                                                          \
    }
#define q4_K_TILE(n) ktile16(wb, job->x + r, job->y + r, j, job->nb, KIND_Q4_K, n)
#define q6_K_TILE(n) ktile16(wb, job->x + r, job->y + r, j, job->nb, KIND_Q6_K, n)
#define iq4_xs_TILE(n) ktile16(wb, job->x + r, job->y + r, j, job->nb, KIND_IQ4_XS, n)
DEFINE_KQUANT_JOB(q4_K, KIND_Q4_K, GGML_TYPE_Q4_K)
DEFINE_KQUANT_JOB(q6_K, KIND_Q6_K, GGML_TYPE_Q6_K)
DEFINE_KQUANT_JOB(iq4_xs, KIND_IQ4_XS, GGML_TYPE_IQ4_XS)

_Static_assert(sizeof(block16) == 9 * 64 && sizeof(sblock16) % 64 == 0, "interleaved blocks keep 64-byte alignment");
_Static_assert(sizeof(block16) <= DG_QK_SCRATCH_BYTES * DG_QK && sizeof(sblock16) <= DG_QK_SCRATCH_BYTES * DG_QK_K,
               "one group's interleaved row fits the scratch");

dg_qk_kernel dg_qk_avx512_kernel(enum ggml_type type) {
    switch (type) {
        case GGML_TYPE_Q8_0: return q8_0_job;
        case GGML_TYPE_Q5_0: return q5_0_job;
        case GGML_TYPE_IQ4_NL: return iq4_nl_job;
        case GGML_TYPE_Q4_K: return q4_K_job;
        case GGML_TYPE_Q6_K: return q6_K_job;
        case GGML_TYPE_IQ4_XS: return iq4_xs_job;
        default: return NULL;
    }
}

#else
dg_qk_kernel dg_qk_avx512_kernel(enum ggml_type type) {
    (void)type;
    return NULL;
}
#endif
