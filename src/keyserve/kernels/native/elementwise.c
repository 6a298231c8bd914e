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
 * dtype: 0 = float32, 1 = bfloat16 (KS_F32 / KS_BF16); every tensor of a call has it.
 * Rows are split over threads when a call has enough elements to pay for waking them.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include "gemv.h"

/* Below this many elements one thread is faster than waking the team (decode rows). */
#define PARALLEL_MIN 65536

static inline float load_at(const void *p, int dt, int64_t k) {
    return dt == KS_BF16 ? ks_bf16_to_f32(((const uint16_t *)p)[k]) : ((const float *)p)[k];
}

static inline void store_at(void *p, int dt, int64_t k, float v) {
    if (dt == KS_BF16)
        ((uint16_t *)p)[k] = ks_f32_to_bf16(v);
    else
        ((float *)p)[k] = v;
}

static inline float round_as(int dt, float v) { return dt == KS_BF16 ? ks_round_bf16(v) : v; }

static int threads_for(int64_t elements, int num_threads) {
    return elements < PARALLEL_MIN || num_threads < 1 ? 1 : num_threads;
}

/* With y: h_out = h + y (rounded to dtype); then out = rms_norm(h_out) * w, as model/norm.py:
 * float32: x * (1 / sqrt(mean(x^2) + eps)) * w; bfloat16: the normalised value rounded to
 * bf16 before the product with the weight, the product rounded. y and h_out may be NULL (no
 * residual: the norm of h). h: [rows, hidden]; out: [rows, hidden]. */
void keyserve_add_rms_norm(const void *h, const void *y, void *h_out, const void *w, void *out,
                           int64_t rows, int hidden, float eps, int dt, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(threads_for(rows * hidden, num_threads))
    for (int64_t r = 0; r < rows; r++) {
        const int64_t base = r * hidden;
        if (y)
            for (int i = 0; i < hidden; i++)
                store_at(h_out, dt, base + i, round_as(dt, load_at(h, dt, base + i) + load_at(y, dt, base + i)));
        const void *x = y ? h_out : h;
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int i = 0; i < hidden; i++) {
            const float v = load_at(x, dt, base + i);
            ss += v * v;
        }
        const float inv = 1.0f / sqrtf(ss / (float)hidden + eps);
        if (dt == KS_BF16) {
            for (int i = 0; i < hidden; i++)
                store_at(out, dt, base + i, load_at(w, dt, i) * ks_round_bf16(load_at(x, dt, base + i) * inv));
        } else {
            const float *xf = (const float *)x, *wf = (const float *)w;
            float *o = (float *)out;
#pragma omp simd
            for (int i = 0; i < hidden; i++) o[base + i] = xf[base + i] * inv * wf[i];
        }
    }
}

/* act[r, f] = silu(gu[r, f]) * gu[r, inter + f], as model/llama.py's LlamaMLP: in bfloat16
 * SiLU's result is rounded, then the product. gu: [rows, 2 * inter]; act: [rows, inter]. */
void keyserve_silu_mul(const void *gu, void *act, int64_t rows, int inter, int dt, int num_threads) {
#pragma omp parallel for schedule(static) num_threads(threads_for(rows * inter, num_threads))
    for (int64_t r = 0; r < rows; r++) {
        const int64_t in = r * 2 * inter, o = r * inter;
        if (dt == KS_BF16) {
            for (int f = 0; f < inter; f++) {
                const float g = load_at(gu, dt, in + f);
                const float s = ks_round_bf16(g / (1.0f + expf(-g)));
                store_at(act, dt, o + f, s * load_at(gu, dt, in + inter + f));
            }
        } else {
            const float *x = (const float *)gu + in;
            float *a = (float *)act + o;
#pragma omp simd
            for (int f = 0; f < inter; f++) a[f] = x[f] / (1.0f + expf(-x[f])) * x[inter + f];
        }
    }
}

/* out[r, h] = x[r, h] * cos[r] + swap_halves(x[r, h]) * sin[r] for the first `heads` heads of
 * each row (model/rope.py's apply_rotary: cos = [c, c], sin = [-s, s], both already in dtype;
 * in bfloat16 each product and the sum are rounded). x: rows of x_stride elements, heads of d;
 * cos, sin: [rows, d]; out: [rows, heads, d] contiguous. */
void keyserve_rotary(const void *x, int64_t x_stride, const void *cos_, const void *sin_, void *out,
                     int64_t rows, int heads, int d, int dt, int num_threads) {
    const int half = d / 2;
#pragma omp parallel for schedule(static) num_threads(threads_for(rows * heads * d, num_threads))
    for (int64_t r = 0; r < rows; r++) {
        for (int hh = 0; hh < heads; hh++) {
            const int64_t xi = r * x_stride + (int64_t)hh * d, oi = (r * heads + hh) * d;
            for (int j = 0; j < d; j++) {
                const int sj = j < half ? j + half : j - half;
                const float a = round_as(dt, load_at(x, dt, xi + j) * load_at(cos_, dt, r * d + j));
                const float b = round_as(dt, load_at(x, dt, xi + sj) * load_at(sin_, dt, r * d + j));
                store_at(out, dt, oi + j, a + b);
            }
        }
    }
}
