// CPU feature checks (__builtin_cpu_supports, cached by the compiler's runtime), the DGEMMA_CPU_ISA cap and the
// floating-point mode.
#include "cpu.h"

#include <stdlib.h>
#include <string.h>

static const char *const ISA_NAMES[] = {"none", "avx2", "avxvnni", "avx512"};

const char *dg_isa_name(dg_isa isa) { return isa >= DG_ISA_NONE && isa <= DG_ISA_AVX512 ? ISA_NAMES[isa] : "?"; }

#if defined(__x86_64__) && defined(__GNUC__)
bool dg_cpu_has_isa(dg_isa isa) {
    __builtin_cpu_init();
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    switch (isa) {
        case DG_ISA_NONE: return true;
        case DG_ISA_AVX2: return avx2;
        case DG_ISA_AVXVNNI: return avx2 && __builtin_cpu_supports("avxvnni");
        case DG_ISA_AVX512:
            return avx2 && __builtin_cpu_supports("avx512f") &&
                   __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                   __builtin_cpu_supports("avx512vnni");
    }
    return false;
}
#else
bool dg_cpu_has_isa(dg_isa isa) { return isa == DG_ISA_NONE; }
#endif

dg_isa dg_cpu_isa(void) {
    dg_isa cap = DG_ISA_AVX512;
    const char *v = getenv("DGEMMA_CPU_ISA");
    for (int i = DG_ISA_NONE; v && i <= DG_ISA_AVX512; i++)
        if (!strcmp(v, ISA_NAMES[i])) cap = (dg_isa)i;
    while (cap > DG_ISA_NONE && !dg_cpu_has_isa(cap)) cap = (dg_isa)(cap - 1);  // Ice Lake: AVX-512 VNNI, no AVX-VNNI
    return cap;
}

// Attention with scale 1.0 and sharp softmaxes produce many subnormal probabilities; x86 handles those in microcode,
// up to 100x slower (one full-attention P·V took a second instead of 15 ms). Flush them to zero while the graph runs:
// they are below 1.2e-38, far under any tolerance. ggml's worker threads are created inside the compute call and
// inherit this floating-point mode; the caller's mode is restored afterwards.
#if defined(__SSE__) || defined(__x86_64__)
#include <xmmintrin.h>
#define FLUSH_SUBNORMALS 0x8040u  // MXCSR flush-to-zero | denormals-are-zero
unsigned int dg_fp_enter_fast(void) {
    const unsigned int saved = _mm_getcsr();
    _mm_setcsr(saved | FLUSH_SUBNORMALS);
    return saved;
}
void dg_fp_leave(unsigned int saved) { _mm_setcsr(saved); }
#else
unsigned int dg_fp_enter_fast(void) { return 0; }
void dg_fp_leave(unsigned int saved) { (void)saved; }
#endif
