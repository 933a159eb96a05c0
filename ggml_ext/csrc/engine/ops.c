// The graph's CPU custom ops that are not a kernel family of their own: the fused GELU·up and the logit softcap
// (element-wise, in exact f32), and the choice of kernel for a dense weight product.
//
// Both element-wise ops use an 8-wide exp on AVX2 instead of libm's expf per element; each has a standard-op form for
// nodes that do not run on the CPU.
#include <math.h>
#include <string.h>

#include "cpu.h"
#include "engine.h"
#include "qkernels.h"

static inline float gelu_mul_scalar(float x, float up) {
    const float z = x * (x * x * 0.044715f + 1.0f) * 1.5957691216057308f;  // 2·sqrt(2/π)
    return x / (1.0f + expf(-z)) * up;
}

// An 8-wide exp for the one-pass element-wise ops below (GELU, softcap): range reduction by ln 2 and a degree-6
// polynomial, within 2 ulp of libm's expf, which ggml's sigmoid and the scalar loops call element by element.
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
__attribute__((target("avx2,fma"))) static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(_mm256_set1_ps(-87.0f), _mm256_min_ps(_mm256_set1_ps(88.0f), x));  // NaN stays NaN
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln 2 in two parts (Cody and Waite)
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(_mm256_mul_ps(p, r), r, _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}

__attribute__((target("avx2,fma"))) static void gelu_mul_row_avx2(const float *g, const float *u, float *y,
                                                                 int64_t n) {
    const __m256 k = _mm256_set1_ps(1.5957691216057308f), c = _mm256_set1_ps(0.044715f), one = _mm256_set1_ps(1.0f);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {  // the scalar loop's operations in its order, with exp8 for expf
        const __m256 x = _mm256_loadu_ps(g + i);
        const __m256 z = _mm256_mul_ps(_mm256_mul_ps(x, _mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(x, x), c), one)), k);
        const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), z));
        _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + i)));
    }
    for (; i < n; i++) y[i] = gelu_mul_scalar(g[i], u[i]);
}
#endif

// gelu_tanh(gate)·up in one pass, as a custom op: gelu_tanh(x) = 0.5·x·(1 + tanh(u)) = x·σ(2u),
// u = sqrt(2/π)·(x + 0.044715·x³), in plain f32 arithmetic with expf (exp8 on AVX2). ggml's own gelu goes through
// an fp16 lookup table (misses 1e-4); composing it from ggml's exact ops took seven passes over the activations.
static void gelu_mul_op(struct ggml_tensor *dst, int ith, int nth, void *userdata) {
    const struct ggml_tensor *gate = dst->src[0], *up = dst->src[1];
    const int64_t n = gate->ne[0], rows = ggml_nrows(gate);
#if defined(__x86_64__) && defined(__GNUC__)
    const bool avx2 = dg_cpu_isa() >= DG_ISA_AVX2;
#endif
    for (int64_t r = rows * ith / nth; r < rows * (ith + 1) / nth; r++) {
        const int64_t i1 = r % gate->ne[1], i2 = r / gate->ne[1] % gate->ne[2], i3 = r / gate->ne[1] / gate->ne[2];
#define ROW(t) ((char *)(t)->data + i1 * (t)->nb[1] + i2 * (t)->nb[2] + i3 * (t)->nb[3])
        const float *g = (const float *)ROW(gate), *u = (const float *)ROW(up);
        float *y = (float *)ROW(dst);
#undef ROW
#if defined(__x86_64__) && defined(__GNUC__)
        if (avx2) {
            gelu_mul_row_avx2(g, u, y, n);
            continue;
        }
#endif
        for (int64_t i = 0; i < n; i++) y[i] = gelu_mul_scalar(g[i], u[i]);
    }
}

// The same x·σ(z)·up from standard ops, z = x·(0.044715·x² + 1)·2·sqrt(2/π): exact f32 on every backend.
static struct ggml_tensor *gelu_mul_standard(struct ggml_context *ctx, struct ggml_tensor *gate,
                                             struct ggml_tensor *up) {
    const float k = 1.5957691216057308f;
    if (!ggml_is_contiguous(gate)) gate = ggml_cont(ctx, gate);  // unary ops on accelerators want contiguous rows
    if (!ggml_is_contiguous(up)) up = ggml_cont(ctx, up);
    struct ggml_tensor *z = ggml_mul(ctx, gate, ggml_scale_bias(ctx, ggml_sqr(ctx, gate), 0.044715f * k, k));
    return ggml_mul(ctx, ggml_mul(ctx, gate, ggml_sigmoid(ctx, z)), up);
}

struct ggml_tensor *dg_build_gelu_mul(struct ggml_context *ctx, struct ggml_tensor *gate, struct ggml_tensor *up,
                                     bool fast) {
    if (!fast) return gelu_mul_standard(ctx, gate, up);
    GGML_ASSERT(gate->type == GGML_TYPE_F32 && up->type == GGML_TYPE_F32 && ggml_are_same_shape(gate, up) &&
                gate->nb[0] == sizeof(float) && up->nb[0] == sizeof(float));
    struct ggml_tensor *args[2] = {gate, up};
    return ggml_custom_4d(ctx, GGML_TYPE_F32, gate->ne[0], gate->ne[1], gate->ne[2], gate->ne[3], args, 2, gelu_mul_op,
                          GGML_N_TASKS_MAX, NULL);
}

// cap·tanh(x / cap) = 2·cap·σ(2x / cap) − cap (the final logit softcap; same σ trick, absolute error ~2e-6).
// On the CPU as one pass with an 8-wide exp: ggml's sigmoid calls libm's expf element by element, which at
// 256 × 262,144 logits took 0.4 s of a step. With exp8 the scale, division and scale-bias are
// the same float operations as the three ggml ops.
#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx2,fma"))) static void softcap_row_avx2(const float *x, float *y, int64_t n, float cap) {
    const __m256 in = _mm256_set1_ps(2.0f / cap), out = _mm256_set1_ps(2.0f * cap), bias = _mm256_set1_ps(-cap);
    const __m256 one = _mm256_set1_ps(1.0f);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 t = _mm256_mul_ps(_mm256_loadu_ps(x + i), in);
        const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), t))));
        _mm256_storeu_ps(y + i, _mm256_add_ps(_mm256_mul_ps(sig, out), bias));
    }
    for (; i < n; i++) y[i] = 1.0f / (1.0f + expf(-(x[i] * (2.0f / cap)))) * (2.0f * cap) + -cap;
}

#endif

// dst = softcap of x: src[1] in place (src[0] is the destination), else src[0]
static void softcap_op(struct ggml_tensor *dst, int ith, int nth, void *userdata) {
    const struct ggml_tensor *x = dst->src[1] ? dst->src[1] : dst->src[0];
    float cap;
    memcpy(&cap, &userdata, sizeof cap);
    const int64_t n = x->ne[0], rows = ggml_nrows(x);
#if defined(__x86_64__) && defined(__GNUC__)
    const bool avx2 = dg_cpu_isa() >= DG_ISA_AVX2;
#endif
    for (int64_t r = rows * ith / nth; r < rows * (ith + 1) / nth; r++) {
        const float *xr = (const float *)((const char *)x->data + r * x->nb[1]);
        float *yr = (float *)((char *)dst->data + r * dst->nb[1]);
#if defined(__x86_64__) && defined(__GNUC__)
        if (avx2) {
            softcap_row_avx2(xr, yr, n, cap);
            continue;
        }
#endif
        for (int64_t i = 0; i < n; i++) yr[i] = 1.0f / (1.0f + expf(-(xr[i] * (2.0f / cap)))) * (2.0f * cap) + -cap;
    }
}

static struct ggml_tensor *softcap_standard(struct ggml_context *ctx, struct ggml_tensor *x, float cap) {
    return ggml_scale_bias(ctx, ggml_sigmoid(ctx, ggml_scale(ctx, x, 2.0f / cap)), 2.0f * cap, -cap);
}

struct ggml_tensor *dg_build_softcap(struct ggml_context *ctx, struct ggml_tensor *x, float cap, bool fast) {
    if (!(fast && x->type == GGML_TYPE_F32 && ggml_is_contiguous(x) && ggml_n_dims(x) <= 2))
        return softcap_standard(ctx, x, cap);
    void *userdata = NULL;
    memcpy(&userdata, &cap, sizeof cap);
    struct ggml_tensor *args[1] = {x};
    return ggml_custom_4d(ctx, GGML_TYPE_F32, x->ne[0], x->ne[1], 1, 1, args, 1, softcap_op, GGML_N_TASKS_MAX,
                          userdata);
}

// Writes the softcapped x into dst ([V, n] views alike). On the CPU (fast, dst in host memory) one pass straight into
// dst; otherwise ggml's three ops and a copy.
struct ggml_tensor *dg_build_softcap_into(struct ggml_context *ctx, struct ggml_tensor *x, float cap,
                                          struct ggml_tensor *dst, bool fast) {
    const struct ggml_tensor *base = dst->view_src ? dst->view_src : dst;  // a view gets its buffer when allocated
    const bool one_pass = fast && x->type == GGML_TYPE_F32 && dst->type == GGML_TYPE_F32 &&
                          ggml_are_same_shape(x, dst) && x->nb[0] == sizeof(float) && dst->nb[0] == sizeof(float) &&
                          ggml_n_dims(x) <= 2 && base->buffer && ggml_backend_buffer_is_host(base->buffer);
    if (!one_pass) return ggml_cpy(ctx, softcap_standard(ctx, x, cap), dst);
    void *userdata = NULL;
    memcpy(&userdata, &cap, sizeof cap);
    struct ggml_tensor *args[1] = {x};
    return ggml_custom_inplace(ctx, dst, args, 1, softcap_op, GGML_N_TASKS_MAX, userdata);
}

// ---------------------------------------------------------------------------------------------------------------
// dense weight products

struct ggml_tensor *dg_build_weight_matmul(struct ggml_context *ctx, struct ggml_tensor *w, struct ggml_tensor *x,
                                           bool fast) {
    if (!fast) return ggml_mul_mat(ctx, w, x);
    struct ggml_tensor *y = w->type == GGML_TYPE_F32 ? dg_build_f32_matmul(ctx, w, x)
                                                     : dg_build_qmatmul(ctx, w, x, dg_qk_default_path());
    return y ? y : ggml_mul_mat(ctx, w, x);
}
