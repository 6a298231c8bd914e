/* AMX tile products of a few dozen rows (amx_linear.c), for the kernels that call them from
 * inside their own OpenMP team (decode_stack.c). */
#ifndef KEYSERVE_AMX_H
#define KEYSERVE_AMX_H

#include <stdint.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__x86_64__)
#include <immintrin.h>
#define KS_AMX 1
#endif

#define KS_AMX_MAX_ROWS 64
/* One row stays on gemv.h's vector kernel (at the bandwidth bound there: 12.0 vs 12.5 ms per
 * SmolLM2 step); from two rows on AMX wins (bench/decode_rows_bench.py: 1.2-1.6x at 2-16 rows). */
#define KS_AMX_MIN_ROWS 2

/* 1 where this process may use AMX tiles (asks Linux for the tile state once), else 0. */
int keyserve_amx_available(void);

#ifdef KS_AMX
/* Load / release this thread's tile configuration around ks_amx_cols calls. */
void ks_amx_begin(void);
void ks_amx_end(void);
/* y[i, c0:c1] = x[i, :] . W[c0:c1, :] (float32 sums), i < m <= KS_AMX_MAX_ROWS, columns
 * c0..c1-1 (multiples of 16) of W [n, k] packed by keyserve_amx_pack; x: float32 rows ldx
 * apart holding bf16 values. Scratch: xbf 64 * k bf16, acc (c1 - c0) / 16 * 1024 floats. */
void ks_amx_cols(const float *x, int m, int ldx, int64_t k, const uint16_t *packed, int64_t n, int64_t c0,
                 int64_t c1, float *y, int ldy, uint16_t *xbf, float *acc);
#endif

#endif
