/* One decode step of a Llama-family decoder, every layer, in one native call.
 *
 * Why: at batch 1 the torch path spends about as long in Python and small ops (views,
 * transposes, empties, one kernel launch per op, ~40 per layer) as it needs to stream the
 * weights. Here one OpenMP team runs the whole stack: the threads split every matrix's output
 * rows evenly (gemv.h, row-major weights streamed once; bf16 steps of 2-64 rows: whole
 * 16-column blocks on AMX tiles, amx_linear.c), redo the tiny per-row work (RMSNorm)
 * privately instead of waiting for each other, and meet at a barrier only where the next phase
 * needs the whole previous result (6 per layer).
 *
 * Semantics are those of model/llama.py's torch path for a decode-only step (every query row
 * is one new token of its sequence), including where bfloat16 rounds: activations are held in
 * float32, and in bf16 mode every value torch would store as a bf16 tensor is rounded to bf16
 * at the same point (linear outputs, RoPE's two products and their sum, the attention output,
 * residual sums, RMSNorm's normalised value and its product with the weight, SiLU and its
 * product with up). Per layer:
 *   xn   = rms_norm(h) * w_in
 *   qkv  = xn @ Wqkv^T (+ b)                 -> rotate q and k (rotate-half, cos/sin tables)
 *   write k, v at the row's slot (slot < 0: skip), in the cache's dtype
 *   attn = paged decode attention over the row's block table (sliding window on the layers
 *          that have one; the row's tree mask, if given, in every layer), as paged_decode.c
 *          computes it
 *   h   += attn @ Wo^T (+ b)
 *   xn   = rms_norm(h) * w_post;  act = silu(xn @ Wg^T) * (xn @ Wu^T);  h += act @ Wd^T (+ b)
 * then out = rms_norm(h) * w_final in the model's dtype.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "attend.h"
#include "f32_block.h"
#include "gemv.h"
#include "vecmath.h"

/* Per-layer pointers (uint64 each, 0 = absent), in this order. */
enum { P_QKV_W, P_QKV_B, P_O_W, P_O_B, P_GU_W, P_GU_B, P_DOWN_W, P_DOWN_B, P_IN_NORM, P_POST_NORM,
       P_K_CACHE, P_V_CACHE, P_SLIDING, P_QKV_PK, P_O_PK, P_GU_PK, P_DOWN_PK, LAYER_FIELDS };
/* P_*_PK: the same bf16 weights packed into AMX tiles (amx_linear.c), or 0. With them a step of
 * KS_AMX_MIN_ROWS (2) to KS_AMX_MAX_ROWS (64) rows runs its products on AMX: past a row or two
 * the vector kernels are bound by their multiplies, AMX by the weight stream
 * (bench/decode_rows_bench.py). In float32 they hold the weights packed for f32_block.c's
 * register tiles, used from KS_F32_BLOCK_MIN_ROWS rows on (AVX-512 builds). */

/* dims[] */
enum { D_HIDDEN, D_INTER, D_HEADS, D_KV_HEADS, D_HEAD_DIM, D_LAYERS, D_WDTYPE, D_CDTYPE,
       D_BLOCK_SIZE, D_NUM_BLOCKS, D_VOCAB, D_MAX_POS, D_EMBED_ROW_STRIDE, D_EMBED_COL_STRIDE,
       NUM_DIMS };

/* Error codes (nothing is written when one is returned). */
enum { OK = 0, BAD_TOKEN = 1, BAD_POSITION = 2, BAD_SLOT = 3, BAD_BLOCK = 4, NO_MEMORY = 5 };

typedef struct {
    int hidden, inter, hq, hkv, d, layers, wdt, cdt, block_size, num_blocks, vocab, max_pos;
    int64_t embed_row, embed_col;
    int qkv_out, group, bf16;
    float eps, scale;
} Dims;

static inline float act_round(const Dims *c, float v) { return c->bf16 ? ks_round_bf16(v) : v; }

static inline const void *ptr(const uint64_t *layer, int field) {
    return (const void *)(uintptr_t)layer[field];
}

/* out[0:n] = rms_norm(x) * w, with torch's rounding for bf16 (see the header comment). */
static void rms_norm(const Dims *c, const float *x, int n, const void *w, float *out) {
    double ss = 0.0;
#pragma omp simd reduction(+ : ss)
    for (int i = 0; i < n; i++) ss += (double)x[i] * x[i];
    const float r = 1.0f / sqrtf((float)(ss / n) + c->eps);
    if (c->bf16) {
        for (int i = 0; i < n; i++)
            out[i] = ks_round_bf16(ks_w_at(w, c->wdt, i) * ks_round_bf16(x[i] * r));
    } else {
        const float *wf = (const float *)w;
        for (int i = 0; i < n; i++) out[i] = x[i] * r * wf[i];
    }
}

/* Rotate one head in place: x*[c, c] + swap_halves(x)*[-s, s], as model/rope.py's
 * apply_rotary (bit-identical in float32; each product and the sum rounded in bf16). */
static void rotate(const Dims *c, float *x, const float *cs, const float *sn) {
    const int half = c->d / 2;
    for (int j = 0; j < half; j++) {
        const float x1 = x[j], x2 = x[j + half];
        if (c->bf16) {
            x[j] = ks_round_bf16(ks_round_bf16(x1 * cs[j]) + ks_round_bf16(x2 * -sn[j]));
            x[j + half] = ks_round_bf16(ks_round_bf16(x2 * cs[j]) + ks_round_bf16(x1 * sn[j]));
        } else {
            x[j] = x1 * cs[j] + x2 * -sn[j];
            x[j + half] = x2 * cs[j] + x1 * sn[j];
        }
    }
}

static inline void store_row(void *cache, int cdt, int64_t row, int d, const float *src) {
    if (cdt == KS_BF16) {
        uint16_t *dst = (uint16_t *)cache + row * d;
        for (int i = 0; i < d; i++) dst[i] = ks_f32_to_bf16(src[i]);
    } else {
        memcpy((float *)cache + row * d, src, sizeof(float) * (size_t)d);
    }
}

/* y[:, o0:o1] += bias, then rounded as the model's dtype (bias may be NULL). */
static void finish_rows(const Dims *c, float *y, int m, int ld, int o0, int o1, const void *bias) {
    if (!bias && !c->bf16) return;
    for (int r = 0; r < m; r++)
        for (int o = o0; o < o1; o++) {
            float v = y[(int64_t)r * ld + o];
            if (bias) v += ks_w_at(bias, c->wdt, o);
            y[(int64_t)r * ld + o] = act_round(c, v);
        }
}

/* h[:, o0:o1] += y[:, o0:o1] (rounded as the model's dtype). */
static void add_residual(const Dims *c, float *h, const float *y, int m, int o0, int o1) {
    for (int r = 0; r < m; r++)
        for (int o = o0; o < o1; o++) {
            const int64_t k = (int64_t)r * c->hidden + o;
            h[k] = act_round(c, h[k] + y[k]);
        }
}

/* Columns [o0, o1) of thread tid of nt, whole blocks of `width` columns (the packed layouts'). */
static void split_blocks(int n, int width, int tid, int nt, int *o0, int *o1) {
    const int blocks = n / width;
    *o0 = width * (int)((int64_t)blocks * tid / nt);
    *o1 = width * (int)((int64_t)blocks * (tid + 1) / nt);
}

/* How a step multiplies: gemv.h's row kernel, AMX tiles (bf16) or float32 register tiles. */
enum { PRODUCTS_ROWS = 0, PRODUCTS_AMX = 1, PRODUCTS_F32_BLOCKS = 2 };

/* y[:, o0:o1] = x . W[o0:o1, :]^T (float32 sums): on AMX tiles where the layer has its packed
 * copy (field pk) and the step has the rows for it, else gemv.h's row kernel on the plain weights. */
static void linear_cols(const Dims *c, int products, const uint64_t *L, int wf, int pk, const float *x, int m,
                        int ldx, int in, int n, int o0, int o1, float *y, int ldy, void *scratch,
                        float *acc) {
#ifdef KS_AMX
    if (products == PRODUCTS_AMX) {
        if (o1 > o0) ks_amx_cols(x, m, ldx, in, (const uint16_t *)ptr(L, pk), n, o0, o1, y, ldy, scratch, acc);
        return;
    }
#endif
#ifdef KS_F32_BLOCK
    if (products == PRODUCTS_F32_BLOCKS) {
        if (o1 > o0) ks_f32_cols(x, m, ldx, in, (const float *)ptr(L, pk), o0, o1, y, ldy);
        return;
    }
#endif
    (void)products; (void)pk; (void)n; (void)scratch; (void)acc;
    ks_gemv_rows(x, m, ldx, in, ptr(L, wf), c->wdt, o0, o1, y, ldy);
}

static int validate(const Dims *c, int m, const int64_t *ids, const int64_t *positions,
                    const int64_t *slots, int64_t slot_layer_stride, int slot_tok_stride,
                    int slot_head_stride, const int32_t *tables, int max_blocks,
                    const int32_t *lens, int64_t lens_layer_stride) {
    const int64_t num_slots = (int64_t)c->num_blocks * c->block_size;
    for (int s = 0; s < m; s++) {
        if (ids[s] < 0 || ids[s] >= c->vocab) return BAD_TOKEN;
        if (positions[s] < 0 || positions[s] >= c->max_pos) return BAD_POSITION;
    }
    const int layer_count = slot_layer_stride ? c->layers : 1;
    for (int l = 0; l < layer_count; l++)
        for (int s = 0; s < m; s++)
            for (int g = 0; g < (slot_head_stride ? c->hkv : 1); g++) {
                int64_t slot = slots[l * slot_layer_stride + (int64_t)s * slot_tok_stride +
                                     (int64_t)g * slot_head_stride];
                if (slot >= num_slots) return BAD_SLOT;
            }
    const int lens_count = lens_layer_stride ? c->layers : 1;
    for (int s = 0; s < m; s++) {
        int longest = 0;
        for (int l = 0; l < lens_count; l++) {
            int len = lens[l * lens_layer_stride + s];
            longest = len > longest ? len : longest;
        }
        if ((int64_t)longest > (int64_t)max_blocks * c->block_size) return BAD_BLOCK;
        for (int b = 0; b < (longest + c->block_size - 1) / c->block_size; b++) {
            int32_t block = tables[(int64_t)s * max_blocks + b];
            if (block < 0 || block >= c->num_blocks) return BAD_BLOCK;
        }
    }
    return OK;
}

/* The step. layers: [num_layers][LAYER_FIELDS] pointers (P_SLIDING: 1 where the layer uses the
 * window). slots: [m] (layer and head strides 0) or [layers, m, hkv]; lens: [m] or [layers, m]
 * (lens_layer_stride m). window: the step's sliding window (0: none). out: [m, hidden] in the
 * model's dtype. tree_masks: [m] int64 decode tree masks (attend.h's ks_attend), relative to
 * each layer's own length, or NULL for none. Returns OK or the first validation error, before
 * touching anything. */
int keyserve_decode_stack(const int64_t *dims, float eps, float scale, const uint64_t *layers,
                          const void *embed, const void *final_norm, const float *cos_table,
                          const float *sin_table, int m, const int64_t *ids,
                          const int64_t *positions, const int64_t *slots,
                          int64_t slot_layer_stride, int slot_tok_stride, int slot_head_stride,
                          const int32_t *tables, int max_blocks, const int32_t *lens,
                          int64_t lens_layer_stride, int window, void *out, int num_threads,
                          const int64_t *tree_masks) {
    Dims c = {
        .hidden = (int)dims[D_HIDDEN], .inter = (int)dims[D_INTER], .hq = (int)dims[D_HEADS],
        .hkv = (int)dims[D_KV_HEADS], .d = (int)dims[D_HEAD_DIM], .layers = (int)dims[D_LAYERS],
        .wdt = (int)dims[D_WDTYPE], .cdt = (int)dims[D_CDTYPE],
        .block_size = (int)dims[D_BLOCK_SIZE], .num_blocks = (int)dims[D_NUM_BLOCKS],
        .vocab = (int)dims[D_VOCAB], .max_pos = (int)dims[D_MAX_POS],
        .embed_row = dims[D_EMBED_ROW_STRIDE], .embed_col = dims[D_EMBED_COL_STRIDE],
        .eps = eps, .scale = scale,
    };
    c.qkv_out = (c.hq + 2 * c.hkv) * c.d;
    c.group = c.hq / c.hkv;
    c.bf16 = c.wdt == KS_BF16;
    int err = validate(&c, m, ids, positions, slots, slot_layer_stride, slot_tok_stride,
                       slot_head_stride, tables, max_blocks, lens, lens_layer_stride);
    if (err) return err;
    if (num_threads < 1) num_threads = 1;

    int max_ctx = 1;
    for (int64_t k = 0; k < (lens_layer_stride ? (int64_t)c.layers * m : m); k++)
        max_ctx = lens[k] > max_ctx ? lens[k] : max_ctx;
    const int widest = c.hidden > c.inter ? c.hidden : c.inter;
    int products = PRODUCTS_ROWS;
#ifdef KS_AMX
    if (c.bf16 && m >= KS_AMX_MIN_ROWS && m <= KS_AMX_MAX_ROWS && layers[P_QKV_PK] && keyserve_amx_available())
        products = PRODUCTS_AMX;
#endif
#ifdef KS_F32_BLOCK
    if (!c.bf16 && m >= KS_F32_BLOCK_MIN_ROWS && layers[P_QKV_PK]) products = PRODUCTS_F32_BLOCKS;
#endif
    const int widest_in = widest > c.hq * c.d ? widest : c.hq * c.d;
    const int widest_out = (c.qkv_out > widest ? c.qkv_out : widest);
    /* product scratch, in floats -- AMX: x as padded bf16 tiles [64, widest_in] and the sums of
     * the widest share of output columns (16-column blocks of 1024 floats); float32 tiles read x
     * in place (each tile has exactly its rows) */
    size_t amx_scratch = 0;
    if (products == PRODUCTS_AMX)
        amx_scratch = (size_t)64 * widest_in / 2 + ((size_t)widest_out / 16 + 1) * 1024;
    const size_t shared = (size_t)m * (c.hidden + c.qkv_out + c.hq * c.d + c.hidden + 2 * c.inter + c.inter);
    const size_t private_ = (size_t)m * widest + (size_t)c.hq * max_ctx + c.d + amx_scratch + 16;
    float *mem = malloc(sizeof(float) * (shared + private_ * num_threads));
    if (!mem) return NO_MEMORY;
    float *h = mem, *qkv = h + (size_t)m * c.hidden, *attn = qkv + (size_t)m * c.qkv_out;
    float *tmp = attn + (size_t)m * c.hq * c.d, *gu = tmp + (size_t)m * c.hidden;
    float *act = gu + (size_t)m * 2 * c.inter;
    float *private_base = act + (size_t)m * c.inter;

    for (int s = 0; s < m; s++)  /* embedding lookup (any strides: column-major works too) */
        for (int i = 0; i < c.hidden; i++)
            h[(int64_t)s * c.hidden + i] = ks_w_at(embed, c.wdt, ids[s] * c.embed_row + i * c.embed_col);

    const int half = c.d / 2;
#pragma omp parallel num_threads(num_threads)
    {
        const int tid = omp_get_thread_num(), nt = omp_get_num_threads();
        float *xn = private_base + private_ * tid;  /* [m, widest] */
        float *logits = xn + (size_t)m * widest;    /* [hq, max_ctx] */
        float *cs = logits + (size_t)c.hq * max_ctx;  /* cos | sin of one position: d floats */
        /* product scratch, 64-byte aligned (tile loads and stores) */
        void *xbf = (void *)(((uintptr_t)(cs + c.d) + 63) & ~(uintptr_t)63);
        float *acc = (float *)((uint16_t *)xbf + (size_t)64 * widest_in);
        int q0, q1, o0, o1, f0, f1;
        if (products != PRODUCTS_ROWS) {
            const int width = products == PRODUCTS_AMX ? 16 : 32;
            split_blocks(c.qkv_out, width, tid, nt, &q0, &q1);
            split_blocks(c.hidden, width, tid, nt, &o0, &o1);
            split_blocks(c.inter, width, tid, nt, &f0, &f1);
#ifdef KS_AMX
            if (products == PRODUCTS_AMX) ks_amx_begin();
#endif
        } else {
            ks_split_rows(c.qkv_out, tid, nt, &q0, &q1);
            ks_split_rows(c.hidden, tid, nt, &o0, &o1);
            ks_split_rows(c.inter, tid, nt, &f0, &f1);
        }
        const int tasks = m * c.hkv;  /* (row, kv head) pairs: RoPE + KV write */
        const int att_heads = m >= 4 * nt ? c.hkv : 1, att_items = c.hkv / att_heads;
        const int t0 = (int)((int64_t)tasks * tid / nt), t1 = (int)((int64_t)tasks * (tid + 1) / nt);

        for (int l = 0; l < c.layers; l++) {
            const uint64_t *L = layers + (int64_t)l * LAYER_FIELDS;
            void *kc = (void *)ptr(L, P_K_CACHE), *vc = (void *)ptr(L, P_V_CACHE);
            const int win = L[P_SLIDING] ? window : 0;

            for (int s = 0; s < m; s++)
                rms_norm(&c, h + (int64_t)s * c.hidden, c.hidden, ptr(L, P_IN_NORM), xn + (int64_t)s * c.hidden);
            linear_cols(&c, products, L, P_QKV_W, P_QKV_PK, xn, m, c.hidden, c.hidden, c.qkv_out, q0, q1, qkv, c.qkv_out,
                        xbf, acc);
            finish_rows(&c, qkv, m, c.qkv_out, q0, q1, ptr(L, P_QKV_B));
#pragma omp barrier
            for (int task = t0; task < t1; task++) {
                const int s = task / c.hkv, g = task % c.hkv;
                const int64_t pos = positions[s];
                for (int j = 0; j < half; j++) {
                    cs[j] = act_round(&c, cos_table[pos * half + j]);
                    cs[half + j] = act_round(&c, sin_table[pos * half + j]);
                }
                float *qrow = qkv + (int64_t)s * c.qkv_out;
                for (int j = 0; j < c.group; j++) rotate(&c, qrow + (int64_t)(g * c.group + j) * c.d, cs, cs + half);
                float *k = qrow + (int64_t)(c.hq + g) * c.d, *v = qrow + (int64_t)(c.hq + c.hkv + g) * c.d;
                rotate(&c, k, cs, cs + half);
                const int64_t slot = slots[l * slot_layer_stride + (int64_t)s * slot_tok_stride +
                                           (int64_t)g * slot_head_stride];
                if (slot >= 0) {
                    store_row(kc, c.cdt, slot * c.hkv + g, c.d, k);
                    store_row(vc, c.cdt, slot * c.hkv + g, c.d, v);
                }
            }
#pragma omp barrier
            /* attention: a row's kv heads together when there are rows enough for every
             * thread (each slot's rows of all kv heads are one stretch: paged_decode.c) */
#pragma omp for schedule(dynamic, 1)
            for (int task = 0; task < m * att_items; task++) {
                const int s = task / att_items, g = (task % att_items) * att_heads;
                const int len = lens[l * lens_layer_stride + s];
                const int lo = (win > 0 && len > win) ? len - win : 0;
                float *o = attn + ((int64_t)s * c.hq + (int64_t)g * c.group) * c.d;
                const ks_kv_view kv = {kc, vc, c.cdt, tables + (int64_t)s * max_blocks, c.block_size, c.hkv, g, c.d};
                ks_attend(&kv, qkv + (int64_t)s * c.qkv_out + (int64_t)g * c.group * c.d, c.group, att_heads, lo,
                          len, c.scale, tree_masks ? tree_masks[s] : -1, logits, logits, o);
                if (c.bf16)
                    for (int i = 0; i < att_heads * c.group * c.d; i++) o[i] = ks_round_bf16(o[i]);
            }
            linear_cols(&c, products, L, P_O_W, P_O_PK, attn, m, c.hq * c.d, c.hq * c.d, c.hidden, o0, o1, tmp, c.hidden,
                        xbf, acc);
            finish_rows(&c, tmp, m, c.hidden, o0, o1, ptr(L, P_O_B));
            add_residual(&c, h, tmp, m, o0, o1);
#pragma omp barrier
            for (int s = 0; s < m; s++)
                rms_norm(&c, h + (int64_t)s * c.hidden, c.hidden, ptr(L, P_POST_NORM), xn + (int64_t)s * c.hidden);
            const void *gb = ptr(L, P_GU_B);
            linear_cols(&c, products, L, P_GU_W, P_GU_PK, xn, m, c.hidden, c.hidden, 2 * c.inter, f0, f1, gu,
                        2 * c.inter, xbf, acc);
            linear_cols(&c, products, L, P_GU_W, P_GU_PK, xn, m, c.hidden, c.hidden, 2 * c.inter, c.inter + f0,
                        c.inter + f1, gu, 2 * c.inter, xbf, acc);
            finish_rows(&c, gu, m, 2 * c.inter, f0, f1, gb);
            finish_rows(&c, gu, m, 2 * c.inter, c.inter + f0, c.inter + f1, gb);
            for (int s = 0; s < m; s++)
                for (int f = f0; f < f1; f++) {
                    const float g = gu[(int64_t)s * 2 * c.inter + f];
                    const float u = gu[(int64_t)s * 2 * c.inter + c.inter + f];
                    act[(int64_t)s * c.inter + f] = act_round(&c, act_round(&c, g / (1.0f + expf(-g))) * u);
                }
#pragma omp barrier
            linear_cols(&c, products, L, P_DOWN_W, P_DOWN_PK, act, m, c.inter, c.inter, c.hidden, o0, o1, tmp, c.hidden,
                        xbf, acc);
            finish_rows(&c, tmp, m, c.hidden, o0, o1, ptr(L, P_DOWN_B));
            add_residual(&c, h, tmp, m, o0, o1);
#pragma omp barrier
        }
#ifdef KS_AMX
        if (products == PRODUCTS_AMX) ks_amx_end();
#endif
        for (int s = tid; s < m; s += nt) {
            float *y = xn;
            rms_norm(&c, h + (int64_t)s * c.hidden, c.hidden, final_norm, y);
            if (c.bf16)
                for (int i = 0; i < c.hidden; i++)
                    ((uint16_t *)out)[(int64_t)s * c.hidden + i] = ks_f32_to_bf16(y[i]);
            else
                memcpy((float *)out + (int64_t)s * c.hidden, y, sizeof(float) * (size_t)c.hidden);
        }
    }
    free(mem);
    return OK;
}
