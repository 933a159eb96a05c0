// The engine's test hooks (bench.c, qkernels_check.c): built with the kernel sources they exercise into
// dgemma_engine._engine_tests, which tests/ and bench/ load and the product never does (setup.py).
#pragma once

#include <stdint.h>

// seeded random numbers (splitmix64; floats in [-1, 1))
uint64_t dg_next_rand(uint64_t *s);
float dg_rand_float(uint64_t *s);
// max |got − want| / max |want| (NaN in got: infinity)
double dg_max_rel_diff(const float *got, const float *want, int64_t n);
