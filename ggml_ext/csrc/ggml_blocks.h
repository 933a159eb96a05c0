// ggml's quantized block layouts (its ggml-common.h, which the installed headers do not include). One copy for the
// engine's kernels and the converter's fast K-quants; the engine checks the sizes against ggml_type_size at run time.
#pragma once

#include <stdint.h>

#define DG_QK 32
#define DG_QK_K 256

typedef struct { uint16_t d; int8_t qs[DG_QK]; } dg_block_q8_0;
typedef struct { uint16_t d; uint8_t qh[4]; uint8_t qs[DG_QK / 2]; } dg_block_q5_0;
typedef struct { float d; int8_t qs[DG_QK_K]; int16_t bsums[DG_QK_K / 16]; } dg_block_q8_K;
// Q4_K / Q5_K: d, dmin (FP16), 12 bytes of 6-bit sub-block scales and mins, then the quants (Q5_K: and the fifth bits)
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qs[DG_QK_K / 2]; } dg_block_q4_K;
typedef struct { uint16_t d, dmin; uint8_t scales[12]; uint8_t qh[DG_QK_K / 8]; uint8_t qs[DG_QK_K / 2]; } dg_block_q5_K;
typedef struct {
    uint8_t ql[DG_QK_K / 2];
    uint8_t qh[DG_QK_K / 4];
    int8_t scales[DG_QK_K / 16];
    uint16_t d;
} dg_block_q6_K;
typedef struct { uint16_t d; uint8_t qs[DG_QK / 2]; } dg_block_iq4_nl;
typedef struct { uint16_t d, scales_h; uint8_t scales_l[DG_QK_K / 64]; uint8_t qs[DG_QK_K / 2]; } dg_block_iq4_xs;

_Static_assert(sizeof(dg_block_q4_K) == 144, "block_q4_K layout");
_Static_assert(sizeof(dg_block_q5_K) == 176, "block_q5_K layout");
_Static_assert(sizeof(dg_block_q6_K) == 210, "block_q6_K layout");
