// AVX2 kernels of the quantized products (qkernels.h): one weight row against a tile of up to NR activation rows,
// integer dot products with vpmaddubsw (u8 × s8 → s16 pairs) and vpmaddwd (s16 × s16 → s32 pairs).
//
// Per type the weight side (load, unpack, scales) is done once per row and tile, and the activation side once per
// activation row and block; only the multiply-adds are done per (row, activation row). The weight rows go in chunks
// of DG_QK_ROW_CHUNK (their scales decoded once into the scratch): a tile of activation rows is multiplied with
// every row of the chunk, so it stays in L1 while the chunk's weights (tens of KiB) come from L2.
// Where the weights unpack to
// small unsigned integers (Q5_0: 0..31, Q4_K: 0..15, Q6_K: 0..63) they are the unsigned operand of vpmaddubsw and
// the offset is taken back out with the activation block sums; Q8_0 and IQ4 weights are signed, so the sign moves
// onto the activations (|w| × sign(x, w)), as in ggml. The 32-element types (Q8_0, Q5_0, IQ4_NL) take eight weight
// rows per instruction instead (see tile8), the one-row tiles only for the rows left over. Compiled with target
// attributes and chosen at run time (qkernels.c).
#include <string.h>

#include "qkernels.h"
#include "qkernels_avx2.h"

#ifdef DG_QK_AVX_VNNI
#define KERNEL_ENTRY dg_qk_avxvnni_kernel
#else
#define KERNEL_ENTRY dg_qk_avx2_kernel
#endif

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

// Built twice from this one source: here with AVX2's u8 × s8 products (vpmaddubsw, then vpmaddwd to s32), and by
// qkernels_avxvnni.c with AVX-VNNI's (vpdpbusd, vpdpwssd: the same sums in one instruction, no s16 step). The
// integer sums are the same on both; so are the floats.
#ifdef DG_QK_AVX_VNNI
#define TARGET __attribute__((target("avx2,fma,f16c,avxvnni")))
// acc + Σ u·s over each 4 bytes (u unsigned, s signed)
#define DOT_ADD(acc, u, s) _mm256_dpbusd_avx_epi32((acc), (u), (s))
// acc + scale · (u·s over each byte pair) over each 4 bytes, scale s16 pairs (no s16 saturation for the K-quants)
#define DOT_SCALED_ADD(acc, u, s, scale) _mm256_dpwssd_avx_epi32((acc), _mm256_maddubs_epi16((u), (s)), (scale))
#else
#define TARGET __attribute__((target("avx2,fma,f16c")))
#define DOT_ADD(acc, u, s) \
    _mm256_add_epi32((acc), _mm256_madd_epi16(_mm256_maddubs_epi16((u), (s)), _mm256_set1_epi16(1)))
#define DOT_SCALED_ADD(acc, u, s, scale) \
    _mm256_add_epi32((acc), _mm256_madd_epi16(_mm256_maddubs_epi16((u), (s)), (scale)))
#endif
#define INLINE TARGET __attribute__((always_inline)) static inline

INLINE float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

INLINE float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

INLINE __m256i load256(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }

// Calls tile(…, n) for the activation rows in groups of NR_MAX, then once for the remainder (a constant per call
// site, so that every tile size is its own specialised loop).
#define FOR_EACH_TILE(NR_MAX, n_rows, TILE_CALL)                  \
    do {                                                          \
        int64_t r = 0;                                            \
        for (; r + NR_MAX <= (n_rows); r += NR_MAX) TILE_CALL(NR_MAX); \
        switch ((n_rows) - r) {                                   \
            case 5: if (5 < NR_MAX) TILE_CALL(5); break;          \
            case 4: if (4 < NR_MAX) TILE_CALL(4); break;          \
            case 3: if (3 < NR_MAX) TILE_CALL(3); break;          \
            case 2: TILE_CALL(2); break;                          \
            case 1: TILE_CALL(1); break;                          \
        }                                                         \
    } while (0)

// A tile's activation rows: per row b < NR (at most MAXR) a zeroed f32 accumulator `acc` and its blocks `xb` (of T)
#define TILE_ROWS(T, MAXR)            \
    __m256 acc[MAXR];                 \
    const T *xb[MAXR];                \
    for (int b = 0; b < NR; b++) {    \
        acc[b] = _mm256_setzero_ps(); \
        xb[b] = (const T *)x[b];      \
    }
// the f32 values the activation quantization keeps after each row's blocks (block scales, or Q8_K's sums)
#define TILE_SIDE(name, MAXR) \
    const float *name[MAXR];  \
    for (int b = 0; b < NR; b++) name[b] = (const float *)(x[b] + side)
// per row, the s32 sums of one block, zeroed
#define BLOCK_SUMS(MAXR) \
    __m256i si[MAXR];    \
    for (int b = 0; b < NR; b++) si[b] = _mm256_setzero_si256()

// ---------------------------------------------------------------------------------------------------------------
// Q8_0 weights × Q8_0 activations: per block Σ |w|·sign(x, w) in 8 s32 lanes, scaled by dw·dx into f32 lanes

INLINE void q8_0_tile(const dg_block_q8_0 *w, const float *dw, const uint8_t **x, float **y, int64_t j, int64_t nb,
                      size_t side, const int NR) {
    TILE_ROWS(dg_block_q8_0, 6);
    TILE_SIDE(dx, 6);
    for (int64_t i = 0; i < nb; i++) {
        const __m256i wv = load256(w[i].qs);
        const __m256i aw = _mm256_sign_epi8(wv, wv);
        const __m256 d = _mm256_set1_ps(dw[i]);
        for (int b = 0; b < NR; b++) {
            const __m256i p = DOT_ADD(_mm256_setzero_si256(), aw, _mm256_sign_epi8(load256(xb[b][i].qs), wv));
            const __m256 s = _mm256_cvtepi32_ps(p);
            acc[b] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_broadcast_ss(dx[b] + i)), s, acc[b]);
        }
    }
    for (int b = 0; b < NR; b++) y[b][j] = hsum8(acc[b]);
}

// The weight rows of a chunk, as f32 block scales (nb floats per row)
TARGET static void block_scales(const dg_qk_job *job, int64_t j0, int64_t j1, size_t block_bytes, float *dw) {
    for (int64_t j = j0; j < j1; j++, dw += job->nb) {
        const uint8_t *w = job->w + (size_t)j * job->w_row;
        for (int64_t i = 0; i < job->nb; i++) {
            uint16_t d;
            memcpy(&d, w + (size_t)i * block_bytes, sizeof d);  // d leads both Q8_0 and Q5_0 blocks
            dw[i] = half_to_float(d);
        }
    }
}

#define W_ROW(T, j) ((const T *)(job->w + (size_t)(j) * job->w_row))

// ---------------------------------------------------------------------------------------------------------------
// Q5_0 weights × Q8_0 activations: the 5-bit values q (0..31) unpacked to bytes, Σ q·x per block in s32 lanes, the
// offset taken out lane by lane (16 · Σx, the activations' lanes16), scaled by dw·dx: the same lanes as ggml's
// (q − 16)·x, so the same f32 sums.
INLINE void q5_0_tile(const dg_block_q5_0 *w, const float *dw, const uint8_t **x, float **y, int64_t j, int64_t nb,
                      size_t side, const int NR) {
    TILE_ROWS(dg_block_q8_0, 6);
    TILE_SIDE(dx, 6);
    const __m256i *lanes16[6];  // 16 · Σx per block, after the scales
    for (int b = 0; b < NR; b++) lanes16[b] = (const __m256i *)(dx[b] + nb);
    for (int64_t i = 0; i < nb; i++) {
        const __m256i q = dg_q5_0_values_avx2(&w[i]);
        const __m256 d = _mm256_set1_ps(dw[i]);
        for (int b = 0; b < NR; b++) {
            const __m256i p = DOT_ADD(_mm256_setzero_si256(), q, load256(xb[b][i].qs));
            const __m256 s = _mm256_cvtepi32_ps(_mm256_sub_epi32(p, _mm256_loadu_si256(lanes16[b] + i)));
            acc[b] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_broadcast_ss(dx[b] + i)), s, acc[b]);
        }
    }
    for (int b = 0; b < NR; b++) y[b][j] = hsum8(acc[b]);
}

// ---------------------------------------------------------------------------------------------------------------
// Q4_K weights × Q8_K activations: per super-block Σ_j scale_j · Σ q·x (0 ≤ q ≤ 15) in s32 lanes, times d·dx; the
// mins as one f32 product of (dmin · min_j) with the activations' (dx · Σx over sub-block j), j = 0..7

typedef struct {  // one super-block of a weight row, decoded once per row
    float mins[8];      // dmin · min_j
    int16_t scales[8];  // scale_j
    float d;
    float pad[3];
} q4k_row_block;

INLINE void q4_K_tile(const dg_block_q4_K *w, const q4k_row_block *rb, const uint8_t **x, float **y, int64_t j,
                      int64_t nb, size_t side, const int NR) {
    TILE_ROWS(dg_block_q8_K, 6);
    TILE_SIDE(s32, 6);
    for (int64_t i = 0; i < nb; i++) {
        BLOCK_SUMS(6);
#pragma GCC unroll 1  // unrolled, GCC re-associates the integer sums into a tree and spills half of it
        for (int c = 0; c < 4; c++) {
            const __m256i lo = dg_q4_K_sub_avx2(&w[i], 2 * c), hi = dg_q4_K_sub_avx2(&w[i], 2 * c + 1);
            const __m256i sl = _mm256_set1_epi16(rb[i].scales[2 * c]), sh = _mm256_set1_epi16(rb[i].scales[2 * c + 1]);
            for (int b = 0; b < NR; b++) {
                const int8_t *xs = xb[b][i].qs + 64 * c;
                si[b] = DOT_SCALED_ADD(DOT_SCALED_ADD(si[b], lo, load256(xs), sl), hi, load256(xs + 32), sh);
            }
        }
        const __m256 d = _mm256_set1_ps(rb[i].d), mins = _mm256_loadu_ps(rb[i].mins);
        for (int b = 0; b < NR; b++) {
            acc[b] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_broadcast_ss(&xb[b][i].d)), _mm256_cvtepi32_ps(si[b]),
                                     acc[b]);
            acc[b] = _mm256_fnmadd_ps(mins, _mm256_loadu_ps(s32[b] + 8 * i), acc[b]);
        }
    }
    for (int b = 0; b < NR; b++) y[b][j] = hsum8(acc[b]);
}

TARGET static void q4_K_rows(const dg_qk_job *job, int64_t j0, int64_t j1, q4k_row_block *rb) {
    for (int64_t j = j0; j < j1; j++) {
        const dg_block_q4_K *w = W_ROW(dg_block_q4_K, j);
        for (int64_t i = 0; i < job->nb; i++, rb++) {
            const float dmin = half_to_float(w[i].dmin);
            for (int s = 0; s < 8; s++) {
                int sc, m;
                dg_qk_q4k_scale_min(w[i].scales, s, &sc, &m);
                rb->scales[s] = (int16_t)sc;
                rb->mins[s] = dmin * (float)m;
            }
            rb->d = half_to_float(w[i].d);
        }
    }
}

TARGET static void q4_K_job(const dg_qk_job *job) {
    q4k_row_block *rb = (q4k_row_block *)job->scratch;  // 16 floats per super-block and row
    for (int64_t j0 = job->n0; j0 < job->n1; j0 += DG_QK_ROW_CHUNK) {
        const int64_t j1 = j0 + DG_QK_ROW_CHUNK < job->n1 ? j0 + DG_QK_ROW_CHUNK : job->n1;
        q4_K_rows(job, j0, j1, rb);
#define Q4_K_TILE(n)                                                                                           \
    for (int64_t j = j0; j < j1; j++)                                                                          \
        q4_K_tile(W_ROW(dg_block_q4_K, j), rb + (j - j0) * job->nb, job->x + r, job->y + r, j, job->nb, job->side, n)
        FOR_EACH_TILE(4, job->n_rows, Q4_K_TILE);
#undef Q4_K_TILE
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Q6_K weights × Q8_K activations: 6-bit q (0..63) unpacked by quarters of 32, Σ_g scale_g · Σ q·x per group of 16,
// minus 32 · Σ_g scale_g · bsum_g (the activations' group sums), all in s32 lanes, times d·dx

INLINE void q6_K_tile(const dg_block_q6_K *w, const uint8_t **x, float **y, int64_t j, int64_t nb, const int NR) {
    TILE_ROWS(dg_block_q8_K, 6);
    for (int64_t i = 0; i < nb; i++) {
        BLOCK_SUMS(6);
        const int8_t *sc = w[i].scales;
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc));  // [sc0..7 | sc8..15]
        for (int h = 0; h < 2; h++) {
            const __m256i half = h ? _mm256_permute2x128_si256(sc16, sc16, 0x11)  // sc[8h..8h+7] in both lanes
                                   : _mm256_permute2x128_si256(sc16, sc16, 0x00);
            for (int quarter = 0; quarter < 4; quarter++) {
                const __m256i q = dg_q6_K_quarter_avx2(&w[i], h, quarter);
                // scale of group 8h + 2·quarter for the first 16 values (low lane), of the next group for the others
                const __m256i s = _mm256_shuffle_epi8(half, _mm256_setr_epi64x(
                    0x0101010101010101ll * (4 * quarter) + 0x0100010001000100ll,
                    0x0101010101010101ll * (4 * quarter) + 0x0100010001000100ll,
                    0x0101010101010101ll * (4 * quarter + 2) + 0x0100010001000100ll,
                    0x0101010101010101ll * (4 * quarter + 2) + 0x0100010001000100ll));
                for (int b = 0; b < NR; b++) {
                    si[b] = DOT_SCALED_ADD(si[b], q, load256(xb[b][i].qs + 128 * h + 32 * quarter), s);
                }
            }
        }
        const __m256 d = _mm256_set1_ps(half_to_float(w[i].d));
        for (int b = 0; b < NR; b++) {
            const __m256i offset = _mm256_slli_epi32(_mm256_madd_epi16(sc16, load256(xb[b][i].bsums)), 5);
            const __m256 s = _mm256_cvtepi32_ps(_mm256_sub_epi32(si[b], offset));
            acc[b] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_broadcast_ss(&xb[b][i].d)), s, acc[b]);
        }
    }
    for (int b = 0; b < NR; b++) y[b][j] = hsum8(acc[b]);
}

TARGET static void q6_K_job(const dg_qk_job *job) {
    for (int64_t j0 = job->n0; j0 < job->n1; j0 += DG_QK_ROW_CHUNK) {
        const int64_t j1 = j0 + DG_QK_ROW_CHUNK < job->n1 ? j0 + DG_QK_ROW_CHUNK : job->n1;
#define Q6_K_TILE(n) \
    for (int64_t j = j0; j < j1; j++) q6_K_tile(W_ROW(dg_block_q6_K, j), job->x + r, job->y + r, j, job->nb, n)
        FOR_EACH_TILE(6, job->n_rows, Q6_K_TILE);
#undef Q6_K_TILE
    }
}

// ---------------------------------------------------------------------------------------------------------------
// IQ4_NL (× Q8_0 activations) and IQ4_XS (× Q8_K): 4-bit indices into a signed 16-value grid, looked up with
// vpshufb; the values are signed, so as for Q8_0 the sign moves onto the activations

INLINE void iq4_nl_tile(const dg_block_iq4_nl *w, const float *dw, const uint8_t **x, float **y, int64_t j,
                        int64_t nb, size_t side, const int NR) {
    TILE_ROWS(dg_block_q8_0, 6);
    TILE_SIDE(dx, 6);
    const __m256i grid = dg_iq4_grid_avx2();
    for (int64_t i = 0; i < nb; i++) {
        const __m256i v = dg_iq4_values16_avx2(w[i].qs, grid);
        const __m256i av = _mm256_sign_epi8(v, v);
        const __m256 d = _mm256_set1_ps(dw[i]);
        for (int b = 0; b < NR; b++) {
            const __m256i p = DOT_ADD(_mm256_setzero_si256(), av, _mm256_sign_epi8(load256(xb[b][i].qs), v));
            const __m256 s = _mm256_cvtepi32_ps(p);
            acc[b] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_broadcast_ss(dx[b] + i)), s, acc[b]);
        }
    }
    for (int b = 0; b < NR; b++) y[b][j] = hsum8(acc[b]);
}


typedef struct {  // one IQ4_XS super-block of a weight row, decoded once per row chunk
    int16_t scales[8];  // scale_j − 32
    float d;
    float pad[11];
} iq4xs_row_block;

INLINE void iq4_xs_tile(const dg_block_iq4_xs *w, const iq4xs_row_block *rb, const uint8_t **x, float **y, int64_t j,
                        int64_t nb, const int NR) {
    TILE_ROWS(dg_block_q8_K, 6);
    const __m256i grid = dg_iq4_grid_avx2();
    for (int64_t i = 0; i < nb; i++) {
        BLOCK_SUMS(6);
#pragma GCC unroll 1  // see q4_K_tile
        for (int sb = 0; sb < 8; sb++) {
            const __m256i v = dg_iq4_values16_avx2(w[i].qs + 16 * sb, grid);
            const __m256i av = _mm256_sign_epi8(v, v);
            const __m256i scale = _mm256_set1_epi16(rb[i].scales[sb]);
            for (int b = 0; b < NR; b++) {
                si[b] = DOT_SCALED_ADD(si[b], av, _mm256_sign_epi8(load256(xb[b][i].qs + 32 * sb), v), scale);
            }
        }
        const __m256 d = _mm256_set1_ps(rb[i].d);
        for (int b = 0; b < NR; b++)
            acc[b] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_broadcast_ss(&xb[b][i].d)), _mm256_cvtepi32_ps(si[b]),
                                     acc[b]);
    }
    for (int b = 0; b < NR; b++) y[b][j] = hsum8(acc[b]);
}

TARGET static void iq4_xs_job(const dg_qk_job *job) {
    iq4xs_row_block *rb = (iq4xs_row_block *)job->scratch;  // 16 floats per super-block and row
    for (int64_t j0 = job->n0; j0 < job->n1; j0 += DG_QK_ROW_CHUNK) {
        const int64_t j1 = j0 + DG_QK_ROW_CHUNK < job->n1 ? j0 + DG_QK_ROW_CHUNK : job->n1;
        iq4xs_row_block *out = rb;
        for (int64_t j = j0; j < j1; j++) {
            const dg_block_iq4_xs *w = W_ROW(dg_block_iq4_xs, j);
            for (int64_t i = 0; i < job->nb; i++, out++) {
                for (int sb = 0; sb < 8; sb++) out->scales[sb] = (int16_t)dg_qk_iq4xs_scale(&w[i], sb);
                out->d = half_to_float(w[i].d);
            }
        }
#define IQ4_XS_TILE(n)                                                                                 \
    for (int64_t j = j0; j < j1; j++)                                                                  \
        iq4_xs_tile(W_ROW(dg_block_iq4_xs, j), rb + (j - j0) * job->nb, job->x + r, job->y + r, j, job->nb, n)
        FOR_EACH_TILE(6, job->n_rows, IQ4_XS_TILE);
#undef IQ4_XS_TILE
    }
}

// ---------------------------------------------------------------------------------------------------------------
// The 32-element types (Q8_0, Q5_0, IQ4_NL; Q8_0 activations), eight weight rows at once. Each block of the eight
// rows is decoded to 32 signed bytes per row and transposed into the scratch (an 8×8 transpose of 32-bit words:
// vector c holds elements 4c..4c+3 of every row, then the rows' eight f32 scales), so that one vpmaddubsw multiplies
// four elements of all eight rows with four broadcast activations and the eight s32 lanes are the eight rows' block
// sums: the block's float scaling (convert, scale, FMA) is one set of instructions for eight outputs, where the
// one-row tiles above need it per output. Rows after the last whole group of eight take the one-row tiles.

typedef struct {
    __m256i w[8];
    float d[8];
} block8;

INLINE void tile8(const block8 *wb, const uint8_t **x, float **y, int64_t j0, int64_t nb, size_t side, const int NR) {
    TILE_ROWS(dg_block_q8_0, 4);
    TILE_SIDE(dx, 4);
    for (int64_t i = 0; i < nb; i++) {
        BLOCK_SUMS(4);
#pragma GCC unroll 8
        for (int c = 0; c < 8; c++) {
            const __m256i wv = _mm256_load_si256(&wb[i].w[c]);
            const __m256i aw = _mm256_sign_epi8(wv, wv);
            for (int b = 0; b < NR; b++) {
                int32_t four;
                memcpy(&four, xb[b][i].qs + 4 * c, sizeof four);
                const __m256i xv = _mm256_sign_epi8(_mm256_set1_epi32(four), wv);
                si[b] = DOT_ADD(si[b], aw, xv);
            }
        }
        const __m256 d = _mm256_load_ps(wb[i].d);
        for (int b = 0; b < NR; b++)
            acc[b] = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_broadcast_ss(dx[b] + i)), _mm256_cvtepi32_ps(si[b]),
                                     acc[b]);
    }
    for (int b = 0; b < NR; b++) _mm256_storeu_ps(y[b] + j0, acc[b]);
}

// NAME##_job: groups of eight rows through tile8 (288 bytes of scratch per block), the rest through NAME##_tile.
#define DEFINE_EIGHT_ROW_JOB(NAME, BLOCK)                                                                           \
    TARGET static void NAME##_interleave(const dg_qk_job *job, int64_t j0, block8 *out) {                          \
        for (int64_t i = 0; i < job->nb; i++, out++) {                                                              \
            __m256i v[8];                                                                                           \
            for (int r = 0; r < 8; r++) {                                                                           \
                const BLOCK *b = W_ROW(BLOCK, j0 + r) + i;                                                          \
                v[r] = dg_##NAME##_signed_avx2(b);                                                                            \
                out->d[r] = half_to_float(b->d);                                                                    \
            }                                                                                                       \
            dg_transpose8x32_avx2(v);                                                                                       \
            for (int c = 0; c < 8; c++) out->w[c] = v[c];                                                           \
        }                                                                                                           \
    }                                                                                                               \
    TARGET static void NAME##_job(const dg_qk_job *job) {                                                          \
        block8 *wb = (block8 *)job->scratch;                                                                        \
        int64_t j8 = job->n0;                                                                                       \
        for (; j8 + 8 <= job->n1; j8 += 8) {                                                                        \
            NAME##_interleave(job, j8, wb);                                                                         \
            FOR_EACH_TILE(4, job->n_rows, TILE8_CALL);                                                              \
        }                                                                                                           \
        for (int64_t j0 = j8; j0 < job->n1; j0 += DG_QK_ROW_CHUNK) {                                                \
            const int64_t j1 = j0 + DG_QK_ROW_CHUNK < job->n1 ? j0 + DG_QK_ROW_CHUNK : job->n1;                     \
            block_scales(job, j0, j1, sizeof(BLOCK), job->scratch);                                                 \
            FOR_EACH_TILE(6, job->n_rows, NAME##_ROW_TILE);                                                         \
        }                                                                                                           \
    }
#define TILE8_CALL(n) tile8(wb, job->x + r, job->y + r, j8, job->nb, job->side, n)
// the one-row tile over a chunk's rows j0..j1 (their f32 block scales in the scratch)
#define ROW_TILE(NAME, BLOCK, n)                                                                                   \
    for (int64_t j = j0; j < j1; j++)                                                                              \
    NAME##_tile(W_ROW(BLOCK, j), job->scratch + (j - j0) * job->nb, job->x + r, job->y + r, j, job->nb, job->side, n)
#define q8_0_ROW_TILE(n) ROW_TILE(q8_0, dg_block_q8_0, n)
#define q5_0_ROW_TILE(n) ROW_TILE(q5_0, dg_block_q5_0, n)
#define iq4_nl_ROW_TILE(n) ROW_TILE(iq4_nl, dg_block_iq4_nl, n)
DEFINE_EIGHT_ROW_JOB(q8_0, dg_block_q8_0)
DEFINE_EIGHT_ROW_JOB(q5_0, dg_block_q5_0)
DEFINE_EIGHT_ROW_JOB(iq4_nl, dg_block_iq4_nl)

dg_qk_kernel KERNEL_ENTRY(enum ggml_type type) {
    switch (type) {
        case GGML_TYPE_IQ4_NL: return iq4_nl_job;
        case GGML_TYPE_IQ4_XS: return iq4_xs_job;
        case GGML_TYPE_Q8_0: return q8_0_job;
        case GGML_TYPE_Q5_0: return q5_0_job;
        case GGML_TYPE_Q4_K: return q4_K_job;
        case GGML_TYPE_Q6_K: return q6_K_job;
        default: return NULL;
    }
}

#else
dg_qk_kernel KERNEL_ENTRY(enum ggml_type type) {
    (void)type;
    return NULL;
}
#endif
