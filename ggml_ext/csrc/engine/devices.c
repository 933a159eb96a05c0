// Devices and per-layer weight placement (docs/engine.md#devices).
//
// Devices come from ggml's backend registry: every GPU (or integrated GPU) device an accelerated llama-cpp-python
// build registers, plus the RPC devices added with dg_rpc_add. Placement follows llama.cpp's -ngl (Ollama's
// num_gpu): of the n_layer + 1 units (the layers, then the output: final norm, LM head, logits, self-conditioning),
// the last num_gpu go to the accelerators, spread over them in equal runs in registry order. num_cpu_moe keeps the
// routed experts of the first num_cpu_moe layers on the CPU (llama.cpp's --n-cpu-moe).
//
// Weights of a unit on an accelerator are copied from the mapping into a buffer of that device, and the layer's
// pointers are switched to the copies; weights on the CPU stay in the mapping (the fast path, nothing copied).
#define _POSIX_C_SOURCE 200809L  // dup, dup2, fileno under -std=c11
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine.h"

// ggml's registry loads its backends on first use, and some announce themselves on stderr from C++ streams, outside
// ggml's log callback (the Vulkan backend lists its devices, or prints "No devices found." where it has none). That
// first use runs here with file descriptor 2 pointed at a temporary file, whose text is returned for the caller's log:
// a CLI's one-line errors stay one line. Returns the device count.
int dg_registry_load(char *out, size_t out_len) {
    if (out && out_len) out[0] = 0;
    fflush(stderr);
    FILE *captured = tmpfile();
    const int saved = captured ? dup(2) : -1;
    if (saved < 0 || dup2(fileno(captured), 2) < 0) {  // cannot capture: load with stderr as it is
        if (saved >= 0) close(saved);
        if (captured) fclose(captured);
        return (int)ggml_backend_dev_count();
    }
    const int n = (int)ggml_backend_dev_count();
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    if (out && out_len) {
        rewind(captured);
        const size_t got = fread(out, 1, out_len - 1, captured);
        out[got] = 0;
    }
    fclose(captured);
    return n;
}

static bool is_accelerator(ggml_backend_dev_t dev) {
    const enum ggml_backend_dev_type t = ggml_backend_dev_type(dev);
    return t == GGML_BACKEND_DEVICE_TYPE_GPU || t == GGML_BACKEND_DEVICE_TYPE_IGPU;
}

// Whether this llama-cpp-python's ggml has the RPC backend (a build with -DGGML_RPC=on).
bool dg_rpc_has_backend(void) { return ggml_backend_reg_by_name("RPC") != NULL; }

// ggml's RPC backend is looked up at run time: a stock llama-cpp-python build has none (docs/engine.md#rpc).
bool dg_rpc_add(const char *endpoint, char *err, size_t err_len) {
    ggml_backend_reg_t rpc = ggml_backend_reg_by_name("RPC");
    if (!rpc) {
        dg_set_err(err, err_len, "this llama-cpp-python has no RPC backend: reinstall it with CMAKE_ARGS=\"-DGGML_RPC=on\" "
                                 "pip install --force-reinstall --no-binary llama-cpp-python llama-cpp-python==0.3.36");
        return false;
    }
    typedef ggml_backend_reg_t (*add_server_fn)(const char *);
    add_server_fn add = (add_server_fn)ggml_backend_reg_get_proc_address(rpc, "ggml_backend_rpc_add_server");
    if (!add) {
        dg_set_err(err, err_len, "ggml's RPC backend has no ggml_backend_rpc_add_server");
        return false;
    }
    char name[300];  // already added (ggml names its registry "RPC[endpoint]"): its devices are registered
    snprintf(name, sizeof(name), "RPC[%s]", endpoint);
    for (size_t i = 0; i < ggml_backend_reg_count(); i++) {
        if (strcmp(ggml_backend_reg_name(ggml_backend_reg_get(i)), name) == 0) return true;
    }
    ggml_backend_reg_t reg = add(endpoint);
    if (!reg || ggml_backend_reg_dev_count(reg) == 0) {
        dg_set_err(err, err_len, "the RPC server at %s offers no device", endpoint);
        return false;
    }
    ggml_backend_register(reg);
    return true;
}

// Serve this process's CPU as a ggml RPC device at endpoint ("host:port"); returns only if the server cannot start.
void dg_rpc_serve(const char *endpoint, int n_threads, char *err, size_t err_len) {
    ggml_backend_reg_t rpc = ggml_backend_reg_by_name("RPC");
    typedef void (*start_server_fn)(const char *, const char *, size_t, size_t, ggml_backend_dev_t *);
    start_server_fn start = rpc ? (start_server_fn)ggml_backend_reg_get_proc_address(rpc, "ggml_backend_rpc_start_server")
                                : NULL;
    ggml_backend_dev_t cpu = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    if (!start || !cpu) {
        dg_set_err(err, err_len, "this llama-cpp-python has no RPC backend: reinstall it with CMAKE_ARGS=\"-DGGML_RPC=on\" "
                                 "pip install --force-reinstall --no-binary llama-cpp-python llama-cpp-python==0.3.36");
        return;
    }
    start(endpoint, NULL, n_threads > 0 ? (size_t)n_threads : 1, 1, &cpu);
    dg_set_err(err, err_len, "the RPC server at %s could not start (port in use?)", endpoint);
}

// The devices in ggml's registry, one "name\tdescription\ttype\tfree\ttotal" line each (for logs and tests).
int dg_devices_list(char *out, size_t out_len) {
    size_t used = 0;
    if (out_len) out[0] = 0;
    for (size_t i = 0; i < ggml_backend_dev_count(); i++) {
        ggml_backend_dev_t dev = ggml_backend_dev_get(i);
        size_t free_b = 0, total_b = 0;
        ggml_backend_dev_memory(dev, &free_b, &total_b);
        const enum ggml_backend_dev_type t = ggml_backend_dev_type(dev);
        const char *kind = t == GGML_BACKEND_DEVICE_TYPE_CPU ? "cpu" : is_accelerator(dev) ? "gpu" : "accel";
        int n = snprintf(out + used, out_len > used ? out_len - used : 0, "%s\t%s\t%s\t%zu\t%zu\n",
                         ggml_backend_dev_name(dev), ggml_backend_dev_description(dev), kind, free_b, total_b);
        if (n > 0) used += (size_t)n;
    }
    return (int)ggml_backend_dev_count();
}

// ---------------------------------------------------------------------------------------------------------------
// which weights belong to which unit

enum { MAX_UNIT_TENSORS = 32 + DG_PASSES * DG_LORA_TARGETS * 2 };

// Pointers to the weight fields of layer il: dense part (attention, dense MLP, router, norms, scalars) and experts.
static int layer_fields(dg_layer *L, struct ggml_tensor ***dense, struct ggml_tensor ***experts, int *n_experts) {
    struct ggml_tensor **d[] = {&L->attn_norm, &L->wq, &L->q_norm, &L->wk, &L->k_norm, &L->wv, &L->wo,
                                &L->post_attn_norm, &L->ffn_norm, &L->ffn_gate, &L->ffn_up, &L->ffn_down,
                                &L->post_ffw_norm_1, &L->router, &L->router_scale, &L->pre_ffw_norm_2,
                                &L->expert_scale, &L->post_ffw_norm_2, &L->post_ffw_norm, &L->dec_scale};
    struct ggml_tensor **e[] = {&L->gate_up_exps, &L->gate_exps, &L->up_exps, &L->down_exps};
    int n = 0;
    for (size_t i = 0; i < sizeof(d) / sizeof(d[0]); i++) dense[n++] = d[i];
    // the encoder scalars may alias the decoder's (files without them): never copy one tensor twice
    if (L->enc_scale != L->dec_scale) dense[n++] = &L->enc_scale;
    *n_experts = 0;
    for (size_t i = 0; i < sizeof(e) / sizeof(e[0]); i++) experts[(*n_experts)++] = e[i];
    for (int pass = 0; pass < DG_PASSES; pass++) {  // the adapters' factors go where the weight they adapt goes
        for (int t = 0; t < DG_LORA_TARGETS; t++) {
            struct ggml_tensor ***list = t >= DG_LORA_GATE_UP_EXPS ? experts : dense;
            int *count = t >= DG_LORA_GATE_UP_EXPS ? n_experts : &n;
            list[(*count)++] = &L->lora[pass][t].a;
            list[(*count)++] = &L->lora[pass][t].b;
        }
    }
    return n;
}

static int output_fields(dg_model *m, struct ggml_tensor ***out) {
    int n = 0;
    out[n++] = &m->output_norm;
    out[n++] = m->output ? &m->output : &m->place.lm_head;  // a tied head gets its own copy (tok_embd stays for rows)
    out[n++] = &m->sc_pre_norm;
    out[n++] = &m->sc_gate;
    out[n++] = &m->sc_up;
    out[n++] = &m->sc_down;
    out[n++] = &m->embd_t;
    for (int t = DG_LORA_GATE; t <= DG_LORA_DOWN; t++) {
        out[n++] = &m->sc_lora[t].a;
        out[n++] = &m->sc_lora[t].b;
    }
    return n;
}

static size_t bytes_of(struct ggml_tensor **const *fields, int n, const dg_model *m) {
    size_t total = 0;
    for (int i = 0; i < n; i++) {
        const struct ggml_tensor *t = *fields[i];
        if (fields[i] == &m->place.lm_head) t = m->tok_embd;
        if (t) total += ggml_nbytes(t);
    }
    return total;
}

static size_t unit_bytes(dg_model *m, int unit, bool with_experts) {
    struct ggml_tensor **dense[MAX_UNIT_TENSORS], **experts[MAX_UNIT_TENSORS];
    if (unit == m->hp.n_layer) return bytes_of(dense, output_fields(m, dense), m);
    int ne = 0;
    const int nd = layer_fields(&m->layers[unit], dense, experts, &ne);
    return bytes_of(dense, nd, m) + (with_experts ? bytes_of(experts, ne, m) : 0);
}

// ---------------------------------------------------------------------------------------------------------------
// placement

// Auto placement (num_gpu < 0): offload units from the last one while they fit in the accelerators' free memory,
// keeping a tenth of it (and 512 MiB) for the cache and the compute buffers.
static int units_that_fit(dg_model *m, const ggml_backend_dev_t *acc, int n_acc, int num_cpu_moe) {
    size_t budget = 0;
    for (int i = 0; i < n_acc; i++) {
        size_t free_b = 0, total_b = 0;
        ggml_backend_dev_memory(acc[i], &free_b, &total_b);
        const size_t reserve = free_b / 10 + ((size_t)512 << 20);
        budget += free_b > reserve ? free_b - reserve : 0;
    }
    const int units = m->hp.n_layer + 1;
    size_t used = 0;
    int n = 0;
    for (int u = units - 1; u >= 0; u--) {
        used += unit_bytes(m, u, u == m->hp.n_layer || u >= num_cpu_moe);
        if (used > budget) break;
        n++;
    }
    return n;
}

// Copy the weights of every field assigned to device d into one buffer of that device and repoint the fields.
static bool copy_to_device(dg_model *m, int d, struct ggml_tensor ***fields, int n, char *err, size_t err_len) {
    dg_placement *p = &m->place;
    struct ggml_init_params ip = {ggml_tensor_overhead() * (size_t)(n + 1), NULL, true};
    p->ctx[d] = ggml_init(ip);
    if (!p->ctx[d]) {
        dg_set_err(err, err_len, "out of memory");
        return false;
    }
    struct ggml_tensor **src = malloc(sizeof(*src) * (size_t)(n + 1));
    struct ggml_tensor **dst = malloc(sizeof(*dst) * (size_t)(n + 1));
    if (!src || !dst) {
        free(src);
        free(dst);
        dg_set_err(err, err_len, "out of memory");
        return false;
    }
    for (int i = 0; i < n; i++) {
        src[i] = fields[i] == &p->lm_head ? m->tok_embd : *fields[i];
        dst[i] = ggml_dup_tensor(p->ctx[d], src[i]);
        ggml_set_name(dst[i], src[i]->name);
    }
    ggml_backend_dev_t dev = p->devices[d];
    p->buf[d] = ggml_backend_alloc_ctx_tensors_from_buft(p->ctx[d], ggml_backend_dev_buffer_type(dev));
    bool ok = p->buf[d] != NULL;
    if (!ok) {
        size_t bytes = 0;
        for (int i = 0; i < n; i++) bytes += ggml_nbytes(src[i]);
        dg_set_err(err, err_len, "cannot allocate %.1f MiB of weights on %s (lower num_gpu)", bytes / 1048576.0,
                   ggml_backend_dev_name(dev));
    } else {
        ggml_backend_buffer_set_usage(p->buf[d], GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
        for (int i = 0; i < n; i++) {
            ggml_backend_tensor_set(dst[i], src[i]->data, 0, ggml_nbytes(src[i]));
            *fields[i] = dst[i];
            p->weight_bytes[d] += ggml_nbytes(src[i]);
        }
    }
    free(src);
    free(dst);
    return ok;
}

bool dg_model_place(dg_model *m, int num_gpu, int num_cpu_moe, char *err, size_t err_len) {
    dg_placement *p = &m->place;
    const int L = m->hp.n_layer, units = L + 1;
    if (p->n_devices > 0) {
        dg_set_err(err, err_len, "the model's weights are placed already");
        return false;
    }
    const char *std_env = getenv("DGEMMA_STANDARD_OPS");
    p->standard_ops = std_env && *std_env && strcmp(std_env, "0") != 0;
    p->n_devices = 1;
    p->devices[0] = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    if (!p->devices[0]) {
        dg_set_err(err, err_len, "ggml has no CPU device");
        return false;
    }

    ggml_backend_dev_t acc[DG_MAX_DEVICES - 1];
    int n_acc = 0;
    for (size_t i = 0; i < ggml_backend_dev_count() && n_acc < DG_MAX_DEVICES - 1; i++) {
        if (is_accelerator(ggml_backend_dev_get(i))) acc[n_acc++] = ggml_backend_dev_get(i);
    }
    if (num_cpu_moe < 0 || num_cpu_moe > L) num_cpu_moe = L;
    int n_off = n_acc == 0 ? 0 : num_gpu < 0 ? units_that_fit(m, acc, n_acc, num_cpu_moe) : num_gpu;
    if (n_off > units) n_off = units;
    const int first = units - n_off;
    const int n_used = n_off < n_acc ? n_off : n_acc;
    for (int i = 0; i < n_used; i++) p->devices[p->n_devices++] = acc[i];
    for (int u = 0; u < units; u++) {
        p->unit_device[u] = u < first ? 0 : (uint8_t)(1 + (u - first) * n_used / n_off);
        if (u < L) p->expert_device[u] = u < num_cpu_moe ? 0 : p->unit_device[u];
    }

    // self-conditioning off the CPU's soft-embedding op needs the transposed embedding (F32 files have it already)
    if (m->hp.has_self_cond && !m->embd_t && !dg_unit_fast(m, L) && !dg_make_transposed_embedding(m, err, err_len))
        return false;
    // the weights in the mapping (and the transposed embedding) are weights to the scheduler: nodes reading them run
    // on the CPU unless placed elsewhere
    if (m->buf_file) ggml_backend_buffer_set_usage(m->buf_file, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    if (m->buf_extra) ggml_backend_buffer_set_usage(m->buf_extra, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
    if (m->buf_lora) ggml_backend_buffer_set_usage(m->buf_lora, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);

    const int cap = (L + 1) * (MAX_UNIT_TENSORS + 8);
    struct ggml_tensor ***fields = malloc(sizeof(*fields) * (size_t)cap);
    if (!fields) {
        dg_set_err(err, err_len, "out of memory");
        return false;
    }
    bool ok = true;
    for (int d = 1; ok && d < p->n_devices; d++) {
        int n = 0;
        for (int u = 0; u < units; u++) {
            struct ggml_tensor **dense[MAX_UNIT_TENSORS], **experts[MAX_UNIT_TENSORS];
            int nd, ne = 0;
            if (u == L) nd = output_fields(m, dense);
            else nd = layer_fields(&m->layers[u], dense, experts, &ne);
            for (int i = 0; i < nd && p->unit_device[u] == d; i++) {
                if (*dense[i] || dense[i] == &p->lm_head) fields[n++] = dense[i];
            }
            for (int i = 0; i < ne && u < L && p->expert_device[u] == d; i++) {
                if (*experts[i]) fields[n++] = experts[i];
            }
        }
        if (n > 0) ok = copy_to_device(m, d, fields, n, err, err_len);
    }
    free(fields);
    if (ok && p->unit_device[L] != 0 && m->buf_extra) {  // the transposed embedding now lives on the device only
        ggml_backend_buffer_free(m->buf_extra);
        m->buf_extra = NULL;
    }
    return ok;
}

void dg_placement_free(dg_placement *p) {
    for (int d = 0; d < DG_MAX_DEVICES; d++) {
        if (p->buf[d]) ggml_backend_buffer_free(p->buf[d]);
        if (p->ctx[d]) ggml_free(p->ctx[d]);
        p->buf[d] = NULL;
        p->ctx[d] = NULL;
    }
}

bool dg_unit_fast(const dg_model *m, int unit) { return !m->place.standard_ops && m->place.unit_device[unit] == 0; }

bool dg_experts_fast(const dg_model *m, int il) { return !m->place.standard_ops && m->place.expert_device[il] == 0; }

struct ggml_tensor *dg_lm_head(const dg_model *m) {
    return m->place.lm_head ? m->place.lm_head : m->output ? m->output : m->tok_embd;
}
