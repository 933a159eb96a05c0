// Counter-based random numbers for the default "fast" mode: every value is a pure function of
// (seed, stream, canvas, step, row, index), so any thread can compute any value and results do not depend on the
// number of threads or on the order of work. The mixer is SplitMix64's finaliser (Steele, Lea & Flood 2014),
// applied to a key built from the coordinates.
#ifndef DG_COUNTER_RNG_H
#define DG_COUNTER_RNG_H

#include <stdint.h>

enum {
    DG_STREAM_INIT = 1,      // canvas initialisation tokens
    DG_STREAM_RENOISE = 2,   // fresh noise tokens after each step
    DG_STREAM_CATEGORY = 3,  // the uniform driving each row's categorical draw
    DG_STREAM_REPAIR = 4,    // noise for positions a task checker sends back (dg_sampler_reopen)
};

static inline uint64_t dg_mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * UINT64_C(0xbf58476d1ce4e5b9);
    z = (z ^ (z >> 27)) * UINT64_C(0x94d049bb133111eb);
    return z ^ (z >> 31);
}

// One 64-bit value for the given coordinates. Each coordinate goes through the mixer before the next is added, so
// distinct coordinate tuples give unrelated keys.
static inline uint64_t dg_counter_u64(uint64_t seed, uint64_t stream, uint64_t canvas, uint64_t step, uint64_t index) {
    const uint64_t golden = UINT64_C(0x9e3779b97f4a7c15);
    uint64_t h = dg_mix64(seed + golden);
    h = dg_mix64(h ^ (stream + golden));
    h = dg_mix64(h ^ (canvas + golden));
    h = dg_mix64(h ^ (step + golden));
    return dg_mix64(h ^ (index * golden + golden));
}

// Uniform double in [0, 1) with 53 random bits.
static inline double dg_counter_uniform(uint64_t seed, uint64_t stream, uint64_t canvas, uint64_t step,
                                        uint64_t index) {
    return (double)(dg_counter_u64(seed, stream, canvas, step, index) >> 11) * (1.0 / 9007199254740992.0);
}

// Uniform integer in [0, n) by Lemire's multiply-shift (bias below 2^-32 for n < 2^32).
static inline uint32_t dg_counter_below(uint32_t n, uint64_t seed, uint64_t stream, uint64_t canvas, uint64_t step,
                                        uint64_t index) {
    uint64_t r = dg_counter_u64(seed, stream, canvas, step, index) >> 32;
    return (uint32_t)((r * (uint64_t)n) >> 32);
}

#endif
