/* float32 products of a few dozen rows as register-blocked outer products (f32_block.c), for
 * the one-call decode step (decode_stack.c). AVX-512 tiles: 12 rows x 32 outputs; AVX2 (16
 * registers) tiles: 6 rows x 16 outputs, half of a packed block at a time, the same layout. */
#ifndef KEYSERVE_F32_BLOCK_H
#define KEYSERVE_F32_BLOCK_H

#include <stdint.h>

#if defined(__AVX512F__)
#define KS_F32_BLOCK 1
#define KS_F32_BLOCK_ROWS 12 /* x rows per register tile (x 2 vectors of outputs: 24 accumulators) */
#elif defined(__AVX2__) && defined(__FMA__)
#define KS_F32_BLOCK 1
#define KS_F32_BLOCK_AVX2 1
#define KS_F32_BLOCK_ROWS 6 /* x rows per register tile (x 2 vectors of 8 outputs: 12 accumulators) */
#else
#define KS_F32_BLOCK_ROWS 12
#endif

#define KS_F32_BLOCK_COLS 32 /* outputs per packed block */
/* Fewer rows stay on gemv.h's row kernel. AVX-512: 2 since the tiles prefetch the next packed
 * block (before, 8): a SmolLM2 float32 step of 2 rows 21.4 -> 20.2 ms, 4 rows 28.5 -> 23.0, 6
 * rows 32.6 -> 25.6 (in-process engine, 2 threads, the Xeon). AVX2: 6 -- SmolLM2's 120 layer
 * weights, 2 threads, the 2-core EPYC: 4 / 5 rows 1.04x / 1.14x the row kernel's time, 6 / 8 /
 * 12 / 16 rows 0.82x / 0.92x / 0.81x / 0.74x (best of 7 interleaved). */
#ifdef KS_F32_BLOCK_AVX2
#define KS_F32_BLOCK_MIN_ROWS 6
#else
#define KS_F32_BLOCK_MIN_ROWS 2
#endif

/* 1 where this build has the AVX-512 tiles, 2 the AVX2 ones, 0 none. */
int keyserve_f32_block_available(void);

#ifdef KS_F32_BLOCK
/* y[i, c0:c1] = x[i, :] . W[c0:c1, :] for i < m, columns c0..c1-1 (multiples of 32) of W [n, k]
 * packed by keyserve_f32_pack; x rows ldx apart, y rows ldy apart. */
void ks_f32_cols(const float *x, int m, int ldx, int64_t k, const float *packed, int64_t c0, int64_t c1,
                 float *y, int ldy);
#endif

#endif
