// Quantized weight products with integer dot products (docs/engine.md#quantized-expert-products).
//
// Entry points: dg_build_qexpert_matmul (a ggml_mul_mat_id of quantized experts) and dg_build_qmatmul (a dense
// ggml_mul_mat of a quantized weight). Each returns NULL when it does not apply (weight type not covered, odd shape,
// path off or not supported by this CPU); the caller then builds ggml's own op. Both build two custom nodes: the F32
// activations are quantized once per product (with ggml's own quantizer, so the integers equal ggml's), then every
// thread multiplies a slice of the output rows against all routed activation rows in register tiles.
#pragma once

#include "engine.h"
#include "ggml_blocks.h"

typedef enum {
    DG_QK_OFF = 0,     // ggml's own ops
    DG_QK_SCALAR = 1,  // portable C
    DG_QK_AVX2 = 2,     // AVX2 vpmaddubsw / vpmaddwd
    DG_QK_AVXVNNI = 3,  // the AVX2 kernels with AVX-VNNI's vpdpbusd / vpdpwssd (256-bit)
    DG_QK_AVX512 = 4,   // AVX-512 VNNI: sixteen weight rows per vpdpbusd (512-bit)
} dg_qk_path;

// The path DGEMMA_QKERNELS asks for (off, scalar, avx2, avxvnni, avx512, auto; unset or anything else = auto), where
// auto is the best under dg_cpu_isa() (never scalar). A path the CPU lacks falls back to ggml's ops.
dg_qk_path dg_qk_default_path(void);
bool dg_qk_path_available(dg_qk_path path);
// Whether a weight of this type with rows of kd elements has kernels (whole blocks, at most 2^16 of them per row).
bool dg_qk_supports(enum ggml_type type, int64_t kd);

// ggml_mul_mat_id(w, x, ids) semantics: w [kd, N, E], x [kd, X1, T] F32 (X1 = 1 or ids->ne[0]), ids [K, T] I32.
struct ggml_tensor *dg_build_qexpert_matmul(struct ggml_context *ctx, struct ggml_tensor *w, struct ggml_tensor *x,
                                            struct ggml_tensor *ids, dg_qk_path path);
// ggml_mul_mat(w, x) for a 2-D quantized w [kd, N] and x [kd, T] F32 (2-D): y [N, T].
struct ggml_tensor *dg_build_qmatmul(struct ggml_context *ctx, struct ggml_tensor *w, struct ggml_tensor *x,
                                     dg_qk_path path);

// ---------------------------------------------------------------------------------------------------------------
// Between qkernels.c and the per-instruction-set files.

// One expert's work for one thread: weight rows [n0, n1) against n_rows quantized activation rows.
typedef struct dg_qk_job {
    const uint8_t *w;         // the expert's row 0
    size_t w_row;             // bytes per weight row
    const uint8_t **x;        // routed activation rows (ggml blocks of the weight's vec_dot_type, then side floats)
    float **y;                // matching output rows: element j at y[r][j]
    int64_t n_rows, n0, n1;
    int64_t nb;               // blocks per row: 32-element blocks, or 256-element super-blocks for K-quants
    size_t side;              // byte offset of an activation row's side floats (see qkernels.c, activation layout)
    float *scratch;           // per-thread scratch, 64-byte aligned: DG_QK_SCRATCH_BYTES · the row's elements
} dg_qk_job;

typedef void (*dg_qk_kernel)(const dg_qk_job *job);
#define DG_QK_ROW_CHUNK 32  // weight rows a kernel prepares at once
// Scratch bytes per element of a weight row: the largest use is AVX-512's sixteen interleaved K-quant rows (16 bytes
// of values and ~4 of scales per element); the AVX2 kernels' eight interleaved rows take 9, the decoded scales of a
// chunk of 32 rows at most 8.
#define DG_QK_SCRATCH_BYTES 24

// NULL when the path has no kernel for that type.
dg_qk_kernel dg_qk_scalar_kernel(enum ggml_type type);
dg_qk_kernel dg_qk_avx2_kernel(enum ggml_type type);
dg_qk_kernel dg_qk_avxvnni_kernel(enum ggml_type type);
dg_qk_kernel dg_qk_avx512_kernel(enum ggml_type type);

// Block decoding shared by the portable (qkernels.c) and AVX2 (qkernels_avx2.c) kernels, inline so that neither file
// calls into the other.
// the 16 values of IQ4_NL / IQ4_XS's 4-bit indices (the format's non-linear grid)
static const int8_t dg_qk_iq4_values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
// IQ4_XS's scale of sub-block j (0..7), already minus its offset of 32
static inline int dg_qk_iq4xs_scale(const dg_block_iq4_xs *b, int j) {
    return (((b->scales_l[j / 2] >> 4 * (j % 2)) & 0xf) | (((b->scales_h >> 2 * j) & 3) << 4)) - 32;
}

// Activation side floats, per row, after the ggml blocks:
// - Q8_0 activations (Q8_0, Q5_0, IQ4_NL weights): dx[nb] (the block scales as f32), then int32 lanes16[8·nb]: 16 ·
//   the sum of qs[4·l .. 4·l + 3] in lane l (Q5_0's offset of 16, in the lanes of vpmaddwd's output), then int32
//   neg128[nb]: −128 · the block's sum (AVX-512 takes the weights as unsigned bytes w + 128).
// - Q8_K activations (Q4_K, Q6_K weights): s32[8·nb] = d · Σ qs over each 32-element sub-block.
// Q4_K's 6-bit scale and min of sub-block j (0..7) from the 12 packed bytes.
static inline void dg_qk_q4k_scale_min(const uint8_t *q, int j, int *scale, int *min) {
    if (j < 4) {
        *scale = q[j] & 63;
        *min = q[j + 4] & 63;
    } else {
        *scale = (q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4);
        *min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}
