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
// The 8×8 transpose of 32-bit words (qkernels_avx2.h) on two rows per register: rows r and r + 4 share one for
// r < 4, rows r + 4 and r + 8 for r = 4..7, so that the last step's 128-bit shuffles leave the rows in order.
INLINE void interleave16(const __m256i v[16], __m512i *out) {
    static const int low[8] = {0, 1, 2, 3, 8, 9, 10, 11};
    __m512i z[8], t[8], u[8];
    for (int k = 0; k < 8; k++) z[k] = _mm512_inserti64x4(_mm512_castsi256_si512(v[low[k]]), v[low[k] + 4], 1);
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(z[2 * i], z[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(z[2 * i], z[2 * i + 1]);
    }
    for (int i = 0; i < 2; i++) {
        for (int h = 0; h < 2; h++) {
            u[4 * i + 2 * h] = _mm512_unpacklo_epi64(t[4 * i + h], t[4 * i + 2 + h]);
            u[4 * i + 2 * h + 1] = _mm512_unpackhi_epi64(t[4 * i + h], t[4 * i + 2 + h]);
        }
    }
    // u[c] holds columns c and c + 4 of rows 0..3 and 4..7 (lanes 0..3), u[4 + c] those of rows 8..15
    for (int c = 0; c < 4; c++) {
        _mm512_store_si512(out + c, _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88));
        _mm512_store_si512(out + c + 4, _mm512_shuffle_i32x4(u[c], u[4 + c], 0xdd));
    }
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

// w + 128 for the 32-element types. Q5_0's fifth bits go straight from qh into a mask register (AVX-512 BW), where
// AVX2 spreads them to bytes with three instructions: (q − 16) + 128 = nibbles + 112, plus 16 where the bit is set.
INLINE __m256i q8_0_unsigned(const dg_block_q8_0 *b) {
    return _mm256_xor_si256(dg_q8_0_signed_avx2(b), _mm256_set1_epi8((char)0x80));
}
INLINE __m256i iq4_nl_unsigned(const dg_block_iq4_nl *b) {
    return _mm256_xor_si256(dg_iq4_nl_signed_avx2(b), _mm256_set1_epi8((char)0x80));
}
INLINE __m256i q5_0_unsigned(const dg_block_q5_0 *b) {
    uint32_t high;
    memcpy(&high, b->qh, sizeof high);
    const __m256i low = _mm256_add_epi8(dg_q5_0_nibbles_avx2(b), _mm256_set1_epi8(112));
    return _mm256_mask_add_epi8(low, (__mmask32)high, low, _mm256_set1_epi8(16));
}

#define DEFINE_BLOCK32_JOB(NAME, BLOCK, TYPE)                                                             \
    TARGET static void NAME##_job(const dg_qk_job *job) {                                                 \
        block16 *wb = (block16 *)job->scratch;                                                            \
        int64_t j = job->n0;                                                                              \
        for (; j + 16 <= job->n1; j += 16) {                                                              \
            for (int64_t i = 0; i < job->nb; i++) {                                                       \
                __m256i v[16];                                                                            \
                for (int r = 0; r < 16; r++) {                                                            \
                    const BLOCK *b = W_ROW(BLOCK, j + r) + i;                                             \
                    v[r] = NAME##_unsigned(b);                                                            \
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

// The scales of sixteen rows' super-block i, gathered as 32-bit words (byte offset `at` in each block) and decoded
// lane-wise: lane r is row j0 + r. (Row offsets fit 32 bits: dg_qk_supports bounds a row to 2^16 blocks.)
INLINE __m512i gather_words(const dg_qk_job *job, int64_t j0, int64_t i, size_t block_bytes, int at) {
    const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32((int)job->w_row));
    const uint8_t *base = job->w + (size_t)j0 * job->w_row + (size_t)i * block_bytes + at;
    return _mm512_i32gather_epi32(rows, (const void *)base, 1);
}

INLINE __m512i bits(__m512i v, int shift, int mask) { return _mm512_and_si512(_mm512_srli_epi32(v, shift), _mm512_set1_epi32(mask)); }
// (lo & 0xffff) | hi << 16 per lane: two s16 values for vpdpwssd
INLINE __m512i pack16(__m512i lo, __m512i hi) {
    return _mm512_or_si512(_mm512_and_si512(lo, _mm512_set1_epi32(0xffff)), _mm512_slli_epi32(hi, 16));
}
// the fp16 in the low (high = 0) or high half of each lane, as f32
INLINE __m512 halfs(__m512i v, int high) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(high ? _mm512_srli_epi32(v, 16) : v)); }

// 32 values (one per row, 32-element part u of the super-block) of the sixteen rows, interleaved into out->w[8u..]
#define INTERLEAVE_PARTS(T, DECODE)                                                                    \
    for (int u = 0; u < 8; u++) {                                                                      \
        __m256i v[16];                                                                                 \
        for (int r = 0; r < 16; r++) {                                                                 \
            const T *b = W_ROW(T, j0 + r) + i;                                                         \
            v[r] = DECODE;                                                                             \
        }                                                                                              \
        interleave16(v, out->w + 8 * u);                                                               \
    }

TARGET static void q4_K_prep(const dg_qk_job *job, int64_t j0, sblock16 *out) {
    for (int64_t i = 0; i < job->nb; i++, out++) {
        INTERLEAVE_PARTS(dg_block_q4_K, dg_q4_K_sub_avx2(b, u))
        // scales[0..11] at byte 4: sc_j, m_j = bytes j, j + 4 (low 6 bits) for j < 4; for j = 4 + k the low / high
        // nibble of byte 8 + k, with the top two bits of bytes k / 4 + k above them
        const __m512i dd = gather_words(job, j0, i, sizeof(dg_block_q4_K), 0);
        const __m512i s0 = gather_words(job, j0, i, sizeof(dg_block_q4_K), 4);
        const __m512i s1 = gather_words(job, j0, i, sizeof(dg_block_q4_K), 8);
        const __m512i s2 = gather_words(job, j0, i, sizeof(dg_block_q4_K), 12);
        __m512i m[8];
        for (int j = 0; j < 4; j++) {
            _mm512_store_si512(out->scale[j], bits(s0, 8 * j, 63));
            m[j] = bits(s1, 8 * j, 63);
            _mm512_store_si512(out->scale[4 + j], _mm512_or_si512(bits(s2, 8 * j, 15), _mm512_slli_epi32(bits(s0, 8 * j + 6, 3), 4)));
            m[4 + j] = _mm512_or_si512(bits(s2, 8 * j + 4, 15), _mm512_slli_epi32(bits(s1, 8 * j + 6, 3), 4));
        }
        for (int p = 0; p < 4; p++) _mm512_store_si512(out->pairs[p], pack16(m[2 * p], m[2 * p + 1]));
        _mm512_store_ps(out->d, halfs(dd, 0));
        _mm512_store_ps(out->dmin, halfs(dd, 1));
    }
}

TARGET static void q6_K_prep(const dg_qk_job *job, int64_t j0, sblock16 *out) {
    for (int64_t i = 0; i < job->nb; i++, out++) {
        INTERLEAVE_PARTS(dg_block_q6_K, dg_q6_K_quarter_avx2(b, u / 4, u % 4))
        __m512i sc[16];  // the signed scale bytes at 192..207, sign-extended
        for (int q = 0; q < 4; q++) {
            const __m512i word = gather_words(job, j0, i, sizeof(dg_block_q6_K), 192 + 4 * q);
            for (int k = 0; k < 4; k++) {
                sc[4 * q + k] = _mm512_srai_epi32(_mm512_slli_epi32(word, 24 - 8 * k), 24);
                _mm512_store_si512(out->scale[4 * q + k], sc[4 * q + k]);
            }
        }
        for (int p = 0; p < 8; p++) _mm512_store_si512(out->pairs[p], pack16(sc[2 * p], sc[2 * p + 1]));
        _mm512_store_ps(out->d, halfs(gather_words(job, j0, i, sizeof(dg_block_q6_K), 206), 1));  // d: bytes 208..209
    }
}

TARGET static void iq4_xs_prep(const dg_qk_job *job, int64_t j0, sblock16 *out) {
    const __m256i grid = dg_iq4_grid_avx2(), bias = _mm256_set1_epi8((char)0x80);
    for (int64_t i = 0; i < job->nb; i++, out++) {
        INTERLEAVE_PARTS(dg_block_iq4_xs, _mm256_xor_si256(dg_iq4_values16_avx2(b->qs + 16 * u, grid), bias))
        // d | scales_h << 16, then scales_l[0..3]: scale_j = (4 bits of scales_l at 4j | 2 bits of scales_h at 2j) − 32
        const __m512i dh = gather_words(job, j0, i, sizeof(dg_block_iq4_xs), 0);
        const __m512i low = gather_words(job, j0, i, sizeof(dg_block_iq4_xs), 4);
        __m512i sc[8];
        for (int j = 0; j < 8; j++) {
            sc[j] = _mm512_sub_epi32(_mm512_or_si512(bits(low, 4 * j, 15), _mm512_slli_epi32(bits(dh, 16 + 2 * j, 3), 4)),
                                     _mm512_set1_epi32(32));
            _mm512_store_si512(out->scale[j], sc[j]);
        }
        for (int p = 0; p < 4; p++) _mm512_store_si512(out->pairs[p], pack16(sc[2 * p], sc[2 * p + 1]));
        _mm512_store_ps(out->d, halfs(dh, 0));
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
        const kquant_kind kind = KIND; /* a constant: ktile16 is inlined for it */                        \
        sblock16 *wb = (sblock16 *)job->scratch;                                                          \
        int64_t j = job->n0;                                                                              \
        for (; j + 16 <= job->n1; j += 16) {                                                              \
            NAME##_prep(job, j, wb);                                                                      \
            FOR_EACH_TILE(6, job->n_rows, KTILE16);                                                       \
        }                                                                                                 \
        rest_avx2(job, j, TYPE);                                                                          \
    }
#define KTILE16(n) ktile16(wb, job->x + r, job->y + r, j, job->nb, kind, n)
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
