// Test hook of the quantized products (tests/test_engine_qkernels.py): one of the engine's kernels against ggml's own
// mul_mat_id / mul_mat on the same quantized weights and activations.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine.h"
#include "hooks.h"
#include "qkernels.h"

// Routing of token r's n_used slots. rows_per_expert > 0: tokens in consecutive groups of that many share their
// experts ((r / rows_per_expert) · n_used + k, mod n_expert), so each used expert gets exactly that many rows when
// n_expert divides evenly, the others none; 0: n_used distinct experts from a random start (uneven counts).
static void route(int32_t *ids, int64_t t, int n_expert, int n_used, int rows_per_expert, uint64_t *seed) {
    for (int64_t r = 0; r < t; r++) {
        const int64_t start = rows_per_expert > 0 ? (r / rows_per_expert) * n_used
                                                  : (int64_t)(dg_next_rand(seed) % (uint64_t)n_expert);
        for (int k = 0; k < n_used; k++) ids[r * n_used + k] = (int32_t)((start + k) % n_expert);
    }
}

// dg_check_qmatmul, or with compare_threads > 0 the number of outputs that differ between n_threads and compare_threads
static double check_qmatmul(int type, int64_t kd, int64_t n, int n_expert, int n_used, int64_t t, int x1,
                            int rows_per_expert, int n_threads, uint64_t seed, int path, int compare_threads) {
    const bool dense = n_expert == 0;
    if (type < 0 || type >= GGML_TYPE_COUNT || kd < 1 || n < 1 || t < 1 || n_expert < 0 || path < DG_QK_SCALAR ||
        path > DG_QK_AVX512 || n_threads < 1 || rows_per_expert < 0 ||
        (!dense && (n_used < 1 || n_used > n_expert || (x1 != 1 && x1 != n_used))))
        return -1;
    if (!dg_qk_path_available((dg_qk_path)path)) return -2;
    if (!dg_qk_supports((enum ggml_type)type, kd)) return -3;
    struct ggml_init_params ip = {ggml_tensor_overhead() * 16 + ggml_graph_overhead(), NULL, true};
    struct ggml_context *ctx = ggml_init(ip);
    ggml_backend_t backend = ggml_backend_cpu_init();
    ggml_backend_buffer_t buf = NULL;
    float *row = NULL;
    double result = -1;
    if (!ctx || !backend) goto done;
    ggml_backend_cpu_set_n_threads(backend, n_threads);
    struct ggml_tensor *w = ggml_new_tensor_3d(ctx, (enum ggml_type)type, kd, n, dense ? 1 : n_expert);
    struct ggml_tensor *x = dense ? ggml_new_tensor_2d(ctx, GGML_TYPE_F32, kd, t)
                                  : ggml_new_tensor_3d(ctx, GGML_TYPE_F32, kd, x1, t);
    struct ggml_tensor *ids = dense ? NULL : ggml_new_tensor_2d(ctx, GGML_TYPE_I32, n_used, t);
    struct ggml_tensor *ours = dense ? dg_build_qmatmul(ctx, w, x, (dg_qk_path)path)
                                     : dg_build_qexpert_matmul(ctx, w, x, ids, (dg_qk_path)path);
    if (!ours) {
        result = -3;
        goto done;
    }
    struct ggml_tensor *ref = dense ? ggml_mul_mat(ctx, w, x) : ggml_mul_mat_id(ctx, w, x, ids);
    struct ggml_cgraph *gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, ours);
    ggml_build_forward_expand(gf, ref);
    buf = ggml_backend_alloc_ctx_tensors(ctx, backend);
    row = malloc(sizeof(float) * (size_t)kd);
    if (!buf || !row) goto done;
    for (int64_t r = 0; r < ggml_nrows(w); r++) {
        for (int64_t i = 0; i < kd; i++) row[i] = dg_rand_float(&seed);
        ggml_quantize_chunk((enum ggml_type)type, row, (char *)w->data + r * w->nb[1], 0, 1, kd, NULL);
    }
    for (int64_t i = 0; i < ggml_nelements(x); i++) ((float *)x->data)[i] = dg_rand_float(&seed);
    if (ids) route(ids->data, t, n_expert, n_used, rows_per_expert, &seed);
    ggml_backend_graph_compute(backend, gf);
    result = dg_max_rel_diff(ours->data, ref->data, ggml_nelements(ref));
    if (compare_threads > 0) {  // the same product on compare_threads threads: every output bit for bit
        const size_t bytes = ggml_nbytes(ours);
        float *first = malloc(bytes);
        if (!first) goto done;
        memcpy(first, ours->data, bytes);
        ggml_backend_cpu_set_n_threads(backend, compare_threads);
        ggml_backend_graph_compute(backend, gf);
        int64_t differ = 0;
        for (int64_t i = 0; i < ggml_nelements(ours); i++) differ += memcmp(first + i, (float *)ours->data + i, 4) != 0;
        free(first);
        result = (double)differ;
    }
done:
    free(row);
    if (buf) ggml_backend_buffer_free(buf);
    if (backend) ggml_backend_free(backend);
    if (ctx) ggml_free(ctx);
    return result;
}

// w [kd, n, n_expert] of `type` (quantized by ggml from random floats), x [kd, x1, t] F32; n_expert = 0: a dense
// [kd, n] weight and x [kd, t]. Returns max |Δ| / max |y| of the engine's product on `path` against ggml's; -1 for
// invalid arguments or no memory, -2 when this CPU lacks the path, -3 when the path has no kernel for the type/shape.
DG_API double dg_check_qmatmul(int type, int64_t kd, int64_t n, int n_expert, int n_used, int64_t t, int x1,
                               int rows_per_expert, int n_threads, uint64_t seed, int path) {
    return check_qmatmul(type, kd, n, n_expert, n_used, t, x1, rows_per_expert, n_threads, seed, path, 0);
}

// The same product on n_threads and on other_threads threads: the number of outputs whose bits differ (-1, -2, -3 as
// above).
DG_API double dg_check_qmatmul_threads(int type, int64_t kd, int64_t n, int n_expert, int n_used, int64_t t,
                                       int n_threads, int other_threads, uint64_t seed, int path) {
    if (other_threads < 1) return -1;
    return check_qmatmul(type, kd, n, n_expert, n_used, t, 1, 0, n_threads, seed, path, other_threads);
}
