/* Few-row products with row-major weights: y[r, o] = x[r, :] . W[o, :] for o in a row range.
 *
 * Why row-major: decoding a handful of tokens is bound by streaming the weights once. With W
 * row-major ([out, in], torch's own layout) a thread's share of output rows is ONE contiguous
 * stretch of memory, read front to back, while the x rows (<= 16 x 6 KB) stay in L1/L2; the
 * column-major strips of skinny_linear.c read 32 interleaved streams instead. Measured on the
 * 2-core AVX2 EPYC over SmolLM2-135M's float32 weights (bench/decode_bench.py, docs/engine.md
 * "Native CPU decode"): see the doc for the numbers that chose this layout.
 *
 * One x row (batch 1): one weight row at a time, prefetching 2 KB ahead; bf16 weights read two
 * at a time from each 32-bit lane against an x permuted once per call (ks_dot_bf16_pairs: a
 * shift and a mask instead of a widening shuffle per value), float32 with AVX-512 where the CPU
 * has it (ks_dot_f32_512), else eight FMA chains (ks_dot8). 2-16 x rows of bf16 weights with
 * AVX-512: the same pairs, each weight row against four x rows at a time (ks_row_pairs). 2-8 x
 * rows of float32 weights with AVX-512: each weight row against up to four x rows, every row
 * summed in the single-row order (ks_rows_f32_512: bit-identical to m one-row products). Else,
 * 2-8 x rows: one
 * weight row at a time against up to four x rows, two chains each (ks_row_xs), the row re-read
 * from L1 for the next four. 9-16 x rows: four weight rows against two x rows at a time
 * (ks_block4: fewer loads per FMA, which starts to matter as the product nears compute-bound).
 * Every weight byte comes from memory once whatever the row count; each shape was chosen by
 * timing it against the others on the 2-core EPYC (docs/engine.md, "Native CPU decode").
 * bfloat16 weights are widened in registers (zero-extend to 32 bits, shift left by 16: exact)
 * and accumulated in float32, as torch's bf16 GEMV does. AVX2+FMA where the compiler targets
 * it (-march=native), a portable scalar loop otherwise.
 */
#ifndef KEYSERVE_GEMV_H
#define KEYSERVE_GEMV_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define KS_GEMV_AVX2 1
#if defined(__AVX512F__)
#define KS_GEMV_AVX512 1
#endif
#endif

/* How far ahead of the row being read a single-row product prefetches its weights: past the
 * 4 KB page the hardware streamer stops at. Measured best of 512-8192 B on the AMX Xeon. */
#define KS_PREFETCH_BYTES 2048

enum { KS_F32 = 0, KS_BF16 = 1 };

static inline float ks_bf16_to_f32(uint16_t v) {
    uint32_t u = ((uint32_t)v) << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round-to-nearest-even to bfloat16 (torch's rounding), NaN kept quiet. Branch-free, so the
 * loops that call it vectorise (elementwise.c). */
static inline uint16_t ks_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)((u >> 16) | 0x40u) : (uint16_t)rounded;
}

static inline float ks_round_bf16(float f) { return ks_bf16_to_f32(ks_f32_to_bf16(f)); }

/* Element k of a weight row in either dtype (the scalar paths). */
static inline float ks_w_at(const void *w, int wdt, int64_t k) {
    return wdt == KS_BF16 ? ks_bf16_to_f32(((const uint16_t *)w)[k]) : ((const float *)w)[k];
}

#ifdef KS_GEMV_AVX2
static inline __attribute__((always_inline)) __m256 ks_load8(const void *w, int wdt, int64_t k) {
    if (wdt == KS_BF16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + k));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)w + k);
}

/* [sum(a0), sum(a1), sum(a2), sum(a3)] */
static inline __m128 ks_hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

/* Weight rows o..o+3 against x rows r0..r0+M-1 (M = 1 or 2; constant at each call site so the
 * accumulators stay in registers). in8 = in rounded down to 8; the rest is scalar. */
static inline __attribute__((always_inline)) void ks_block4(
    const float *x, int ldx, int in, int in8, const void *w, int wdt, int o, int r0, int M,
    float *y, int ldy) {
    __m256 acc[2][4];
    for (int r = 0; r < M; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = _mm256_setzero_ps();
    const int64_t base = (int64_t)o * in;
    for (int i = 0; i < in8; i += 8) {
        __m256 w0 = ks_load8(w, wdt, base + i);
        __m256 w1 = ks_load8(w, wdt, base + in + i);
        __m256 w2 = ks_load8(w, wdt, base + 2 * (int64_t)in + i);
        __m256 w3 = ks_load8(w, wdt, base + 3 * (int64_t)in + i);
        for (int r = 0; r < M; r++) {
            __m256 xv = _mm256_loadu_ps(x + (int64_t)(r0 + r) * ldx + i);
            acc[r][0] = _mm256_fmadd_ps(xv, w0, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(xv, w1, acc[r][1]);
            acc[r][2] = _mm256_fmadd_ps(xv, w2, acc[r][2]);
            acc[r][3] = _mm256_fmadd_ps(xv, w3, acc[r][3]);
        }
    }
    for (int r = 0; r < M; r++) {
        float s[4];
        _mm_storeu_ps(s, ks_hsum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
        const float *xr = x + (int64_t)(r0 + r) * ldx;
        for (int i = in8; i < in; i++)
            for (int j = 0; j < 4; j++) s[j] += xr[i] * ks_w_at(w, wdt, base + (int64_t)j * in + i);
        for (int j = 0; j < 4; j++) y[(int64_t)(r0 + r) * ldy + o + j] = s[j];
    }
}

/* One weight row against one x row with eight independent accumulators: the single-row
 * (batch-1) case. More chains in flight let the core issue loads further ahead, which is what
 * a memory-bound stream needs: measured faster than four rows side by side (ks_block4 with
 * M = 1) and than fewer accumulators, at one and two threads. */
static inline __attribute__((always_inline)) float ks_dot8(const float *x, int in, const void *w, int wdt, int64_t base) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    int i = 0;
    for (; i + 64 <= in; i += 64) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), ks_load8(w, wdt, base + i), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 8), ks_load8(w, wdt, base + i + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 16), ks_load8(w, wdt, base + i + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 24), ks_load8(w, wdt, base + i + 24), a3);
        a4 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 32), ks_load8(w, wdt, base + i + 32), a4);
        a5 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 40), ks_load8(w, wdt, base + i + 40), a5);
        a6 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 48), ks_load8(w, wdt, base + i + 48), a6);
        a7 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i + 56), ks_load8(w, wdt, base + i + 56), a7);
    }
    for (; i + 8 <= in; i += 8)
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), ks_load8(w, wdt, base + i), a0);
    float s4[4];
    _mm_storeu_ps(s4, ks_hsum4(_mm256_add_ps(a0, a4), _mm256_add_ps(a1, a5),
                               _mm256_add_ps(a2, a6), _mm256_add_ps(a3, a7)));
    float s = (s4[0] + s4[1]) + (s4[2] + s4[3]);
    for (; i < in; i++) s += x[i] * ks_w_at(w, wdt, base + i);
    return s;
}

/* bfloat16 weights, two at a time: one 32-bit lane holds the pair (w[2i], w[2i+1]) with w[2i]
 * in its low half (little-endian), so `lane << 16` is w[2i] as a float32 and
 * `lane & 0xffff0000` is w[2i+1] -- exact, and two ALU ops per 2 x VEC values instead of a
 * widening shuffle and a shift per VEC. x is permuted once per call to match: each chunk of
 * 2 * VEC floats becomes its VEC even-indexed values, then its VEC odd-indexed ones. */
static inline void ks_pair_permute(const float *x, int in, int vec, float *xp) {
    for (int c = 0; c < in; c += 2 * vec)
        for (int j = 0; j < vec; j++) {
            xp[c + j] = x[c + 2 * j];
            xp[c + vec + j] = x[c + 2 * j + 1];
        }
}

#ifdef KS_GEMV_AVX512
/* One float32 weight row against x rows r0..r0+M-1 (M <= 4, constant per call site): four
 * chains per x row, 64 values a step, prefetching ahead. The single-row product is this with
 * M = 1 (ks_dot_f32_512), so every row's result is bit-identical to it by construction: a
 * verification step's K + 1 rows give the very logits K + 1 plain decode steps would. The
 * weight row streams once; the x rows come from L1. */
static inline __attribute__((always_inline)) void ks_rows_f32_512(
    const float *x, int ldx, int in, const float *w, int r0, int M, float *y, int ldy, int o) {
    __m512 a[4][4];
    for (int r = 0; r < M; r++) a[r][0] = a[r][1] = a[r][2] = a[r][3] = _mm512_setzero_ps();
    int i = 0;
    for (; i + 64 <= in; i += 64) {
        const char *ahead = (const char *)(w + i) + KS_PREFETCH_BYTES;
        _mm_prefetch(ahead, _MM_HINT_T0);
        _mm_prefetch(ahead + 64, _MM_HINT_T0);
        _mm_prefetch(ahead + 128, _MM_HINT_T0);
        _mm_prefetch(ahead + 192, _MM_HINT_T0);
        const __m512 w0 = _mm512_loadu_ps(w + i), w1 = _mm512_loadu_ps(w + i + 16);
        const __m512 w2 = _mm512_loadu_ps(w + i + 32), w3 = _mm512_loadu_ps(w + i + 48);
        for (int r = 0; r < M; r++) {
            const float *xr = x + (int64_t)(r0 + r) * ldx + i;
            a[r][0] = _mm512_fmadd_ps(_mm512_loadu_ps(xr), w0, a[r][0]);
            a[r][1] = _mm512_fmadd_ps(_mm512_loadu_ps(xr + 16), w1, a[r][1]);
            a[r][2] = _mm512_fmadd_ps(_mm512_loadu_ps(xr + 32), w2, a[r][2]);
            a[r][3] = _mm512_fmadd_ps(_mm512_loadu_ps(xr + 48), w3, a[r][3]);
        }
    }
    const int body = i;
    for (int r = 0; r < M; r++) {
        const float *xr = x + (int64_t)(r0 + r) * ldx;
        int k = body;
        for (; k + 16 <= in; k += 16) a[r][0] = _mm512_fmadd_ps(_mm512_loadu_ps(xr + k), _mm512_loadu_ps(w + k), a[r][0]);
        float s = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[r][0], a[r][2]), _mm512_add_ps(a[r][1], a[r][3])));
        for (; k < in; k++) s += xr[k] * w[k];
        y[(int64_t)(r0 + r) * ldy + o] = s;
    }
}

/* One float32 weight row . x: ks_rows_f32_512 with one x row. */
static inline __attribute__((always_inline)) float ks_dot_f32_512(const float *x, int in, const float *w) {
    float s;
    ks_rows_f32_512(x, 0, in, w, 0, 1, &s, 0, 0);
    return s;
}

/* 2-8 x rows against float32 weights: one weight row at a time against groups of up to four x
 * rows (ks_rows_f32_512). */
static inline void ks_gemv_f32_rows_512(const float *x, int m, int ldx, int in, const float *w,
                                        int o0, int o1, float *y, int ldy) {
    for (int o = o0; o < o1; o++) {
        const float *row = w + (int64_t)o * in;
        int r0 = 0;
        for (; r0 + 4 <= m; r0 += 4) ks_rows_f32_512(x, ldx, in, row, r0, 4, y, ldy, o);
        switch (m - r0) {
            case 1: ks_rows_f32_512(x, ldx, in, row, r0, 1, y, ldy, o); break;
            case 2: ks_rows_f32_512(x, ldx, in, row, r0, 2, y, ldy, o); break;
            case 3: ks_rows_f32_512(x, ldx, in, row, r0, 3, y, ldy, o); break;
            default: break;
        }
    }
}

/* One bf16 weight row . x (x pair-permuted with vec = 16; in % 32 == 0), 64 values a step. */
static inline __attribute__((always_inline)) float ks_dot_bf16_pairs(const float *xp, int in, const uint16_t *w) {
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int i = 0;
    for (; i + 64 <= in; i += 64) {
        const char *ahead = (const char *)(w + i) + KS_PREFETCH_BYTES;
        _mm_prefetch(ahead, _MM_HINT_T0);
        _mm_prefetch(ahead + 64, _MM_HINT_T0);
        const __m512i v0 = _mm512_loadu_si512(w + i), v1 = _mm512_loadu_si512(w + i + 32);
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(xp + i), _mm512_castsi512_ps(_mm512_slli_epi32(v0, 16)), a0);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(xp + i + 16), _mm512_castsi512_ps(_mm512_and_si512(v0, hi)), a1);
        a2 = _mm512_fmadd_ps(_mm512_loadu_ps(xp + i + 32), _mm512_castsi512_ps(_mm512_slli_epi32(v1, 16)), a2);
        a3 = _mm512_fmadd_ps(_mm512_loadu_ps(xp + i + 48), _mm512_castsi512_ps(_mm512_and_si512(v1, hi)), a3);
    }
    for (; i < in; i += 32) {
        const __m512i v0 = _mm512_loadu_si512(w + i);
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(xp + i), _mm512_castsi512_ps(_mm512_slli_epi32(v0, 16)), a0);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(xp + i + 16), _mm512_castsi512_ps(_mm512_and_si512(v0, hi)), a1);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a2), _mm512_add_ps(a1, a3)));
}
#define KS_PAIR_VEC 16
#else
/* AVX2: one bf16 weight row . x (x pair-permuted with vec = 8; in % 16 == 0), 64 values a
 * step in eight chains (more chains in flight: see ks_dot8). */
static inline __attribute__((always_inline)) float ks_dot_bf16_pairs(const float *xp, int in, const uint16_t *w) {
    const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
    __m256 a[8];
    for (int k = 0; k < 8; k++) a[k] = _mm256_setzero_ps();
    int i = 0;
    for (; i + 64 <= in; i += 64) {
        _mm_prefetch((const char *)(w + i) + KS_PREFETCH_BYTES, _MM_HINT_T0);
        _mm_prefetch((const char *)(w + i) + KS_PREFETCH_BYTES + 64, _MM_HINT_T0);
        for (int k = 0; k < 4; k++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(w + i + 16 * k));
            a[2 * k] = _mm256_fmadd_ps(_mm256_loadu_ps(xp + i + 16 * k),
                                       _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), a[2 * k]);
            a[2 * k + 1] = _mm256_fmadd_ps(_mm256_loadu_ps(xp + i + 16 * k + 8),
                                           _mm256_castsi256_ps(_mm256_and_si256(v, hi)), a[2 * k + 1]);
        }
    }
    for (; i < in; i += 16) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(w + i));
        a[0] = _mm256_fmadd_ps(_mm256_loadu_ps(xp + i), _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), a[0]);
        a[1] = _mm256_fmadd_ps(_mm256_loadu_ps(xp + i + 8), _mm256_castsi256_ps(_mm256_and_si256(v, hi)), a[1]);
    }
    float s4[4];
    _mm_storeu_ps(s4, ks_hsum4(_mm256_add_ps(a[0], a[4]), _mm256_add_ps(a[1], a[5]),
                               _mm256_add_ps(a[2], a[6]), _mm256_add_ps(a[3], a[7])));
    return (s4[0] + s4[1]) + (s4[2] + s4[3]);
}
#define KS_PAIR_VEC 8
#endif

/* A thread's scratch for pair-permuted x rows, grown on demand and kept for the thread's life
 * (no allocation per call once it fits; NULL where memory runs out: callers fall back). */
static inline float *ks_pair_scratch(size_t floats) {
    static __thread float *buf = NULL;
    static __thread size_t cap = 0;
    if (floats > cap) {
        float *grown = aligned_alloc(64, ((floats * sizeof(float) + 63) / 64) * 64);
        if (!grown) return NULL;
        free(buf);
        buf = grown;
        cap = floats;
    }
    return buf;
}

/* The single-row (batch-1 decode) product where a faster kernel than ks_dot8 applies: bf16
 * weights two at a time (ks_dot_bf16_pairs), float32 with AVX-512. Returns 0 where it does
 * not (the caller runs ks_dot8). Measured on the AMX Xeon (docs/engine.md): bf16 ~1.3x and
 * float32 ~1.05x ks_dot8's bytes per second at one thread. */
static inline __attribute__((always_inline)) int ks_gemv1_fast(const float *x, int in, const void *w, int wdt,
                                                               int o0, int o1, float *y) {
    if (wdt == KS_BF16) {
        float *xp = in % (2 * KS_PAIR_VEC) == 0 ? ks_pair_scratch((size_t)in) : NULL;
        if (!xp) return 0;
        ks_pair_permute(x, in, KS_PAIR_VEC, xp);
        const uint16_t *wb = (const uint16_t *)w;
        for (int o = o0; o < o1; o++) y[o] = ks_dot_bf16_pairs(xp, in, wb + (int64_t)o * in);
        return 1;
    }
#ifdef KS_GEMV_AVX512
    const float *wf = (const float *)w;
    for (int o = o0; o < o1; o++) y[o] = ks_dot_f32_512(x, in, wf + (int64_t)o * in);
    return 1;
#else
    return 0;
#endif
}

#ifdef KS_GEMV_AVX512
/* One bf16 weight row against pair-permuted x rows r0..r0+M-1 (M <= 4, constant per call
 * site; in % 32 == 0): the row is read once, split into its even and odd halves, and used by
 * every x row from registers. */
static inline __attribute__((always_inline)) void ks_row_pairs(
    const float *xp, int in, const uint16_t *w, int r0, int M, float *y, int ldy, int o) {
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
    __m512 a[4][2];
    for (int r = 0; r < M; r++) a[r][0] = a[r][1] = _mm512_setzero_ps();
    for (int i = 0; i < in; i += 32) {
        const __m512i v = _mm512_loadu_si512(w + i);
        const __m512 ev = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
        const __m512 od = _mm512_castsi512_ps(_mm512_and_si512(v, hi));
        for (int r = 0; r < M; r++) {
            const float *xr = xp + (int64_t)(r0 + r) * in + i;
            a[r][0] = _mm512_fmadd_ps(_mm512_loadu_ps(xr), ev, a[r][0]);
            a[r][1] = _mm512_fmadd_ps(_mm512_loadu_ps(xr + 16), od, a[r][1]);
        }
    }
    for (int r = 0; r < M; r++)
        y[(int64_t)(r0 + r) * ldy + o] = _mm512_reduce_add_ps(_mm512_add_ps(a[r][0], a[r][1]));
}

/* 2-16 x rows against bf16 weights, two weights per 32-bit lane (as ks_dot_bf16_pairs), each
 * weight row against groups of up to four x rows. Returns 0 where it does not apply. */
static inline int ks_gemv_pairs_rows(const float *x, int m, int ldx, int in, const void *w,
                                     int o0, int o1, float *y, int ldy) {
    float *xp = in % (2 * KS_PAIR_VEC) == 0 ? ks_pair_scratch((size_t)m * in) : NULL;
    if (!xp) return 0;
    for (int r = 0; r < m; r++) ks_pair_permute(x + (int64_t)r * ldx, in, KS_PAIR_VEC, xp + (int64_t)r * in);
    const uint16_t *wb = (const uint16_t *)w;
    for (int o = o0; o < o1; o++) {
        const uint16_t *row = wb + (int64_t)o * in;
        _mm_prefetch((const char *)row + KS_PREFETCH_BYTES, _MM_HINT_T0);
        int r0 = 0;
        for (; r0 + 4 <= m; r0 += 4) ks_row_pairs(xp, in, row, r0, 4, y, ldy, o);
        switch (m - r0) {
            case 1: ks_row_pairs(xp, in, row, r0, 1, y, ldy, o); break;
            case 2: ks_row_pairs(xp, in, row, r0, 2, y, ldy, o); break;
            case 3: ks_row_pairs(xp, in, row, r0, 3, y, ldy, o); break;
            default: break;
        }
    }
    return 1;
}
#endif

/* One weight row against x rows r0..r0+M-1 (M <= 4, constant per call site), two FMA chains
 * per x row: the weight row streams once, the x rows come from L1. */
static inline __attribute__((always_inline)) void ks_row_xs(
    const float *x, int ldx, int in, const void *w, int wdt, int64_t base, int r0, int M,
    float *y, int ldy, int o) {
    __m256 a[4][2];
    for (int r = 0; r < M; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= in; i += 16) {
        __m256 w0 = ks_load8(w, wdt, base + i), w1 = ks_load8(w, wdt, base + i + 8);
        for (int r = 0; r < M; r++) {
            const float *xr = x + (int64_t)(r0 + r) * ldx + i;
            a[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(xr), w0, a[r][0]);
            a[r][1] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8), w1, a[r][1]);
        }
    }
    for (; i + 8 <= in; i += 8) {
        __m256 w0 = ks_load8(w, wdt, base + i);
        for (int r = 0; r < M; r++)
            a[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + (int64_t)(r0 + r) * ldx + i), w0, a[r][0]);
    }
    for (int r = 0; r < M; r++) {
        __m256 t = _mm256_add_ps(a[r][0], a[r][1]);
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
        h = _mm_hadd_ps(h, h);
        h = _mm_hadd_ps(h, h);
        float s = _mm_cvtss_f32(h);
        const float *xr = x + (int64_t)(r0 + r) * ldx;
        for (int k = i; k < in; k++) s += xr[k] * ks_w_at(w, wdt, base + k);
        y[(int64_t)(r0 + r) * ldy + o] = s;
    }
}

/* One weight row against x rows (the out % 4 tail). */
static inline __attribute__((always_inline)) void ks_row1(const float *x, int m, int ldx, int in, int in8, const void *w,
                           int wdt, int o, float *y, int ldy) {
    const int64_t base = (int64_t)o * in;
    for (int r = 0; r < m; r++) {
        const float *xr = x + (int64_t)r * ldx;
        __m256 acc = _mm256_setzero_ps();
        for (int i = 0; i < in8; i += 8)
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(xr + i), ks_load8(w, wdt, base + i), acc);
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
        h = _mm_hadd_ps(h, h);
        h = _mm_hadd_ps(h, h);
        float s = _mm_cvtss_f32(h);
        for (int i = in8; i < in; i++) s += xr[i] * ks_w_at(w, wdt, base + i);
        y[(int64_t)r * ldy + o] = s;
    }
}
#endif

/* y[r * ldy + o] = x[r * ldx + :] . W[o, :] for o in [o0, o1), r < m. W row-major [out, in]
 * of dtype wdt; x float32. No bias (callers add it, then round as their dtype needs). */
static inline __attribute__((always_inline)) void ks_gemv_rows_impl(
    const float *x, int m, int ldx, int in, const void *w, int wdt, int o0, int o1, float *y,
    int ldy) {
#ifdef KS_GEMV_AVX2
    const int in8 = in & ~7;
    if (m == 1) {
        if (ks_gemv1_fast(x, in, w, wdt, o0, o1, y)) return;
        for (int o = o0; o < o1; o++) y[o] = ks_dot8(x, in, w, wdt, (int64_t)o * in);
        return;
    }
#ifdef KS_GEMV_AVX512
    if (wdt == KS_BF16 && ks_gemv_pairs_rows(x, m, ldx, in, w, o0, o1, y, ldy)) return;
    if (wdt == KS_F32 && m <= 8) {
        ks_gemv_f32_rows_512(x, m, ldx, in, (const float *)w, o0, o1, y, ldy);
        return;
    }
#endif
    if (m <= 8) {  /* one weight row at a time against groups of up to four x rows */
        for (int o = o0; o < o1; o++) {
            const int64_t base = (int64_t)o * in;
            int r0 = 0;
            for (; r0 + 4 <= m; r0 += 4) ks_row_xs(x, ldx, in, w, wdt, base, r0, 4, y, ldy, o);
            switch (m - r0) {
                case 1: ks_row_xs(x, ldx, in, w, wdt, base, r0, 1, y, ldy, o); break;
                case 2: ks_row_xs(x, ldx, in, w, wdt, base, r0, 2, y, ldy, o); break;
                case 3: ks_row_xs(x, ldx, in, w, wdt, base, r0, 3, y, ldy, o); break;
                default: break;
            }
        }
        return;
    }
    int o = o0;
    for (; o + 4 <= o1; o += 4) {
        int r0 = 0;
        for (; r0 + 2 <= m; r0 += 2) ks_block4(x, ldx, in, in8, w, wdt, o, r0, 2, y, ldy);
        if (r0 < m) ks_block4(x, ldx, in, in8, w, wdt, o, r0, 1, y, ldy);
    }
    for (; o < o1; o++) ks_row1(x, m, ldx, in, in8, w, wdt, o, y, ldy);
#else
    for (int o = o0; o < o1; o++)
        for (int r = 0; r < m; r++) {
            const float *xr = x + (int64_t)r * ldx;
            float s = 0.0f;
            if (wdt == KS_BF16) {
                const uint16_t *wr = (const uint16_t *)w + (int64_t)o * in;
                for (int i = 0; i < in; i++) s += xr[i] * ks_bf16_to_f32(wr[i]);
            } else {
                const float *wr = (const float *)w + (int64_t)o * in;
                for (int i = 0; i < in; i++) s += xr[i] * wr[i];
            }
            y[(int64_t)r * ldy + o] = s;
        }
#endif
}

/* The weight dtype as a constant in each copy of the loops: a dtype test inside the hot loop
 * (ks_load8) measured bf16 at ~60 % of the read bandwidth; specialised, the branch is gone. */
static inline void ks_gemv_rows(const float *x, int m, int ldx, int in, const void *w, int wdt,
                                int o0, int o1, float *y, int ldy) {
    if (wdt == KS_BF16)
        ks_gemv_rows_impl(x, m, ldx, in, w, KS_BF16, o0, o1, y, ldy);
    else
        ks_gemv_rows_impl(x, m, ldx, in, w, KS_F32, o0, o1, y, ldy);
}

/* This thread's share [*o0, *o1) of n output rows, split evenly in units of 4 rows. */
static inline void ks_split_rows(int n, int tid, int nt, int *o0, int *o1) {
    int units = (n + 3) / 4;
    int per = units / nt, extra = units % nt;
    int u0 = tid * per + (tid < extra ? tid : extra);
    int u1 = u0 + per + (tid < extra ? 1 : 0);
    *o0 = u0 * 4 < n ? u0 * 4 : n;
    *o1 = u1 * 4 < n ? u1 * 4 : n;
}

#endif
