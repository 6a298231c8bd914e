/* Decode attention of one kv head's query group against one sequence's paged K/V: the two
 * passes both native kernels share (paged_decode.c, decode_stack.c).
 *
 * Why a shared, vectorised pass: at 64 decode rows with a few hundred tokens of context the
 * attention is most of a step (issue 18's mixed-request profile: 246 of 453 ms), and the
 * earlier per-slot loops -- a division per slot to find the block, the row copied to a buffer,
 * one horizontal reduction per 64-float dot product written as a generic simd loop -- ran at
 * ~5 GB/s with the whole layer's cache in L3. Here the slots are walked block by block (one
 * table lookup per block, then a fixed row stride), the K row is widened once into registers
 * and reused by every query head of the group (GQA), and the V pass keeps the group's output
 * rows in registers when they fit.
 *
 * Cache rows: cache[(block * block_size + offset) * hkv + kv_head][d], float32 or bfloat16
 * (KS_F32 / KS_BF16), bf16 widened exactly (shift left by 16). Sums are float32; their order
 * differs from the torch reference's, so results agree to rounding, not bit for bit.
 */
#ifndef KEYSERVE_ATTEND_H
#define KEYSERVE_ATTEND_H

#include <stdint.h>
#include <string.h>

#include "gemv.h"
#include "vecmath.h"

typedef struct {
    const void *k, *v;      /* cache bases */
    int cdt;                /* KS_F32 or KS_BF16 */
    const int32_t *table;   /* this sequence's block table */
    int block_size, hkv, kv_head, d;
} ks_kv_view;

/* First cache row of logical slot t (rows of one kv head are hkv apart inside a block). */
static inline int64_t ks_kv_row(const ks_kv_view *kv, int t) {
    return ((int64_t)kv->table[t / kv->block_size] * kv->block_size + t % kv->block_size) * kv->hkv +
           kv->kv_head;
}

/* Bytes of one block of a cache (every kv head's rows of block_size slots). */
static inline int64_t ks_kv_block_bytes(const ks_kv_view *kv) {
    return (int64_t)kv->block_size * kv->hkv * kv->d * (kv->cdt == KS_BF16 ? 2 : 4);
}

/* The walker below prefetches one block ahead, spread over the current block's slots (each
 * slot asks for the same slot's lines of the next block): a block is one contiguous stretch,
 * but the next one is anywhere, so the hardware prefetcher only catches up after a few misses
 * at every block start. Spread, because a whole block's 96 lines asked at once overflow the
 * line-fill buffers and get dropped. Into L2 (locality 2, prefetcht1): 2-3 % faster than into
 * L1 here. A perf profile of the passes (docs/engine.md) puts over half their samples on the
 * prefetch itself, waiting for a free fill buffer: a thread reads ~6 GB/s of scattered
 * blocks, its limit of lines in flight, not the DRAM's. */
static inline const char *ks_kv_block_at(const ks_kv_view *kv, const void *base, int t) {
    return (const char *)base + (int64_t)kv->table[t / kv->block_size] * ks_kv_block_bytes(kv);
}

/* Runs the body for slots lo..len-1 with `row` the cache row of the slot's first kv head
 * (kv->kv_head) and i = t - lo: one table lookup per block; `base` (the cache the body reads)
 * prefetched a block ahead. */
#define KS_FOR_SLOTS(kv, base, lo, len, row, i, ...)                                   \
    do {                                                                               \
        const int bs_ = (kv)->block_size;                                              \
        const int slot_bytes_ = (kv)->hkv * (kv)->d * ((kv)->cdt == KS_BF16 ? 2 : 4);  \
        for (int t0_ = (lo); t0_ < (len);) {                                           \
            const int t1_ = (t0_ / bs_ + 1) * bs_ < (len) ? (t0_ / bs_ + 1) * bs_ : (len); \
            const char *next_ = t1_ < (len) ? ks_kv_block_at((kv), (base), t1_) : 0;  \
            int64_t row = ks_kv_row((kv), t0_);                                        \
            for (int t_ = t0_; t_ < t1_; t_++, row += (kv)->hkv) {                     \
                const int i = t_ - (lo);                                               \
                if (next_)                                                             \
                    for (int b_ = 0; b_ < slot_bytes_; b_ += 64)                       \
                        __builtin_prefetch(next_ + (int64_t)(t_ % bs_) * slot_bytes_ + b_, 0, 2); \
                __VA_ARGS__;                                                           \
            }                                                                          \
            t0_ = t1_;                                                                 \
        }                                                                              \
    } while (0)

#if defined(KS_GEMV_AVX512)
#define KS_VW 16
typedef __m512 ks_vec;
static inline __attribute__((always_inline)) ks_vec ks_vload(const void *base, int cdt, int64_t k) {
    if (cdt == KS_BF16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + k));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    return _mm512_loadu_ps((const float *)base + k);
}
#define ks_vloadf(p) _mm512_loadu_ps(p)
#define ks_vstoref(p, x) _mm512_storeu_ps((p), (x))
#define ks_vfma(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#define ks_vset1(x) _mm512_set1_ps(x)
#define ks_vzero() _mm512_setzero_ps()
#define ks_vsum(x) _mm512_reduce_add_ps(x)
#elif defined(KS_GEMV_AVX2)
#define KS_VW 8
typedef __m256 ks_vec;
#define ks_vload(base, cdt, k) ks_load8((base), (cdt), (k))
#define ks_vloadf(p) _mm256_loadu_ps(p)
#define ks_vstoref(p, x) _mm256_storeu_ps((p), (x))
#define ks_vfma(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define ks_vset1(x) _mm256_set1_ps(x)
#define ks_vzero() _mm256_setzero_ps()
static inline float ks_vsum(__m256 x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* Most vectors of one row the vector passes hold (d <= KS_MAX_CHUNKS * KS_VW); wider heads
 * take the scalar loops. */
#define KS_MAX_CHUNKS 16
/* The V pass keeps a tile of output vectors in registers -- up to KS_TILE_HEADS query heads x
 * KS_TILE_CHUNKS vectors (18 of AVX-512's 32 registers; 9 of AVX2's 16) -- and walks the
 * slots once per tile. SmolLM2's 9 heads x 64 dims take two walks with AVX-512: the first
 * streams every kv head's rows of a slot from memory, the second finds them in L2. */
#define KS_TILE_HEADS 9
#if defined(KS_GEMV_AVX512)
#define KS_TILE_CHUNKS 2
#else
#define KS_TILE_CHUNKS 1
#endif

/* logits[j * n + i] = (q[j] . K[lo + i]) * scale for the query heads j of `heads` kv heads
 * from kv->kv_head on (group query heads each, heads' query rows consecutive), n = len - lo.
 * q: [heads * group, d] float32. With several kv heads each slot's rows are read as one
 * contiguous stretch (the cache interleaves kv heads per slot). */
static inline void ks_attend_logits(const ks_kv_view *kv, const float *q, int group, int heads,
                                    int lo, int len, float scale, float *logits) {
    const int d = kv->d, n = len - lo;
#ifdef KS_VW
    if (d % KS_VW == 0 && d / KS_VW <= KS_MAX_CHUNKS) {
        const int chunks = d / KS_VW;
        KS_FOR_SLOTS(kv, kv->k, lo, len, row, i, {
            for (int h = 0; h < heads; h++) {
                ks_vec kr[KS_MAX_CHUNKS];
                for (int c = 0; c < chunks; c++) kr[c] = ks_vload(kv->k, kv->cdt, (row + h) * d + c * KS_VW);
                for (int j = h * group; j < (h + 1) * group; j++) {
                    const float *qj = q + (int64_t)j * d;
                    ks_vec a0 = ks_vzero(), a1 = ks_vzero();
                    int c = 0;
                    for (; c + 1 < chunks; c += 2) {
                        a0 = ks_vfma(kr[c], ks_vloadf(qj + c * KS_VW), a0);
                        a1 = ks_vfma(kr[c + 1], ks_vloadf(qj + (c + 1) * KS_VW), a1);
                    }
                    if (c < chunks) a0 = ks_vfma(kr[c], ks_vloadf(qj + c * KS_VW), a0);
                    logits[(int64_t)j * n + i] = ks_vsum(a0 + a1) * scale;
                }
            }
        });
        return;
    }
#endif
    KS_FOR_SLOTS(kv, kv->k, lo, len, row, i, {
        for (int j = 0; j < heads * group; j++) {
            const float *qj = q + (int64_t)j * d;
            const int64_t r = row + j / group;
            float acc = 0.0f;
            for (int e = 0; e < d; e++) acc += qj[e] * ks_w_at(kv->k, kv->cdt, r * d + e);
            logits[(int64_t)j * n + i] = acc * scale;
        }
    });
}

#ifdef KS_VW
/* One register tile of the V pass: query heads j0 .. j0+H-1 (H constant, so the accumulators
 * stay in registers; head j reads kv head j / group) x KS_TILE_CHUNKS vectors from element e0,
 * over slots lo..len-1. probs: [heads, n]; o: [heads, d], both indexed from head 0. */
#define KS_DEFINE_VALUES_TILE(H)                                                                \
    static void ks_values_tile##H(const ks_kv_view *kv, const float *probs, int n, int group,   \
                                  int j0, int lo, int len, int e0, float *o) {                  \
        const int d = kv->d;                                                                   \
        ks_vec acc[H * KS_TILE_CHUNKS];                                                        \
        int64_t off[H];                                                                        \
        for (int j = 0; j < H; j++) off[j] = (int64_t)((j0 + j) / group) * d + e0;             \
        for (int a = 0; a < H * KS_TILE_CHUNKS; a++) acc[a] = ks_vzero();                       \
        KS_FOR_SLOTS(kv, kv->v, lo, len, row, i, {                                             \
            for (int j = 0; j < H; j++) {                                                      \
                const ks_vec p = ks_vset1(probs[(int64_t)(j0 + j) * n + i]);                   \
                for (int c = 0; c < KS_TILE_CHUNKS; c++)                                       \
                    acc[j * KS_TILE_CHUNKS + c] = ks_vfma(                                     \
                        p, ks_vload(kv->v, kv->cdt, row * d + off[j] + c * KS_VW), acc[j * KS_TILE_CHUNKS + c]); \
            }                                                                                  \
        });                                                                                    \
        for (int j = 0; j < H; j++)                                                            \
            for (int c = 0; c < KS_TILE_CHUNKS; c++)                                           \
                ks_vstoref(o + (int64_t)(j0 + j) * d + e0 + c * KS_VW, acc[j * KS_TILE_CHUNKS + c]); \
    }
KS_DEFINE_VALUES_TILE(1)
KS_DEFINE_VALUES_TILE(2)
KS_DEFINE_VALUES_TILE(3)
KS_DEFINE_VALUES_TILE(4)
KS_DEFINE_VALUES_TILE(5)
KS_DEFINE_VALUES_TILE(6)
KS_DEFINE_VALUES_TILE(7)
KS_DEFINE_VALUES_TILE(8)
KS_DEFINE_VALUES_TILE(9)

typedef void (*ks_values_tile_fn)(const ks_kv_view *, const float *, int, int, int, int, int, int, float *);
static const ks_values_tile_fn ks_values_tiles[KS_TILE_HEADS + 1] = {
    0, ks_values_tile1, ks_values_tile2, ks_values_tile3, ks_values_tile4, ks_values_tile5,
    ks_values_tile6, ks_values_tile7, ks_values_tile8, ks_values_tile9};
#endif

/* o[j] = sum_i probs[j * n + i] * V[lo + i] for the query heads j of `heads` kv heads from
 * kv->kv_head on (group each), n = len - lo; o: [heads * group, d] float32, overwritten. */
static inline void ks_attend_values(const ks_kv_view *kv, const float *probs, int group, int heads,
                                    int lo, int len, float *o) {
    const int d = kv->d, n = len - lo, hq = heads * group;
    memset(o, 0, sizeof(float) * (size_t)hq * d);
    if (n <= 0) return;
#ifdef KS_VW
    if (d % (KS_VW * KS_TILE_CHUNKS) == 0) {
        for (int j0 = 0; j0 < hq; j0 += KS_TILE_HEADS) {
            const int h = hq - j0 < KS_TILE_HEADS ? hq - j0 : KS_TILE_HEADS;
            for (int e0 = 0; e0 < d; e0 += KS_VW * KS_TILE_CHUNKS)
                ks_values_tiles[h](kv, probs, n, group, j0, lo, len, e0, o);
        }
        return;
    }
#endif
    KS_FOR_SLOTS(kv, kv->v, lo, len, row, i, {
        for (int j = 0; j < hq; j++) {
            const float p = probs[(int64_t)j * n + i];
            float *oj = o + (int64_t)j * d;
            const int64_t r = row + j / group;
            for (int e = 0; e < d; e++) oj[e] += p * ks_w_at(kv->v, kv->cdt, r * d + e);
        }
    });
}

/* o = softmax(q . K * scale) @ V for the query heads of `heads` kv heads from kv->kv_head on:
 * the logits pass, a softmax per head into probs (which may be logits itself, when the logits
 * are not needed afterwards), the values pass. logits, probs: [heads * group, len - lo];
 * o: [heads * group, d]. len <= lo gives zeros. */
static inline void ks_attend(const ks_kv_view *kv, const float *q, int group, int heads, int lo,
                             int len, float scale, float *logits, float *probs, float *o) {
    const int n = len - lo, hq = heads * group;
    if (n <= 0) {
        memset(o, 0, sizeof(float) * (size_t)hq * kv->d);
        return;
    }
    ks_attend_logits(kv, q, group, heads, lo, len, scale, logits);
    for (int j = 0; j < hq; j++) softmax_into(logits + (int64_t)j * n, probs + (int64_t)j * n, n);
    ks_attend_values(kv, probs, group, heads, lo, len, o);
}

#endif
