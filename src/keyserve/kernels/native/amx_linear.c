#define _GNU_SOURCE
/* bf16 products of a few dozen rows on AMX tiles, streaming weights packed once.
 *
 * Why: a decode step of a few to 64 rows multiplies them by every weight matrix; at that size
 * the product should be bound by reading the weights once (SmolLM2: 270 MB per step), but the
 * vector kernels (gemv.h) are bound by their multiplies past a few rows and oneDNN's prepacked
 * bf16 path reads the weights at ~13 GB/s on this 2-core Xeon, about half the measured
 * bandwidth. Here each thread streams its own contiguous stretch of pre-tiled weights front to
 * back (the hardware prefetcher sees one sequential stream per core) while AMX does the
 * multiplies: one 16 x 32 weight tile per step against up to four 16-row tiles of x.
 *
 * x is taken KS_AMX_CHUNK inputs at a time (its 16-row tiles for one chunk stay in L1: all of a
 * 64-row x does not fit there at k = 576, and reading it again from L2 for every 16 columns
 * made 48 and 64 rows slower than oneDNN); the sums of each column block wait in a scratch
 * between chunks.
 *
 * Layout of the packed weights (keyserve_amx_pack): W [n, k] bf16 becomes tiles of 16 output
 * columns x 32 inputs in AMX's pair-interleaved order; chunk by chunk of inputs, then column
 * block by column block, so one thread's share of a chunk is one contiguous stretch:
 *   tile (nb, kb) at ((kb0 * nbs + nb * kl + kb - kb0) * 512), kb0 = kb's chunk start, kl = its
 *   length in tiles, nbs = n / 16; inside a tile [r * 32 + c * 2 + p] = W[nb*16 + c][kb*32 + 2r + p]
 * Sums are float32 (tdpbf16ps), rounded once to bf16 (RNE); their order differs from oneDNN's,
 * so results agree with F.linear to rounding, not bit for bit.
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "amx.h"
#include "gemv.h"

#define KS_AMX_CHUNK 8 /* 32-input tiles of x per chunk: 64 rows x 256 inputs = 32 KB */
#define KS_AMX_PREFETCH_BYTES 4096 /* the weight stream, this far ahead, into L1 */

/* 1 where this process may use AMX tiles (asks Linux for the tile state once), else 0. */
int keyserve_amx_available(void) {
#ifdef KS_AMX
    static int state = -1;
    if (state < 0) {
        /* ARCH_REQ_XCOMP_PERM (0x1023) for XFEATURE_XTILEDATA (18): without it the first tile
         * instruction faults. oneDNN asks too; asking twice is harmless. */
        state = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    }
    return state;
#else
    return 0;
#endif
}

/* W [n, k] bf16 -> tiles (layout above); n % 16 == 0, k % 32 == 0. */
void keyserve_amx_pack(const uint16_t *w, int64_t n, int64_t k, uint16_t *packed) {
    const int64_t kbs = k / 32, nbs = n / 16;
    for (int64_t nb = 0; nb < nbs; nb++)
        for (int64_t kb = 0; kb < kbs; kb++) {
            const int64_t kb0 = kb / KS_AMX_CHUNK * KS_AMX_CHUNK;
            const int64_t kl = kbs - kb0 < KS_AMX_CHUNK ? kbs - kb0 : KS_AMX_CHUNK;
            uint16_t *tile = packed + (kb0 * nbs + nb * kl + kb - kb0) * 512;
            for (int r = 0; r < 16; r++)
                for (int c = 0; c < 16; c++)
                    for (int p = 0; p < 2; p++)
                        tile[r * 32 + c * 2 + p] = w[(nb * 16 + c) * k + kb * 32 + 2 * r + p];
        }
}

#ifdef KS_AMX
typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} ks_tile_config;

/* Column blocks nb0..nb1-1, inputs kb0 .. kb0 + kl - 1 (tiles of 32), for mt 16-row tiles of x
 * (padded to 16 * mt rows, k columns), adding to the sums in acc (zero first when kb0 == 0):
 * tiles 0-3 hold the sums, 4 the weight tile, 5 and 6 take turns with x's tiles. */
#define KS_AMX_BLOCKS(MT)                                                                          \
    static void ks_amx_blocks##MT(const uint16_t *x, int64_t k, const uint16_t *b, int64_t kb0,     \
                                  int64_t kl, int64_t nb0, int64_t nb1, float *acc) {               \
        const int64_t xstride = k * 2;                                                             \
        for (int64_t nb = nb0; nb < nb1; nb++) {                                                   \
            float *a = acc + (nb - nb0) * 1024;                                                    \
            if (kb0 == 0) {                                                                        \
                _tile_zero(0);                                                                     \
                if (MT > 1) _tile_zero(1);                                                         \
                if (MT > 2) _tile_zero(2);                                                         \
                if (MT > 3) _tile_zero(3);                                                         \
            } else {                                                                               \
                _tile_loadd(0, a, 64);                                                             \
                if (MT > 1) _tile_loadd(1, a + 256, 64);                                           \
                if (MT > 2) _tile_loadd(2, a + 512, 64);                                           \
                if (MT > 3) _tile_loadd(3, a + 768, 64);                                           \
            }                                                                                      \
            for (int64_t kb = kb0; kb < kb0 + kl; kb++, b += 512) {                                \
                const char *ahead = (const char *)b + KS_AMX_PREFETCH_BYTES;                       \
                for (int l = 0; l < 1024; l += 64) _mm_prefetch(ahead + l, _MM_HINT_T0);          \
                _tile_loadd(4, b, 64);                                                             \
                _tile_loadd(5, x + kb * 32, xstride);                                              \
                _tile_dpbf16ps(0, 5, 4);                                                           \
                if (MT > 1) {                                                                      \
                    _tile_loadd(6, x + 16 * k + kb * 32, xstride);                                 \
                    _tile_dpbf16ps(1, 6, 4);                                                       \
                }                                                                                  \
                if (MT > 2) {                                                                      \
                    _tile_loadd(5, x + 32 * k + kb * 32, xstride);                                 \
                    _tile_dpbf16ps(2, 5, 4);                                                       \
                }                                                                                  \
                if (MT > 3) {                                                                      \
                    _tile_loadd(6, x + 48 * k + kb * 32, xstride);                                 \
                    _tile_dpbf16ps(3, 6, 4);                                                       \
                }                                                                                  \
            }                                                                                      \
            _tile_stored(0, a, 64);                                                                \
            if (MT > 1) _tile_stored(1, a + 256, 64);                                              \
            if (MT > 2) _tile_stored(2, a + 512, 64);                                              \
            if (MT > 3) _tile_stored(3, a + 768, 64);                                              \
        }                                                                                          \
    }
KS_AMX_BLOCKS(1)
KS_AMX_BLOCKS(2)
KS_AMX_BLOCKS(3)
KS_AMX_BLOCKS(4)

/* acc[(nb - nb0) * 1024 + t * 256 + r * 16 + c] = sum over k of xpad[t * 16 + r, :] . W[nb * 16 + c, :]
 * for column blocks nb0..nb1-1 of nbs, mt 16-row tiles of xpad (bf16 [mt * 16, k]); on a
 * thread whose tiles ks_amx_begin configured. */
static void ks_amx_sums(const uint16_t *xpad, int mt, int64_t k, const uint16_t *packed, int64_t nbs,
                        int64_t nb0, int64_t nb1, float *acc) {
    const int64_t kbs = k / 32;
    for (int64_t kb0 = 0; kb0 < kbs; kb0 += KS_AMX_CHUNK) {
        const int64_t kl = kbs - kb0 < KS_AMX_CHUNK ? kbs - kb0 : KS_AMX_CHUNK;
        const uint16_t *b = packed + (kb0 * nbs + nb0 * kl) * 512;
        switch (mt) {
        case 1: ks_amx_blocks1(xpad, k, b, kb0, kl, nb0, nb1, acc); break;
        case 2: ks_amx_blocks2(xpad, k, b, kb0, kl, nb0, nb1, acc); break;
        case 3: ks_amx_blocks3(xpad, k, b, kb0, kl, nb0, nb1, acc); break;
        default: ks_amx_blocks4(xpad, k, b, kb0, kl, nb0, nb1, acc); break;
        }
    }
}

/* Every tile 16 rows x 64 bytes (sums, weights, x). A static table: gcc's _tile_loadconfig
 * tells the compiler it reads 8 bytes, so stores into a local config were dropped as dead. */
static const ks_tile_config ks_amx_config __attribute__((aligned(64))) = {
    .palette_id = 1,
    .colsb = {64, 64, 64, 64, 64, 64, 64},
    .rows = {16, 16, 16, 16, 16, 16, 16},
};

void ks_amx_begin(void) { _tile_loadconfig(&ks_amx_config); }

void ks_amx_end(void) { _tile_release(); }

/* y[i, c0:c1] = x[i, :] . W[c0:c1, :] as float32 sums, i < m <= 64, for columns c0..c1-1
 * (multiples of 16) of packed W [n, k]: x float32 rows (ldx apart) holding bf16 values (exact
 * as bf16: the decode step's activations), y rows ldy apart. Scratch: xbf 64 * k bf16, acc
 * (c1 - c0) / 16 * 1024 floats. On a thread ks_amx_begin configured. */
void ks_amx_cols(const float *x, int m, int ldx, int64_t k, const uint16_t *packed, int64_t n, int64_t c0,
                 int64_t c1, float *y, int ldy, uint16_t *xbf, float *acc) {
    const int mt = (m + 15) / 16;
    for (int i = 0; i < m; i++) {
        const uint32_t *src = (const uint32_t *)(x + (int64_t)i * ldx);
        uint16_t *dst = xbf + (int64_t)i * k;
        for (int64_t e = 0; e < k; e++) dst[e] = (uint16_t)(src[e] >> 16);
    }
    memset(xbf + (int64_t)m * k, 0, (size_t)((mt * 16 - m) * k) * 2);
    ks_amx_sums(xbf, mt, k, packed, n / 16, c0 / 16, c1 / 16, acc);
    for (int64_t nb = c0 / 16; nb < c1 / 16; nb++) {
        const float *blk = acc + (nb - c0 / 16) * 1024;
        for (int i = 0; i < m; i++)
            memcpy(y + (int64_t)i * ldy + nb * 16, blk + (i / 16) * 256 + (i % 16) * 16, 64);
    }
}
#endif

/* y[i, :] = x[i, :] . W^T for i < m (m <= 64), x [m, k] bf16 row-major, packed W from
 * keyserve_amx_pack, y [m, n] bf16. xpad: scratch of 64 * k bf16 (x copied there, padded with
 * zero rows to whole tiles); acc: scratch of n * 64 floats. Returns 0, or -1 where AMX cannot
 * run (the caller then uses another path). */
int keyserve_amx_linear(const uint16_t *x, int64_t m, int64_t k, const uint16_t *packed, int64_t n, uint16_t *y,
                        uint16_t *xpad, float *acc, int num_threads) {
#ifdef KS_AMX
    if (!keyserve_amx_available() || m < 1 || m > KS_AMX_MAX_ROWS || k % 32 || n % 16) return -1;
    const int mt = (int)((m + 15) / 16);
    memcpy(xpad, x, (size_t)(m * k) * 2);
    memset(xpad + m * k, 0, (size_t)((mt * 16 - m) * k) * 2);
    const int64_t nbs = n / 16;
    if (num_threads < 1) num_threads = 1;
    if (nbs < 2 * num_threads) num_threads = 1;
#pragma omp parallel num_threads(num_threads)
    {
        ks_amx_begin();
        const int nt = omp_get_num_threads(), tid = omp_get_thread_num();
        const int64_t nb0 = nbs * tid / nt, nb1 = nbs * (tid + 1) / nt;
        ks_amx_sums(xpad, mt, k, packed, nbs, nb0, nb1, acc + nb0 * 1024);
        ks_amx_end();
        for (int64_t nb = nb0; nb < nb1; nb++) {
            const float *blk = acc + nb * 1024;
            for (int64_t i = 0; i < m; i++) {
                const float *row = blk + (i / 16) * 256 + (i % 16) * 16;
                uint16_t *out = y + i * n + nb * 16;
                for (int c = 0; c < 16; c++) out[c] = ks_f32_to_bf16(row[c]);
            }
        }
    }
    return 0;
#else
    (void)x; (void)m; (void)k; (void)packed; (void)n; (void)y; (void)xpad; (void)acc; (void)num_threads;
    return -1;
#endif
}
