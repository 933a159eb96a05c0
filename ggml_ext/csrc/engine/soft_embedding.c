// Self-conditioning's soft embedding P·E contracted over the vocabulary in the embedding's stored layout.
//
// Why: P [n, V] (probabilities) times E [V, H] contracts over E's rows, but ggml's matmul contracts over the contiguous
// dimension, so the engine used to keep a transposed copy of E: 1.5 GB in F16 at the released vocabulary, more than a
// third of a Q4_K_M file's size on top of it. This op reads E where it lies (any type ggml can dequantize): panels of
// KC vocabulary rows × NC columns are dequantized to F32 into a small per-thread buffer, then multiplied into register
// tiles of MR tokens × NR columns (AVX2: 12 ymm), or MR tokens × 4·NR columns with AVX-512 (24 zmm). Every product and
// sum is F32 (the copy rounded P to F16). Both vector paths compute each output as the same FMA chain (per panel: zero,
// one FMA per vocabulary row in order, then one add into the output), so AVX-512 gives the AVX2 path's bits.
//
// Threads: the vocabulary is cut into `slices` ranges; a thread owns whole slices and writes each one's partial sums
// to its own [H, n] plane of the output, which the graph then adds in slice order (no barrier inside the op).
// F32 embeddings keep the exact transposed copy (model.c), whose results the fidelity goldens were recorded with.
#include <stdlib.h>
#include <string.h>

#include "cpu.h"
#include "engine.h"
#include "qkernels_avx2.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define DG_X86 1
#endif

enum { KC = 128, NC = 256, MR = 6, NR = 16, MC = 16 * MR };  // NC is a multiple of every ggml block size (32 and 256)

// One panel: KC vocabulary rows × NC embedding columns, both operands packed so that a tile reads contiguous memory.
typedef struct {
    const float *a;   // probabilities: token block t0 / MR at a + (t0 / MR)·KC·MR, laid out [k][token in block]
    const float *b;   // dequantized E: column strip j / NR at b + (j / NR)·KC·NR, laid out [k][column in strip]
    float *y;         // output plane, row t at y + t·ldy
    size_t ldy;
    int64_t kc, nc;   // panel rows and columns in use (a strip past nc is zero-padded)
} panel;

// y[t][j0 + c] += Σ_k a·b for the tokens [t0, t0 + mr) of one strip's first nr columns, scalar.
static void tile_scalar(const panel *pn, int64_t t0, int mr, int64_t j0, int nr) {
    const float *a = pn->a + (size_t)(t0 / MR) * KC * MR, *b = pn->b + (size_t)(j0 / NR) * KC * NR;
    for (int i = 0; i < mr; i++) {
        float *yr = pn->y + (size_t)(t0 + i) * pn->ldy + j0;
        for (int c = 0; c < nr; c++) {
            float acc = 0.0f;
            for (int64_t k = 0; k < pn->kc; k++) acc += a[k * MR + i] * b[k * NR + c];
            yr[c] += acc;
        }
    }
}

static void panel_scalar(const panel *pn, int64_t n) {
    for (int64_t j = 0; j < pn->nc; j += NR)
        for (int64_t t0 = 0; t0 < n; t0 += MR)
            tile_scalar(pn, t0, n - t0 < MR ? (int)(n - t0) : MR, j, pn->nc - j < NR ? (int)(pn->nc - j) : NR);
}

#ifdef DG_X86
// MR_ tokens × one 16-column strip in 2·MR_ ymm accumulators; MR_ is a constant after inlining. The strip (8 KiB)
// stays in L1 while the token blocks stream past it.
__attribute__((target("avx2,fma"), always_inline)) static inline void tile_avx2(const panel *pn, int64_t t0,
                                                                                 const int MR_, int64_t j, int nr) {
    __m256 acc[MR][2];
    for (int i = 0; i < MR_; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    const float *b = pn->b + (size_t)(j / NR) * KC * NR, *ap = pn->a + (size_t)(t0 / MR) * KC * MR;
    const int64_t kc = pn->kc;
    // the output rows lie H floats apart, far from L1: fetch them while the products run, not at the end
    for (int i = 0; i < MR_; i++) {  // a 16-float row segment may straddle two cache lines
        const float *yr = pn->y + (size_t)(t0 + i) * pn->ldy + j;
        _mm_prefetch((const char *)yr, _MM_HINT_T0);
        _mm_prefetch((const char *)(yr + NR - 1), _MM_HINT_T0);
    }
    for (int64_t k = 0; k < kc; k++, b += NR, ap += MR) {
        const __m256 b0 = _mm256_load_ps(b), b1 = _mm256_load_ps(b + 8);
        for (int i = 0; i < MR_; i++) {
            const __m256 a = _mm256_broadcast_ss(ap + i);
            acc[i][0] = _mm256_fmadd_ps(a, b0, acc[i][0]);
            acc[i][1] = _mm256_fmadd_ps(a, b1, acc[i][1]);
        }
    }
    // the last strip of a width that is not a multiple of 16 is stored under a mask (a spill to a temporary array
    // would keep every accumulator in memory inside the loop above)
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i m0 = _mm256_cmpgt_epi32(_mm256_set1_epi32(nr), lane);
    const __m256i m1 = _mm256_cmpgt_epi32(_mm256_set1_epi32(nr - 8), lane);
    for (int i = 0; i < MR_; i++) {
        float *yr = pn->y + (size_t)(t0 + i) * pn->ldy + j;
        if (nr == NR) {
            _mm256_storeu_ps(yr, _mm256_add_ps(_mm256_loadu_ps(yr), acc[i][0]));
            _mm256_storeu_ps(yr + 8, _mm256_add_ps(_mm256_loadu_ps(yr + 8), acc[i][1]));
        } else {
            _mm256_maskstore_ps(yr, m0, _mm256_add_ps(_mm256_maskload_ps(yr, m0), acc[i][0]));
            _mm256_maskstore_ps(yr + 8, m1, _mm256_add_ps(_mm256_maskload_ps(yr + 8, m1), acc[i][1]));
        }
    }
}

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
enum { NS512 = 4 };  // AVX-512 tile: MR tokens × NS512 16-column strips (64 columns) in 24 of the 32 zmm registers

// MR_ tokens × NS_ strips (constants after inlining), one zmm accumulator each: per output the same chain as tile_avx2
// (zero, one fmadd per k in order, one add into y), so the same bits. Per k, NS_ strip loads and MR_ broadcasts feed
// MR_·NS_ FMAs. The strip layout is the AVX2 one: a tile reads NS_ strips side by side (32 KiB, in L1 while the
// token blocks of a group stream past). Measured on an Intel Xeon (AVX-512), 6 × 64 ran as fast as 12 tokens × 32
// columns and faster than 6 × 48.
AVX512 __attribute__((always_inline)) static inline void tile_avx512(const panel *pn, int64_t t0, const int MR_,
                                                                      int64_t j, const int NS_, int nr) {
    __m512 acc[MR][NS512];
    for (int i = 0; i < MR_; i++)
        for (int s = 0; s < NS_; s++) acc[i][s] = _mm512_setzero_ps();
    const float *b = pn->b + (size_t)(j / NR) * KC * NR, *ap = pn->a + (size_t)(t0 / MR) * KC * MR;
    const int64_t kc = pn->kc;
    for (int i = 0; i < MR_; i++) {  // as in tile_avx2: fetch the far output rows while the products run
        const float *yr = pn->y + (size_t)(t0 + i) * pn->ldy + j;
        for (int c = 0; c < NR * NS_; c += 16) _mm_prefetch((const char *)(yr + c), _MM_HINT_T0);
        _mm_prefetch((const char *)(yr + NR * NS_ - 1), _MM_HINT_T0);
    }
    for (int64_t k = 0; k < kc; k++, b += NR, ap += MR) {
        __m512 bv[NS512];
        for (int s = 0; s < NS_; s++) bv[s] = _mm512_load_ps(b + (size_t)s * KC * NR);
        for (int i = 0; i < MR_; i++) {
            const __m512 a = _mm512_set1_ps(ap[i]);
            for (int s = 0; s < NS_; s++) acc[i][s] = _mm512_fmadd_ps(a, bv[s], acc[i][s]);
        }
    }
    for (int i = 0; i < MR_; i++) {
        float *yr = pn->y + (size_t)(t0 + i) * pn->ldy + j;
        for (int s = 0; s < NS_; s++) {  // masked: the last strip of a width that is not a multiple of 16
            const int left = nr - NR * s;
            const __mmask16 m = left >= NR ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
            _mm512_mask_storeu_ps(yr + NR * s, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, yr + NR * s), acc[i][s]));
        }
    }
}

// The tokens [t0, t0 + mr) × a group of ns strips (nr columns, 16·(ns − 1) < nr ≤ 16·ns): constant tile shapes.
AVX512 static void tiles_avx512(const panel *pn, int64_t t0, int mr, int64_t j, int ns, int nr) {
#define DG_SE_TOKENS(NS_)                                                                                           \
    switch (mr) {                                                                                                   \
        case 6: tile_avx512(pn, t0, 6, j, NS_, nr); break;                                                          \
        case 5: tile_avx512(pn, t0, 5, j, NS_, nr); break;                                                          \
        case 4: tile_avx512(pn, t0, 4, j, NS_, nr); break;                                                          \
        case 3: tile_avx512(pn, t0, 3, j, NS_, nr); break;                                                          \
        case 2: tile_avx512(pn, t0, 2, j, NS_, nr); break;                                                          \
        default: tile_avx512(pn, t0, 1, j, NS_, nr); break;                                                         \
    }
    switch (ns) {
        case 4: DG_SE_TOKENS(4) break;
        case 3: DG_SE_TOKENS(3) break;
        case 2: DG_SE_TOKENS(2) break;
        default: DG_SE_TOKENS(1) break;
    }
#undef DG_SE_TOKENS
}

// As panel_avx2, with column groups of NS512 strips.
AVX512 static void panel_avx512(const panel *pn, int64_t n) {
    for (int64_t m0 = 0; m0 < n; m0 += MC)
    for (int64_t j = 0; j < pn->nc; j += NR * NS512) {
        const int nr = pn->nc - j < NR * NS512 ? (int)(pn->nc - j) : NR * NS512;
        for (int64_t t0 = m0; t0 < n && t0 < m0 + MC; t0 += MR)
            tiles_avx512(pn, t0, n - t0 < MR ? (int)(n - t0) : MR, j, (nr + NR - 1) / NR, nr);
    }
}

// Tokens go in groups of MC so that a group's probabilities and outputs stay in L2 beside the panel.
__attribute__((target("avx2,fma"))) static void panel_avx2(const panel *pn, int64_t n) {
    for (int64_t m0 = 0; m0 < n; m0 += MC)
    for (int64_t j = 0; j < pn->nc; j += NR) {
        const int nr = pn->nc - j < NR ? (int)(pn->nc - j) : NR;
        for (int64_t t0 = m0; t0 < n && t0 < m0 + MC; t0 += MR) {
            switch (n - t0 < MR ? n - t0 : MR) {  // constant tile heights, so the accumulators stay in registers
                case 6: tile_avx2(pn, t0, 6, j, nr); break;
                case 5: tile_avx2(pn, t0, 5, j, nr); break;
                case 4: tile_avx2(pn, t0, 4, j, nr); break;
                case 3: tile_avx2(pn, t0, 3, j, nr); break;
                case 2: tile_avx2(pn, t0, 2, j, nr); break;
                default: tile_avx2(pn, t0, 1, j, nr); break;
            }
        }
    }
}
#endif

// ---- dequantization of E's rows ---------------------------------------------------------------------------------
// ggml's own to_float (ggml-base) is built for any x86-64, so it runs scalar; at n = 256 tokens that alone took as
// long as the products. The two types the converter gives an embedding (Q6_K in the K mixes, Q8_0) are dequantized
// here with the same arithmetic, element for element (a product of the block scale, the sub-scale and the integer,
// in that order; no sums), in loops the compiler vectorizes for AVX2; the results are bit-identical (tested).

typedef struct {
    ggml_fp16_t d;
    int8_t qs[32];
} block_q8_0_layout;

typedef struct {
    uint8_t ql[128];  // low four bits of the 6-bit quants
    uint8_t qh[64];   // high two bits
    int8_t scales[16];
    ggml_fp16_t d;
} block_q6_K_layout;

_Static_assert(sizeof(block_q8_0_layout) == 34 && sizeof(block_q6_K_layout) == 210, "ggml block layouts");

#define DEFINE_DEQUANT(SUFFIX, TARGET)                                                                              \
    TARGET static void dequant_q8_0_##SUFFIX(const void *src, float *y, int64_t k) {                               \
        const block_q8_0_layout *b = src;                                                                           \
        for (int64_t i = 0; i < k / 32; i++) {                                                                      \
            const float d = ggml_fp16_to_fp32(b[i].d);                                                              \
            for (int j = 0; j < 32; j++) y[i * 32 + j] = (float)b[i].qs[j] * d;                                     \
        }                                                                                                           \
    }                                                                                                               \
    TARGET static void dequant_q6_K_##SUFFIX(const void *src, float *y, int64_t k) {                               \
        const block_q6_K_layout *b = src;                                                                           \
        for (int64_t i = 0; i < k / 256; i++, y += 256) {                                                           \
            const float d = ggml_fp16_to_fp32(b[i].d);                                                              \
            for (int half = 0; half < 2; half++) {                                                                  \
                const uint8_t *ql = b[i].ql + 64 * half, *qh = b[i].qh + 32 * half;                                 \
                const int8_t *sc = b[i].scales + 8 * half;                                                          \
                float *yh = y + 128 * half;                                                                         \
                for (int g = 0; g < 2; g++) { /* 16 quants share each sub-scale: d·scale first, as ggml does */   \
                    const float s1 = d * sc[g], s2 = d * sc[g + 2], s3 = d * sc[g + 4], s4 = d * sc[g + 6];           \
                    for (int l = 16 * g; l < 16 * g + 16; l++) {                                                    \
                        const int q1 = (ql[l] & 0xF) | ((qh[l] & 3) << 4), q2 = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4); \
                        const int q3 = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4), q4 = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4); \
                        yh[l] = s1 * (float)(q1 - 32);                                                              \
                        yh[l + 32] = s2 * (float)(q2 - 32);                                                         \
                        yh[l + 64] = s3 * (float)(q3 - 32);                                                         \
                        yh[l + 96] = s4 * (float)(q4 - 32);                                                         \
                    }                                                                                               \
                }                                                                                                   \
            }                                                                                                       \
        }                                                                                                           \
    }

DEFINE_DEQUANT(portable, )
#ifdef DG_X86
DEFINE_DEQUANT(avx2, __attribute__((target("avx2,fma"))))
#endif

#ifdef DG_X86
// Straight into the panel's strips (row k of each NR-column strip), for the two embedding types; the same products
// as the row dequantizers above, so the same floats.
#define AVX2 __attribute__((target("avx2,fma,f16c")))
AVX2 static inline void store8(float *strips, int64_t k, int64_t e, __m256 v) {
    _mm256_store_ps(strips + (size_t)(e / NR) * KC * NR + k * NR + e % NR, v);
}

// the low 8 signed bytes as floats
AVX2 static inline __m256 widen8(__m128i q) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)); }

// one super-block (256 columns, first column e0 of the panel) of a Q6_K row
AVX2 static void strips_q6_K(const void *src, float *strips, int64_t k, int64_t e0) {
    const dg_block_q6_K *b = src;
    const float d = _cvtsh_ss(b->d);
    for (int half = 0; half < 2; half++) {
        for (int quarter = 0; quarter < 4; quarter++) {
            const __m256i q = _mm256_sub_epi8(dg_q6_K_quarter_avx2(b, half, quarter), _mm256_set1_epi8(32));  // q − 32
            const int8_t *sc = b->scales + 8 * half + 2 * quarter;
            const __m256 s0 = _mm256_set1_ps(d * (float)sc[0]), s1 = _mm256_set1_ps(d * (float)sc[1]);
            const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
            const int64_t e = e0 + 128 * half + 32 * quarter;
            store8(strips, k, e, _mm256_mul_ps(s0, widen8(lo)));
            store8(strips, k, e + 8, _mm256_mul_ps(s0, widen8(_mm_srli_si128(lo, 8))));
            store8(strips, k, e + 16, _mm256_mul_ps(s1, widen8(hi)));
            store8(strips, k, e + 24, _mm256_mul_ps(s1, widen8(_mm_srli_si128(hi, 8))));
        }
    }
}

// one 32-column block of a Q8_0 row
AVX2 static void strips_q8_0(const void *src, float *strips, int64_t k, int64_t e0) {
    const block_q8_0_layout *b = src;
    const __m256 d = _mm256_set1_ps(_cvtsh_ss(b->d));
    for (int v = 0; v < 4; v++) {
        const __m128i q = _mm_loadl_epi64((const __m128i *)(b->qs + 8 * v));
        store8(strips, k, e0 + 8 * v, _mm256_mul_ps(widen8(q), d));
    }
}
#endif

// The row dequantizer for `type` (NULL: a plain copy of F32).
ggml_to_float_t dg_row_dequantizer(enum ggml_type type, bool avx2) {
    switch (type) {
        case GGML_TYPE_F32: return NULL;
#ifdef DG_X86
        case GGML_TYPE_Q8_0: return avx2 ? dequant_q8_0_avx2 : dequant_q8_0_portable;
        case GGML_TYPE_Q6_K: return avx2 ? dequant_q6_K_avx2 : dequant_q6_K_portable;
#else
        case GGML_TYPE_Q8_0: return dequant_q8_0_portable;
        case GGML_TYPE_Q6_K: return dequant_q6_K_portable;
#endif
        default: return ggml_get_type_traits(type)->to_float;
    }
}

int dg_soft_embedding_isa(void) {
#ifdef DG_X86
    const dg_isa isa = dg_cpu_isa();
    if (isa >= DG_ISA_AVX512) return DG_ISA_AVX512;
    if (isa >= DG_ISA_AVX2) return DG_ISA_AVX2;  // AVX-VNNI adds nothing to F32 products
#endif
    return DG_ISA_NONE;
}

// dst [H, n, slices]; src[0] = E [H, V] (any dequantizable type), src[1] = P [V, n] F32 contiguous rows.
static void soft_embedding_op(struct ggml_tensor *dst, int ith, int nth, void *userdata) {
    const struct ggml_tensor *e = dst->src[0], *p = dst->src[1];
    const int64_t H = e->ne[0], V = e->ne[1], n = p->ne[1], slices = dst->ne[2];
    const dg_isa isa = (dg_isa)(intptr_t)userdata;  // chosen at build time: DG_ISA_NONE, AVX2 or AVX512
    const bool avx2 = isa >= DG_ISA_AVX2;  // the AVX-512 path dequantizes with the AVX2 loops too
    const ggml_to_float_t to_float = dg_row_dequantizer(e->type, avx2);
    const int64_t blck = ggml_blck_size(e->type);
    const size_t type_size = ggml_type_size(e->type);
    // per thread: the packed panel of E (128 KiB), one dequantized row, and the packed probabilities of the panel's
    // rows (KC per token; P's rows lie V floats apart, a stride that maps them all onto the same cache sets)
    const int64_t n_blocks = (n + MR - 1) / MR;
    float *buf = aligned_alloc(64, sizeof(float) * (KC * NC + NC + (size_t)(n_blocks * KC * MR)));
    if (!buf) abort();  // a custom op cannot fail; without these few hundred KiB the process is lost anyway
    float *row_f32 = buf + KC * NC, *packed = row_f32 + NC;
    const float *probs = p->data;
    const size_t ldp = p->nb[1] / sizeof(float);
    for (int64_t s = ith; s < slices; s += nth) {
        float *y = (float *)((char *)dst->data + (size_t)s * dst->nb[2]);
        memset(y, 0, sizeof(float) * (size_t)(H * n));
        const int64_t v_end = V * (s + 1) / slices;
        for (int64_t v0 = V * s / slices; v0 < v_end; v0 += KC) {
            const int64_t kc = v_end - v0 < KC ? v_end - v0 : KC;
            for (int64_t t = 0; t < n_blocks * MR; t++) {  // rows past n are zeros, never stored
                float *dst = packed + (size_t)(t / MR) * KC * MR + t % MR;
                for (int64_t k = 0; k < kc; k++) dst[k * MR] = t < n ? probs[(size_t)t * ldp + v0 + k] : 0.0f;
            }
            for (int64_t h0 = 0; h0 < H; h0 += NC) {
                const int64_t nc = H - h0 < NC ? H - h0 : NC;
                // E's rows lie a row's size apart (2310 bytes for Q6_K at H 2816), a stride the hardware prefetchers
                // do not follow, so each block came from memory one miss at a time (the dequantization took 19 % of the
                // AVX-512 op at n = 256, 7 % with this): fetch the next panel's blocks into L2 while this one runs
                const int64_t hn = h0 + NC < H ? h0 + NC : 0, vn = h0 + NC < H ? v0 : v0 + KC;
                const int64_t kn = vn >= v_end ? 0 : v_end - vn < KC ? v_end - vn : KC;
                const size_t span = (size_t)((H - hn < NC ? H - hn : NC) / blck) * type_size;
                memset(row_f32, 0, sizeof(float) * NC);  // zero padding of the last strip stays zero
                for (int64_t k = 0; k < kc; k++) {
                    const char *row = (const char *)e->data + (size_t)(v0 + k) * e->nb[1] + (size_t)(h0 / blck) * type_size;
                    if (k < kn) {
                        const char *next = (const char *)e->data + (size_t)(vn + k) * e->nb[1] + (size_t)(hn / blck) * type_size;
                        for (size_t o = 0; o < span; o += 64) __builtin_prefetch(next + o, 0, 2);
                        __builtin_prefetch(next + span - 1, 0, 2);
                    }
#ifdef DG_X86
                    if (avx2 && nc == NC && (e->type == GGML_TYPE_Q6_K || e->type == GGML_TYPE_Q8_0)) {
                        void (*strips)(const void *, float *, int64_t, int64_t) =
                            e->type == GGML_TYPE_Q6_K ? strips_q6_K : strips_q8_0;
                        for (int64_t c = 0; c < NC; c += blck) strips(row + (size_t)(c / blck) * type_size, buf, k, c);
                        continue;
                    }
#endif
                    if (!to_float) memcpy(row_f32, row, sizeof(float) * (size_t)nc);
                    else to_float(row, row_f32, nc);
                    for (int64_t j = 0; j < nc; j += NR) memcpy(buf + (size_t)(j / NR) * KC * NR + k * NR, row_f32 + j, sizeof(float) * NR);
                }
                const panel pn = {packed, buf, y + h0, (size_t)H, kc, nc};
#ifdef DG_X86
                if (isa == DG_ISA_AVX512) panel_avx512(&pn, n);
                else if (avx2) panel_avx2(&pn, n);
                else panel_scalar(&pn, n);
#else
                (void)avx2;
                (void)isa;
                panel_scalar(&pn, n);
#endif
            }
        }
    }
    free(buf);
}

// The path run for a requested level: AVX-512, AVX2 or portable, never above what dg_soft_embedding_isa() allows.
static dg_isa soft_embedding_level(int isa) {
    const int best = dg_soft_embedding_isa();
    const int want = isa >= DG_ISA_AVX512 ? DG_ISA_AVX512 : isa >= DG_ISA_AVX2 ? DG_ISA_AVX2 : DG_ISA_NONE;
    return (dg_isa)(want < best ? want : best);
}

// isa: a dg_isa level, DG_ISA_NONE portable C, DG_ISA_AVX2 (or AVXVNNI) AVX2 + FMA, DG_ISA_AVX512 the 512-bit tiles
// (dg_soft_embedding_isa() is the best this CPU runs; a level above it runs that instead).
struct ggml_tensor *dg_build_soft_embedding(struct ggml_context *ctx, struct ggml_tensor *embd, struct ggml_tensor *p,
                                            int slices, int isa) {
    GGML_ASSERT(p->type == GGML_TYPE_F32 && ggml_is_contiguous(p) && p->ne[0] == embd->ne[1] && p->ne[2] == 1);
    GGML_ASSERT(embd->ne[0] % ggml_blck_size(embd->type) == 0 && embd->ne[2] == 1 &&
                (embd->type == GGML_TYPE_F32 || ggml_get_type_traits(embd->type)->to_float));
    if (slices < 1) slices = 1;
    struct ggml_tensor *args[2] = {embd, p};
    struct ggml_tensor *parts = ggml_custom_4d(ctx, GGML_TYPE_F32, embd->ne[0], p->ne[1], slices, 1, args, 2,
                                               soft_embedding_op, GGML_N_TASKS_MAX,
                                               (void *)(intptr_t)soft_embedding_level(isa));
    struct ggml_tensor *sum = ggml_view_2d(ctx, parts, parts->ne[0], parts->ne[1], parts->nb[1], 0);
    for (int s = 1; s < slices; s++) {
        sum = ggml_add(ctx, sum, ggml_view_2d(ctx, parts, parts->ne[0], parts->ne[1], parts->nb[1], (size_t)s * parts->nb[2]));
    }
    return sum;
}

// ---------------------------------------------------------------------------------------------------------------
// Top-k self-conditioning (self_cond_top_k): per token, the k most probable vocabulary rows, renormalised, times E.

typedef struct {
    float p;
    int32_t v;
} scored;

// Heap order: the smallest probability on top, and among equal ones the highest index, so that the k kept are the
// largest with ties to the lower index.
static bool scored_below(scored a, scored b) { return a.p < b.p || (a.p == b.p && a.v > b.v); }

static void sift_down(scored *h, int k, int i) {
    for (;;) {
        int m = i, l = 2 * i + 1, r = l + 1;
        if (l < k && scored_below(h[l], h[m])) m = l;
        if (r < k && scored_below(h[r], h[m])) m = r;
        if (m == i) return;
        const scored t = h[i];
        h[i] = h[m];
        h[m] = t;
        i = m;
    }
}

static int by_index(const void *a, const void *b) {
    const int32_t x = ((const scored *)a)->v, y = ((const scored *)b)->v;
    return (x > y) - (x < y);
}

// dst [H, n]; src[0] = E [H, V], src[1] = P [V, n] F32 rows; userdata: k (1 ≤ k < V, checked when built). Threads
// take whole tokens; each output is one FMA chain over its k rows in vocabulary order.
static void soft_embedding_topk_op(struct ggml_tensor *dst, int ith, int nth, void *userdata) {
    const struct ggml_tensor *e = dst->src[0], *p = dst->src[1];
    const int64_t H = e->ne[0], V = e->ne[1], n = p->ne[1];
    const int k = (int)(intptr_t)userdata;
    const ggml_to_float_t to_float = dg_row_dequantizer(e->type, dg_cpu_isa() >= DG_ISA_AVX2);
    scored *heap = malloc(sizeof(scored) * (size_t)k);
    float *row = malloc(sizeof(float) * (size_t)H);
    if (!heap || !row) abort();  // a custom op cannot fail; k ≤ DG_MAX_SC_TOP_K entries and one row
    for (int64_t t = ith; t < n; t += nth) {
        const float *pt = (const float *)((const char *)p->data + (size_t)t * p->nb[1]);
        for (int i = 0; i < k; i++) heap[i] = (scored){pt[i], (int32_t)i};
        for (int i = k / 2 - 1; i >= 0; i--) sift_down(heap, k, i);
        for (int64_t v = k; v < V; v++) {
            if (pt[v] > heap[0].p) {  // equal: the lower index already held wins
                heap[0] = (scored){pt[v], (int32_t)v};
                sift_down(heap, k, 0);
            }
        }
        qsort(heap, (size_t)k, sizeof(scored), by_index);
        double total = 0.0;
        for (int i = 0; i < k; i++) total += heap[i].p;
        float *y = (float *)((char *)dst->data + (size_t)t * dst->nb[1]);
        memset(y, 0, sizeof(float) * (size_t)H);
        if (!(total > 0.0)) continue;  // an all-zero row (never a softmax's) stays zero
        for (int i = 0; i < k; i++) {
            const float w = (float)(heap[i].p / total);
            if (w == 0.0f) continue;
            const char *src = (const char *)e->data + (size_t)heap[i].v * e->nb[1];
            if (to_float) to_float(src, row, H);
            else memcpy(row, src, sizeof(float) * (size_t)H);
            for (int64_t h = 0; h < H; h++) y[h] += w * row[h];
        }
    }
    free(heap);
    free(row);
}

struct ggml_tensor *dg_build_soft_embedding_topk(struct ggml_context *ctx, struct ggml_tensor *embd,
                                                 struct ggml_tensor *p, int k) {
    GGML_ASSERT(p->type == GGML_TYPE_F32 && p->nb[0] == sizeof(float) && p->ne[0] == embd->ne[1] && p->ne[2] == 1);
    GGML_ASSERT(k >= 1 && k < embd->ne[1] && k <= DG_MAX_SC_TOP_K && embd->ne[2] == 1 &&
                (embd->type == GGML_TYPE_F32 || ggml_get_type_traits(embd->type)->to_float));
    struct ggml_tensor *args[2] = {embd, p};
    return ggml_custom_4d(ctx, GGML_TYPE_F32, embd->ne[0], p->ne[1], 1, 1, args, 2, soft_embedding_topk_op,
                          GGML_N_TASKS_MAX, (void *)(intptr_t)k);
}
