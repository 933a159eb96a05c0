// Graph builders for one DiffusionGemma layer (docs/model.md#layer), shared by the encoder and the decoder.
//
// Exactness notes (each is covered by a test against transformers):
// - GELU (tanh form) and the logit softcap are computed in plain f32 (ops.c): ggml's gelu/geglu on the CPU go through
//   an fp16 lookup table, which misses 1e-4.
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

// The rows are read where the first layer runs: from the output device's copy of a tied embedding when layer 0
// shares that device (then only the ids cross to it, not [H, n] floats), else from the mapped file on the CPU.
struct ggml_tensor *dg_build_embed(struct ggml_context *ctx, const dg_model *m, struct ggml_tensor *ids) {
    const dg_placement *p = &m->place;
    const bool on_device = p->lm_head && p->unit_device[0] != 0 && p->unit_device[0] == p->unit_device[m->hp.n_layer];
    return ggml_scale(ctx, ggml_get_rows(ctx, on_device ? p->lm_head : m->tok_embd, ids), m->embd_scale);
}

struct ggml_tensor *dg_build_rmsw(struct ggml_context *ctx, const dg_model *m, struct ggml_tensor *x,
                                  struct ggml_tensor *w) {
    struct ggml_tensor *y = ggml_rms_norm(ctx, x, m->hp.rms_eps);
    return w ? ggml_mul(ctx, y, w) : y;
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
    return lora_matmul(ctx, &deltas[DG_LORA_DOWN], down, dg_build_gelu_mul(ctx, g, u, fast), fast);
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
    struct ggml_tensor *act = dg_build_gelu_mul(ctx, gate, up, fast);                       // [FFe, K, T]
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
    // off the CPU the products get contiguous operands: ggml's Vulkan backend rounds a non-contiguous one to f16
    if (!fast) keys = ggml_cont(ctx, keys);
    struct ggml_tensor *kq = ggml_mul_mat(ctx, keys, q);                    // [S, T, nh]; GQA by broadcast
    kq = ggml_soft_max_ext(ctx, kq, mask, 1.0f, 0.0f);
    struct ggml_tensor *vals = ggml_view_3d(ctx, vc, span.len, hd, nkv, vc->nb[1], vc->nb[1] * hd,
                                            (size_t)span.first * vc->nb[0]);  // [S, hd, nkv]
    if (!fast) vals = ggml_cont(ctx, vals);
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
