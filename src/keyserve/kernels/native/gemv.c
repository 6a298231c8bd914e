/* Exported few-row products over row-major float32 / bfloat16 weights (kernels in gemv.h), and
 * the streaming read the decode bench measures bandwidth with. */
#include <omp.h>
#include <stdint.h>

#include "gemv.h"

/* y [m, out] float32 = x [m, in] float32 @ W^T (+ bias), W row-major [out, in] of dtype wdt,
 * bias (may be NULL) of the same dtype. round_bf16: round every output to bfloat16 (what a
 * bf16 F.linear returns, kept in float32). Output rows are split evenly over the threads. */
void keyserve_gemv(const float *x, int m, int in, const void *w, int wdt, const void *bias,
                   int out, float *y, int round_bf16, int num_threads) {
    if (num_threads < 1) num_threads = 1;
#pragma omp parallel num_threads(num_threads)
    {
        int o0, o1;
        ks_split_rows(out, omp_get_thread_num(), omp_get_num_threads(), &o0, &o1);
        ks_gemv_rows(x, m, in, in, w, wdt, o0, o1, y, out);
        if (bias || round_bf16)
            for (int r = 0; r < m; r++)
                for (int o = o0; o < o1; o++) {
                    float v = y[(int64_t)r * out + o];
                    if (bias) v += ks_w_at(bias, wdt, o);
                    y[(int64_t)r * out + o] = round_bf16 ? ks_round_bf16(v) : v;
                }
    }
}

/* Sum of n floats read front to back, the threads each taking one contiguous half: the read
 * bandwidth a weight stream can hope for at this thread count. */
double keyserve_read_stream(const float *buf, int64_t n, int num_threads) {
    double total = 0.0;
    if (num_threads < 1) num_threads = 1;
#pragma omp parallel num_threads(num_threads) reduction(+ : total)
    {
        int t = omp_get_thread_num(), nt = omp_get_num_threads();
        int64_t per = (n / nt) & ~(int64_t)31;
        int64_t lo = t * per, hi = t == nt - 1 ? n : lo + per;
#ifdef KS_GEMV_AVX2
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        int64_t i = lo;
        for (; i + 32 <= hi; i += 32) {
            a0 = _mm256_add_ps(a0, _mm256_loadu_ps(buf + i));
            a1 = _mm256_add_ps(a1, _mm256_loadu_ps(buf + i + 8));
            a2 = _mm256_add_ps(a2, _mm256_loadu_ps(buf + i + 16));
            a3 = _mm256_add_ps(a3, _mm256_loadu_ps(buf + i + 24));
        }
        float s[4];
        _mm_storeu_ps(s, ks_hsum4(a0, a1, a2, a3));
        double part = (double)s[0] + s[1] + s[2] + s[3];
        for (; i < hi; i++) part += buf[i];
#else
        double part = 0.0;
        for (int64_t i = lo; i < hi; i++) part += buf[i];
#endif
        total += part;
    }
    return total;
}
