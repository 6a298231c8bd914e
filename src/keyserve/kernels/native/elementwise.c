/* The model's elementwise work between its matrix products, fused: residual add + RMSNorm,
 * SiLU(gate) * up, and rotary embedding, one pass each over rows of float32 or bfloat16.
 *
 * Why: in bfloat16 every torch op widens, computes and rounds in its own pass, and the torch
 * path's RMSNorm alone is six of them (to float, square, mean, rsqrt, scale, back, times the
 * weight). A profile of a 2048-token prefill chunk (issue 18, bench/mixed_profile.py) put the
 * elementwise ops at as much time as the chunk's matrix products. Here each op is one pass,
 * with bfloat16 rounded at exactly the points torch rounds (model/norm.py, model/llama.py,
 * model/rope.py), so the result is the torch path's up to float32 summation order.
 *
 * Every loop is written once per dtype with the dtype fixed, and the bf16 conversions
 * (gemv.h's) are branch-free, so the compiler vectorises them: a first version that tested the dtype per
 * element and rounded through a branch cost more CPU than the torch ops it replaced.
 *
 * dtype: 0 = float32, 1 = bfloat16 (KS_F32 / KS_BF16); every tensor of a call has it.
 * Rows are split over threads when a call has enough elements to pay for waking them.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include "gemv.h"
#include "vecmath.h"

/* Below this many elements one thread is faster than waking the team (decode rows). */
#define PARALLEL_MIN 65536

static int threads_for(int64_t elements, int num_threads) {
    return elements < PARALLEL_MIN || num_threads < 1 ? 1 : num_threads;
}

/* float32: h_out = h + y; out = h_out * (1 / sqrt(mean(h_out^2) + eps)) * w (torch.rms_norm). */
static void add_rms_norm_f32(const float *h, const float *y, float *h_out, const float *w, float *out,
                             int64_t rows, int hidden, float eps, int nt) {
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t r = 0; r < rows; r++) {
        const float *x = h + r * hidden;
        if (y) {
            float *xo = h_out + r * hidden;
            const float *yr = y + r * hidden;
#pragma omp simd
            for (int i = 0; i < hidden; i++) xo[i] = x[i] + yr[i];
            x = xo;
        }
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int i = 0; i < hidden; i++) ss += x[i] * x[i];
        const float inv = 1.0f / sqrtf(ss / (float)hidden + eps);
        float *o = out + r * hidden;
#pragma omp simd
        for (int i = 0; i < hidden; i++) o[i] = x[i] * inv * w[i];
    }
}

/* bfloat16: h_out = bf16(h + y); out = bf16(w * bf16(h_out * rsqrt(mean(h_out^2) + eps))),
 * model/norm.py's order (the normalised value rounded before the weight). */
static void add_rms_norm_bf16(const uint16_t *h, const uint16_t *y, uint16_t *h_out, const uint16_t *w,
                              uint16_t *out, int64_t rows, int hidden, float eps, int nt) {
#pragma omp parallel for schedule(static) num_threads(nt)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *x = h + r * hidden;
        if (y) {
            uint16_t *xo = h_out + r * hidden;
            const uint16_t *yr = y + r * hidden;
#pragma omp simd
            for (int i = 0; i < hidden; i++) xo[i] = ks_f32_to_bf16(ks_bf16_to_f32(x[i]) + ks_bf16_to_f32(yr[i]));
            x = xo;
        }
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int i = 0; i < hidden; i++) ss += ks_bf16_to_f32(x[i]) * ks_bf16_to_f32(x[i]);
        const float inv = 1.0f / sqrtf(ss / (float)hidden + eps);
        uint16_t *o = out + r * hidden;
#pragma omp simd
        for (int i = 0; i < hidden; i++) o[i] = ks_f32_to_bf16(ks_bf16_to_f32(w[i]) * ks_round_bf16(ks_bf16_to_f32(x[i]) * inv));
    }
}

/* With y: h_out = h + y; then out = rms_norm(h_out) * w. y and h_out may be NULL (the norm of
 * h). h, y, h_out, out: [rows, hidden]; w: [hidden]. */
void keyserve_add_rms_norm(const void *h, const void *y, void *h_out, const void *w, void *out,
                           int64_t rows, int hidden, float eps, int dt, int num_threads) {
    const int nt = threads_for(rows * hidden, num_threads);
    if (dt == KS_BF16)
        add_rms_norm_bf16(h, y, h_out, w, out, rows, hidden, eps, nt);
    else
        add_rms_norm_f32(h, y, h_out, w, out, rows, hidden, eps, nt);
}

/* act[r, f] = silu(gu[r, f]) * gu[r, inter + f], as model/llama.py's LlamaMLP: in bfloat16
 * SiLU's result is rounded, then the product. gu: [rows, 2 * inter]; act: [rows, inter]. */
void keyserve_silu_mul(const void *gu, void *act, int64_t rows, int inter, int dt, int num_threads) {
    const int nt = threads_for(rows * inter, num_threads);
    if (dt == KS_BF16) {
#pragma omp parallel for schedule(static) num_threads(nt)
        for (int64_t r = 0; r < rows; r++) {
            const uint16_t *g = (const uint16_t *)gu + r * 2 * inter, *u = g + inter;
            uint16_t *a = (uint16_t *)act + r * inter;
#pragma omp simd
            for (int f = 0; f < inter; f++) {
                const float x = ks_bf16_to_f32(g[f]);
                a[f] = ks_f32_to_bf16(ks_round_bf16(x / (1.0f + expf(-x))) * ks_bf16_to_f32(u[f]));
            }
        }
    } else {
#pragma omp parallel for schedule(static) num_threads(nt)
        for (int64_t r = 0; r < rows; r++) {
            const float *g = (const float *)gu + r * 2 * inter, *u = g + inter;
            float *a = (float *)act + r * inter;
#pragma omp simd
            for (int f = 0; f < inter; f++) a[f] = g[f] / (1.0f + expf(-g[f])) * u[f];
        }
    }
}

/* out[r, h] = x[r, h] * cos[r] + swap_halves(x[r, h]) * sin[r] for the first `heads` heads of
 * each row (model/rope.py's apply_rotary: cos = [c, c], sin = [-s, s], both already in dtype;
 * in bfloat16 each product and the sum are rounded). x: rows of x_stride elements, heads of d;
 * cos, sin: [rows, d]; out: [rows, heads, d] contiguous. */
void keyserve_rotary(const void *x, int64_t x_stride, const void *cos_, const void *sin_, void *out,
                     int64_t rows, int heads, int d, int dt, int num_threads) {
    const int half = d / 2, nt = threads_for(rows * heads * d, num_threads);
    if (dt == KS_BF16) {
#pragma omp parallel for schedule(static) num_threads(nt)
        for (int64_t r = 0; r < rows; r++) {
            const uint16_t *c = (const uint16_t *)cos_ + r * d, *s = (const uint16_t *)sin_ + r * d;
            for (int hh = 0; hh < heads; hh++) {
                const uint16_t *xi = (const uint16_t *)x + r * x_stride + (int64_t)hh * d;
                uint16_t *o = (uint16_t *)out + (r * heads + hh) * d;
#pragma omp simd
                for (int j = 0; j < half; j++) {
                    const float x1 = ks_bf16_to_f32(xi[j]), x2 = ks_bf16_to_f32(xi[j + half]);
                    o[j] = ks_f32_to_bf16(ks_round_bf16(x1 * ks_bf16_to_f32(c[j])) + ks_round_bf16(x2 * ks_bf16_to_f32(s[j])));
                    o[j + half] = ks_f32_to_bf16(ks_round_bf16(x2 * ks_bf16_to_f32(c[j + half])) + ks_round_bf16(x1 * ks_bf16_to_f32(s[j + half])));
                }
            }
        }
    } else {
#pragma omp parallel for schedule(static) num_threads(nt)
        for (int64_t r = 0; r < rows; r++) {
            const float *c = (const float *)cos_ + r * d, *s = (const float *)sin_ + r * d;
            for (int hh = 0; hh < heads; hh++) {
                const float *xi = (const float *)x + r * x_stride + (int64_t)hh * d;
                float *o = (float *)out + (r * heads + hh) * d;
#pragma omp simd
                for (int j = 0; j < half; j++) {
                    const float x1 = xi[j], x2 = xi[j + half];
                    o[j] = x1 * c[j] + x2 * s[j];
                    o[j + half] = x2 * c[j + half] + x1 * s[j + half];
                }
            }
        }
    }
}
