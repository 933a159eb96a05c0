// The AVX2 kernels built a second time with AVX-VNNI's integer dot products (vpdpbusd, vpdpwssd on 256-bit
// registers): one source, qkernels_avx2.c, so each block format keeps one decoder and one tile.
#define DG_QK_AVX_VNNI 1
#include "qkernels_avx2.c"
