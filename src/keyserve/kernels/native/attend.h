/* Decode attention of one kv head's query group against one sequence's paged K/V: the two
 * passes both native kernels share (paged_decode.c, decode_stack.c).
 *
 * Why a shared, vectorised pass: at 64 decode rows with a few hundred tokens of context the
 * attention is most of a step (issue 18's mixed-request profile: 246 of 453 ms), and the
 * earlier per-slot loops -- a division per slot to find the block, the row copied to a buffer,
 * one horizontal reduction per 64-float dot product written as a generic simd loop -- ran at
 * ~5 GB/s with the whole layer's cache in L3. Here the slots are walked in runs of up to one
 * vector's width inside a block (one table lookup per run, then a fixed row stride); the
 * logits pass gives a run one accumulator vector per slot and sums the run's vectors in one
 * transposing tree (16 horizontal sums in 45 ops instead of ~8 dependent ones each); the V
 * pass keeps the group's output rows in registers when they fit. Measured on 48 sequences x
 * 600 bf16 slots, 2 threads (Xeon, AVX-512): 28.7 -> 25.5 ms per 30 layers with the data in
 * cache, 54.8 -> 52.8 ms scattered in DRAM; the rest is the ~7 GB/s one core reads from
 * scattered 6 KB blocks (docs/engine.md).
 *
 * Cache rows: cache[(block * block_size + offset) * hkv + kv_head][d], float32 or bfloat16
 * (KS_F32 / KS_BF16), bf16 widened exactly in pairs (ks_vload_pair). Sums are float32; their order
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
/* Two vectors from 2 * KS_VW cache values at element k: bf16 as the even- and odd-indexed
 * values (gemv.h's pair trick: `lane << 16` and `lane & 0xffff0000`, exact, two ALU ops per
 * 32 values instead of a widening shuffle and a shift per 16), float32 as the two halves. */
static inline __attribute__((always_inline)) void ks_vload_pair(const void *base, int cdt, int64_t k,
                                                                ks_vec *a, ks_vec *b) {
    if (cdt == KS_BF16) {
        const __m512i x = _mm512_loadu_si512((const void *)((const uint16_t *)base + k));
        *a = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
        *b = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xffff0000u)));
        return;
    }
    *a = _mm512_loadu_ps((const float *)base + k);
    *b = _mm512_loadu_ps((const float *)base + k + KS_VW);
}
/* Stores 2 * KS_VW outputs from the pair order of ks_vload_pair (bf16: even, odd) in element
 * order. */
static inline void ks_vstore_pair(float *p, int cdt, ks_vec a, ks_vec b) {
    if (cdt == KS_BF16) {
        const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
        const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
        _mm512_storeu_ps(p, _mm512_permutex2var_ps(a, lo, b));
        _mm512_storeu_ps(p + KS_VW, _mm512_permutex2var_ps(a, hi, b));
        return;
    }
    _mm512_storeu_ps(p, a);
    _mm512_storeu_ps(p + KS_VW, b);
}
/* [sum(a[0]), ..., sum(a[15])]: the sixteen horizontal sums in one transposing tree, 45 ops
 * instead of 16 reductions of ~8 dependent ones each. */
static inline __attribute__((always_inline)) ks_vec ks_vsums(const ks_vec *a) {
    __m512 r[8], s[4], t[2];
    for (int i = 0; i < 8; i++)
        r[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        const __m512d x = _mm512_castps_pd(r[2 * i]), y = _mm512_castps_pd(r[2 * i + 1]);
        s[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int i = 0; i < 2; i++)
        t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(t[0], t[1], 0x88), _mm512_shuffle_f32x4(t[0], t[1], 0xDD));
}
/* The first m lanes of x to p. */
static inline void ks_vstore_first(float *p, ks_vec x, int m) {
    _mm512_mask_storeu_ps(p, (__mmask16)((1u << m) - 1u), x);
}
#define ks_vloadf(p) _mm512_loadu_ps(p)
#define ks_vfma(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#define ks_vmul(a, b) _mm512_mul_ps((a), (b))
#define ks_vset1(x) _mm512_set1_ps(x)
#define ks_vzero() _mm512_setzero_ps()
#elif defined(KS_GEMV_AVX2)
#define KS_VW 8
typedef __m256 ks_vec;
static inline __attribute__((always_inline)) void ks_vload_pair(const void *base, int cdt, int64_t k,
                                                                ks_vec *a, ks_vec *b) {
    if (cdt == KS_BF16) {
        const __m256i x = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + k));
        *a = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
        *b = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32((int)0xffff0000u)));
        return;
    }
    *a = _mm256_loadu_ps((const float *)base + k);
    *b = _mm256_loadu_ps((const float *)base + k + KS_VW);
}
static inline void ks_vstore_pair(float *p, int cdt, ks_vec a, ks_vec b) {
    if (cdt == KS_BF16) {
        const __m256 lo = _mm256_unpacklo_ps(a, b), hi = _mm256_unpackhi_ps(a, b);
        _mm256_storeu_ps(p, _mm256_permute2f128_ps(lo, hi, 0x20));
        _mm256_storeu_ps(p + KS_VW, _mm256_permute2f128_ps(lo, hi, 0x31));
        return;
    }
    _mm256_storeu_ps(p, a);
    _mm256_storeu_ps(p + KS_VW, b);
}
static inline __attribute__((always_inline)) ks_vec ks_vsums(const ks_vec *a) {
    __m256 r[4], s[2];
    for (int i = 0; i < 4; i++)
        r[i] = _mm256_add_ps(_mm256_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm256_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 2; i++) {
        const __m256d x = _mm256_castps_pd(r[2 * i]), y = _mm256_castps_pd(r[2 * i + 1]);
        s[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)), _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
    }
    return _mm256_add_ps(_mm256_permute2f128_ps(s[0], s[1], 0x20), _mm256_permute2f128_ps(s[0], s[1], 0x31));
}
static inline void ks_vstore_first(float *p, ks_vec x, int m) {
    float tmp[KS_VW];
    _mm256_storeu_ps(tmp, x);
    memcpy(p, tmp, sizeof(float) * (size_t)m);
}
#define ks_vloadf(p) _mm256_loadu_ps(p)
#define ks_vfma(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define ks_vmul(a, b) _mm256_mul_ps((a), (b))
#define ks_vset1(x) _mm256_set1_ps(x)
#define ks_vzero() _mm256_setzero_ps()
#endif

#ifdef KS_VW
/* The vector passes walk the slots in runs of at most KS_VW slots inside one block (one table
 * lookup per run, a fixed row stride inside it): the logits pass turns a run into one vector of
 * logits per query head; both passes prefetch the next run while they work on this one. */

/* First cache row (of kv->kv_head) of the run starting at slot t; *m = its slots. */
static inline int64_t ks_kv_run(const ks_kv_view *kv, int t, int len, int *m) {
    const int bs = kv->block_size, in_block = bs - t % bs, left = len - t;
    *m = in_block < left ? in_block : left;
    if (*m > KS_VW) *m = KS_VW;
    return ks_kv_row(kv, t);
}

/* Software prefetch of the next run (ks_kv_block_at says why), a slot's rows of `heads` kv
 * heads (from kv->kv_head) at a time, spread over the work on the current run: a whole run
 * asked at once overflows the line-fill buffers. Into L2 (locality 2). */
typedef struct {
    const char *p;  /* the next run's first row; NULL when this run is the last */
    int64_t stride; /* bytes between its slots */
    int m, span;    /* its slots; bytes of one slot's rows */
} ks_next_run;

static inline ks_next_run ks_next_run_of(const ks_kv_view *kv, const void *base, int heads, int t, int m,
                                         int len) {
    ks_next_run r = {0, 0, 0, 0};
    const int tn = t + m;
    if (tn >= len) return r;
    const int esize = kv->cdt == KS_BF16 ? 2 : 4;
    const int64_t row = ks_kv_run(kv, tn, len, &r.m);
    r.p = (const char *)base + row * kv->d * esize;
    r.stride = (int64_t)kv->hkv * kv->d * esize;
    r.span = heads * kv->d * esize;
    return r;
}

/* Prefetches slots s0..s1-1 of the next run. */
static inline void ks_prefetch_slots(const ks_next_run *r, int s0, int s1) {
    if (!r->p) return;
    if (s1 > r->m) s1 = r->m;
    for (int s = s0; s < s1; s++)
        for (int b = 0; b < r->span; b += 64) __builtin_prefetch(r->p + s * r->stride + b, 0, 2);
}
#endif

/* Most query floats the vector logits pass permutes at a time (query heads x d): wider groups
 * go through in chunks of heads, each walking the slots again. */
#define KS_MAX_QUERY 4096
/* Widest head the vector passes take (d <= KS_MAX_CHUNKS * KS_VW); wider heads take the scalar
 * loops, as do heads that are not a multiple of 2 * KS_VW. */
#define KS_MAX_CHUNKS 16
/* The V pass keeps a tile of output vectors in registers -- up to KS_TILE_HEADS query heads x
 * one pair of vectors (2 * KS_VW values: 18 of AVX-512's 32 registers; 12 of AVX2's 16) -- and
 * walks the slots once per tile. SmolLM2's 9 heads x 64 dims take two walks with AVX-512: the
 * first streams every kv head's rows of a slot from memory, the second finds them in L2. */
#define KS_L2_RESIDENT_BYTES (1 << 20)
#if defined(KS_GEMV_AVX512)
#define KS_TILE_HEADS 9
#else
#define KS_TILE_HEADS 6
#endif

#ifdef KS_VW
/* One query head's logits for a run of KS_VW slots: slot s's row starts at element e + s *
 * estride; q in the pair order of ks_vload_pair, P pairs (2 * KS_VW values each). Constant P
 * and cdt (the callers' switch) let the compiler keep the accumulators in registers. */
static inline __attribute__((always_inline)) ks_vec ks_logits_run(const void *k, const int cdt, int64_t e,
                                                                  int64_t estride, const float *q,
                                                                  const int P, const char *pf, int npf) {
    ks_vec acc[KS_VW], qa[8], qb[8];
    for (int c = 0; c < P; c++) {
        qa[c] = ks_vloadf(q + 2 * c * KS_VW);
        qb[c] = ks_vloadf(q + (2 * c + 1) * KS_VW);
    }
#pragma GCC unroll 16
    for (int s = 0; s < KS_VW; s++) {
        if (s < npf) __builtin_prefetch(pf + s * 64, 0, 2);
        ks_vec x = ks_vzero(), y = ks_vzero();
#pragma GCC unroll 8
        for (int c = 0; c < P; c++) {
            ks_vec a, b;
            ks_vload_pair(k, cdt, e + s * estride + 2 * c * KS_VW, &a, &b);
            x = ks_vfma(a, qa[c], x);
            y = ks_vfma(b, qb[c], y);
        }
        acc[s] = x + y;
    }
    for (int l = KS_VW; l < npf; l++) __builtin_prefetch(pf + l * 64, 0, 2);
    return ks_vsums(acc);
}

/* The same for any pair count and the first m slots only (runs cut by a block's end or the
 * context's): the rest of the vector is zero. */
static ks_vec ks_logits_run_any(const void *k, int cdt, int64_t e, int64_t estride, const float *q, int P,
                                int m) {
    ks_vec acc[KS_VW];
    for (int s = 0; s < KS_VW; s++) {
        ks_vec x = ks_vzero();
        for (int c = 0; c < P && s < m; c++) {
            ks_vec a, b;
            ks_vload_pair(k, cdt, e + s * estride + 2 * c * KS_VW, &a, &b);
            x = ks_vfma(a, ks_vloadf(q + 2 * c * KS_VW), x);
            x = ks_vfma(b, ks_vloadf(q + (2 * c + 1) * KS_VW), x);
        }
        acc[s] = x;
    }
    return ks_vsums(acc);
}

#define KS_LOGITS_CASE(P)                                                                     \
    case 2 * P: return ks_logits_run(k, KS_F32, e, estride, q, P, pf, npf);                   \
    case 2 * P + 1: return ks_logits_run(k, KS_BF16, e, estride, q, P, pf, npf);
static ks_vec ks_logits_run_of(const void *k, int cdt, int64_t e, int64_t estride, const float *q, int P, int m,
                                const char *pf, int npf) {
    if (m == KS_VW) switch (2 * P + (cdt == KS_BF16)) {
            KS_LOGITS_CASE(1)
            KS_LOGITS_CASE(2)
            KS_LOGITS_CASE(4)
            KS_LOGITS_CASE(8)
        }
    for (int l = 0; l < npf; l++) __builtin_prefetch(pf + l * 64, 0, 2);
    return ks_logits_run_any(k, cdt, e, estride, q, P, m);
}
#endif

/* logits[j * n + i] = (q[j] . K[lo + i]) * scale for the query heads j of `heads` kv heads
 * from kv->kv_head on (group query heads each, heads' query rows consecutive), n = len - lo.
 * q: [heads * group, d] float32. Vector path: per run of slots, for each query head, one
 * accumulator vector per slot (its row's pairs against the query permuted to match), then the
 * run's sums in one transposing tree; the run's rows stay in L1 across the query heads. */
static inline void ks_attend_logits(const ks_kv_view *kv, const float *q, int group, int heads,
                                    int lo, int len, float scale, float *logits) {
    const int d = kv->d, n = len - lo, hq = heads * group;
#ifdef KS_VW
    if (d % (2 * KS_VW) == 0 && d <= KS_MAX_CHUNKS * KS_VW) {
        float qp[KS_MAX_QUERY];
        const int per = KS_MAX_QUERY / d; /* query heads per chunk */
        const ks_vec vscale = ks_vset1(scale);
        for (int j0 = 0; j0 < hq; j0 += per) {
            const int j1 = j0 + per < hq ? j0 + per : hq;
            const float *qs = q + (int64_t)j0 * d;
            if (kv->cdt == KS_BF16) {
                for (int j = j0; j < j1; j++)
                    ks_pair_permute(q + (int64_t)j * d, d, KS_VW, qp + (int64_t)(j - j0) * d);
                qs = qp;
            }
            const int nh = j1 - j0;
            for (int t = lo; t < len;) {
                int m;
                const int64_t row0 = ks_kv_run(kv, t, len, &m);
                const ks_next_run next = ks_next_run_of(kv, kv->k, heads, t, m, len);
                /* A contiguous next run is asked for a line per slot; otherwise a slot's rows per head */
                const int flat = next.p && next.stride == next.span;
                const int lines = flat ? (next.m * next.span + 63) / 64 : 0;
                for (int j = j0; j < j1; j++) {
                    int l0 = 0, l1 = 0;
                    if (flat) {
                        l0 = (int)((int64_t)(j - j0) * lines / nh);
                        l1 = (int)((int64_t)(j - j0 + 1) * lines / nh);
                    } else {
                        ks_prefetch_slots(&next, (j - j0) * KS_VW / nh, (j - j0 + 1) * KS_VW / nh);
                    }
                    const ks_vec sums = ks_logits_run_of(kv->k, kv->cdt, (row0 + j / group) * d, (int64_t)kv->hkv * d,
                                                         qs + (int64_t)(j - j0) * d, d / (2 * KS_VW), m,
                                                         flat ? next.p + (int64_t)l0 * 64 : 0, l1 - l0);
                    ks_vstore_first(logits + (int64_t)j * n + (t - lo), ks_vmul(sums, vscale), m);
                }
                t += m;
            }
        }
        return;
    }
#endif
    KS_FOR_SLOTS(kv, kv->k, lo, len, row, i, {
        for (int j = 0; j < hq; j++) {
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
 * stay in registers; head j reads kv head j / group, whose pair is loaded once for the heads
 * that share it) x one pair of vectors from element e0, over slots lo..len-1, prefetching the
 * next run when `prefetch` (the first walk; later walks find the rows in L2).
 * probs: [heads, n]; o: [heads, d], both indexed from head 0. */
#define KS_DEFINE_VALUES_TILE(H)                                                                \
    static void ks_values_tile##H(const ks_kv_view *kv, const float *probs, int n, int group,   \
                                  int heads, int j0, int lo, int len, int e0, int prefetch,    \
                                  float *o) {                                                  \
        const int d = kv->d;                                                                   \
        ks_vec acc[2 * H];                                                                     \
        int64_t off[H];                                                                        \
        for (int j = 0; j < H; j++) off[j] = (int64_t)((j0 + j) / group) * d + e0;             \
        for (int a = 0; a < 2 * H; a++) acc[a] = ks_vzero();                                    \
        for (int t = lo; t < len;) {                                                           \
            int m;                                                                             \
            const int64_t row0 = ks_kv_run(kv, t, len, &m);                                    \
            const ks_next_run next = prefetch ? ks_next_run_of(kv, kv->v, heads, t, m, len)    \
                                              : (ks_next_run){0, 0, 0, 0};                      \
            for (int s = 0; s < m; s++) {                                                      \
                const int64_t row = row0 + (int64_t)s * kv->hkv;                               \
                const float *pr = probs + (t - lo) + s;                                        \
                ks_prefetch_slots(&next, s, s + 1);                                            \
                ks_vec a = ks_vzero(), b = ks_vzero();                                         \
                for (int j = 0; j < H; j++) {                                                  \
                    if (j == 0 || off[j] != off[j - 1]) ks_vload_pair(kv->v, kv->cdt, row * d + off[j], &a, &b); \
                    const ks_vec p = ks_vset1(pr[(int64_t)(j0 + j) * n]);                      \
                    acc[2 * j] = ks_vfma(p, a, acc[2 * j]);                                    \
                    acc[2 * j + 1] = ks_vfma(p, b, acc[2 * j + 1]);                            \
                }                                                                              \
            }                                                                                  \
            t += m;                                                                            \
        }                                                                                      \
        for (int j = 0; j < H; j++)                                                            \
            ks_vstore_pair(o + (int64_t)(j0 + j) * d + e0, kv->cdt, acc[2 * j], acc[2 * j + 1]); \
    }
KS_DEFINE_VALUES_TILE(1)
KS_DEFINE_VALUES_TILE(2)
KS_DEFINE_VALUES_TILE(3)
KS_DEFINE_VALUES_TILE(4)
KS_DEFINE_VALUES_TILE(5)
KS_DEFINE_VALUES_TILE(6)
#if KS_TILE_HEADS > 6
KS_DEFINE_VALUES_TILE(7)
KS_DEFINE_VALUES_TILE(8)
KS_DEFINE_VALUES_TILE(9)
#endif

typedef void (*ks_values_tile_fn)(const ks_kv_view *, const float *, int, int, int, int, int, int, int, int,
                                  float *);
static const ks_values_tile_fn ks_values_tiles[KS_TILE_HEADS + 1] = {
    0, ks_values_tile1, ks_values_tile2, ks_values_tile3, ks_values_tile4, ks_values_tile5, ks_values_tile6,
#if KS_TILE_HEADS > 6
    ks_values_tile7, ks_values_tile8, ks_values_tile9
#endif
};
#endif

/* o[j] = sum_i probs[j * n + i] * V[lo + i] for the query heads j of `heads` kv heads from
 * kv->kv_head on (group each), n = len - lo; o: [heads * group, d] float32, overwritten. */
static inline void ks_attend_values(const ks_kv_view *kv, const float *probs, int group, int heads,
                                    int lo, int len, float *o) {
    const int d = kv->d, n = len - lo, hq = heads * group;
    memset(o, 0, sizeof(float) * (size_t)hq * d);
    if (n <= 0) return;
#ifdef KS_VW
    if (d % (2 * KS_VW) == 0 && d <= KS_MAX_CHUNKS * KS_VW) {
        /* Later walks find the rows the first one brought in L2 when they fit there. */
        const int fits_l2 = (int64_t)n * heads * d * (kv->cdt == KS_BF16 ? 2 : 4) <= KS_L2_RESIDENT_BYTES;
        for (int j0 = 0; j0 < hq; j0 += KS_TILE_HEADS) {
            const int h = hq - j0 < KS_TILE_HEADS ? hq - j0 : KS_TILE_HEADS;
            for (int e0 = 0; e0 < d; e0 += 2 * KS_VW)
                ks_values_tiles[h](kv, probs, n, group, heads, j0, lo, len, e0, (j0 == 0 && e0 == 0) || !fits_l2, o);
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

/* Slots a tree mask covers (keyserve/kernels/metadata.py, decode_tree_masks): bit i of a row's
 * int64 mask, 0 <= i < KS_TREE_BITS, shows slot len-1-i; older slots are always visible. */
#define KS_TREE_BITS 63

/* Hides the slots of lo..len-1 that `mask` does not show, for `rows` rows of logits ([rows,
 * len - lo]): their logits become -inf, so the softmax gives them weight exactly 0 (the values
 * pass then adds 0 * V, and scores from these logits are 0). Only the last min(63, len - lo)
 * slots can be hidden. Returns 1 when some slot of lo..len-1 stays visible. */
static inline int ks_hide_tree_slots(float *logits, int rows, int lo, int len, int64_t mask) {
    const int n = len - lo;
    int visible = len - KS_TREE_BITS > lo; /* a slot older than the mask's reach */
    for (int i = 0; i < KS_TREE_BITS && len - 1 - i >= lo; i++) {
        if (((uint64_t)mask >> i) & 1u) {
            visible = 1;
            continue;
        }
        for (int j = 0; j < rows; j++) logits[(int64_t)j * n + (len - 1 - i - lo)] = -INFINITY;
    }
    return visible;
}

/* o = softmax(q . K * scale) @ V for the query heads of `heads` kv heads from kv->kv_head on:
 * the logits pass, a softmax per head into probs (which may be logits itself, when the logits
 * are not needed afterwards), the values pass. logits, probs: [heads * group, len - lo];
 * o: [heads * group, d]. tree_mask: the row's decode tree mask (-1: every slot, and nothing
 * extra is done; otherwise hidden slots' logits are -inf before the softmax). Returns 1, or 0
 * with zeros in o (logits and probs undefined) when no slot is visible: len <= lo, or a tree
 * mask hiding every slot of lo..len-1. */
static inline int ks_attend(const ks_kv_view *kv, const float *q, int group, int heads, int lo,
                            int len, float scale, int64_t tree_mask, float *logits, float *probs,
                            float *o) {
    const int n = len - lo, hq = heads * group;
    if (n <= 0) {
        memset(o, 0, sizeof(float) * (size_t)hq * kv->d);
        return 0;
    }
    ks_attend_logits(kv, q, group, heads, lo, len, scale, logits);
    if (tree_mask != -1 && !ks_hide_tree_slots(logits, hq, lo, len, tree_mask)) {
        memset(o, 0, sizeof(float) * (size_t)hq * kv->d);
        return 0;
    }
    for (int j = 0; j < hq; j++) softmax_into(logits + (int64_t)j * n, probs + (int64_t)j * n, n);
    ks_attend_values(kv, probs, group, heads, lo, len, o);
    return 1;
}

#endif
