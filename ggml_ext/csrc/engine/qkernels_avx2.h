// AVX2 block decoding shared by the quantized products (qkernels_avx2.c) and the soft embedding (soft_embedding.c).
#pragma once

#include "qkernels.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

// The 32 six-bit values (0..63) of quarter `quarter` (0..3) of half `h` of a Q6_K block: elements
// 128h + 32·quarter + 0..31, in order.
__attribute__((target("avx2"), always_inline)) static inline __m256i dg_q6_K_quarter_avx2(const dg_block_q6_K *b,
                                                                                          int h, int quarter) {
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
#endif
