/* y = x @ W^T for a few rows of x (float32), with W stored column-major: wt = W^T, [in, out]
 * contiguous (keyserve keeps CPU float32 weights that way, model/matmul.py).
 *
 * Why: decoding a handful of tokens at once (speculative verification of K + 1 positions, small
 * batches) is bound by streaming the weights, so m rows should cost about what one row costs.
 * The BLAS that torch uses here treats m = 2..8 as a small GEMM and takes ~1.5-2x the time of
 * m = 1. This kernel reads every weight once: for a block of 32 input rows it walks all 16-wide
 * output strips, keeping the strip's m partial sums in registers (m <= 4 per pass; 5..8 rows
 * take two passes, the second from cache), so each weight row is read sequentially. Each
 * OpenMP thread owns a contiguous range of strips.
 */
#include <stddef.h>
#include <string.h>
#include <omp.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KS_AVX2 1
#endif

#define STRIP 16

#define IBLOCK 32

#ifdef KS_AVX2
/* Rows r0..r0+R-1 of x against output columns [o, o + 16), inputs [i0, i1): the block's
 * partial sums (in registers) are added to y (zeroed by the caller), so an input block streams
 * IBLOCK weight rows side by side across all strips (sequential per row). Summing per block
 * first keeps float32 rounding at two short chains instead of one as long as the input. */
static inline void strip_avx2(const float *x, int in, const float *wt, int out, float *y,
                              int o, int r0, int R, int i0, int i1) {
    __m256 a0[4], a1[4];
    for (int r = 0; r < R; r++) {
        a0[r] = _mm256_setzero_ps();
        a1[r] = _mm256_setzero_ps();
    }
    const float *w = wt + (size_t)i0 * out + o;
    for (int i = i0; i < i1; i++, w += out) {
        __m256 w0 = _mm256_loadu_ps(w);
        __m256 w1 = _mm256_loadu_ps(w + 8);
        for (int r = 0; r < R; r++) {  /* R is 1..4: the compiler unrolls per call site */
            __m256 xv = _mm256_broadcast_ss(x + (size_t)(r0 + r) * in + i);
            a0[r] = _mm256_fmadd_ps(xv, w0, a0[r]);
            a1[r] = _mm256_fmadd_ps(xv, w1, a1[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        float *dst = y + (size_t)(r0 + r) * out + o;
        _mm256_storeu_ps(dst, _mm256_add_ps(_mm256_loadu_ps(dst), a0[r]));
        _mm256_storeu_ps(dst + 8, _mm256_add_ps(_mm256_loadu_ps(dst + 8), a1[r]));
    }
}

static void strips_avx2(const float *x, int m, int in, const float *wt, int out, float *y,
                        int s0, int s1) {
    for (int i0 = 0; i0 < in; i0 += IBLOCK) {
        int i1 = i0 + IBLOCK < in ? i0 + IBLOCK : in;
        for (int s = s0; s < s1; s++) {
            int o = s * STRIP;
            for (int r0 = 0; r0 < m; r0 += 4) {
                int R = m - r0 < 4 ? m - r0 : 4;
                switch (R) {  /* constant R per branch: the accumulators stay in registers */
                    case 1: strip_avx2(x, in, wt, out, y, o, r0, 1, i0, i1); break;
                    case 2: strip_avx2(x, in, wt, out, y, o, r0, 2, i0, i1); break;
                    case 3: strip_avx2(x, in, wt, out, y, o, r0, 3, i0, i1); break;
                    default: strip_avx2(x, in, wt, out, y, o, r0, 4, i0, i1); break;
                }
            }
        }
    }
}
#endif

/* Scalar columns [o, o_end) (the tail that does not fill a strip, or no AVX2). */
static void columns_scalar(const float *x, int m, int in, const float *wt, int out, float *y,
                           int o, int o_end) {
    for (int r = 0; r < m; r++) {
        float acc[STRIP];
        int n = o_end - o;
        memset(acc, 0, sizeof(acc));
        for (int i = 0; i < in; i++) {
            float xv = x[(size_t)r * in + i];
            const float *w = wt + (size_t)i * out + o;
            for (int t = 0; t < n; t++) acc[t] += xv * w[t];
        }
        for (int t = 0; t < n; t++) y[(size_t)r * out + o + t] = acc[t];
    }
}

void keyserve_skinny_linear(const float *x, int m, int in, const float *wt, int out, float *y) {
    int strips = out / STRIP;
#ifdef KS_AVX2
    memset(y, 0, sizeof(float) * (size_t)m * out);
#pragma omp parallel
    {
        int nt = omp_get_num_threads(), t = omp_get_thread_num();
        int per = (strips + nt - 1) / nt;
        int s0 = t * per, s1 = s0 + per < strips ? s0 + per : strips;
        if (s0 < s1) strips_avx2(x, m, in, wt, out, y, s0, s1);
    }
#else
#pragma omp parallel for schedule(static)
    for (int s = 0; s < strips; s++) columns_scalar(x, m, in, wt, out, y, s * STRIP, s * STRIP + STRIP);
#endif
    if (strips * STRIP < out) columns_scalar(x, m, in, wt, out, y, strips * STRIP, out);
}
