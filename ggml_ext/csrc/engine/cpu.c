// CPU feature checks (__builtin_cpu_supports, cached by the compiler's runtime) and the floating-point mode.
#include "cpu.h"

#if defined(__x86_64__) && defined(__GNUC__)
bool dg_cpu_has_avx2_fma(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

bool dg_cpu_has_avx2_fma_f16c(void) { return dg_cpu_has_avx2_fma() && __builtin_cpu_supports("f16c"); }

bool dg_cpu_has_avx512f(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f");
}
#else
bool dg_cpu_has_avx2_fma(void) { return false; }
bool dg_cpu_has_avx2_fma_f16c(void) { return false; }
bool dg_cpu_has_avx512f(void) { return false; }
#endif

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
