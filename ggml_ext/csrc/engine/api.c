// Every function the engine exports (ggml_ext/model.py and ggml_ext/devices.py bind them with ctypes), and nothing
// else: each checks or forwards its arguments to the file that does the work. Errors go to the caller's buffer.
#include <stdlib.h>

#include "engine.h"

// ---------------------------------------------------------------------------------------------------------------
// model: load, check, adapters, placement

DG_API dg_model *dg_model_load(const char *path, int n_threads, char *err, size_t err_len) {
    return dg_model_load_impl(path, n_threads, false, err, err_len);
}

DG_API void dg_model_free(dg_model *m) {
    if (!m) return;
    dg_placement_free(&m->place);
    dg_lora_free(m);
    dg_model_free_impl(m);
}

// Every check a load makes, allocating nothing (what `create` runs on a file). 1 ok, 0 with err set.
DG_API int dg_model_check(const char *path, char *err, size_t err_len) {
    dg_model *m = dg_model_load_impl(path, 1, true, err, err_len);
    dg_model_free(m);
    return m != NULL;
}

DG_API const dg_hparams *dg_model_hparams(const dg_model *m) { return &m->hp; }

DG_API const struct gguf_context *dg_model_gguf(const dg_model *m) { return m->gguf; }

DG_API const char *dg_model_warnings(const dg_model *m) { return m->warnings; }

DG_API size_t dg_model_file_size(const dg_model *m) { return m->map_size; }

DG_API size_t dg_hparams_size(void) { return sizeof(dg_hparams); }

// 0 on success; else 1 + the index of the adapter at fault (n + 1 when none is), err set.
DG_API int dg_model_load_adapters(dg_model *m, const char *const *paths, const float *scales, int n, char *err,
                                  size_t err_len) {
    if (err && err_len) err[0] = 0;
    return dg_lora_load(m, paths, scales, n, err, err_len);
}

// Every check loading `adapter` onto the model at `model_path` makes, allocating neither. 1 ok, 0 with err set.
DG_API int dg_adapter_check(const char *model_path, const char *adapter_path, char *err, size_t err_len) {
    dg_model *m = dg_model_load_impl(model_path, 1, true, err, err_len);
    if (!m) return 0;
    const bool ok = dg_lora_check(m, adapter_path, err, err_len);
    dg_model_free(m);
    return ok;
}

DG_API int dg_model_n_adapters(const dg_model *m) { return m->n_adapters; }

DG_API int dg_model_offload(dg_model *m, int num_gpu, int num_cpu_moe, char *err, size_t err_len) {
    if (err && err_len) err[0] = 0;
    return dg_model_place(m, num_gpu, num_cpu_moe, err, err_len) ? 0 : -1;
}

// Device index (0 = CPU) of a unit (0..n_layer; n_layer = output) or, with experts set, of layer il's experts.
DG_API int dg_model_unit_device(const dg_model *m, int unit, int experts) {
    if (unit < 0 || unit > m->hp.n_layer) return -1;
    if (experts) return unit < m->hp.n_layer ? m->place.expert_device[unit] : -1;
    return m->place.unit_device[unit];
}

DG_API int dg_model_n_devices(const dg_model *m) { return m->place.n_devices; }

DG_API const char *dg_model_device_name(const dg_model *m, int d) {
    return d >= 0 && d < m->place.n_devices ? ggml_backend_dev_name(m->place.devices[d]) : NULL;
}

DG_API size_t dg_model_device_weight_bytes(const dg_model *m, int d) {
    return d >= 0 && d < m->place.n_devices ? m->place.weight_bytes[d] : 0;
}

// ---------------------------------------------------------------------------------------------------------------
// devices: ggml's registry and RPC servers

// Whether this llama-cpp-python's ggml has the RPC backend (a build with -DGGML_RPC=on).
DG_API int dg_rpc_available(void) { return dg_rpc_has_backend(); }

DG_API int dg_rpc_add_server(const char *endpoint, char *err, size_t err_len) {
    return dg_rpc_add(endpoint, err, err_len) ? 0 : -1;
}

// Serve this process's CPU as a ggml RPC device at endpoint ("host:port"); returns only if the server cannot start.
DG_API int dg_rpc_start_server(const char *endpoint, int n_threads, char *err, size_t err_len) {
    dg_rpc_serve(endpoint, n_threads, err, err_len);
    return -1;
}

// The devices in ggml's registry, one "name\tdescription\ttype\tfree\ttotal" line each (for logs and tests).
DG_API int dg_devices_describe(char *out, size_t out_len) { return dg_devices_list(out, out_len); }

// The first use of ggml's registry, with what its backends print as they load captured into out (devices.c).
DG_API int dg_devices_load(char *out, size_t out_len) { return dg_registry_load(out, out_len); }

// ---------------------------------------------------------------------------------------------------------------
// context: encode, decoder steps, logits

// max_canvases: the most candidate canvases one step may hold (1 for plain generation).
DG_API dg_context *dg_context_new_multi(dg_model *m, int n_ctx, int n_threads, int max_canvases, char *err,
                                        size_t err_len) {
    return dg_context_create(m, n_ctx, n_threads, max_canvases, 0, err, err_len);
}

// image_rows: the longest image block (soft tokens) one encoder pass must take whole; it sizes the sliding caches.
DG_API dg_context *dg_context_new_images(dg_model *m, int n_ctx, int n_threads, int max_canvases, int image_rows,
                                         char *err, size_t err_len) {
    return dg_context_create(m, n_ctx, n_threads, max_canvases, image_rows, err, err_len);
}

DG_API void dg_context_free(dg_context *c) { dg_context_destroy(c); }

DG_API void dg_context_reset(dg_context *c) { dg_context_clear(c); }

DG_API int dg_context_n_past(const dg_context *c) { return c->n_past; }

DG_API int dg_context_encode(dg_context *c, const int32_t *ids, int n, char *err, size_t err_len) {
    return dg_encode(c, ids, n, NULL, err, err_len);
}

// dg_context_encode with images: spans = n_spans (first row, rows) pairs over ids, ascending and disjoint; embd =
// float32 [Σ rows, n_embd], span after span. Those rows take the embeddings instead of their tokens' and attend
// bidirectionally within their span.
DG_API int dg_context_encode_images(dg_context *c, const int32_t *ids, int n, const int32_t *spans, int n_spans,
                                    const float *embd, char *err, size_t err_len) {
    const dg_image_rows images = {.spans = spans, .n_spans = n_spans, .embd = embd};
    return dg_encode(c, ids, n, &images, err, err_len);
}

// One step over n_canvases candidate canvases of n / n_canvases rows each (ids: canvas after canvas); logits rows in
// the same order. Self-conditioning reads the previous step's rows, which must have been the same layout.
DG_API float *dg_context_step_canvases(dg_context *c, const int32_t *ids, int n, int n_canvases, int use_self_cond,
                                       float inv_temp, char *err, size_t err_len) {
    return dg_step(c, ids, n, n_canvases, use_self_cond, inv_temp, NULL, err, err_len);
}

// A sampling step (fast RNG mode; docs/engine.md#sampling-on-the-device): the logits stay on the output's device as
// the tempered probabilities softmax(logits · inv_temp), which the next self-conditioned step reads; per row only
// the argmax, the entropy (nats) and the inverse-CDF draw at uniforms[i] ∈ [0, 1) come back. 0, or -1 with err set.
DG_API int dg_context_step_reduced(dg_context *c, const int32_t *ids, int n, int n_canvases, int use_self_cond,
                                   float sc_inv_temp, float inv_temp, const float *uniforms, int32_t *argmax,
                                   float *entropy, int32_t *draw, char *err, size_t err_len) {
    return dg_step_reduced(c, ids, n, n_canvases, use_self_cond, sc_inv_temp, inv_temp, uniforms, argmax, entropy,
                           draw, err, err_len);
}

// Whether the logits buffers live in host memory (the CPU), else on the output's device.
DG_API int dg_context_logits_on_host(const dg_context *c) { return ggml_backend_buffer_is_host(c->logits[0]->buffer); }

// The same step on one canvas, timed node by node: seconds[class] += each node's time (DG_PROFILE_COUNT entries).
DG_API float *dg_context_step_profiled(dg_context *c, const int32_t *ids, int n, int use_self_cond, float inv_temp,
                                       double *seconds, char *err, size_t err_len) {
    return dg_step(c, ids, n, 1, use_self_cond, inv_temp, seconds, err, err_len);
}

// Drop finished candidates: of the last step's n_canvases canvases, keep those with keep[k] != 0, moving their logits
// rows to the front in order, so the next step (self-conditioned) runs on the kept canvases alone.
DG_API int dg_context_keep_canvases(dg_context *c, const uint8_t *keep, int n_canvases, char *err, size_t err_len) {
    return dg_keep_canvases(c, keep, n_canvases, err, err_len);
}

// Overwrite "the previous step's raw logits" (rows × n_vocab floats). Written into the buffer the last step did not
// use, so a view of the last step's logits stays valid until the next step.
DG_API int dg_context_set_self_cond(dg_context *c, const float *data, int rows, char *err, size_t err_len) {
    return dg_set_self_cond(c, data, rows, err, err_len);
}

// Self-conditioning from each row's k most probable tokens, renormalised; 0 (the default): all of them, exact.
DG_API int dg_context_set_self_cond_top_k(dg_context *c, int k, char *err, size_t err_len) {
    return dg_set_self_cond_top_k(c, k, err, err_len);
}

// Logits of the last step (or set_self_cond), NULL if none.
DG_API float *dg_context_logits(const dg_context *c) { return dg_last_logits(c); }

DG_API int dg_context_logits_rows(const dg_context *c) { return c->last < 0 ? 0 : c->last_rows; }

// Bytes decoder steps copied between the host and the devices since the context was made, and the steps counted
// (docs/engine.md#what-crosses).
DG_API void dg_context_transfers(const dg_context *c, uint64_t *to_device, uint64_t *from_device, int64_t *steps) {
    *to_device = c->xfer_to_device;
    *from_device = c->xfer_from_device;
    *steps = c->xfer_steps;
}

// Where the last decoder step ran: its splits and the kinds of node left on the CPU ("" before any step;
// docs/engine.md#what-runs-where).
DG_API const char *dg_context_step_report(const dg_context *c) { return c->step_report; }

// out [n, H] = probs [n, V] · E through the step's sliced soft-embedding graph (no embedding scale): the soft
// embedding a step computes, for tests/test_engine_selfcond.py.
DG_API int dg_context_soft_embedding(dg_context *c, const float *probs, int n, float *out, char *err, size_t err_len) {
    return dg_run_soft_embedding(c, probs, n, out, err, err_len);
}

// ---------------------------------------------------------------------------------------------------------------
// vision: the projector GGUF (Gemma 4's vision tower), ggml_ext/vision.py binds these

DG_API dg_vision_model *dg_vision_load(const char *path, int n_threads, char *err, size_t err_len) {
    return dg_vision_load_impl(path, n_threads, err, err_len);
}

DG_API void dg_vision_free(dg_vision_model *m) { dg_vision_free_impl(m); }

DG_API const dg_vision_hparams *dg_vision_get_hparams(const dg_vision_model *m) { return &m->hp; }

DG_API size_t dg_vision_hparams_size(void) { return sizeof(dg_vision_hparams); }

// One image: its soft tokens' embeddings (embed_vision's output) into out [n_soft, n_embd_text]; n_soft, or -1.
DG_API int dg_vision_encode_image(dg_vision_model *m, const float *patches, const int32_t *positions, int n_patches,
                                  float *out, int out_rows, char *err, size_t err_len) {
    if (err && err_len) err[0] = 0;
    return dg_vision_encode(m, patches, positions, n_patches, out, out_rows, err, err_len);
}
