// Graph builders for one DiffusionGemma layer (docs/model.md#layer), shared by the encoder and the decoder.
//
// Exactness notes (each is covered by a test against transformers):
// - GELU (tanh form) is computed in plain f32 (x·σ(2u), fused with the ·up product; on AVX2 with an 8-wide exp
//   within 2 ulp of expf): ggml's gelu/geglu on the CPU go through an fp16 lookup table, which misses 1e-4.
// - Two forms of the same arithmetic: the fast one with CPU-only custom ops (fused GELU, tiled F32 experts, packed
//   F32 weight products) for nodes that run on the CPU, and a standard-op one (what any ggml backend runs) for
//   nodes placed on an accelerator, or everywhere with DGEMMA_STANDARD_OPS (docs/engine.md#devices).
// - RoPE is NEOX with n_dims = head_dim; full layers get the partial rotary through `rope_freqs` factors.
// - Attention scale is 1.0 (q and k are RMS-normalised instead).
// - LoRA adapters (lora.c) add b·(a·x) to a weight's matmul, with the encoder's or the decoder's delta by pass; the
//   base matmul keeps its fast kernel, the delta is ggml's F32 matmul (any backend).
#include <math.h>
#include <string.h>

#include "engine.h"
#include "qkernels.h"

struct ggml_tensor *dg_build_rmsw(struct ggml_context *ctx, const dg_model *m, struct ggml_tensor *x,
                                  struct ggml_tensor *w) {
    struct ggml_tensor *y = ggml_rms_norm(ctx, x, m->hp.rms_eps);
    return w ? ggml_mul(ctx, y, w) : y;
}

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
    const bool avx2 = dg_qk_path_available(DG_QK_AVX2);  // the quantized kernels' CPU check
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

static struct ggml_tensor *gelu_mul(struct ggml_context *ctx, struct ggml_tensor *gate, struct ggml_tensor *up,
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

// dst (src[0], the destination written in place) = softcap of src[1]
static void softcap_op(struct ggml_tensor *dst, int ith, int nth, void *userdata) {
    const struct ggml_tensor *x = dst->src[1];
    float cap;
    memcpy(&cap, &userdata, sizeof cap);
    const int64_t n = x->ne[0], rows = ggml_nrows(x);
#if defined(__x86_64__) && defined(__GNUC__)
    const bool avx2 = dg_qk_path_available(DG_QK_AVX2);  // the quantized kernels' CPU check
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

// Writes the softcapped x into dst ([V, n] views alike). On the CPU (fast, dst in host memory) one pass straight into
// dst; otherwise ggml's three ops and a copy.
struct ggml_tensor *dg_build_softcap_into(struct ggml_context *ctx, struct ggml_tensor *x, float cap,
                                          struct ggml_tensor *dst, bool fast) {
    const struct ggml_tensor *base = dst->view_src ? dst->view_src : dst;  // a view gets its buffer when allocated
    const bool one_pass = fast && x->type == GGML_TYPE_F32 && dst->type == GGML_TYPE_F32 &&
                          ggml_are_same_shape(x, dst) && x->nb[0] == sizeof(float) && dst->nb[0] == sizeof(float) &&
                          ggml_n_dims(x) <= 2 && base->buffer && ggml_backend_buffer_is_host(base->buffer);
    if (!one_pass)
        return ggml_cpy(ctx, ggml_scale_bias(ctx, ggml_sigmoid(ctx, ggml_scale(ctx, x, 2.0f / cap)), 2.0f * cap, -cap),
                        dst);
    void *userdata = NULL;
    memcpy(&userdata, &cap, sizeof cap);
    struct ggml_tensor *args[1] = {x};
    return ggml_custom_inplace(ctx, dst, args, 1, softcap_op, GGML_N_TASKS_MAX, userdata);
}

// w·x plus an adapters' delta b·(a·x) (x: [n_in, T]); d NULL or empty: w·x alone
static struct ggml_tensor *lora_matmul(struct ggml_context *ctx, const dg_lora *d, struct ggml_tensor *w,
                                       struct ggml_tensor *x, bool fast) {
    struct ggml_tensor *y = dg_build_weight_matmul(ctx, w, x, fast);
    if (!d->a) return y;
    return ggml_add(ctx, y, ggml_mul_mat(ctx, d->b, ggml_mul_mat(ctx, d->a, x)));
}

// a layer weight's matmul with its adapters' delta in this pass
static struct ggml_tensor *adapted_matmul(struct ggml_context *ctx, const dg_layer *L, int pass, int target,
                                          struct ggml_tensor *w, struct ggml_tensor *x, bool fast) {
    return lora_matmul(ctx, &L->lora[pass][target], w, x, fast);
}

// gated MLP whose three matmuls carry the deltas deltas[DG_LORA_GATE / UP / DOWN]
static struct ggml_tensor *lora_gated_mlp(struct ggml_context *ctx, const dg_lora *deltas, struct ggml_tensor *x,
                                          struct ggml_tensor *gate, struct ggml_tensor *up, struct ggml_tensor *down,
                                          bool fast) {
    struct ggml_tensor *g = lora_matmul(ctx, &deltas[DG_LORA_GATE], gate, x, fast);
    struct ggml_tensor *u = lora_matmul(ctx, &deltas[DG_LORA_UP], up, x, fast);
    return lora_matmul(ctx, &deltas[DG_LORA_DOWN], down, gelu_mul(ctx, g, u, fast), fast);
}

struct ggml_tensor *dg_build_self_cond_mlp(struct ggml_context *ctx, const dg_model *m, struct ggml_tensor *x) {
    return lora_gated_mlp(ctx, m->sc_lora, x, m->sc_gate, m->sc_up, m->sc_down, dg_unit_fast(m, m->hp.n_layer));
}

// Experts on the CPU take the fast kernels (expert_matmul.c); anywhere else ggml's own mul_mat_id, which every
// backend has: a CPU kernel must never be handed weights that live in another device's memory. An adapter's
// per-expert delta goes through mul_mat_id twice: a_e·x, then b_e·(…) for the routed expert e of each row.
static struct ggml_tensor *expert_matmul(struct ggml_context *ctx, const dg_layer *L, int pass, int target,
                                         struct ggml_tensor *w, struct ggml_tensor *x, struct ggml_tensor *ids,
                                         bool fast) {
    struct ggml_tensor *y = fast ? dg_build_expert_matmul(ctx, w, x, ids) : ggml_mul_mat_id(ctx, w, x, ids);
    const dg_lora *d = &L->lora[pass][target];
    if (!d->a) return y;
    return ggml_add(ctx, y, ggml_mul_mat_id(ctx, d->b, ggml_mul_mat_id(ctx, d->a, x, ids), ids));
}

// Router on the raw residual, experts on pre_feedforward_layernorm_2(a) (docs/model.md#mlp-and-moe-routing). a: [H, T]
static struct ggml_tensor *build_moe(struct ggml_context *ctx, const dg_model *m, int il, int pass,
                                     struct ggml_tensor *a) {
    const dg_layer *L = &m->layers[il];
    const bool fast = dg_experts_fast(m, il);
    const int64_t H = m->hp.n_embd, E = m->hp.n_expert, K = m->hp.n_expert_used, FFe = m->hp.n_ff_exp;
    const int64_t T = a->ne[1];

    struct ggml_tensor *r = ggml_mul(ctx, ggml_rms_norm(ctx, a, m->hp.rms_eps), L->router_scale);
    r = ggml_scale(ctx, r, 1.0f / sqrtf((float)H));
    struct ggml_tensor *logits = adapted_matmul(ctx, L, pass, DG_LORA_ROUTER, L->router, r, false);  // ggml's matmul
    struct ggml_tensor *probs = ggml_soft_max(ctx, logits);  // [E, T], softmax before top-k
    struct ggml_tensor *idx = ggml_top_k(ctx, probs, (int)K);  // [K, T], contiguous, order irrelevant

    struct ggml_tensor *w = ggml_get_rows(ctx, ggml_reshape_3d(ctx, probs, 1, E, T), idx);  // [1, K, T]
    w = ggml_reshape_2d(ctx, w, K, T);
    w = ggml_div(ctx, w, ggml_sum_rows(ctx, w));  // renormalise the K weights
    struct ggml_tensor *pes = ggml_get_rows(ctx, ggml_reshape_2d(ctx, L->expert_scale, 1, E),
                                            ggml_reshape_1d(ctx, idx, K * T));  // [1, K*T]
    w = ggml_mul(ctx, w, ggml_reshape_2d(ctx, pes, K, T));  // per-expert scale after renormalisation
    w = ggml_reshape_3d(ctx, w, 1, K, T);

    struct ggml_tensor *xe = ggml_reshape_3d(ctx, dg_build_rmsw(ctx, m, a, L->pre_ffw_norm_2), H, 1, T);
    struct ggml_tensor *gate, *up;
    if (L->gate_up_exps) {
        // fused [H, 2·FFe, E]: output rows [0, FFe) are gate, [FFe, 2·FFe) are up
        struct ggml_tensor *gu = expert_matmul(ctx, L, pass, DG_LORA_GATE_UP_EXPS, L->gate_up_exps, xe, idx, fast);
        gate = ggml_view_3d(ctx, gu, FFe, K, T, gu->nb[1], gu->nb[2], 0);
        up = ggml_view_3d(ctx, gu, FFe, K, T, gu->nb[1], gu->nb[2], FFe * ggml_element_size(gu));
    } else {
        gate = expert_matmul(ctx, L, pass, DG_LORA_GATE_EXPS, L->gate_exps, xe, idx, fast);
        up = expert_matmul(ctx, L, pass, DG_LORA_UP_EXPS, L->up_exps, xe, idx, fast);
    }
    struct ggml_tensor *act = gelu_mul(ctx, gate, up, fast);                                // [FFe, K, T]
    struct ggml_tensor *y = expert_matmul(ctx, L, pass, DG_LORA_DOWN_EXPS, L->down_exps, act, idx, fast);  // [H, K, T]
    y = ggml_mul(ctx, y, w);

    struct ggml_tensor *out = ggml_view_2d(ctx, y, H, T, y->nb[2], 0);
    for (int64_t k = 1; k < K; k++) {
        out = ggml_add(ctx, out, ggml_view_2d(ctx, y, H, T, y->nb[2], k * y->nb[1]));
    }
    return out;
}

// Attention for T rows at cache slots [slot0, slot0+T): their K/V are stored in the cache first, then the rows attend
// to the slots [span.first, span.first + span.len). mask: [span.len, T] or NULL (decoder: no mask at all).
// Attention of several candidate canvases, each over the cached context and its own rows only. Each candidate's
// keys and values are gathered into [context | own rows | zeros], the layout one canvas alone attends to (`span`), so
// a candidate computes what it would alone, and the cost grows with the number of candidates, not its square.
// kc: K cache [hd, nkv, slot]; vc: transposed V cache [slot, hd * nkv]; q: [hd, T, nh] with T = canvases * R rows,
// whose K/V sit in consecutive slots from slot0; mask: [span.len, R] (NULL: nothing to hide). Returns [hd * nh, T].
static struct ggml_tensor *attend_per_canvas(struct ggml_context *ctx, struct ggml_tensor *kc, struct ggml_tensor *vc,
                                             struct ggml_tensor *q, struct ggml_tensor *mask, int slot0,
                                             dg_attn_span span) {
    const int64_t hd = q->ne[0], nh = q->ne[2], nkv = kc->ne[1], N = span.canvases, R = q->ne[1] / N;
    const int64_t n_context = span.len - span.tail - R;  // context slots, leading padding included
    struct ggml_tensor *context_k = ggml_view_4d(ctx, kc, hd, n_context, 1, nkv, kc->nb[2], kc->nb[2] * n_context,
                                                 kc->nb[1], (size_t)span.first * kc->nb[2]);
    struct ggml_tensor *own_k = ggml_view_4d(ctx, kc, hd, R, N, nkv, kc->nb[2], kc->nb[2] * R, kc->nb[1],
                                             (size_t)slot0 * kc->nb[2]);
    struct ggml_tensor *keys = ggml_concat(ctx, ggml_repeat_4d(ctx, context_k, hd, n_context, N, nkv), own_k, 1);
    keys = ggml_pad(ctx, keys, 0, span.tail, 0, 0);  // [hd, S, N, nkv]

    struct ggml_tensor *context_v = ggml_view_4d(ctx, vc, n_context, hd, 1, nkv, vc->nb[1], vc->nb[1] * hd * nkv,
                                                 vc->nb[1] * hd, (size_t)span.first * vc->nb[0]);
    struct ggml_tensor *own_v = ggml_view_4d(ctx, vc, R, hd, N, nkv, vc->nb[1], vc->nb[0] * R, vc->nb[1] * hd,
                                             (size_t)slot0 * vc->nb[0]);
    struct ggml_tensor *vals = ggml_concat(ctx, ggml_repeat_4d(ctx, context_v, n_context, hd, N, nkv), own_v, 0);
    vals = ggml_pad(ctx, vals, span.tail, 0, 0, 0);  // [S, hd, N, nkv]

    struct ggml_tensor *kq = ggml_mul_mat(ctx, keys, ggml_reshape_4d(ctx, q, hd, R, N, nh));  // [S, R, N, nh]
    kq = ggml_soft_max_ext(ctx, ggml_reshape_3d(ctx, kq, span.len, R, N * nh), mask, 1.0f, 0.0f);
    struct ggml_tensor *kqv = ggml_mul_mat(ctx, vals, ggml_reshape_4d(ctx, kq, span.len, R, N, nh));  // [hd, R, N, nh]
    return ggml_cont_2d(ctx, ggml_permute(ctx, kqv, 0, 2, 3, 1), hd * nh, N * R);  // [hd, nh, R, N] -> rows
}

static struct ggml_tensor *build_attention(struct ggml_context *ctx, struct ggml_cgraph *gf, const dg_model *m,
                                           const dg_context *c, int il, struct ggml_tensor *h,
                                           struct ggml_tensor *pos, struct ggml_tensor *mask, int slot0,
                                           dg_attn_span span, int pass, bool kv_only) {
    const dg_layer *L = &m->layers[il];
    const int64_t hd = L->head_dim, nkv = L->n_head_kv, nh = m->hp.n_head, T = h->ne[1];
    const float base = L->sliding ? m->hp.rope_base_swa : m->hp.rope_base_full;
    struct ggml_tensor *freq_factors = L->sliding ? NULL : m->rope_freqs;
    const int n_ctx_orig = m->hp.n_ctx_train;
    const bool fast = dg_unit_fast(m, il);  // the layer's weights are in CPU memory: the engine's kernels may read them

    struct ggml_tensor *kr = ggml_reshape_3d(ctx, adapted_matmul(ctx, L, pass, DG_LORA_K, L->wk, h, fast), hd, nkv, T);
    struct ggml_tensor *vr =
        L->wv ? ggml_reshape_3d(ctx, adapted_matmul(ctx, L, pass, DG_LORA_V, L->wv, h, fast), hd, nkv, T) : kr;
    struct ggml_tensor *k = dg_build_rmsw(ctx, m, kr, L->k_norm);
    k = ggml_rope_ext(ctx, k, pos, freq_factors, (int)hd, GGML_ROPE_TYPE_NEOX, n_ctx_orig, base, 1.0f, 0.0f, 1.0f,
                      0.0f, 0.0f);
    struct ggml_tensor *v = ggml_rms_norm(ctx, vr, m->hp.rms_eps);  // weight-less, no RoPE

    // store: K as [hd, nkv, slot], V transposed as [slot, hd, nkv] so that P·V needs no copy
    struct ggml_tensor *kc = c->k_cache[il], *vc = c->v_cache[il];
    struct ggml_tensor *k_dst = ggml_view_3d(ctx, kc, hd, nkv, T, kc->nb[1], kc->nb[2], (size_t)slot0 * kc->nb[2]);
    ggml_build_forward_expand(gf, ggml_cpy(ctx, k, k_dst));
    struct ggml_tensor *v_dst = ggml_view_2d(ctx, vc, T, hd * nkv, vc->nb[1], (size_t)slot0 * vc->nb[0]);
    ggml_build_forward_expand(gf, ggml_cpy(ctx, ggml_transpose(ctx, ggml_reshape_2d(ctx, v, hd * nkv, T)), v_dst));
    if (kv_only) return NULL;

    struct ggml_tensor *q = ggml_reshape_3d(ctx, adapted_matmul(ctx, L, pass, DG_LORA_Q, L->wq, h, fast), hd, nh, T);
    q = dg_build_rmsw(ctx, m, q, L->q_norm);
    q = ggml_rope_ext(ctx, q, pos, freq_factors, (int)hd, GGML_ROPE_TYPE_NEOX, n_ctx_orig, base, 1.0f, 0.0f, 1.0f,
                      0.0f, 0.0f);
    q = ggml_cont(ctx, ggml_permute(ctx, q, 0, 2, 1, 3));  // [hd, T, nh]; contiguous so ggml can use its sgemm

    if (span.canvases > 1) return adapted_matmul(ctx, L, pass, DG_LORA_O, L->wo,
                                                 attend_per_canvas(ctx, kc, vc, q, mask, slot0, span), fast);

    struct ggml_tensor *keys = ggml_view_3d(ctx, kc, hd, span.len, nkv, kc->nb[2], kc->nb[1],
                                            (size_t)span.first * kc->nb[2]);  // [hd, S, nkv]
    struct ggml_tensor *kq = ggml_mul_mat(ctx, keys, q);                    // [S, T, nh]; GQA by broadcast
    kq = ggml_soft_max_ext(ctx, kq, mask, 1.0f, 0.0f);
    struct ggml_tensor *vals = ggml_view_3d(ctx, vc, span.len, hd, nkv, vc->nb[1], vc->nb[1] * hd,
                                            (size_t)span.first * vc->nb[0]);  // [S, hd, nkv]
    struct ggml_tensor *kqv = ggml_mul_mat(ctx, vals, kq);                      // [hd, T, nh]
    struct ggml_tensor *out = ggml_cont_2d(ctx, ggml_permute(ctx, kqv, 0, 2, 1, 3), hd * nh, T);
    return adapted_matmul(ctx, L, pass, DG_LORA_O, L->wo, out, fast);
}

// One layer (docs/model.md#block-assembly). Encoder: causal mask + encoder λ; decoder: no mask + decoder λ.
// kv_only: the encoder's last layer, whose output nothing reads; only its K/V are stored.
struct ggml_tensor *dg_build_layer(struct ggml_context *ctx, struct ggml_cgraph *gf, const dg_model *m,
                                   const dg_context *c, int il, struct ggml_tensor *x, struct ggml_tensor *pos,
                                   struct ggml_tensor *mask, int slot0, dg_attn_span span, bool encoder,
                                   bool kv_only) {
    const dg_layer *L = &m->layers[il];
    const int pass = encoder ? DG_PASS_ENCODER : DG_PASS_DECODER;
    struct ggml_tensor *h = dg_build_rmsw(ctx, m, x, L->attn_norm);
    struct ggml_tensor *o = build_attention(ctx, gf, m, c, il, h, pos, mask, slot0, span, pass, kv_only);
    if (kv_only) return NULL;
    struct ggml_tensor *a = ggml_add(ctx, x, dg_build_rmsw(ctx, m, o, L->post_attn_norm));

    struct ggml_tensor *u = dg_build_rmsw(ctx, m, a, L->ffn_norm);
    struct ggml_tensor *mlp = lora_gated_mlp(ctx, L->lora[pass], u, L->ffn_gate, L->ffn_up, L->ffn_down,
                                             dg_unit_fast(m, il));
    struct ggml_tensor *h1 = dg_build_rmsw(ctx, m, mlp, L->post_ffw_norm_1);
    struct ggml_tensor *h2 = dg_build_rmsw(ctx, m, build_moe(ctx, m, il, pass, a), L->post_ffw_norm_2);
    struct ggml_tensor *y = ggml_add(ctx, a, dg_build_rmsw(ctx, m, ggml_add(ctx, h1, h2), L->post_ffw_norm));
    return ggml_mul(ctx, y, encoder ? L->enc_scale : L->dec_scale);
}
