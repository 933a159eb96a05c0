// What crosses between the host and the devices during decoder steps (docs/engine.md#what-crosses): the engine's own
// reads and writes of tensors outside host memory, and the scheduler's copies of split inputs, added to a context's
// totals. Below every file that moves tensor data; calls nothing of the engine.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "engine.h"

static bool in_host_memory(const struct ggml_tensor *t) {
    const struct ggml_tensor *base = t->view_src ? t->view_src : t;
    return !base->buffer || ggml_backend_buffer_is_host(base->buffer);
}

void dg_tensor_set(dg_context *c, struct ggml_tensor *t, const void *data, size_t offset, size_t size) {
    ggml_backend_tensor_set(t, data, offset, size);
    if (c->counting && !in_host_memory(t)) c->xfer_to_device += size;
}

void dg_tensor_get(dg_context *c, const struct ggml_tensor *t, void *data, size_t offset, size_t size) {
    ggml_backend_tensor_get(t, data, offset, size);
    if (c->counting && !in_host_memory(t)) c->xfer_from_device += size;
}

static int compare_ptr(const void *a, const void *b) {
    const uintptr_t x = (uintptr_t) * (const void *const *)a, y = (uintptr_t) * (const void *const *)b;
    return (x > y) - (x < y);
}

// The scheduler copies every split input into a tensor of its own in the destination's compute buffer, named
// "<backend>#<source>#<copy>", and rewires the consumers' sources to it (ggml-backend.cpp, split_graph); each such
// tensor is filled once per run. So the distinct rewired sources are exactly what crosses between backends.
void dg_count_split_copies(dg_context *c, struct ggml_cgraph *gf) {
    if (c->model->place.n_devices < 2) return;
    const int n_nodes = ggml_graph_n_nodes(gf);
    const size_t cap = (size_t)n_nodes * GGML_MAX_SRC;
    const struct ggml_tensor **seen = malloc(sizeof(*seen) * (cap ? cap : 1));
    if (!seen) return;  // a count is not worth failing a step for
    size_t n = 0;
    for (int i = 0; i < n_nodes; i++) {
        const struct ggml_tensor *node = ggml_graph_node(gf, i);
        for (int j = 0; j < GGML_MAX_SRC; j++) {
            const struct ggml_tensor *s = node->src[j];
            if (s && s->buffer && ggml_backend_buffer_get_usage(s->buffer) == GGML_BACKEND_BUFFER_USAGE_COMPUTE &&
                strchr(s->name, '#'))
                seen[n++] = s;
        }
    }
    qsort(seen, n, sizeof(*seen), compare_ptr);
    const char *cpu = ggml_backend_name(c->backends[0]);
    const size_t cpu_len = strlen(cpu);
    for (size_t i = 0; i < n; i++) {
        if (i > 0 && seen[i] == seen[i - 1]) continue;
        const bool to_cpu = strncmp(seen[i]->name, cpu, cpu_len) == 0 && seen[i]->name[cpu_len] == '#';
        if (to_cpu) c->xfer_from_device += ggml_nbytes(seen[i]);
        else c->xfer_to_device += ggml_nbytes(seen[i]);
    }
    free(seen);
}
