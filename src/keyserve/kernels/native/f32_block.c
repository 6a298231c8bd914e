/* float32 products of a few dozen rows as register-blocked outer products, on weights packed
 * once.
 *
 * Why: a float32 decode step of 17-64 rows multiplies them by every weight matrix; there the
 * product is bound by its multiplies (no AMX for float32), and gemv.h's row kernel -- a dot
 * product per (x row, weight row), with a horizontal sum at the end of each -- reached about
 * 160 GFLOP/s on this 2-core Xeon against 372 for MKL's GEMM. Here the weights of 32 outputs
 * are packed input-major, so one step over the inputs loads two weight vectors and broadcasts
 * one x value per row into 12 rows x 32 outputs of accumulators (24 registers, 24 FMAs per 14
 * loads): the FMA units are the limit, as in a GEMM micro-kernel -- once the weights are near.
 * The first row tile of a block used to read it from DRAM at the multiplies' pace (two lines
 * per 24 FMAs: more than a core streams), so each tile now prefetches a share of the next block
 * into L2: a 36-row SmolLM2 step 65 -> 51-54 ms (perf: the tiles ran at ~179 GFLOP/s before).
 *
 * Layout (keyserve_f32_pack): W [n, k] float32 -> packed[(nb * k + i) * 32 + c] = W[nb * 32 + c][i].
 * Sums run over the inputs in order in one float32 accumulator per output, so results agree
 * with F.linear to float32 rounding, not bit for bit.
 *
 * On AVX2 (no AVX-512: the 2-core AMD EPYC) the same layout is multiplied by 6-row x 16-output
 * tiles, half a block at a time (below): before, float32 steps of several rows stayed on
 * gemv.h's row kernel there, a dot product per (x row, weight row), whose extra rows cost
 * ~4.3-5.7 ms each at batch 8 (SmolLM2, 128-token contexts) against ~7.6 ms per plain token.
 */
#include <stdint.h>
#include <string.h>

#include "f32_block.h"

/* W [n, k] float32 -> 32-output blocks, input-major (layout above); n % 32 == 0. */
void keyserve_f32_pack(const float *w, int64_t n, int64_t k, float *packed) {
    for (int64_t nb = 0; nb < n / KS_F32_BLOCK_COLS; nb++)
        for (int64_t i = 0; i < k; i++)
            for (int c = 0; c < KS_F32_BLOCK_COLS; c++)
                packed[(nb * k + i) * KS_F32_BLOCK_COLS + c] = w[(nb * KS_F32_BLOCK_COLS + c) * k + i];
}

#ifdef KS_F32_BLOCK
#include <immintrin.h>
#include <omp.h>

/* The 32 outputs of one packed block for MR rows of xp (k floats each, ldx apart), into out
 * [MR, 32]. MR constant (1 to 12: a tile has exactly the rows it multiplies, so the last tile of
 * a step computes no padding -- before, 4, 8 or 12 only: a 5-row speculative step at batch 1
 * multiplied 8, 3 of them zeros, and a 13-row step's last row as 4), so the 2 x MR accumulators
 * stay in registers. Meanwhile `lines` cache lines from pf on
 * (a share of the next packed block) are prefetched into L2, spread evenly over the k steps:
 * the block after this one then comes from L2 instead of stalling the multiplies on DRAM. */
#ifdef KS_F32_BLOCK_AVX2
/* AVX2: 16 registers hold 6 rows x 16 outputs of accumulators (12), the two weight vectors and
 * a broadcast x value, so a tile covers half of a packed block (b: the block's first input row,
 * offset by 0 or 16 outputs; consecutive inputs KS_F32_BLOCK_COLS apart) and the block is
 * multiplied in two halves, each with every row tile. out: [MR, 16]. The sums are the AVX-512
 * tiles' to the bit: per output one accumulator, inputs in order, one FMA each. */
#define KS_F32_TILE_COLS 16 /* outputs per tile: half a packed block */
/* One row of the tile: its two accumulators, a##r##0 and a##r##1, named rather than an array,
 * which GCC kept on the stack (stored every input: ~1.3x slower than the row kernel). */
#define KS_F32_ROW_FMA(r)                                                                          \
    if (tile_rows > r) {                                                                                \
        const __m256 xv = _mm256_broadcast_ss(xp + r * ldx + i);                                   \
        a##r##0 = _mm256_fmadd_ps(xv, w0, a##r##0);                                                \
        a##r##1 = _mm256_fmadd_ps(xv, w1, a##r##1);                                                \
    }
#define KS_F32_ROW_STORE(r)                                                                        \
    if (tile_rows > r) {                                                                                \
        _mm256_storeu_ps(out + r * KS_F32_TILE_COLS, a##r##0);                                          \
        _mm256_storeu_ps(out + r * KS_F32_TILE_COLS + 8, a##r##1);                                      \
    }
#define KS_F32_TILE(MR)                                                                            \
    static void ks_f32_tile##MR(const float *xp, int64_t ldx, int64_t k, const float *b, float *out, \
                                const char *pf, int64_t lines) {                                   \
        enum { tile_rows = MR };                                                                   \
        __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00;   \
        __m256 a30 = a00, a31 = a00, a40 = a00, a41 = a00, a50 = a00, a51 = a00;                   \
        int64_t due = 0;                                                                           \
        for (int64_t i = 0; i < k; i++, b += KS_F32_BLOCK_COLS) {                                  \
            due += lines; /* lines <= k (a block's 2k lines over >= 2 tiles): one prefetch at most */ \
            if (due >= k) {                                                                        \
                due -= k;                                                                          \
                __builtin_prefetch(pf, 0, 2);                                                      \
                pf += 64;                                                                          \
            }                                                                                      \
            const __m256 w0 = _mm256_loadu_ps(b), w1 = _mm256_loadu_ps(b + 8);                      \
            KS_F32_ROW_FMA(0) KS_F32_ROW_FMA(1) KS_F32_ROW_FMA(2)                                  \
            KS_F32_ROW_FMA(3) KS_F32_ROW_FMA(4) KS_F32_ROW_FMA(5)                                  \
        }                                                                                          \
        KS_F32_ROW_STORE(0) KS_F32_ROW_STORE(1) KS_F32_ROW_STORE(2)                                \
        KS_F32_ROW_STORE(3) KS_F32_ROW_STORE(4) KS_F32_ROW_STORE(5)                                \
    }
KS_F32_TILE(1)
KS_F32_TILE(2)
KS_F32_TILE(3)
KS_F32_TILE(4)
KS_F32_TILE(5)
KS_F32_TILE(6)

#define KS_F32_TILE_LIST ks_f32_tile1, ks_f32_tile2, ks_f32_tile3, ks_f32_tile4, ks_f32_tile5, ks_f32_tile6
#else
#define KS_F32_TILE_COLS KS_F32_BLOCK_COLS /* outputs per tile: the whole packed block */
#define KS_F32_TILE(MR)                                                                            \
    static void ks_f32_tile##MR(const float *xp, int64_t ldx, int64_t k, const float *b, float *out, \
                                const char *pf, int64_t lines) {                                   \
        __m512 acc[MR][2];                                                                         \
        int64_t due = 0;                                                                           \
        for (int r = 0; r < MR; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();                  \
        for (int64_t i = 0; i < k; i++, b += KS_F32_BLOCK_COLS) {                                  \
            for (due += lines; due >= k; due -= k, pf += 64) __builtin_prefetch(pf, 0, 2);         \
            const __m512 w0 = _mm512_loadu_ps(b), w1 = _mm512_loadu_ps(b + 16);                    \
            _Pragma("GCC unroll 12") for (int r = 0; r < MR; r++) {                                \
                const __m512 xv = _mm512_set1_ps(xp[r * ldx + i]);                                 \
                acc[r][0] = _mm512_fmadd_ps(xv, w0, acc[r][0]);                                    \
                acc[r][1] = _mm512_fmadd_ps(xv, w1, acc[r][1]);                                    \
            }                                                                                      \
        }                                                                                          \
        for (int r = 0; r < MR; r++) {                                                             \
            _mm512_storeu_ps(out + r * KS_F32_TILE_COLS, acc[r][0]);                              \
            _mm512_storeu_ps(out + r * KS_F32_TILE_COLS + 16, acc[r][1]);                         \
        }                                                                                          \
    }
KS_F32_TILE(1)
KS_F32_TILE(2)
KS_F32_TILE(3)
KS_F32_TILE(4)
KS_F32_TILE(5)
KS_F32_TILE(6)
KS_F32_TILE(7)
KS_F32_TILE(8)
KS_F32_TILE(9)
KS_F32_TILE(10)
KS_F32_TILE(11)
KS_F32_TILE(12)

#define KS_F32_TILE_LIST ks_f32_tile1, ks_f32_tile2, ks_f32_tile3, ks_f32_tile4, ks_f32_tile5, ks_f32_tile6, \
    ks_f32_tile7, ks_f32_tile8, ks_f32_tile9, ks_f32_tile10, ks_f32_tile11, ks_f32_tile12
#endif /* KS_F32_BLOCK_AVX2 */

typedef void (*ks_f32_tile_fn)(const float *, int64_t, int64_t, const float *, float *, const char *, int64_t);
static const ks_f32_tile_fn KS_F32_TILES[KS_F32_BLOCK_ROWS + 1] = {0, KS_F32_TILE_LIST};

void ks_f32_cols(const float *x, int m, int ldx, int64_t k, const float *packed, int64_t c0, int64_t c1,
                 float *y, int ldy) {
    const int rb = (m + KS_F32_BLOCK_ROWS - 1) / KS_F32_BLOCK_ROWS;
    const int parts = KS_F32_BLOCK_COLS / KS_F32_TILE_COLS; /* of a block: 1 (AVX-512) or 2 halves (AVX2) */
    const int tiles = parts * rb;                           /* per block: each part, every row tile */
    float tile[KS_F32_BLOCK_ROWS * KS_F32_TILE_COLS];
    const int64_t block_lines = k * KS_F32_BLOCK_COLS * (int64_t)sizeof(float) / 64;
    const int64_t nb1 = c1 / KS_F32_BLOCK_COLS;
    for (int64_t nb = c0 / KS_F32_BLOCK_COLS; nb < nb1; nb++) {
        const float *b = packed + nb * k * KS_F32_BLOCK_COLS;
        /* the next block, a share per tile (none after the last block) */
        const char *next = nb + 1 < nb1 ? (const char *)(b + k * KS_F32_BLOCK_COLS) : 0;
        for (int h = 0, u = 0; h < parts; h++) {
            /* rb tiles of balanced heights (16 rows: 8 + 8, not 12 + 4: a short tile does few
             * FMAs per weight load) */
            for (int r0 = 0, t = 0; r0 < m; t++, u++) {
                const int rows = (m - r0) / (rb - t) + ((m - r0) % (rb - t) != 0);
                const float *xp = x + (int64_t)r0 * ldx;  /* read in place: no tile needs padding rows */
                const int64_t l0 = block_lines * u / tiles, l1 = block_lines * (u + 1) / tiles;
                const char *pf = next ? next + l0 * 64 : 0;
                const int64_t lines = next ? l1 - l0 : 0;
                KS_F32_TILES[rows](xp, ldx, k, b + h * KS_F32_TILE_COLS, tile, pf, lines);
                for (int r = 0; r < rows; r++)
                    memcpy(y + (int64_t)(r0 + r) * ldy + nb * KS_F32_BLOCK_COLS + h * KS_F32_TILE_COLS,
                           tile + r * KS_F32_TILE_COLS, sizeof(float) * KS_F32_TILE_COLS);
                r0 += rows;
            }
        }
    }
}

/* y [m, n] = x [m, k] . W^T for W packed by keyserve_f32_pack, the 32-column blocks split over
 * num_threads OpenMP threads (the LM head of a decode step of a few dozen rows: an ordinary
 * linear, outside the layer stack). Returns 0 (2 in a build without the tiles). */
int keyserve_f32_linear(const float *x, int m, int64_t k, const float *packed, int64_t n, float *y,
                        int num_threads) {
    const int64_t blocks = n / KS_F32_BLOCK_COLS;
    if (num_threads < 1) num_threads = 1;
#pragma omp parallel num_threads(num_threads)
    {
        const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t c0 = KS_F32_BLOCK_COLS * (blocks * tid / nt);
        const int64_t c1 = KS_F32_BLOCK_COLS * (blocks * (tid + 1) / nt);
        if (c1 > c0) ks_f32_cols(x, m, (int)k, k, packed, c0, c1, y, (int)n);
    }
    return 0;
}
#else
int keyserve_f32_linear(const float *x, int m, int64_t k, const float *packed, int64_t n, float *y,
                        int num_threads) {
    (void)x; (void)m; (void)k; (void)packed; (void)n; (void)y; (void)num_threads;
    return 2;
}
#endif

int keyserve_f32_block_available(void) {
#if defined(KS_F32_BLOCK_AVX2)
    return 2;
#elif defined(KS_F32_BLOCK)
    return 1;
#else
    return 0;
#endif
}
