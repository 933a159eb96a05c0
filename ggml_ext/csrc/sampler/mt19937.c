#include "mt19937.h"

#define MT_M 397
#define MT_MATRIX_A 0x9908b0dfu
#define MT_UPPER 0x80000000u
#define MT_LOWER 0x7fffffffu

void dg_mt_seed(dg_mt19937 *mt, uint32_t seed) {
    mt->state[0] = seed;
    for (int i = 1; i < DG_MT_N; i++) {
        uint32_t prev = mt->state[i - 1];
        mt->state[i] = 1812433253u * (prev ^ (prev >> 30)) + (uint32_t)i;
    }
    mt->next = DG_MT_N;
}

// Regenerate all 624 words in place (the reference "genrand" refill).
static void twist(dg_mt19937 *mt) {
    uint32_t *s = mt->state;
    int i = 0;
    // Three ranges so the inner loops need no modulo: the same recurrence as the reference code.
    for (; i < DG_MT_N - MT_M; i++) {
        uint32_t y = (s[i] & MT_UPPER) | (s[i + 1] & MT_LOWER);
        s[i] = s[i + MT_M] ^ (y >> 1) ^ ((y & 1u) ? MT_MATRIX_A : 0u);
    }
    for (; i < DG_MT_N - 1; i++) {
        uint32_t y = (s[i] & MT_UPPER) | (s[i + 1] & MT_LOWER);
        s[i] = s[i + MT_M - DG_MT_N] ^ (y >> 1) ^ ((y & 1u) ? MT_MATRIX_A : 0u);
    }
    uint32_t y = (s[DG_MT_N - 1] & MT_UPPER) | (s[0] & MT_LOWER);
    s[DG_MT_N - 1] = s[MT_M - 1] ^ (y >> 1) ^ ((y & 1u) ? MT_MATRIX_A : 0u);
    mt->next = 0;
}

uint32_t dg_mt_next(dg_mt19937 *mt) {
    if (mt->next >= DG_MT_N) {
        twist(mt);
    }
    uint32_t y = mt->state[mt->next++];
    y ^= y >> 11;
    y ^= (y << 7) & 0x9d2c5680u;
    y ^= (y << 15) & 0xefc60000u;
    y ^= y >> 18;
    return y;
}

void dg_mt_skip(dg_mt19937 *mt, uint64_t count) {
    // Words already available in the current block need no work; every further 624 need one twist.
    uint64_t available = (uint64_t)(DG_MT_N - mt->next);
    if (count <= available) {
        mt->next += (int32_t)count;
        return;
    }
    count -= available;
    mt->next = DG_MT_N;
    while (count > DG_MT_N) {
        twist(mt);
        mt->next = DG_MT_N;
        count -= DG_MT_N;
    }
    twist(mt);
    mt->next = (int32_t)count;
}
