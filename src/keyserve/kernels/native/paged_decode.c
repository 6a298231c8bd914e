/* Paged decode attention for the CPU, reading K/V straight from the block layout.
 *
 * Why: torch has no paged attention on the CPU, so the torch path gathers every sequence's
 * blocks into a contiguous copy per layer per step before its fused SDPA. At batch 32-64 with
 * contexts of a few hundred tokens that copy is as large as the attention itself, and with
 * score output (KV budgets) the torch path materialises [seqs, heads, slots] logits in several
 * passes. Decode attention is memory-bound: one pass over each sequence's K and V from the
 * cache, with the group's query heads sharing every K/V row (GQA), is the least work there is.
 *
 * Semantics equal keyserve/kernels/reference.py (paged_decode_attention_reference):
 *   out[s, h]  = softmax(q[s,h] . K[s, lo:len] * scale) @ V[s, lo:len]
 *   lo         = max(0, len - window) with a sliding window, else 0
 *   tree masks = optional, per row (keyserve/kernels/metadata.py, decode_tree_masks): slot
 *                len-1-i (i < 63) is left out unless bit i of the row's mask is set; left-out
 *                slots weigh exactly 0 in the output and score 0
 *   scores     = per (s, kv-head, slot) attention mass summed over the group's query heads:
 *                softmax (H2O) or softmax((x + zeta) / tau) with zeta = -log(-log U) (Keyformer)
 *   U          = keyserve/kernels/noise.py's hash of (the row's noise seed and query position,
 *                noise_layer + query head, slot): the same bits as the torch and Triton paths
 * Cache rows: k_cache[(block * block_size + offset) * num_kv_heads + kv_head][head_dim],
 * float32 or bfloat16. The two passes over K and V are attend.h's; work is split over sequences
 * (or, with few sequences, (sequence, kv head) pairs) with OpenMP.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "attend.h"
#include "gemv.h"
#include "vecmath.h"

#define TINY 1e-20f

/* Keyformer's noise (keyserve/kernels/noise.py, which states the function): lowbias32 over a
 * per-(row, head) key and the slot, so every (sequence, head, position, slot) draws the same
 * uniform whatever the batch, the thread scheduling or the kernel. */
static inline uint32_t mix32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= x >> 15;
    x *= 0x846CA68Bu;
    x ^= x >> 16;
    return x;
}

static inline uint32_t noise_row(uint32_t seed, uint32_t head_key, uint32_t position) {
    return mix32(mix32(seed ^ mix32(head_key)) ^ position);
}

static inline float noise_uniform(uint32_t row, uint32_t slot) {
    const uint32_t bits = mix32(row + slot * 0x9E3779B9u);
    return ((float)(bits >> 9) + 0.5f) * (1.0f / 8388608.0f); /* in (0, 1), exact */
}

/* noisy[i] = (logits[i] + zeta_i) / tau with zeta = -log(-log U): U from `uniforms` (tests, at
 * index0 + i) or the noise hash of row key `row` at slot slot0 + i. Split in two loops so the
 * logs vectorise. */
static void gumbel_logits(const float *logits, const float *uniforms, uint32_t row,
                          int64_t index0, int slot0, float inv_tau, float *noisy, int n) {
    if (uniforms)
        memcpy(noisy, uniforms + index0, sizeof(float) * (size_t)n);
    else
        for (int i = 0; i < n; i++) noisy[i] = noise_uniform(row, (uint32_t)(slot0 + i));
#pragma omp simd
    for (int i = 0; i < n; i++) {
        float u = noisy[i] < TINY ? TINY : noisy[i];
        u = u > 1.0f - 1e-7f ? 1.0f - 1e-7f : u;
        noisy[i] = (logits[i] - logf(-logf(u))) * inv_tau;
    }
}

/* Scores of one (sequence s, kv head kh) from its group's logits/probs ([group, n] each):
 * sc[lo + i] = sum over the group's heads of softmax (H2O) or the noisy softmax (Keyformer). */
static void group_scores(const float *logits, const float *probs, int group, int n, int lo,
                         int s, int kh, int num_heads, int score_mode, const float *tau,
                         const float *uniforms, const int64_t *noise_keys, uint32_t noise_layer,
                         int max_ctx, float *noisy, float *sc) {
    memset(sc, 0, sizeof(float) * max_ctx);
    for (int g = 0; g < group; g++) {
        const float *p = probs + (int64_t)g * n;
        if (score_mode == 2) {
            const int64_t h = (int64_t)s * num_heads + kh * group + g;
            const uint32_t key = uniforms ? 0u : noise_row((uint32_t)noise_keys[2 * s],
                                                           noise_layer + (uint32_t)(kh * group + g),
                                                           (uint32_t)noise_keys[2 * s + 1]);
            gumbel_logits(logits + (int64_t)g * n, uniforms, key, h * max_ctx + lo, lo, 1.0f / tau[s],
                          noisy, n);
            softmax_into(noisy, noisy, n);
            p = noisy;
        }
        for (int i = 0; i < n; i++) sc[lo + i] += p[i];
    }
}

/* The kernel. Work items are (sequence, run of kv heads): with enough sequences to keep every
 * thread busy a sequence's kv heads go together, so each slot's rows (every kv head's, one
 * contiguous stretch) are read once, front to back; with few sequences (batch 1) one item per
 * kv head spreads the work over the threads. */
static void decode(const void *q, const void *k_cache, const void *v_cache, int cdt,
                   const int32_t *tables, int max_blocks, const int32_t *lens, int num_seqs,
                   int num_heads, int num_kv_heads, int head_dim, int block_size, float scale,
                   int window, void *out, int score_mode, const float *tau, const float *uniforms,
                   const int64_t *noise_keys, uint32_t noise_layer, float *scores, int max_ctx,
                   int num_threads, int iodt, const int64_t *tree_masks) {
    const int group = num_heads / num_kv_heads;
    const int heads = num_seqs >= 4 * num_threads ? num_kv_heads : 1; /* kv heads per item */
    const int per_seq = num_kv_heads / heads;
    const size_t ctx = max_ctx > 0 ? (size_t)max_ctx : 1;
#pragma omp parallel num_threads(num_threads)
    {
        float *logits = malloc(sizeof(float) * (size_t)heads * group * ctx);
        float *probs = malloc(sizeof(float) * (size_t)heads * group * ctx);
        float *noisy = score_mode == 2 ? malloc(sizeof(float) * ctx) : NULL;
        /* bf16 queries are widened here and outputs rounded (RNE) here: two torch conversions
         * per layer cost more than the step's whole KV write */
        float *qf = iodt == KS_BF16 ? malloc(sizeof(float) * (size_t)heads * group * head_dim * 2) : NULL;
        float *of = qf ? qf + (size_t)heads * group * head_dim : NULL;
#pragma omp for schedule(dynamic, 1)
        for (int task = 0; task < num_seqs * per_seq; task++) {
            const int s = task / per_seq, kh0 = (task % per_seq) * heads;
            const int len = lens[s];
            const int lo = (window > 0 && len > window) ? len - window : 0;
            const int n = len - lo;
            const int hq = heads * group;
            const int64_t first = ((int64_t)s * num_heads + (int64_t)kh0 * group) * head_dim;
            if (n <= 0) {
                const size_t esize = iodt == KS_BF16 ? 2 : 4;
                memset((char *)out + first * esize, 0, esize * (size_t)hq * head_dim);
                if (score_mode != 0)
                    memset(scores + ((int64_t)s * num_kv_heads + kh0) * max_ctx, 0,
                           sizeof(float) * (size_t)heads * max_ctx);
                continue;
            }
            const ks_kv_view kv = {k_cache, v_cache, cdt, tables + (int64_t)s * max_blocks,
                                   block_size, num_kv_heads, kh0, head_dim};
            const float *qs = (const float *)q + first;
            float *o = (float *)out + first;
            if (iodt == KS_BF16) {
                for (int64_t e = 0; e < (int64_t)hq * head_dim; e++) qf[e] = ks_bf16_to_f32(((const uint16_t *)q)[first + e]);
                qs = qf;
                o = of;
            }
            const int attended = ks_attend(&kv, qs, group, heads, lo, len, scale, tree_masks ? tree_masks[s] : -1,
                                           logits, probs, o);
            if (iodt == KS_BF16)
                for (int64_t e = 0; e < (int64_t)hq * head_dim; e++) ((uint16_t *)out)[first + e] = ks_f32_to_bf16(of[e]);
            if (score_mode == 0) continue;
            if (!attended) { /* a tree mask hid every slot: no mass anywhere */
                memset(scores + ((int64_t)s * num_kv_heads + kh0) * max_ctx, 0, sizeof(float) * (size_t)heads * max_ctx);
                continue;
            }
            for (int h = 0; h < heads; h++)
                group_scores(logits + (int64_t)h * group * n, probs + (int64_t)h * group * n, group, n,
                             lo, s, kh0 + h, num_heads, score_mode, tau, uniforms, noise_keys,
                             noise_layer, max_ctx, noisy,
                             scores + ((int64_t)s * num_kv_heads + kh0 + h) * max_ctx);
        }
        free(logits);
        free(probs);
        free(noisy);
        free(qf);
    }
}

/* Entry point (ctypes). cache_dtype and io_dtype (q and out): 0 = float32, 1 = bfloat16. score_mode: 0 none,
 * 1 softmax, 2 gumbel. uniforms may be NULL (then U is the noise hash of noise_keys [num_seqs,
 * 2] = (seed, query position) and noise_layer + head). scores may be NULL when score_mode == 0.
 * tree_masks: [num_seqs] int64 decode tree masks, or NULL for none. */
void keyserve_paged_decode(const void *q, const void *k_cache, const void *v_cache,
                           int cache_dtype, const int32_t *tables, int max_blocks,
                           const int32_t *lens, int num_seqs, int num_heads, int num_kv_heads,
                           int head_dim, int block_size, float scale, int window, void *out,
                           int score_mode, const float *tau, const float *uniforms,
                           const int64_t *noise_keys, uint32_t noise_layer, float *scores,
                           int max_ctx, int num_threads,
                           int parallel_min_rows, int io_dtype, const int64_t *tree_masks) {
    if (max_ctx < 0) { /* not given (no score output): the longest context sizes the buffers */
        max_ctx = 0;
        for (int s = 0; s < num_seqs; s++) max_ctx = lens[s] > max_ctx ? lens[s] : max_ctx;
    }
    if ((int64_t)num_seqs * num_kv_heads * max_ctx < parallel_min_rows) num_threads = 1;
    if (num_threads < 1) num_threads = 1;
    decode(q, k_cache, v_cache, cache_dtype == 1 ? KS_BF16 : KS_F32, tables, max_blocks, lens,
           num_seqs, num_heads, num_kv_heads, head_dim, block_size, scale, window, out, score_mode,
           tau, uniforms, noise_keys, noise_layer, scores, max_ctx, num_threads, io_dtype == 1 ? KS_BF16 : KS_F32,
           tree_masks);
}

/* Keyformer's Gumbel noise zeta = -log(-log U) for one sequence's chunk of queries (the CPU
 * prefill-with-scores path): out[h][j][t] for query head h (key head_key0 + h), query j at
 * position pos0 + j and slot slot0 + t, U the noise hash of `seed` (noise.py). */
void keyserve_gumbel_noise(float *out, uint32_t seed, uint32_t head_key0, int num_heads,
                           int64_t pos0, int num_queries, int64_t slot0, int num_slots,
                           int num_threads) {
    const int64_t rows = (int64_t)num_heads * num_queries;
    if (rows * num_slots < 65536 || num_threads < 1) num_threads = 1;
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const int h = (int)(r / num_queries), j = (int)(r % num_queries);
        const uint32_t key = noise_row(seed, head_key0 + (uint32_t)h, (uint32_t)(pos0 + j));
        float *o = out + r * num_slots;
        for (int t = 0; t < num_slots; t++) o[t] = noise_uniform(key, (uint32_t)(slot0 + t));
#pragma omp simd
        for (int t = 0; t < num_slots; t++) {
            float u = o[t] < TINY ? TINY : o[t];
            u = u > 1.0f - 1e-7f ? 1.0f - 1e-7f : u;
            o[t] = -logf(-logf(u));
        }
    }
}

/* Scatter new K/V rows into the paged cache: token i, kv-head h goes to slot
 * slots[i * slot_stride + h * head_stride] (head_stride 0: one slot per token; a slot < 0 is
 * skipped). key/value rows are [num_tokens, num_kv_heads, head_dim] contiguous in the cache's
 * dtype; elem_size is that dtype's size in bytes. One memcpy per (token, head) row, instead of
 * the boolean-mask index_put (a nonzero, an index and a scatter per tensor) torch needs.
 * Every slot is checked against num_slots first (here: a torch max and a sync per layer cost
 * more than the copy): returns -1, or the first slot out of range with nothing written. */
int64_t keyserve_write_kv(const void *key, const void *value, void *k_cache, void *v_cache,
                          const int64_t *slots, int num_tokens, int num_kv_heads, int head_dim,
                          int elem_size, int slot_stride, int head_stride, int64_t num_slots) {
    const size_t row = (size_t)head_dim * elem_size;
    const int per_token = head_stride ? num_kv_heads : 1;
    for (int i = 0; i < num_tokens; i++)
        for (int h = 0; h < per_token; h++) {
            const int64_t slot = slots[(int64_t)i * slot_stride + (int64_t)h * head_stride];
            if (slot >= num_slots) return slot;
        }
    for (int i = 0; i < num_tokens; i++) {
        for (int h = 0; h < num_kv_heads; h++) {
            const int64_t slot = slots[(int64_t)i * slot_stride + (int64_t)h * head_stride];
            if (slot < 0) continue;
            const size_t src = ((size_t)i * num_kv_heads + h) * row;
            const size_t dst = ((size_t)slot * num_kv_heads + h) * row;
            memcpy((char *)k_cache + dst, (const char *)key + src, row);
            memcpy((char *)v_cache + dst, (const char *)value + src, row);
        }
    }
    return -1;
}
