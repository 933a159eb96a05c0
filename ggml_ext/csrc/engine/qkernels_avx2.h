// AVX2 block decoding: one decoder per block format, shared by the quantized products (qkernels_avx2.c, its AVX-VNNI
// build qkernels_avxvnni.c, and qkernels_avx512.c, which joins two of these 256-bit halves) and the soft embedding
// (soft_embedding.c). Each returns a block's (or a 32-element part's) values, element k in byte k.
#pragma once

#include <string.h>

#include "qkernels.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define DG_AVX2_INLINE __attribute__((target("avx2"), always_inline)) static inline

// The 32 six-bit values (0..63) of quarter `quarter` (0..3) of half `h` of a Q6_K block: elements
// 128h + 32·quarter + 0..31, in order.
DG_AVX2_INLINE __m256i dg_q6_K_quarter_avx2(const dg_block_q6_K *b, int h, int quarter) {
    const __m256i m4 = _mm256_set1_epi8(0x0f), m2 = _mm256_set1_epi8(0x30);
    const __m256i ql = _mm256_loadu_si256((const __m256i *)(b->ql + 64 * h + 32 * (quarter & 1)));
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(b->qh + 32 * h));
    const __m256i low = quarter < 2 ? _mm256_and_si256(ql, m4) : _mm256_and_si256(_mm256_srli_epi16(ql, 4), m4);
    __m256i high;  // bits 2·quarter, 2·quarter + 1 of qh moved to bits 4, 5 (16-bit shifts; the mask drops spill-over)
    switch (quarter) {
        case 0: high = _mm256_slli_epi16(qh, 4); break;
        case 1: high = _mm256_slli_epi16(qh, 2); break;
        case 2: high = qh; break;
        default: high = _mm256_srli_epi16(qh, 2); break;
    }
    return _mm256_or_si256(low, _mm256_and_si256(high, m2));
}

// The 32 four-bit values (0..15) of sub-block j (0..7) of a Q4_K block.
DG_AVX2_INLINE __m256i dg_q4_K_sub_avx2(const dg_block_q4_K *b, int j) {
    const __m256i q = _mm256_loadu_si256((const __m256i *)(b->qs + 32 * (j / 2)));
    return _mm256_and_si256(j & 1 ? _mm256_srli_epi16(q, 4) : q, _mm256_set1_epi8(0x0f));
}

// byte i = 0xff where bit i of the 32-bit mask is set
DG_AVX2_INLINE __m256i dg_bits_to_bytes_avx2(const uint8_t *bits) {
    uint32_t v;
    memcpy(&v, bits, sizeof v);
    const __m256i which = _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303);
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)v), which);  // byte i = byte i/8 of v
    const __m256i others = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe);                 // ~(1 << i%8)
    return _mm256_cmpeq_epi8(_mm256_or_si256(spread, others), _mm256_set1_epi64x(-1));
}

// Q5_0's low four bits of each value; the fifth is bit k of qh
DG_AVX2_INLINE __m256i dg_q5_0_nibbles_avx2(const dg_block_q5_0 *b) {
    const __m128i q = _mm_loadu_si128((const __m128i *)b->qs), m4 = _mm_set1_epi8(0x0f);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m4), _mm_and_si128(q, m4));
}

// Q5_0's 5-bit values q (0..31); the weight is q − 16
DG_AVX2_INLINE __m256i dg_q5_0_values_avx2(const dg_block_q5_0 *b) {
    return _mm256_or_si256(dg_q5_0_nibbles_avx2(b), _mm256_and_si256(dg_bits_to_bytes_avx2(b->qh), _mm256_set1_epi8(0x10)));
}

// IQ4's 16-value grid in both 128-bit lanes (for vpshufb)
DG_AVX2_INLINE __m256i dg_iq4_grid_avx2(void) {
    return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)dg_qk_iq4_values));
}

// 16 bytes of IQ4 indices -> the 32 signed values of one 32-element block (low nibbles first, then high nibbles)
DG_AVX2_INLINE __m256i dg_iq4_values16_avx2(const uint8_t *qs, __m256i grid) {
    const __m128i q = _mm_loadu_si128((const __m128i *)qs), m4 = _mm_set1_epi8(0x0f);
    const __m256i idx = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m4), _mm_and_si128(q, m4));
    return _mm256_shuffle_epi8(grid, idx);
}

// the 32-element blocks' weights as signed bytes
DG_AVX2_INLINE __m256i dg_q8_0_signed_avx2(const dg_block_q8_0 *b) { return _mm256_loadu_si256((const __m256i *)b->qs); }
DG_AVX2_INLINE __m256i dg_q5_0_signed_avx2(const dg_block_q5_0 *b) {
    return _mm256_sub_epi8(dg_q5_0_values_avx2(b), _mm256_set1_epi8(16));
}
DG_AVX2_INLINE __m256i dg_iq4_nl_signed_avx2(const dg_block_iq4_nl *b) {
    return dg_iq4_values16_avx2(b->qs, dg_iq4_grid_avx2());
}

// An 8×8 transpose of 32-bit words: out[c] word r = in[r] word c.
DG_AVX2_INLINE void dg_transpose8x32_avx2(__m256i v[8]) {
    __m256i t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_epi32(v[2 * i], v[2 * i + 1]);      // r0c0 r1c0 r0c1 r1c1 | r0c4 r1c4 r0c5 r1c5
        t[2 * i + 1] = _mm256_unpackhi_epi32(v[2 * i], v[2 * i + 1]);  // r0c2 r1c2 r0c3 r1c3 | ...c6, c7
    }
    for (int i = 0; i < 2; i++) {
        for (int h = 0; h < 2; h++) {
            u[4 * i + 2 * h] = _mm256_unpacklo_epi64(t[4 * i + h], t[4 * i + 2 + h]);      // r0..r3 of c(2h) | c(2h+4)
            u[4 * i + 2 * h + 1] = _mm256_unpackhi_epi64(t[4 * i + h], t[4 * i + 2 + h]);  // r0..r3 of c(2h+1) | ...
        }
    }
    for (int c = 0; c < 4; c++) {  // u[c]: rows 0..3 of columns c (low) and c + 4 (high); u[4 + c]: rows 4..7
        v[c] = _mm256_permute2x128_si256(u[c], u[4 + c], 0x20);
        v[c + 4] = _mm256_permute2x128_si256(u[c], u[4 + c], 0x31);
    }
}
#endif
