// The CPU's vector instruction sets and the floating-point mode graphs run in. The bottom of the engine: every
// kernel asks here, and this file calls nothing else of the engine.
#pragma once

#include <stdbool.h>

// The instruction-set levels the engine's own CPU kernels are written for, in increasing order. Each includes AVX2 +
// FMA + F16C; AVX-512 does not need AVX-VNNI (Cascade Lake and Ice Lake have AVX-512 VNNI only), and a CPU with
// AVX-512 F but no VNNI (Skylake-X) runs the AVX2 kernels.
typedef enum {
    DG_ISA_NONE = 0,     // portable C (or ggml's own ops)
    DG_ISA_AVX2 = 1,     // AVX2 + FMA + F16C
    DG_ISA_AVXVNNI = 2,  // the above + AVX-VNNI: 256-bit vpdpbusd / vpdpwssd
    DG_ISA_AVX512 = 3,   // the above + AVX-512 F/BW/VL/VNNI: 512-bit registers and integer dot products
} dg_isa;

// Whether this CPU has `isa`.
bool dg_cpu_has_isa(dg_isa isa);
// The best level this CPU has, capped by DGEMMA_CPU_ISA (avx512, avxvnni, avx2, none; unset or auto: no cap), so
// that tests and benchmarks can run each path the machine has. Read at each call (graph build), not cached.
dg_isa dg_cpu_isa(void);
// The level's name as DGEMMA_CPU_ISA spells it.
const char *dg_isa_name(dg_isa isa);

// Flush subnormals to zero while a graph runs (returns the caller's mode for dg_fp_leave).
unsigned int dg_fp_enter_fast(void);
void dg_fp_leave(unsigned int saved);
