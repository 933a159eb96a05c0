// What the test hooks share: seeded random numbers and the error measure they report.
#include <math.h>

#include "cpu.h"
#include "engine.h"
#include "hooks.h"

uint64_t dg_next_rand(uint64_t *s) {  // splitmix64
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

float dg_rand_float(uint64_t *s) { return (float)((double)(dg_next_rand(s) >> 11) * 0x1.0p-53 * 2.0 - 1.0); }

double dg_max_rel_diff(const float *got, const float *want, int64_t n) {
    double max_diff = 0, max_abs = 0;
    for (int64_t i = 0; i < n; i++) {
        const double a = got[i], b = want[i];
        max_diff = a != a ? INFINITY : fmax(max_diff, fabs(a - b));
        max_abs = fmax(max_abs, fabs(b));
    }
    return max_abs > 0 ? max_diff / max_abs : max_diff;
}

// Test hooks: whether this CPU has instruction-set level `level` (cpu.h's dg_isa order), and the level the engine's
// kernels take under DGEMMA_CPU_ISA.
DG_API int dg_check_cpu_has_isa(int level) {
    return level >= DG_ISA_NONE && level <= DG_ISA_AVX512 && dg_cpu_has_isa((dg_isa)level);
}
DG_API int dg_check_cpu_isa(void) { return (int)dg_cpu_isa(); }
