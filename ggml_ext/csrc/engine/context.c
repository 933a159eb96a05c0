// A generation context's lifecycle and how its graphs run: backends and the scheduler, the K/V cache and logits
// buffers (allocated here, managed by kv_cache.c and decoder.c), placing and computing a graph, per-node profiling.
// The passes themselves are encoder.c and decoder.c.
#define _POSIX_C_SOURCE 200809L  // clock_gettime, sysconf under -std=c11
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cpu.h"
#include "engine.h"
#include "gguf_names.h"

size_t dg_graph_nodes(const dg_model *m) {
    // 1024: embedding, self-conditioning (its top-k gather: up to 8 nodes per chunk), LM head, sampling reductions;
    // the dense soft embedding adds a view and an add per vocabulary slice, one slice per thread
    const size_t slices = m->n_threads > 1 ? (size_t)m->n_threads : 1;
    return 1024 + 2 * slices + (size_t)m->hp.n_layer * (128 + 4 * (size_t)m->hp.n_expert_used) +
           (size_t)m->lora_graph_nodes;
}

struct ggml_context *dg_new_graph_ctx(const dg_model *m) {
    const size_t n = dg_graph_nodes(m);
    struct ggml_init_params ip = {ggml_tensor_overhead() * n * 2 + ggml_graph_overhead_custom(n, false), NULL, true};
    return ggml_init(ip);
}

// Place a graph with the scheduler: every node on a device, split inputs copied, compute buffers allocated. A graph
// may have been placed before in buffers that have since been re-planned for another graph, so its compute tensors
// are detached first and placed again. Custom ops (fused GELU, tiled experts) are CPU code: pinned to the CPU; pins
// name other nodes' devices.
bool dg_place_graph(dg_context *c, struct ggml_context *gctx, struct ggml_cgraph *gf, const dg_pin *pins, int n_pins,
                    char *err, size_t err_len) {
    for (struct ggml_tensor *t = ggml_get_first_tensor(gctx); t; t = ggml_get_next_tensor(gctx, t)) {
        t->data = NULL;
        t->buffer = NULL;
    }
    ggml_backend_sched_reset(c->sched);
    for (int i = 0; i < ggml_graph_n_nodes(gf); i++) {
        struct ggml_tensor *node = ggml_graph_node(gf, i);
        if (node->op == GGML_OP_CUSTOM) ggml_backend_sched_set_tensor_backend(c->sched, node, c->backends[0]);
    }
    for (int i = 0; i < n_pins; i++) {  // an op the device lacks is left to the scheduler (it runs on the CPU)
        ggml_backend_t b = c->backends[pins[i].device];
        if (pins[i].t->op != GGML_OP_CUSTOM && ggml_backend_supports_op(b, pins[i].t))
            ggml_backend_sched_set_tensor_backend(c->sched, pins[i].t, b);
    }
    if (!ggml_backend_sched_alloc_graph(c->sched, gf)) {
        dg_set_err(err, err_len, "cannot allocate the compute graph (out of memory)");
        return false;
    }
    return true;
}

static bool computes(const struct ggml_tensor *t) {
    switch (t->op) {
        case GGML_OP_NONE: case GGML_OP_VIEW: case GGML_OP_RESHAPE: case GGML_OP_PERMUTE: case GGML_OP_TRANSPOSE:
            return false;
        default:
            return true;
    }
}

// Why a computing node runs on the CPU although accelerators are in use: a custom op is CPU code; an op no
// accelerator supports; else the scheduler's choice, which follows where the node's weights and inputs are (a unit
// placed on the CPU, or a CPU weight such as the mapped embedding read by a unit on a device).
static const char *cpu_reason(const dg_context *c, const struct ggml_tensor *t) {
    if (t->op == GGML_OP_CUSTOM) return "custom op (a CPU kernel)";
    for (int d = 1; d < c->model->place.n_devices; d++) {
        if (ggml_backend_supports_op(c->backends[d], t)) return "weights or inputs on the CPU";
    }
    return "no accelerator supports it";
}

void dg_graph_report(const dg_context *c, struct ggml_cgraph *gf, char *out, size_t out_len) {
    const int splits = ggml_backend_sched_get_n_splits(c->sched);
    enum { KINDS = 64 };
    const char *ops[KINDS], *reasons[KINDS];
    int counts[KINDS], n_kinds = 0;
    for (int i = 0; c->model->place.n_devices > 1 && i < ggml_graph_n_nodes(gf); i++) {
        struct ggml_tensor *t = ggml_graph_node(gf, i);
        if (!computes(t) || ggml_backend_sched_get_tensor_backend(c->sched, t) != c->backends[0]) continue;
        const char *op = ggml_op_desc(t), *reason = cpu_reason(c, t);
        int k = 0;
        while (k < n_kinds && (strcmp(ops[k], op) != 0 || strcmp(reasons[k], reason) != 0)) k++;
        if (k == n_kinds) {
            if (n_kinds == KINDS) continue;
            ops[k] = op, reasons[k] = reason, counts[k] = 0, n_kinds++;
        }
        counts[k]++;
    }
    size_t used = (size_t)snprintf(out, out_len, "splits\t%d\n", splits);
    for (int k = 0; k < n_kinds && used < out_len; k++) {
        used += (size_t)snprintf(out + used, out_len - used, "%s\t%s\t%d\n", ops[k], reasons[k], counts[k]);
    }
}

static bool run_graph(dg_context *c, struct ggml_cgraph *gf, char *err, size_t err_len) {
    const unsigned int fp_mode = dg_fp_enter_fast();  // flush subnormal attention probabilities (cpu.c)
    const enum ggml_status status = ggml_backend_sched_graph_compute(c->sched, gf);
    dg_fp_leave(fp_mode);
    if (status != GGML_STATUS_SUCCESS) {
        dg_set_err(err, err_len, "ggml graph computation failed");
        return false;
    }
    return true;
}

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static bool is_weight(const struct ggml_tensor *t) {
    return t->buffer && ggml_backend_buffer_get_usage(t->buffer) == GGML_BACKEND_BUFFER_USAGE_WEIGHTS;
}

static bool starts_with(const char *s, const char *prefix) { return strncmp(s, prefix, strlen(prefix)) == 0; }

// The class of a node by the weight it reads (activation quantization nodes carry their weight's name).
static dg_profile_class profile_class(const struct ggml_tensor *node, int64_t n_vocab) {
    const char *w = NULL;
    for (int i = 0; i < GGML_MAX_SRC && node->src[i] && !w; i++)
        if (is_weight(node->src[i]) && ggml_nelements(node->src[i]) > node->src[i]->ne[0]) w = node->src[i]->name;
    // only the output product quantizes for token_embd
    const bool quantizes = !w && strstr(node->name, DG_WEIGHT_SUFFIX);
    if (quantizes) w = node->name;
    if (w && node->op != GGML_OP_GET_ROWS) {
        if (strstr(w, DG_EXPERTS_MARK)) return DG_PROFILE_EXPERTS;
        if (strstr(w, DG_SELF_COND_PREFIX)) return DG_PROFILE_SELF_COND;
        if (starts_with(w, DG_STEM_TOKEN_EMBD) || starts_with(w, DG_STEM_OUTPUT "."))
            return quantizes || node->ne[0] == n_vocab ? DG_PROFILE_LM_HEAD : DG_PROFILE_SELF_COND;  // soft embedding
        if (starts_with(w, DG_BLOCK_PREFIX)) return DG_PROFILE_DENSE;
    }
    if (node->ne[0] == n_vocab) return node->op == GGML_OP_SOFT_MAX ? DG_PROFILE_SELF_COND : DG_PROFILE_LM_HEAD;
    if (node->op == GGML_OP_MUL_MAT || node->op == GGML_OP_SOFT_MAX) return DG_PROFILE_ATTENTION;
    return DG_PROFILE_OTHER;
}

// The scheduler computes a node on its own when this callback asks to observe it (ask), then hands it over: the time
// in between is the node's wall time (with its split's input copies, on the first node of a split).
static bool profile_node(struct ggml_tensor *node, bool ask, void *user) {
    dg_context *c = user;
    if (ask) {
        c->profile_t0 = now_s();
        return true;
    }
    const double dt = now_s() - c->profile_t0;
    const dg_profile_class cls = profile_class(node, c->model->hp.n_vocab);
    c->profile[cls] += dt;
    if (getenv("DGEMMA_PROFILE_NODES")) {  // one line per node, for bench notes
        const struct ggml_tensor *a = node->src[0] ? node->src[0] : node;
        fprintf(stderr, "class %d %s %s: %s [%lld,%lld,%lld] -> [%lld,%lld,%lld] %.6f s\n", (int)cls,
                ggml_op_desc(node), node->name, ggml_type_name(a->type), (long long)a->ne[0], (long long)a->ne[1],
                (long long)a->ne[2], (long long)node->ne[0], (long long)node->ne[1], (long long)node->ne[2], dt);
    }
    return true;
}

// With profile (bench/real_shapes.py) the graph runs node by node, adding each node's wall time to its class.
bool dg_compute(dg_context *c, struct ggml_cgraph *gf, double *profile, char *err, size_t err_len) {
    if (!profile) return run_graph(c, gf, err, err_len);
    c->profile = profile;
    ggml_backend_sched_set_eval_callback(c->sched, profile_node, c);
    const bool ok = run_graph(c, gf, err, err_len);
    ggml_backend_sched_set_eval_callback(c->sched, NULL, NULL);
    c->profile = NULL;
    return ok;
}

bool dg_ids_ok(const dg_model *m, const int32_t *ids, int n, char *err, size_t err_len) {
    for (int i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= m->hp.n_vocab) {
            dg_set_err(err, err_len, "token id %d at index %d is outside the vocabulary [0, %d)", ids[i], i,
                       m->hp.n_vocab);
            return false;
        }
    }
    return true;
}

void dg_free_step_graphs(dg_context *c) {
    for (int s = 0; s < DG_SC_MODES; s++) {
        for (int o = 0; o < 2; o++) {
            for (int r = 0; r < 2; r++) {
                dg_step_graph *g = &c->steps[s][o][r];
                if (g->ctx) ggml_free(g->ctx);
                memset(g, 0, sizeof(*g));
            }
        }
    }
    c->steps_tails_clear = false;
    c->steps_n_past = -1;
    c->steps_swa_base = -1;
    c->steps_n_rows = -1;
    c->steps_n_canvases = -1;
}

// One backend per placement device, and the scheduler over them: accelerators first, the CPU last (its lowest
// priority: nodes run where their weights are, the rest follows its neighbours).
static bool init_backends(dg_context *c, int n_threads, char *err, size_t err_len) {
    const dg_placement *p = &c->model->place;
    const int n = p->n_devices > 0 ? p->n_devices : 1;
    c->backends[0] = ggml_backend_cpu_init();
    if (!c->backends[0]) {
        dg_set_err(err, err_len, "cannot initialise the CPU backend");
        return false;
    }
    ggml_backend_cpu_set_n_threads(c->backends[0], n_threads);
    ggml_backend_t order[DG_MAX_DEVICES];
    for (int d = 1; d < n; d++) {
        c->backends[d] = ggml_backend_dev_init(p->devices[d], NULL);
        if (!c->backends[d]) {
            dg_set_err(err, err_len, "cannot initialise the device %s", ggml_backend_dev_name(p->devices[d]));
            return false;
        }
        order[d - 1] = c->backends[d];
    }
    order[n - 1] = c->backends[0];
    c->sched = ggml_backend_sched_new(order, NULL, n, 2 * dg_graph_nodes(c->model) + 1024, false, false);
    if (!c->sched) {
        dg_set_err(err, err_len, "cannot create the graph scheduler");
        return false;
    }
    return true;
}

// K/V cache of each layer on the layer's device (kv_cache.c says which slot holds what), the logits ping-pong
// buffers on the output's.
static bool alloc_state(dg_context *c, char *err, size_t err_len) {
    const dg_model *m = c->model;
    const dg_placement *p = &m->place;
    const int L = m->hp.n_layer, n = p->n_devices > 0 ? p->n_devices : 1, n_slots = c->n_slots;
    c->k_cache = calloc((size_t)L, sizeof(struct ggml_tensor *));
    c->v_cache = calloc((size_t)L, sizeof(struct ggml_tensor *));
    if (!c->k_cache || !c->v_cache) {
        dg_set_err(err, err_len, "out of memory");
        return false;
    }
    for (int d = 0; d < n; d++) {
        struct ggml_init_params ip = {ggml_tensor_overhead() * (2 * (size_t)L + 2), NULL, true};
        if (!(c->ctx_state[d] = ggml_init(ip))) {
            dg_set_err(err, err_len, "out of memory");
            return false;
        }
    }
    const int64_t step_rows = (int64_t)c->max_canvases * m->hp.canvas_length;
    c->swa_cap = dg_kv_sliding_slots(m, c->max_canvases, c->image_rows, n_slots);
    for (int il = 0; il < L; il++) {
        const dg_layer *ly = &m->layers[il];
        struct ggml_context *ctx = c->ctx_state[p->unit_device[il]];
        const int slots = ly->sliding ? c->swa_cap : n_slots;
        c->k_cache[il] = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, ly->head_dim, ly->n_head_kv, slots);
        c->v_cache[il] = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, slots, ly->head_dim, ly->n_head_kv);
    }
    const int out_dev = p->unit_device[L];
    for (int i = 0; i < 2; i++) {
        c->logits[i] = ggml_new_tensor_2d(c->ctx_state[out_dev], GGML_TYPE_F32, m->hp.n_vocab, step_rows);
    }
    for (int d = 0; d < n; d++) {
        if (!ggml_get_first_tensor(c->ctx_state[d])) continue;
        c->buf_state[d] = ggml_backend_alloc_ctx_tensors(c->ctx_state[d], c->backends[d]);
        if (!c->buf_state[d]) {
            size_t bytes = 0;
            for (struct ggml_tensor *t = ggml_get_first_tensor(c->ctx_state[d]); t;
                 t = ggml_get_next_tensor(c->ctx_state[d], t)) {
                bytes += ggml_nbytes(t);
            }
            dg_set_err(err, err_len, "cannot allocate %.1f MiB for the K/V cache and logits (n_ctx %d, %d canvases)",
                       bytes / 1048576.0, c->n_ctx, c->max_canvases);
            return false;
        }
    }
    for (int i = 0; i < 2; i++) {
        ggml_backend_tensor_memset(c->logits[i], 0, 0, ggml_nbytes(c->logits[i]));
        if (!ggml_backend_buffer_is_host(c->logits[i]->buffer)) {
            c->logits_host[i] = calloc(ggml_nelements(c->logits[i]), sizeof(float));
            if (!c->logits_host[i]) {
                dg_set_err(err, err_len, "out of memory");
                return false;
            }
        }
    }
    return true;
}

// max_canvases: the most candidate canvases one step may hold (1 for plain generation).
dg_context *dg_context_create(dg_model *m, int n_ctx, int n_threads, int max_canvases, int image_rows, char *err,
                              size_t err_len) {
    if (err && err_len) err[0] = 0;
    if (n_ctx < 1 || n_ctx > (1 << 24)) {
        dg_set_err(err, err_len, "n_ctx must be in [1, %d], got %d", 1 << 24, n_ctx);
        return NULL;
    }
    if (max_canvases < 1 || max_canvases > DG_MAX_CANDIDATES) {
        dg_set_err(err, err_len, "max_canvases must be in [1, %d], got %d", DG_MAX_CANDIDATES, max_canvases);
        return NULL;
    }
    if (n_threads > GGML_MAX_N_THREADS) {
        dg_set_err(err, err_len, "n_threads must be at most %d (ggml's limit), got %d", GGML_MAX_N_THREADS, n_threads);
        return NULL;
    }
    if (image_rows < 0 || image_rows > n_ctx) {
        dg_set_err(err, err_len, "image_rows must be in [0, n_ctx %d], got %d", n_ctx, image_rows);
        return NULL;
    }
    const int64_t scratch = (int64_t)(max_canvases - 1) * m->hp.canvas_length;
    if (n_ctx + scratch > (1 << 24)) {
        dg_set_err(err, err_len, "n_ctx %d with %d canvases of scratch exceeds %d cache slots", n_ctx, max_canvases,
                   1 << 24);
        return NULL;
    }
    dg_context *c = calloc(1, sizeof(dg_context));
    if (!c) {
        dg_set_err(err, err_len, "out of memory");
        return NULL;
    }
    c->model = m;
    c->n_ctx = n_ctx;
    c->max_canvases = max_canvases;
    c->image_rows = image_rows;
    c->n_slots = (int)(n_ctx + scratch);
    c->last = -1;
    c->steps_n_past = c->steps_swa_base = c->steps_n_rows = c->steps_n_canvases = -1;
    if (n_threads <= 0) n_threads = m->n_threads > 0 ? m->n_threads : (int)sysconf(_SC_NPROCESSORS_ONLN);
    if (n_threads <= 0) n_threads = 1;

    if (!init_backends(c, n_threads, err, err_len) || !alloc_state(c, err, err_len)) {
        dg_context_destroy(c);
        return NULL;
    }
    return c;
}

void dg_context_destroy(dg_context *c) {
    if (!c) return;
    dg_free_step_graphs(c);
    if (c->sched) ggml_backend_sched_free(c->sched);
    for (int d = 0; d < DG_MAX_DEVICES; d++) {
        if (c->buf_state[d]) ggml_backend_buffer_free(c->buf_state[d]);
        if (c->ctx_state[d]) ggml_free(c->ctx_state[d]);
        if (c->backends[d]) ggml_backend_free(c->backends[d]);
    }
    free(c->logits_host[0]);
    free(c->logits_host[1]);
    free(c->k_cache);
    free(c->v_cache);
    free(c);
}

void dg_context_clear(dg_context *c) {
    c->n_past = 0;
    c->swa_base = 0;
    c->last = -1;
    c->last_rows = 0;
    c->holds_probs[0] = c->holds_probs[1] = false;
    dg_free_step_graphs(c);
}
