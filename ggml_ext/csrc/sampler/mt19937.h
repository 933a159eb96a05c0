// MT19937 (Matsumoto & Nishimura), the generator behind torch's CPU random functions.
// Besides drawing, it can skip ahead cheaply: skipping n outputs only needs the twists, not the tempering,
// which lets worker threads start mid-stream at exactly the offset torch would have reached.
#ifndef DG_MT19937_H
#define DG_MT19937_H

#include <stdint.h>

#define DG_MT_N 624

typedef struct {
    uint32_t state[DG_MT_N];
    int32_t  next;  // index of the next untempered word; DG_MT_N means "twist before drawing"
} dg_mt19937;

void     dg_mt_seed(dg_mt19937 *mt, uint32_t seed);   // init_genrand: torch.manual_seed(s) uses s mod 2^32
uint32_t dg_mt_next(dg_mt19937 *mt);                  // one tempered 32-bit output
void     dg_mt_skip(dg_mt19937 *mt, uint64_t count);  // advance as if `count` outputs had been drawn

// The uniform behind torch's exponential_(1): two outputs -> 53-bit u in [0, 1); torch's sample is then
// (float)(-log1p(-u)).
static inline double dg_mt_uniform53(dg_mt19937 *mt) {
    uint64_t hi = dg_mt_next(mt);
    uint64_t lo = dg_mt_next(mt);
    uint64_t bits = ((hi << 32) | lo) & ((UINT64_C(1) << 53) - 1);
    return (double)bits * (1.0 / 9007199254740992.0);  // 2^-53
}

#endif
