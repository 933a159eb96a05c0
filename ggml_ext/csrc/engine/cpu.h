// The CPU's vector instruction sets and the floating-point mode graphs run in. The bottom of the engine: every
// kernel asks here, and this file calls nothing else of the engine.
#pragma once

#include <stdbool.h>

// AVX2 + FMA: the F32 tiles (expert and dense products, soft embedding, the 8-wide exp).
bool dg_cpu_has_avx2_fma(void);
// AVX2 + FMA + F16C: the quantized kernels (F16 block scales) and everything that shares their check.
bool dg_cpu_has_avx2_fma_f16c(void);
bool dg_cpu_has_avx512f(void);

// Flush subnormals to zero while a graph runs (returns the caller's mode for dg_fp_leave).
unsigned int dg_fp_enter_fast(void);
void dg_fp_leave(unsigned int saved);
