/* float32 products of a few dozen rows as register-blocked outer products (f32_block.c), for
 * the one-call decode step (decode_stack.c). AVX-512 only: with AVX2's 16 registers the tile
 * does not fit, and the step keeps gemv.h's row kernel there. */
#ifndef KEYSERVE_F32_BLOCK_H
#define KEYSERVE_F32_BLOCK_H

#include <stdint.h>

#if defined(__AVX512F__)
#define KS_F32_BLOCK 1
#endif

#define KS_F32_BLOCK_ROWS 12 /* x rows per register tile (x 2 vectors of outputs: 24 accumulators) */
#define KS_F32_BLOCK_COLS 32 /* outputs per packed block */
/* Fewer rows stay on gemv.h's row kernel. 2 since the tiles prefetch the next packed block
 * (before, 8): a SmolLM2 float32 step of 2 rows 21.4 -> 20.2 ms, 4 rows 28.5 -> 23.0, 6 rows
 * 32.6 -> 25.6 (in-process engine, 2 threads, the Xeon). */
#define KS_F32_BLOCK_MIN_ROWS 2

/* 1 where this build has the kernel (AVX-512). */
int keyserve_f32_block_available(void);

#ifdef KS_F32_BLOCK
/* y[i, c0:c1] = x[i, :] . W[c0:c1, :] for i < m, columns c0..c1-1 (multiples of 32) of W [n, k]
 * packed by keyserve_f32_pack; x rows ldx apart, y rows ldy apart. */
void ks_f32_cols(const float *x, int m, int ldx, int64_t k, const float *packed, int64_t c0, int64_t c1,
                 float *y, int ldy);
#endif

#endif
