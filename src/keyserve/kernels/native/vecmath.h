/* Small math shared by the native kernels' attention (paged_decode.c, decode_stack.c).
 *
 * With KEYSERVE_LIBMVEC (x86-64 glibc), the `declare simd` prototypes let gcc call glibc's
 * 8-wide expf/logf in the simd loops (-fno-math-errno allows it). */
#ifndef KEYSERVE_VECMATH_H
#define KEYSERVE_VECMATH_H

#include <math.h>

#ifdef KEYSERVE_LIBMVEC
#pragma omp declare simd notinbranch
extern float expf(float);
#pragma omp declare simd notinbranch
extern float logf(float);
#endif

/* Softmax of x[0:n] into p[0:n] (p may alias x). */
static inline void softmax_into(const float *x, float *p, int n) {
    float m = -INFINITY;
#pragma omp simd reduction(max : m)
    for (int i = 0; i < n; i++) m = x[i] > m ? x[i] : m;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int i = 0; i < n; i++) {
        p[i] = expf(x[i] - m);
        sum += p[i];
    }
    const float inv = 1.0f / sum;
#pragma omp simd
    for (int i = 0; i < n; i++) p[i] *= inv;
}

#endif
