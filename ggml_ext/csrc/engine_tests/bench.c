// ggml matmul microbenchmark (bench/step.py): the rate ggml itself reaches on one weight shape and type, to judge
// how close a whole decoder step comes to it.
#define _POSIX_C_SOURCE 200809L  // clock_gettime under -std=c11
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cpu.h"
#include "engine.h"
#include "hooks.h"
#include "qkernels.h"

static double clock_s(clockid_t id) {
    struct timespec ts;
    clock_gettime(id, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

// ggml's CPU "repack" buffer type (weights interleaved at upload for its tiled kernels), or NULL when this ggml has
// none. llama.cpp uses it by default; the engine's mapped weights do not (bench/kernels.py measures the difference).
static ggml_backend_buffer_type_t cpu_repack_buft(void) {
    ggml_backend_dev_t cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    if (!cpu) return NULL;
    typedef ggml_backend_buffer_type_t *(*extra_bufts_fn)(ggml_backend_dev_t);
    extra_bufts_fn extra = (extra_bufts_fn)ggml_backend_reg_get_proc_address(ggml_backend_dev_backend_reg(cpu),
                                                                             "ggml_backend_dev_get_extra_bufts");
    for (ggml_backend_buffer_type_t *b = extra ? extra(cpu) : NULL; b && *b; b++) {
        if (strcmp(ggml_backend_buft_name(*b), "CPU_REPACK") == 0) return *b;
    }
    return NULL;
}

// Seconds per product (best of `reps`) of a [k, m] weight of `type` (n_expert > 0: [k, m, n_expert] experts used
// n_used at a time per token through mul_mat_id) with n F32 activation columns. engine_op: 0 ggml's op on a plain CPU
// buffer (how the engine maps weights); 1 the engine's own expert matmul / quantized product where it covers the
// type; 2 ggml's op on its CPU repack buffer (Q4_0, Q4_K, IQ4_NL). Returns < 0 on failure (-2: no repack for the type).
// *cpu_seconds: process CPU time of that best run (equals wall time at one thread on an idle machine; on a loaded
// machine it is the load-independent measure).
DG_API double dg_bench_mul_mat(int type, int64_t k, int64_t m, int64_t n, int n_expert, int n_used, int engine_op,
                               int n_threads, int reps, double *cpu_seconds, char *err, size_t err_len) {
    if (type < 0 || type >= GGML_TYPE_COUNT || k <= 0 || m <= 0 || n <= 0 || reps <= 0 || n_used > n_expert ||
        k % ggml_blck_size((enum ggml_type)type) != 0) {
        dg_set_err(err, err_len, "invalid benchmark shape or type");
        return -1;
    }
    const int n_mat = n_expert > 0 ? n_expert : 1;
    // the types whose repacked products ran here (Q6_K and Q8_0 weights in a repack buffer crashed this ggml's CPU
    // backend on these shapes, so they are not offered)
    const bool repackable = type == GGML_TYPE_Q4_0 || type == GGML_TYPE_Q4_K || type == GGML_TYPE_IQ4_NL;
    ggml_backend_buffer_type_t repack = engine_op == 2 && repackable ? cpu_repack_buft() : NULL;
    if (engine_op == 2 && !repack) {
        dg_set_err(err, err_len, "no CPU repack buffer type for %s in this ggml", ggml_type_name((enum ggml_type)type));
        return -2;
    }
    struct ggml_init_params ip = {ggml_tensor_overhead() * 8 + ggml_graph_overhead(), NULL, true};
    struct ggml_context *ctx = ggml_init(ip), *ctx_w = ggml_init(ip);
    ggml_backend_t backend = ggml_backend_cpu_init();
    ggml_backend_cpu_set_n_threads(backend, n_threads);
    struct ggml_tensor *w = ggml_new_tensor_3d(ctx_w, (enum ggml_type)type, k, m, n_mat);
    struct ggml_tensor *x = n_expert > 0 ? ggml_new_tensor_3d(ctx, GGML_TYPE_F32, k, 1, n)
                                         : ggml_new_tensor_2d(ctx, GGML_TYPE_F32, k, n);
    struct ggml_tensor *ids = n_expert > 0 ? ggml_new_tensor_2d(ctx, GGML_TYPE_I32, n_used, n) : NULL;
    struct ggml_tensor *y = n_expert == 0 ? (engine_op == 1 ? dg_build_weight_matmul(ctx, w, x, true) : NULL)
                           : engine_op == 1 ? dg_build_expert_matmul(ctx, w, x, ids)
                                            : ggml_mul_mat_id(ctx, w, x, ids);
    if (!y) y = ggml_mul_mat(ctx, w, x);
    struct ggml_cgraph *gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, y);
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, backend);
    ggml_backend_buffer_t buf_w = repack ? ggml_backend_alloc_ctx_tensors_from_buft(ctx_w, repack)
                                         : ggml_backend_alloc_ctx_tensors(ctx_w, backend);
    double best = -1;
    float *row = malloc(sizeof(float) * (size_t)k * 64);
    char *wq = malloc(ggml_nbytes(w));  // quantised here, then uploaded whole (a repack buffer interleaves on upload)
    if (!buf || !buf_w || !row || !wq) {
        dg_set_err(err, err_len, "out of memory");
        goto done;
    }
    if (repack) ggml_backend_buffer_set_usage(buf_w, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    uint64_t seed = 1;
    const int64_t rows = m * n_mat;
    for (int64_t r0 = 0; r0 < rows; r0 += 64) {  // random weights, quantised by ggml itself
        const int64_t nr = rows - r0 < 64 ? rows - r0 : 64;
        for (int64_t i = 0; i < nr * k; i++) row[i] = dg_rand_float(&seed);
        ggml_quantize_chunk((enum ggml_type)type, row, wq + r0 * w->nb[1], 0, nr, k, NULL);
    }
    ggml_backend_tensor_set(w, wq, 0, ggml_nbytes(w));
    for (int64_t i = 0; i < ggml_nelements(x); i++) ((float *)x->data)[i] = dg_rand_float(&seed);
    if (ids) {
        for (int64_t t = 0; t < n; t++) {  // n_used distinct experts per token
            int32_t *sel = (int32_t *)ids->data + t * n_used;
            for (int j = 0; j < n_used; j++) {
                int e;
                bool fresh;
                do {
                    e = (int)(dg_next_rand(&seed) % (uint64_t)n_expert);
                    fresh = true;
                    for (int q = 0; q < j; q++) fresh &= sel[q] != e;
                } while (!fresh);
                sel[j] = e;
            }
        }
    }
    ggml_backend_graph_compute(backend, gf);  // warm up
    for (int r = 0; r < reps; r++) {
        double t0 = clock_s(CLOCK_MONOTONIC), c0 = clock_s(CLOCK_PROCESS_CPUTIME_ID);
        ggml_backend_graph_compute(backend, gf);
        double dt = clock_s(CLOCK_MONOTONIC) - t0, dc = clock_s(CLOCK_PROCESS_CPUTIME_ID) - c0;
        if (best < 0 || dt < best) best = dt;
        if (cpu_seconds && (r == 0 || dc < *cpu_seconds)) *cpu_seconds = dc;
    }
done:
    free(row);
    free(wq);
    if (buf) ggml_backend_buffer_free(buf);
    if (buf_w) ggml_backend_buffer_free(buf_w);
    ggml_backend_free(backend);
    ggml_free(ctx);
    ggml_free(ctx_w);
    return best;
}

// Test hook: the engine's tiled F32 expert matmul (isa 1 = AVX2, 2 = AVX-512) against ggml_mul_mat_id on the same
// random data (w [kd, n, n_expert], x [kd, x1, t], n_used distinct experts per token). Returns max |Δ| / max |y|
// (relative to the output's scale); -1 for invalid arguments or no memory, -2 when this CPU lacks that instruction set.
DG_API double dg_check_expert_matmul(int64_t kd, int64_t n, int n_expert, int n_used, int64_t t, int x1, int n_threads,
                                     uint64_t seed, int isa) {
    if (kd < 1 || n < 1 || t < 1 || n_expert < 1 || n_used < 1 || n_used > n_expert || (x1 != 1 && x1 != n_used) ||
        isa < 1 || isa > 2)
        return -1;
    if (dg_expert_matmul_isa() < isa) return -2;
    struct ggml_init_params ip = {ggml_tensor_overhead() * 8 + ggml_graph_overhead(), NULL, true};
    struct ggml_context *ctx = ggml_init(ip);
    ggml_backend_t backend = ggml_backend_cpu_init();
    ggml_backend_buffer_t buf = NULL;
    double result = -1;
    if (!ctx || !backend) goto done;
    ggml_backend_cpu_set_n_threads(backend, n_threads);
    struct ggml_tensor *w = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, kd, n, n_expert);
    struct ggml_tensor *x = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, kd, x1, t);
    struct ggml_tensor *ids = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, n_used, t);
    struct ggml_tensor *tiled = dg_build_expert_matmul_isa(ctx, w, x, ids, isa);
    struct ggml_tensor *ref = ggml_mul_mat_id(ctx, w, x, ids);
    if (tiled->op != GGML_OP_CUSTOM) goto done;
    struct ggml_cgraph *gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, tiled);
    ggml_build_forward_expand(gf, ref);
    buf = ggml_backend_alloc_ctx_tensors(ctx, backend);
    if (!buf) goto done;
    for (int64_t i = 0; i < ggml_nelements(w); i++) ((float *)w->data)[i] = dg_rand_float(&seed);
    for (int64_t i = 0; i < ggml_nelements(x); i++) ((float *)x->data)[i] = dg_rand_float(&seed);
    for (int64_t r = 0; r < t; r++) {  // n_used distinct experts from a random start: uneven counts per expert
        const int start = (int)(dg_next_rand(&seed) % (uint64_t)n_expert);
        for (int k = 0; k < n_used; k++) ((int32_t *)ids->data)[r * n_used + k] = (start + k) % n_expert;
    }
    ggml_backend_graph_compute(backend, gf);
    result = dg_max_rel_diff(tiled->data, ref->data, ggml_nelements(ref));
done:
    if (buf) ggml_backend_buffer_free(buf);
    if (backend) ggml_backend_free(backend);
    if (ctx) ggml_free(ctx);
    return result;
}

// Test hook: the engine's F32 weight product (f32_matmul.c) against ggml_mul_mat on the same random data (w [kd, n],
// x [kd, t], rows of x `x_stride` floats apart, ≥ kd). isa: a dg_isa level (1 AVX2, 2 AVX-VNNI = AVX2, 3 AVX-512), or
// -1 for the level the engine dispatches (dg_cpu_isa()). Returns max |Δ| / max |y|; -1 for invalid arguments or no
// memory, -2 when the op does not apply on this CPU (or DGEMMA_CPU_ISA caps it below isa). *out (t·n floats, may be
// NULL) receives the op's result, so that a test can compare two paths bit for bit on the same inputs (same seed).
DG_API double dg_check_f32_matmul(int64_t kd, int64_t n, int64_t t, int64_t x_stride, int n_threads, uint64_t seed,
                                  int isa, float *out) {
    if (kd < 1 || n < 1 || t < 1 || x_stride < kd || n_threads < 1 || kd * n > ((int64_t)1 << 28) ||
        x_stride * t > ((int64_t)1 << 28) || isa < -1 || isa > DG_ISA_AVX512)
        return -1;
    struct ggml_init_params ip = {ggml_tensor_overhead() * 8 + ggml_graph_overhead(), NULL, true};
    struct ggml_context *ctx = ggml_init(ip);
    ggml_backend_t backend = ggml_backend_cpu_init();
    ggml_backend_buffer_t buf = NULL;
    double result = -1;
    if (!ctx || !backend) goto done;
    ggml_backend_cpu_set_n_threads(backend, n_threads);
    struct ggml_tensor *w = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, kd, n);
    struct ggml_tensor *xs = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, x_stride, t);
    struct ggml_tensor *x = ggml_view_2d(ctx, xs, kd, t, xs->nb[1], 0);  // strided rows, as a view of a wider tensor
    struct ggml_tensor *packed = isa < 0 ? dg_build_f32_matmul(ctx, w, x) : dg_build_f32_matmul_isa(ctx, w, x, isa);
    if (!packed) {
        result = -2;
        goto done;
    }
    struct ggml_tensor *ref = ggml_mul_mat(ctx, w, ggml_cont(ctx, x));
    struct ggml_cgraph *gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, packed);
    ggml_build_forward_expand(gf, ref);
    buf = ggml_backend_alloc_ctx_tensors(ctx, backend);
    if (!buf) goto done;
    for (int64_t i = 0; i < ggml_nelements(w); i++) ((float *)w->data)[i] = dg_rand_float(&seed);
    for (int64_t i = 0; i < ggml_nelements(xs); i++) ((float *)xs->data)[i] = dg_rand_float(&seed);
    ggml_backend_graph_compute(backend, gf);
    result = dg_max_rel_diff(packed->data, ref->data, ggml_nelements(ref));
    if (out) memcpy(out, packed->data, ggml_nbytes(packed));
done:
    if (buf) ggml_backend_buffer_free(buf);
    if (backend) ggml_backend_free(backend);
    if (ctx) ggml_free(ctx);
    return result;
}

// Test and bench hook for the soft-embedding op (soft_embedding.c): E [h, v] of `type` (random, quantised by ggml),
// P [v, n] random non-negative; isa a dg_isa level (0 portable, 1 AVX2, 2 AVX-VNNI = AVX2 here, 3 AVX-512). Returns
// max |Δ| / max |y| against a double-precision product with ggml's own dequantisation of E; -1 for invalid arguments
// or no memory, -2 when this CPU (or DGEMMA_CPU_ISA) does not allow that instruction set. reps > 0 also times the
// op: *seconds = best wall time of reps runs (after one warm-up). *out (n·h floats, may be NULL) receives the result,
// so that a test can compare two paths bit for bit on the same inputs (same seed).
DG_API double dg_check_soft_embedding(int type, int64_t v, int64_t h, int64_t n, int slices, int n_threads,
                                      uint64_t seed, int isa, int reps, double *seconds, float *out) {
    if (type < 0 || type >= GGML_TYPE_COUNT || v < 1 || h < 1 || n < 1 || slices < 1 || isa < 0 || isa > 3 ||
        h % ggml_blck_size((enum ggml_type)type) != 0 ||
        (type != GGML_TYPE_F32 && !ggml_get_type_traits((enum ggml_type)type)->to_float) ||
        v * h > ((int64_t)1 << 31) || v * n > ((int64_t)1 << 31))
        return -1;
    if (isa == DG_ISA_AVXVNNI) isa = DG_ISA_AVX2;  // the op has no AVX-VNNI path of its own
    if (dg_soft_embedding_isa() < isa) return -2;
    struct ggml_init_params ip = {ggml_tensor_overhead() * (size_t)(8 + 2 * slices) + ggml_graph_overhead(), NULL, true};
    struct ggml_context *ctx = ggml_init(ip);
    ggml_backend_t backend = ggml_backend_cpu_init();
    ggml_backend_buffer_t buf = NULL;
    float *row = NULL, *deq = NULL;
    double result = -1;
    if (!ctx || !backend) goto done;
    ggml_backend_cpu_set_n_threads(backend, n_threads);
    struct ggml_tensor *e = ggml_new_tensor_2d(ctx, (enum ggml_type)type, h, v);
    struct ggml_tensor *p = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, v, n);
    struct ggml_tensor *y = dg_build_soft_embedding(ctx, e, p, slices, isa);
    struct ggml_cgraph *gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, y);
    buf = ggml_backend_alloc_ctx_tensors(ctx, backend);
    row = malloc(sizeof(float) * (size_t)h);
    deq = malloc(sizeof(float) * (size_t)h);
    if (!buf || !row || !deq) goto done;
    for (int64_t r = 0; r < v; r++) {
        for (int64_t i = 0; i < h; i++) row[i] = dg_rand_float(&seed);
        if (type == GGML_TYPE_F32) memcpy((char *)e->data + r * e->nb[1], row, sizeof(float) * (size_t)h);
        else ggml_quantize_chunk((enum ggml_type)type, row, (char *)e->data + r * e->nb[1], 0, 1, h, NULL);
    }
    for (int64_t i = 0; i < ggml_nelements(p); i++) ((float *)p->data)[i] = 0.5f * (dg_rand_float(&seed) + 1.0f);
    ggml_backend_graph_compute(backend, gf);
    if (seconds) *seconds = -1;
    for (int r = 0; r < reps; r++) {
        double t0 = clock_s(CLOCK_MONOTONIC);
        ggml_backend_graph_compute(backend, gf);
        double dt = clock_s(CLOCK_MONOTONIC) - t0;
        if (seconds && (*seconds < 0 || dt < *seconds)) *seconds = dt;
    }
    double *ref = calloc((size_t)(h * n), sizeof(double));
    if (!ref) goto done;
    const ggml_to_float_t to_float = ggml_get_type_traits((enum ggml_type)type)->to_float;
    for (int64_t r = 0; r < v; r++) {
        const char *src = (const char *)e->data + r * e->nb[1];
        if (type == GGML_TYPE_F32) memcpy(deq, src, sizeof(float) * (size_t)h);
        else to_float(src, deq, h);
        for (int64_t t = 0; t < n; t++) {
            const double pv = ((float *)p->data)[t * v + r];
            for (int64_t i = 0; i < h; i++) ref[t * h + i] += pv * deq[i];
        }
    }
    double max_diff = 0, max_abs = 0;
    for (int64_t t = 0; t < n; t++) {
        const float *yr = (const float *)((const char *)y->data + t * y->nb[1]);
        if (out) memcpy(out + t * h, yr, sizeof(float) * (size_t)h);
        for (int64_t i = 0; i < h; i++) {
            const double a = yr[i], b = ref[t * h + i];
            max_diff = a != a ? INFINITY : fmax(max_diff, fabs(a - b));
            max_abs = fmax(max_abs, fabs(b));
        }
    }
    free(ref);
    result = max_abs > 0 ? max_diff / max_abs : max_diff;
done:
    free(row);
    free(deq);
    if (buf) ggml_backend_buffer_free(buf);
    if (backend) ggml_backend_free(backend);
    if (ctx) ggml_free(ctx);
    return result;
}

// Test hook: the soft-embedding op's row dequantizer for `type` (isa 0 portable, ≥ 1 AVX2: the AVX2 and AVX-512
// paths share it) against ggml's to_float on
// `n_blocks` blocks of random bytes (each block's fp16 scale a finite random value). Returns the number of elements
// whose bits differ; -1 for invalid arguments or no memory, -2 when this CPU lacks that instruction set.
DG_API int64_t dg_check_row_dequantizer(int type, int64_t n_blocks, int isa, uint64_t seed) {
    if ((type != GGML_TYPE_Q8_0 && type != GGML_TYPE_Q6_K) || n_blocks < 1 || n_blocks > 4096 || isa < 0 || isa > 3)
        return -1;
    if (dg_soft_embedding_isa() < (isa == DG_ISA_AVXVNNI ? DG_ISA_AVX2 : isa)) return -2;
    const int64_t blck = ggml_blck_size((enum ggml_type)type), k = blck * n_blocks;
    const size_t bytes = ggml_type_size((enum ggml_type)type) * (size_t)n_blocks;
    uint8_t *src = malloc(bytes);
    float *ours = malloc(sizeof(float) * (size_t)k), *theirs = malloc(sizeof(float) * (size_t)k);
    int64_t differ = -1;
    if (src && ours && theirs) {
        for (size_t i = 0; i < bytes; i++) src[i] = (uint8_t)dg_next_rand(&seed);
        const size_t scale_at = type == GGML_TYPE_Q8_0 ? 0 : 208;  // offset of the fp16 d inside one block
        for (int64_t b = 0; b < n_blocks; b++) {
            const ggml_fp16_t d = ggml_fp32_to_fp16(dg_rand_float(&seed) * 0.01f);
            memcpy(src + (size_t)b * ggml_type_size((enum ggml_type)type) + scale_at, &d, sizeof(d));
        }
        dg_row_dequantizer((enum ggml_type)type, isa >= DG_ISA_AVX2)(src, ours, k);
        ggml_get_type_traits((enum ggml_type)type)->to_float(src, theirs, k);
        differ = 0;
        for (int64_t i = 0; i < k; i++) differ += memcmp(ours + i, theirs + i, sizeof(float)) != 0;
    }
    free(src);
    free(ours);
    free(theirs);
    return differ;
}

// Test hook: the best instruction set the soft-embedding op runs on this CPU under DGEMMA_CPU_ISA (a dg_isa level:
// 0 portable, 1 AVX2 + FMA, 3 AVX-512).
DG_API int dg_check_soft_embedding_isa(void) { return dg_soft_embedding_isa(); }
