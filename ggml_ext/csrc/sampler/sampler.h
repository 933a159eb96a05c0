// DiffusionGemma's entropy-bound sampler over a float32 [C, V] logits buffer.
// Algorithm: docs/model.md#sampler; the random stream of torch mode: docs/model.md#torch-rng-stream.
//
// One dg_sampler serves one generation: it owns the random stream, the step counter of the current canvas and the
// argmax history used by the adaptive stop. Per step it computes, for every canvas row (in parallel over rows):
// processed logits z = raw / T, argmax, entropy, one categorical draw; then entropy-bound acceptance, renoise with
// fresh uniform tokens, and the stop decision.
#ifndef DG_SAMPLER_H
#define DG_SAMPLER_H

#include <stdint.h>

#define DG_API __attribute__((visibility("default")))

enum dg_rng_mode {
    DG_RNG_FAST = 0,   // counter-based, parallel, reproducible per seed whatever the thread count
    DG_RNG_TORCH = 1,  // MT19937 consumed exactly like transformers' CPU generate()
};

typedef struct {
    int32_t max_steps;             // N: step cap per canvas; the temperature schedule counts n = N..1
    double  t_min;                 // temperature at n = 0 (never reached: the last step uses n = 1)
    double  t_max;                 // temperature at the first step (n = N)
    double  entropy_bound;         // B: accept while the sum of lower-ranked entropies is <= B
    double  confidence_threshold;  // Cf: stop needs mean entropy < Cf
    int32_t stability_threshold;   // S: stop needs the argmax canvas unchanged for S steps (0: always stable)
    int32_t greedy;                // draw = argmax instead of a categorical sample (no exponentials consumed)
} dg_sampler_params;

typedef struct {
    int32_t step;          // steps executed in this canvas, this one included (1-based)
    int32_t remaining;     // n used for this step's temperature (N for the first step)
    float   temperature;   // T of this step: the self-conditioning temperature of the next step
    float   mean_entropy;  // mean over rows of the entropy (nats) of the processed logits
    int32_t n_accepted;
    int32_t stable;
    int32_t confident;
    int32_t stop;          // adaptive stop: stable and confident
    int32_t exhausted;     // this was the canvas's last allowed step
} dg_step_info;

typedef struct dg_sampler dg_sampler;

// Returns NULL and writes a message into err on invalid arguments or allocation failure.
DG_API dg_sampler *dg_sampler_create(int32_t canvas_len, int32_t n_vocab, const dg_sampler_params *params,
                                     int32_t rng_mode, uint64_t seed, int32_t n_threads, char *err, int32_t err_len);
DG_API void dg_sampler_free(dg_sampler *s);

// Start a canvas: draws its C initial tokens into `canvas`, resets the step counter and the argmax history.
DG_API int32_t dg_sampler_begin_canvas(dg_sampler *s, int32_t *canvas);

// One denoising step on raw (softcapped) logits: row r starts at raw_logits + r * row_stride.
// Writes the next canvas, and optionally (NULL to skip) the argmax canvas, the sampled tokens, per-row entropies
// and the acceptance mask. Returns 0, or -1 when no canvas is active or its steps are used up.
DG_API int32_t dg_sampler_step(dg_sampler *s, const float *raw_logits, int64_t row_stride, int32_t *canvas,
                               int32_t *argmax, int32_t *sampled, float *entropy, uint8_t *accepted,
                               dg_step_info *info);

// For a caller that reduces the logits itself (the engine's sampling step, fast mode only): the next step's
// temperature and the uniform each row's inverse-CDF draw uses (the ones dg_sampler_step would use, rounded to float
// and kept below 1). Returns 0, or -1 in torch mode or without an active canvas with steps left.
DG_API int32_t dg_sampler_draw_inputs(const dg_sampler *s, float *uniforms, float *temperature);

// The step from per-row reductions made elsewhere (argmax, entropy in nats, the draw at dg_sampler_draw_inputs'
// uniforms): acceptance, renoise, history and the stop decision as dg_sampler_step. Returns 0, -1 as dg_sampler_step,
// -2 for a token id outside the vocabulary (nothing is changed then).
DG_API int32_t dg_sampler_step_reduced(dg_sampler *s, const int32_t *row_argmax, const float *row_entropy,
                                       const int32_t *row_draw, int32_t *canvas, int32_t *argmax, int32_t *sampled,
                                       float *entropy, uint8_t *accepted, dg_step_info *info);

// Reopen a finished canvas for more steps (self-correction): positions with reset[i] != 0 get fresh uniform tokens in
// `canvas` (the rest keep the caller's tokens), the argmax history is cleared so the stop needs S new steps, and the
// step counter and temperature schedule go on where they were. Returns the number of steps left, 0 when none are
// (nothing is changed then), -1 on bad arguments.
DG_API int32_t dg_sampler_reopen(dg_sampler *s, int32_t *canvas, const uint8_t *reset);

// The linear schedule, exactly in fp32: T = f32(t_min) + f32(t_max - t_min) * (f32(n) / f32(N)).
// (docs/model.md#sampler-loop, line 10)
DG_API float dg_sampler_temperature(int32_t remaining, int32_t max_steps, double t_min, double t_max);

#endif
