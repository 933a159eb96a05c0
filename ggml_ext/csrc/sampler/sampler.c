// Entropy-bound sampler: see sampler.h, docs/model.md#sampler (algorithm) and #torch-rng-stream (torch's stream).
#include "sampler.h"

#include <float.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "counter_rng.h"
#include "mt19937.h"

// Limits on caller-supplied sizes: far above the model (C 256, V 262144) and small enough that every buffer
// size below fits comfortably in memory and in 64-bit arithmetic.
#define MAX_CANVAS (1 << 16)
#define MAX_VOCAB (1 << 24)
#define MAX_THREADS 256

typedef struct {
    float entropy;
    int32_t pos;
} ranked_position;

typedef struct dg_sampler_job row_job;

struct dg_sampler_job {
    const dg_sampler *s;
    const float *raw;
    int64_t row_stride;
    float temperature;
    int32_t row_begin, row_end;
    float *scratch;     // V floats owned by this worker
    dg_mt19937 mt;      // torch mode: the stream positioned at this worker's first row
};

struct dg_sampler {
    int32_t C, V;
    dg_sampler_params p;
    int32_t rng_mode;
    uint64_t seed;
    int32_t n_threads;

    dg_mt19937 mt;        // torch mode: the one global stream, as torch.manual_seed(seed) leaves it
    int64_t canvas_index; // fast mode: canvases started so far (a coordinate of the counter RNG)

    int32_t active;       // a canvas is in progress
    int32_t steps_done;   // steps executed in the current canvas

    int32_t history_len;  // rows kept for the stability test: min(S, N + 1), see dg_sampler_create
    int32_t history_fill; // rows written so far (unwritten rows hold -1, which never equals a token)
    int32_t *history;     // [history_len, C] ring buffer of previous argmax canvases
    int32_t history_head; // index of the oldest row

    float *scratch;       // [n_threads, V] per-thread exp buffer
    int32_t *draw;        // [C] sampled tokens
    int32_t *argmax;      // [C]
    float *entropy;       // [C]
    ranked_position *ranked;  // [C] positions sorted by entropy
    row_job *jobs;        // [n_threads] per-step work split (on the heap: each holds an MT state)
    pthread_t *threads;   // [n_threads]
    uint8_t *accepted;    // [C]
};

static void set_error(char *err, int32_t err_len, const char *msg) {
    if (err != NULL && err_len > 0) {
        snprintf(err, (size_t)err_len, "%s", msg);
    }
}

float dg_sampler_temperature(int32_t remaining, int32_t max_steps, double t_min, double t_max) {
    // transformers: t_min + (t_max - t_min) * (cur_step / N) with cur_step an int32 tensor. The division makes an
    // fp32 tensor; the Python floats (t_max - t_min is a double subtraction) are rounded to fp32 as they meet it.
    float fraction = (float)remaining / (float)max_steps;
    float span = (float)(t_max - t_min);
    return (float)t_min + span * fraction;
}

dg_sampler *dg_sampler_create(int32_t canvas_len, int32_t n_vocab, const dg_sampler_params *params,
                              int32_t rng_mode, uint64_t seed, int32_t n_threads, char *err, int32_t err_len) {
    if (params == NULL) {
        set_error(err, err_len, "sampler parameters missing");
        return NULL;
    }
    if (canvas_len < 1 || canvas_len > MAX_CANVAS) {
        set_error(err, err_len, "canvas length out of range");
        return NULL;
    }
    if (n_vocab < 1 || n_vocab > MAX_VOCAB) {
        set_error(err, err_len, "vocabulary size out of range");
        return NULL;
    }
    if (params->max_steps < 1 || params->max_steps > 100000) {
        set_error(err, err_len, "max_steps must be between 1 and 100000");
        return NULL;
    }
    if (!(params->t_min >= 0.0) || !(params->t_max > params->t_min) || !isfinite(params->t_max)) {
        set_error(err, err_len, "temperatures must satisfy 0 <= t_min < t_max (finite)");
        return NULL;
    }
    if (!(params->entropy_bound > 0.0) || !(params->confidence_threshold > 0.0)) {
        set_error(err, err_len, "entropy_bound and confidence_threshold must be > 0");
        return NULL;
    }
    if (params->stability_threshold < 0) {
        set_error(err, err_len, "stability_threshold must be >= 0");
        return NULL;
    }
    if (rng_mode != DG_RNG_FAST && rng_mode != DG_RNG_TORCH) {
        set_error(err, err_len, "unknown rng mode");
        return NULL;
    }
    if (n_threads < 1) {
        n_threads = 1;
    }
    if (n_threads > MAX_THREADS) {
        n_threads = MAX_THREADS;
    }
    if (n_threads > canvas_len) {
        n_threads = canvas_len;
    }

    dg_sampler *s = calloc(1, sizeof(*s));
    if (s == NULL) {
        set_error(err, err_len, "out of memory");
        return NULL;
    }
    s->C = canvas_len;
    s->V = n_vocab;
    s->p = *params;
    s->rng_mode = rng_mode;
    s->seed = seed;
    s->n_threads = n_threads;
    dg_mt_seed(&s->mt, (uint32_t)seed);  // torch.manual_seed(s) == init_genrand(s mod 2^32)

    // A history longer than N + 1 rows can never fill within one canvas, exactly like an S > N history in
    // transformers: stability stays false. Capping keeps the allocation bounded whatever S the caller passes.
    int64_t history_len = params->stability_threshold;
    if (history_len > (int64_t)params->max_steps + 1) {
        history_len = (int64_t)params->max_steps + 1;
    }
    s->history_len = (int32_t)history_len;

    size_t C = (size_t)canvas_len;
    s->history = malloc(sizeof(int32_t) * C * (size_t)(history_len > 0 ? history_len : 1));
    s->scratch = malloc(sizeof(float) * (size_t)n_vocab * (size_t)n_threads);
    s->draw = malloc(sizeof(int32_t) * C);
    s->argmax = malloc(sizeof(int32_t) * C);
    s->entropy = malloc(sizeof(float) * C);
    s->ranked = malloc(sizeof(ranked_position) * C);
    s->accepted = malloc(C);
    s->jobs = calloc((size_t)n_threads, sizeof(row_job));
    s->threads = calloc((size_t)n_threads, sizeof(pthread_t));
    if (!s->jobs || !s->threads || !s->history || !s->scratch || !s->draw || !s->argmax || !s->entropy ||
        !s->ranked || !s->accepted) {
        dg_sampler_free(s);
        set_error(err, err_len, "out of memory");
        return NULL;
    }
    return s;
}

void dg_sampler_free(dg_sampler *s) {
    if (s == NULL) {
        return;
    }
    free(s->history);
    free(s->scratch);
    free(s->draw);
    free(s->argmax);
    free(s->entropy);
    free(s->ranked);
    free(s->jobs);
    free(s->threads);
    free(s->accepted);
    free(s);
}

// C uniform tokens over the whole vocabulary (canvas init and renoise). Torch: randint(0, V, (C,)) = one 32-bit
// output per element, reduced mod V.
static void draw_uniform_tokens(dg_sampler *s, int32_t stream, int32_t *out) {
    if (s->rng_mode == DG_RNG_TORCH) {
        for (int32_t i = 0; i < s->C; i++) {
            out[i] = (int32_t)(dg_mt_next(&s->mt) % (uint32_t)s->V);
        }
    } else {
        for (int32_t i = 0; i < s->C; i++) {
            out[i] = (int32_t)dg_counter_below((uint32_t)s->V, s->seed, (uint64_t)stream, (uint64_t)s->canvas_index,
                                               (uint64_t)s->steps_done, (uint64_t)i);
        }
    }
}

int32_t dg_sampler_begin_canvas(dg_sampler *s, int32_t *canvas) {
    if (s == NULL || canvas == NULL) {
        return -1;
    }
    s->canvas_index++;
    s->steps_done = 0;
    s->history_fill = 0;
    s->history_head = 0;
    s->active = 1;
    draw_uniform_tokens(s, DG_STREAM_INIT, canvas);
    return 0;
}

// ---------------------------------------------------------------------------------------------------------------
// Per-row work

// Processes one row: z = raw / T, argmax (first maximum), entropy, and the categorical draw.
static void sample_row(row_job *job, int32_t row) {
    const dg_sampler *s = job->s;
    const int32_t V = s->V;
    const float *raw = job->raw + (int64_t)row * job->row_stride;
    const float T = job->temperature;
    float *e = job->scratch;

    // Pass 1: max and first argmax of the processed logits.
    float zmax = raw[0] / T;
    int32_t best = 0;
    for (int32_t v = 1; v < V; v++) {
        float z = raw[v] / T;
        if (z > zmax) {
            zmax = z;
            best = v;
        }
    }
    s->argmax[row] = best;

    // Pass 2: unnormalised probabilities e_v = exp(z_v - max); entropy H = log S - sum(e (z - max)) / S, in double.
    double sum = 0.0, weighted = 0.0;
    for (int32_t v = 0; v < V; v++) {
        float shifted = raw[v] / T - zmax;
        float ev = expf(shifted);
        e[v] = ev;
        sum += ev;
        weighted += (double)ev * (double)shifted;
    }
    double h = log(sum) - weighted / sum;
    s->entropy[row] = (float)(h > 0.0 ? h : 0.0);

    // Pass 3: the categorical draw (greedy variant: the argmax itself).
    int32_t drawn = best;
    if (s->p.greedy) {
        drawn = best;
    } else if (s->rng_mode == DG_RNG_TORCH) {
        // torch.multinomial(p, 1) = argmax_v p_v / Exp_v with Exp drawn row-major, two outputs per element;
        // p as torch's softmax makes it: e_v * (1 / sum), fp32. Every element consumes its two outputs, but the
        // logarithm is skipped when the ratio provably cannot beat the best so far (Exp >= u, see below).
        const float inv = 1.0f / (float)sum;
        float best_ratio = -1.0f;
        for (int32_t v = 0; v < V; v++) {
            double u = dg_mt_uniform53(&job->mt);
            float pv = e[v] * inv;
            // -log1p(-u) >= u, so u * best >= p (1 + 1e-6) implies fl(p / Exp) <= best: no new maximum.
            if (best_ratio > 0.0f && u * (double)best_ratio >= (double)pv * (1.0 + 1e-6)) {
                continue;
            }
            float exp_draw = (float)(-log1p(-u));
            float ratio = pv / exp_draw;
            if (ratio > best_ratio) {
                best_ratio = ratio;
                drawn = v;
            }
        }
    } else {
        // Inverse CDF with one counter-based uniform per row.
        double target = dg_counter_uniform(s->seed, DG_STREAM_CATEGORY, (uint64_t)s->canvas_index,
                                           (uint64_t)s->steps_done, (uint64_t)row) * sum;
        double cumulative = 0.0;
        for (int32_t v = 0; v < V; v++) {
            if (e[v] <= 0.0f) {
                continue;
            }
            cumulative += e[v];
            drawn = v;
            if (cumulative > target) {
                break;
            }
        }
    }
    s->draw[row] = drawn;
}

static void *run_rows(void *arg) {
    row_job *job = arg;
    for (int32_t row = job->row_begin; row < job->row_end; row++) {
        sample_row(job, row);
    }
    return NULL;
}

// Runs sample_row over all rows, contiguous blocks per thread. In torch mode each block gets the MT stream
// positioned at 2 * V * first_row outputs past the step's start (two outputs per exponential, row-major), and the
// sampler's own stream ends up 2 * C * V outputs further, as after torch's exponential_(C * V).
static void sample_rows(dg_sampler *s, const float *raw, int64_t row_stride, float T) {
    row_job *jobs = s->jobs;
    pthread_t *threads = s->threads;
    const int32_t nt = s->n_threads;
    const int use_mt = s->rng_mode == DG_RNG_TORCH && !s->p.greedy;
    const uint64_t per_row = 2 * (uint64_t)s->V;

    int32_t row = 0;
    for (int32_t t = 0; t < nt; t++) {
        int32_t rows = s->C / nt + (t < s->C % nt ? 1 : 0);
        jobs[t] = (row_job){s, raw, row_stride, T, row, row + rows, s->scratch + (size_t)t * (size_t)s->V, {{0}, 0}};
        if (use_mt) {
            jobs[t].mt = s->mt;
            dg_mt_skip(&s->mt, per_row * (uint64_t)rows);
        }
        row += rows;
    }

    int32_t started = 0;
    for (int32_t t = 1; t < nt; t++) {
        if (pthread_create(&threads[t], NULL, run_rows, &jobs[t]) != 0) {
            break;
        }
        started = t;
    }
    run_rows(&jobs[0]);
    // Blocks whose thread could not be started run here, so the result never depends on thread creation.
    for (int32_t t = started + 1; t < nt; t++) {
        run_rows(&jobs[t]);
    }
    for (int32_t t = 1; t <= started; t++) {
        pthread_join(threads[t], NULL);
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Acceptance, renoise, stop

static int compare_ranked(const void *a, const void *b) {
    const ranked_position *x = a, *y = b;
    if (x->entropy < y->entropy) return -1;
    if (x->entropy > y->entropy) return 1;
    return (x->pos > y->pos) - (x->pos < y->pos);  // ties by position: deterministic (torch's sort is unstable)
}

// Accept the positions whose lower-ranked entropies sum to <= B. torch: cumsum accumulates in double and rounds
// every prefix to fp32; cs - H and the comparison (B rounded to fp32) are fp32.
static int32_t accept_by_entropy_bound(dg_sampler *s) {
    ranked_position *ranked = s->ranked;
    for (int32_t i = 0; i < s->C; i++) {
        ranked[i] = (ranked_position){s->entropy[i], i};
    }
    qsort(ranked, (size_t)s->C, sizeof(ranked_position), compare_ranked);

    const float bound = (float)s->p.entropy_bound;
    double running = 0.0;
    int32_t n_accepted = 0;
    for (int32_t rank = 0; rank < s->C; rank++) {
        float h = ranked[rank].entropy;
        running += (double)h;
        float inclusive = (float)running;
        int ok = (inclusive - h) <= bound;
        s->accepted[ranked[rank].pos] = (uint8_t)ok;
        n_accepted += ok;
    }
    return n_accepted;
}

// Stable: the argmax canvas equals each of the last S argmax canvases (rows not yet written hold -1, which never
// equals a token id). Then the new argmax canvas enters the history, dropping the oldest.
static int update_stability(dg_sampler *s) {
    const int32_t S = s->p.stability_threshold;
    if (S == 0) {
        return 1;
    }
    const size_t C = (size_t)s->C;
    int stable = s->history_fill == s->history_len && s->history_len == S;
    for (int32_t k = 0; stable && k < s->history_len; k++) {
        stable = memcmp(s->history + (size_t)k * C, s->argmax, C * sizeof(int32_t)) == 0;
    }
    if (s->history_fill < s->history_len) {
        memcpy(s->history + (size_t)s->history_fill * C, s->argmax, C * sizeof(int32_t));
        s->history_fill++;
    } else if (s->history_len > 0) {
        memcpy(s->history + (size_t)s->history_head * C, s->argmax, C * sizeof(int32_t));
        s->history_head = (s->history_head + 1) % s->history_len;
    }
    return stable;
}

int32_t dg_sampler_reopen(dg_sampler *s, int32_t *canvas, const uint8_t *reset) {
    if (s == NULL || canvas == NULL || reset == NULL || s->canvas_index == 0) {
        return -1;
    }
    const int32_t left = s->p.max_steps - s->steps_done;
    if (left <= 0) {
        return 0;
    }
    for (int32_t i = 0; i < s->C; i++) {
        if (!reset[i]) continue;
        if (s->rng_mode == DG_RNG_TORCH) {
            canvas[i] = (int32_t)(dg_mt_next(&s->mt) % (uint32_t)s->V);
        } else {
            canvas[i] = (int32_t)dg_counter_below((uint32_t)s->V, s->seed, (uint64_t)DG_STREAM_REPAIR,
                                                  (uint64_t)s->canvas_index, (uint64_t)s->steps_done, (uint64_t)i);
        }
    }
    s->history_fill = 0;
    s->history_head = 0;
    s->active = 1;
    return left;
}

// Acceptance, renoise, stability and stop, from the rows' argmax, entropy and draw in s (one step at temperature T).
static void finish_step(dg_sampler *s, int32_t remaining, float T, int32_t *canvas, int32_t *argmax,
                        int32_t *sampled, float *entropy, uint8_t *accepted, dg_step_info *info) {
    const int32_t C = s->C;
    int32_t n_accepted = accept_by_entropy_bound(s);

    // Renoise: a full fresh canvas every step (torch draws randint(C) after the exponentials), then
    // accepted positions take the sampled token.
    draw_uniform_tokens(s, DG_STREAM_RENOISE, canvas);
    for (int32_t i = 0; i < C; i++) {
        if (s->accepted[i]) {
            canvas[i] = s->draw[i];
        }
    }

    int stable = update_stability(s);
    double total = 0.0;
    for (int32_t i = 0; i < C; i++) {
        total += (double)s->entropy[i];
    }
    float mean_entropy = (float)total / (float)C;
    int confident = mean_entropy < (float)s->p.confidence_threshold;

    s->steps_done++;
    int exhausted = s->steps_done >= s->p.max_steps;
    int stop = stable && confident;
    if (stop || exhausted) {
        s->active = 0;
    }

    if (argmax != NULL) memcpy(argmax, s->argmax, sizeof(int32_t) * (size_t)C);
    if (sampled != NULL) memcpy(sampled, s->draw, sizeof(int32_t) * (size_t)C);
    if (entropy != NULL) memcpy(entropy, s->entropy, sizeof(float) * (size_t)C);
    if (accepted != NULL) memcpy(accepted, s->accepted, (size_t)C);
    if (info != NULL) {
        *info = (dg_step_info){
            .step = s->steps_done,
            .remaining = remaining,
            .temperature = T,
            .mean_entropy = mean_entropy,
            .n_accepted = n_accepted,
            .stable = stable,
            .confident = confident,
            .stop = stop,
            .exhausted = exhausted,
        };
    }
}

static float step_temperature(const dg_sampler *s) {
    return dg_sampler_temperature(s->p.max_steps - s->steps_done, s->p.max_steps, s->p.t_min, s->p.t_max);
}

int32_t dg_sampler_step(dg_sampler *s, const float *raw_logits, int64_t row_stride, int32_t *canvas,
                        int32_t *argmax, int32_t *sampled, float *entropy, uint8_t *accepted, dg_step_info *info) {
    if (s == NULL || raw_logits == NULL || canvas == NULL || !s->active || s->steps_done >= s->p.max_steps ||
        row_stride < s->V) {
        return -1;
    }
    const float T = step_temperature(s);
    sample_rows(s, raw_logits, row_stride, T);
    finish_step(s, s->p.max_steps - s->steps_done, T, canvas, argmax, sampled, entropy, accepted, info);
    return 0;
}

// The largest float below 1 whose product with a positive float stays below it (1 - 2^-24 may round up to it): a
// uniform rounded to float and clamped to it keeps u · total below a row's total.
#define UNIFORM_MAX 0x1.fffffcp-1f

int32_t dg_sampler_draw_inputs(const dg_sampler *s, float *uniforms, float *temperature) {
    if (s == NULL || uniforms == NULL || temperature == NULL || s->rng_mode != DG_RNG_FAST || !s->active ||
        s->steps_done >= s->p.max_steps) {
        return -1;
    }
    for (int32_t row = 0; row < s->C; row++) {
        // the same uniform sample_row would draw with, rounded to float
        const float u = (float)dg_counter_uniform(s->seed, DG_STREAM_CATEGORY, (uint64_t)s->canvas_index,
                                                  (uint64_t)s->steps_done, (uint64_t)row);
        uniforms[row] = u < UNIFORM_MAX ? u : UNIFORM_MAX;
    }
    *temperature = step_temperature(s);
    return 0;
}

int32_t dg_sampler_step_reduced(dg_sampler *s, const int32_t *row_argmax, const float *row_entropy,
                                const int32_t *row_draw, int32_t *canvas, int32_t *argmax, int32_t *sampled,
                                float *entropy, uint8_t *accepted, dg_step_info *info) {
    if (s == NULL || row_argmax == NULL || row_entropy == NULL || row_draw == NULL || canvas == NULL || !s->active ||
        s->steps_done >= s->p.max_steps) {
        return -1;
    }
    for (int32_t i = 0; i < s->C; i++) {
        if (row_argmax[i] < 0 || row_argmax[i] >= s->V || row_draw[i] < 0 || row_draw[i] >= s->V) {
            return -2;
        }
    }
    for (int32_t i = 0; i < s->C; i++) {
        s->argmax[i] = row_argmax[i];
        s->draw[i] = s->p.greedy ? row_argmax[i] : row_draw[i];
        s->entropy[i] = row_entropy[i] > 0.0f ? row_entropy[i] : 0.0f;  // as sample_row: NaN and rounding below 0
    }
    const float T = step_temperature(s);
    finish_step(s, s->p.max_steps - s->steps_done, T, canvas, argmax, sampled, entropy, accepted, info);
    return 0;
}
