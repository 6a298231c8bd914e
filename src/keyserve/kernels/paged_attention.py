"""Triton kernels for paged KV writes and paged attention (the CUDA path of ``attention.py``).

The launchers (``write_kv``, ``paged_decode_attention``, ``paged_prefill_attention``) take the
same arguments and return the same values as their pure-torch twins in ``reference.py`` (the
keyword-only ``noise_keys`` / ``noise_layer`` of Keyformer's noise included); extra keyword-only
knobs (``split_k``, ``partition_size``) exist for tests and tuning.
This is the only module that imports triton, so ``import keyserve`` never needs it. Under
``TRITON_INTERPRET=1`` the kernels also run on CPU tensors (that is how the test suite runs them,
against the reference); ``tests/kernels/aot_compile.py`` compiles them for sm_80/sm_90 through
ptxas. Until they have run on a GPU, treat their speed (tile sizes, warps) as untuned.

Kernel layout, in short:

- **KV write**: one program per token; it stores every kv-head of the token at that head's
  slot (the slot may differ per head under KV budgets, and ``< 0`` skips the head).
- **Decode**: one program per (sequence, kv-head[, partition]) that holds all ``G`` query heads
  of the group as the rows of one tile, so each K/V tile is loaded once for the whole group.
  It walks the sequence's slots in tiles of ``BLOCK_N`` (a tile may span several cache blocks:
  every slot looks its block up in the block table) with an online softmax. Long contexts with
  few (sequence, kv-head) pairs use the split-K (flash-decoding) path: the context is cut into
  partitions of ``partition_size`` slots, each program writes an unnormalised partial output
  with its running max and sum, and ``_decode_reduce_kernel`` merges them. A row's tree mask
  (``tree_masks``, tree speculation) is loaded once per program and turns hidden slots' logits
  to -inf, the logits stored for scores included (so their scores are 0).
- **Prefill / chunked prefill**: one program per (sequence, kv-head, tile of ``BLOCK_Q`` query
  tokens); its rows are (query token, group head) pairs. Query ``j`` sits at slot ``P + j``
  (``P`` = cached prefix) and attends slots ``<= P + j`` (and ``> P + j - window``).
- **Scores for KV budgets** (see ``_scores_kernel``): a slot's probability needs the row's final
  max and sum, known only after the last tile (and, split-K, after the reduce). Rather than a
  second loop over K, the attention kernels write each row's logit per slot (raw for H2O, the
  Gumbel-perturbed ``(x + ζ) / τ`` for Keyformer, with its own online max/sum) into a float32
  scratch ``[tokens, heads, max_context]`` while they stream K/V, plus each row's final
  max/sum; ``_scores_kernel`` then normalises the stored logits and sums them over the
  group's heads and the chunk's queries. Per slot and kv-head that is ``2 * G * 4`` bytes of
  scratch traffic (24 for SmolLM2) against ``head_dim * 2`` bytes (128) for re-reading a bf16
  key, and it needs no atomics, so the summed scores are deterministic. The K/V cache is read
  exactly once. The scratch is O(tokens * heads * context) and exists only when scores are
  requested (KV-budget runs, whose contexts the budget keeps short after the prompt).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from keyserve.kernels import checks, noise
from keyserve.kernels.reference import ScoreMode

_SCORE_CODES: dict[ScoreMode | None, int] = {None: 0, "softmax": 1, "gumbel": 2}
DEFAULT_PARTITION_SIZE = 512  # slots per split-K partition
_P_CHUNK = 16  # partitions merged per step by the reduce kernel


# --------------------------------------------------------------------------- jit helpers


@triton.jit
def _qk(q, k, USE_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """[M, D] x [N, D] -> [M, N] float32 logits (tensor cores when the shapes allow).

    PRECISION "f32-operands" upcasts the operands first: Triton's interpreter multiplies
    bfloat16 blocks as their raw uint16 bits, so under TRITON_INTERPRET=1 bf16 goes through
    float32 (bf16 x bf16 products are exact in float32, so the result is the same)."""
    if USE_DOT:
        if PRECISION == "f32-operands":
            return tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        return tl.dot(q, tl.trans(k), input_precision=PRECISION)
    return tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)


@triton.jit
def _pv(p, v, USE_DOT: tl.constexpr, PRECISION: tl.constexpr):
    """[M, N] probabilities x [N, D] values -> [M, D] float32 (p rounded to v's dtype for the
    tensor cores, as flash attention does)."""
    if USE_DOT:
        if PRECISION == "f32-operands":
            return tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
        return tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1)


@triton.jit
def _gumbel(u):
    """ζ = -log(-log U) with the reference's clamp, so equal uniforms give equal noise."""
    u = tl.minimum(tl.maximum(u, 1e-20), 1.0 - 1e-7)
    return -tl.log(-tl.log(u))


@triton.jit
def _slot_rows(table_row_ptr, slots, slot_ok, BLOCK_SIZE: tl.constexpr):
    """(physical block, offset in block) of a sequence's logical ``slots`` [N]; a tile may
    span several cache blocks, so every slot looks its own block up."""
    block = tl.load(table_row_ptr + slots // BLOCK_SIZE, mask=slot_ok, other=0).to(tl.int64)
    return block, slots % BLOCK_SIZE


@triton.jit
def _tree_visible(mask, ctx, n):
    """[N] which slots ``n`` a decode row's tree mask shows (``AttentionMetadata.decode_tree_masks``):
    slot t of a row with context ``ctx`` is visible iff ctx-1-t >= 63 or bit ctx-1-t of ``mask``
    (int64) is set. The shift is clamped to 0..63 (shifts past 63 are undefined); slots at or
    past ``ctx`` read bit 0 and are masked by the caller."""
    back = (ctx - 1 - n).to(tl.int64)
    shift = tl.minimum(tl.maximum(back, 0), 63)
    return (back >= 63) | (((mask >> shift) & 1) == 1)


@triton.jit
def _online_update(x, m, l):
    """One online-softmax step over a tile of logits ``x`` [M, N] (-inf = masked).

    Returns the tile's probabilities relative to the new max, the rescale factor for the
    old accumulators, and the new max and sum. Rows masked so far keep max -inf without NaNs.
    """
    m_new = tl.maximum(m, tl.max(x, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(x - m_safe[:, None])
    alpha = tl.exp(m - m_safe)
    l_new = l * alpha + tl.sum(p, axis=1)
    return p, alpha, m_new, l_new


@triton.jit
def _mix32(x):
    """lowbias32 on uint32 (``kernels/noise.py``)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _noise_rows(keys_ptr, seq, noise_layer, heads, qi):
    """Each row's noise key ``mix(mix(seed ^ mix(head_key)) ^ position)`` (``kernels/noise.py``):
    the sequence's (seed, first query position) from ``keys_ptr`` [S, 2], ``heads`` [M] its
    query heads, ``qi`` [M] each row's query index in the chunk (0 for decode)."""
    seed = tl.load(keys_ptr + seq.to(tl.int64) * 2).to(tl.uint32)
    pos0 = tl.load(keys_ptr + seq.to(tl.int64) * 2 + 1)
    head_key = (heads + noise_layer).to(tl.uint32)
    pos = (pos0 + qi).to(tl.uint32)
    return _mix32(_mix32(seed ^ _mix32(head_key)) ^ pos)


@triton.jit
def _noisy_logits(x, valid, u_ptrs, rows, slots, tau, HAS_U: tl.constexpr):
    """Keyformer's perturbed logits (x + ζ) / τ; ζ from test uniforms or the noise hash of
    each row's key (``rows`` [M] from ``_noise_rows``) and slot (``slots`` [N]), the same
    function as the reference and the native kernel, so every (token, head, slot) draws the
    same uniform whatever the batch, tiling or split-K partitioning. x, valid, u_ptrs [M, N].
    """
    if HAS_U:
        u = tl.load(u_ptrs, mask=valid, other=0.5)
    else:
        bits = _mix32(rows[:, None] + slots.to(tl.uint32)[None, :] * 0x9E3779B9)
        u = ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
    y = (x + _gumbel(u)) / tau
    return tl.where(valid, y, float("-inf"))


# --------------------------------------------------------------------------- kernels


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    stride_st, stride_sh,
    num_kv_heads, head_dim,
    BLOCK_SIZE: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, H_PAD)
    d = tl.arange(0, D_PAD)
    h_ok = h < num_kv_heads
    slot = tl.load(slot_ptr + t * stride_st + h * stride_sh, mask=h_ok, other=-1).to(tl.int64)
    ok = h_ok & (slot >= 0)
    slot = tl.where(ok, slot, 0)
    block, off = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    mask = ok[:, None] & (d[None, :] < head_dim)
    k = tl.load(key_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    k_dst = block[:, None] * stride_kcb + off[:, None] * stride_kcs + h[:, None] * stride_kch
    v_dst = block[:, None] * stride_vcb + off[:, None] * stride_vcs + h[:, None] * stride_vch
    tl.store(k_cache_ptr + k_dst + d[None, :], k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + v_dst + d[None, :], v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, table_ptr, ctx_ptr,
    tree_ptr,  # [S] int64 decode tree masks (read only when HAS_TREE)
    out_ptr,  # [S, Hq, D] (direct) or [S, Hq, P, D] float32 partial outputs (split-K)
    m_ptr, l_ptr,  # [S, Hq, P] partial max / sum (split-K only)
    sm_ptr, sl_ptr,  # score-softmax max / sum: [S, Hq] (direct) or [S, Hq, P] (split-K)
    logit_ptr,  # [S, Hq, max_ctx] float32 scratch for scores
    tau_ptr, u_ptr, keys_ptr, noise_layer,  # keys [S, 2] int64: (noise seed, query position)
    scale, window, head_dim, max_ctx, num_heads, max_slots,
    stride_qs, stride_qh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    stride_bt, stride_os, stride_oh, stride_op,
    stride_ms, stride_mh, stride_ls, stride_lh, stride_us, stride_uh,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, PARTITION: tl.constexpr,
    SPLIT: tl.constexpr, HAS_WINDOW: tl.constexpr, SCORE_MODE: tl.constexpr,
    HAS_U: tl.constexpr, USE_DOT: tl.constexpr, PRECISION: tl.constexpr,
    HAS_TREE: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    ctx = tl.minimum(tl.load(ctx_ptr + seq).to(tl.int32), max_slots)  # never past the table
    tree = -1
    if HAS_TREE:  # the row's tree mask, once per program (split-K: against the whole context)
        tree = tl.load(tree_ptr + seq).to(tl.int64)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(ctx - window, 0)
    hi = ctx
    if SPLIT:
        lo = tl.maximum(lo, part * PARTITION)
        hi = tl.minimum(hi, (part + 1) * PARTITION)

    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    g_ok = g < GROUP
    d_ok = d < head_dim
    heads = kv_head * GROUP + g
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qs + heads[:, None] * stride_qh + d[None, :],
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    l = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    m2 = tl.full([G_PAD], float("-inf"), tl.float32)
    l2 = tl.zeros([G_PAD], tl.float32)
    tau = 1.0
    row_keys = tl.zeros([G_PAD], tl.uint32)
    if SCORE_MODE == 2:
        tau = tl.load(tau_ptr + seq).to(tl.float32)
        if not HAS_U:
            row_keys = _noise_rows(keys_ptr, seq, noise_layer, heads, g * 0)
    table_row = table_ptr + seq.to(tl.int64) * stride_bt
    n_base = tl.arange(0, BLOCK_N)
    logit_rows = logit_ptr + (seq.to(tl.int64) * num_heads + heads) * max_ctx

    for start in range(lo, hi, BLOCK_N):
        n = start + n_base
        n_ok = n < hi
        kv_mask = n_ok[:, None] & d_ok[None, :]
        block, offset = _slot_rows(table_row, n, n_ok, BLOCK_SIZE)
        k_off = block * stride_kcb + offset * stride_kcs + kv_head * stride_kch
        k = tl.load(k_cache_ptr + k_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        x = _qk(q, k, USE_DOT, PRECISION) * scale
        seen = n_ok
        if HAS_TREE:  # hidden slots: -inf logits (weight 0, stored for the scores as -inf: 0)
            seen = seen & _tree_visible(tree, ctx, n)
        x = tl.where(seen[None, :], x, float("-inf"))
        p, alpha, m, l = _online_update(x, m, l)
        v_off = block * stride_vcb + offset * stride_vcs + kv_head * stride_vch
        v = tl.load(v_cache_ptr + v_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + _pv(p, v, USE_DOT, PRECISION)
        if SCORE_MODE != 0:
            valid = g_ok[:, None] & n_ok[None, :]
            if SCORE_MODE == 2:
                u_ptrs = u_ptr + seq.to(tl.int64) * stride_us + heads[:, None] * stride_uh + n[None, :]
                x = _noisy_logits(x, valid, u_ptrs, row_keys, n, tau, HAS_U)
                _, _, m2, l2 = _online_update(x, m2, l2)
            tl.store(logit_rows[:, None] + n[None, :], x, mask=valid)

    if SCORE_MODE == 1:
        m2 = m
        l2 = l
    if SPLIT:
        base = seq.to(tl.int64) * stride_os + heads * stride_oh + part * stride_op
        tl.store(out_ptr + base[:, None] + d[None, :], acc, mask=g_ok[:, None] & d_ok[None, :])
        stat = seq.to(tl.int64) * stride_ms + heads * stride_mh + part
        tl.store(m_ptr + stat, m, mask=g_ok)
        tl.store(l_ptr + stat, l, mask=g_ok)
        if SCORE_MODE == 2:
            tl.store(sm_ptr + stat, m2, mask=g_ok)
            tl.store(sl_ptr + stat, l2, mask=g_ok)
    else:
        out = acc / tl.where(l > 0, l, 1.0)[:, None]
        base = seq.to(tl.int64) * stride_os + heads * stride_oh
        tl.store(out_ptr + base[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=g_ok[:, None] & d_ok[None, :])
        if SCORE_MODE != 0:
            stat = seq.to(tl.int64) * stride_ls + heads * stride_lh
            tl.store(sm_ptr + stat, m2, mask=g_ok)
            tl.store(sl_ptr + stat, l2, mask=g_ok)


@triton.jit
def _partition_max(m_ptrs, num_parts, P_CHUNK: tl.constexpr):
    """Max over a row of per-partition maxima (-inf where every partition was empty)."""
    p = tl.arange(0, P_CHUNK)
    m = tl.full([P_CHUNK], float("-inf"), tl.float32)
    for p0 in range(0, num_parts, P_CHUNK):
        m = tl.maximum(m, tl.load(m_ptrs + p0 + p, mask=p0 + p < num_parts, other=float("-inf")))
    return tl.max(m, axis=0)


@triton.jit
def _decode_reduce_kernel(
    part_out_ptr, part_m_ptr, part_l_ptr, part_sm_ptr, part_sl_ptr,
    out_ptr, sm_ptr, sl_ptr,
    num_parts, head_dim,
    stride_pos, stride_poh, stride_pop, stride_pms, stride_pmh,
    stride_os, stride_oh, stride_ls, stride_lh,
    P_CHUNK: tl.constexpr, D_PAD: tl.constexpr, SCORE_MODE: tl.constexpr,
):
    """Merge the split-K partials of one (sequence, query head):
    out = Σ_p w_p acc_p / Σ_p w_p l_p with w_p = exp(m_p - max_p m_p); same for score stats."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, D_PAD)
    p = tl.arange(0, P_CHUNK)
    stats = seq * stride_pms + head * stride_pmh
    m = _partition_max(part_m_ptr + stats, num_parts, P_CHUNK)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    l = tl.zeros([P_CHUNK], tl.float32)
    acc = tl.zeros([D_PAD], tl.float32)
    m2 = m
    l2 = tl.zeros([P_CHUNK], tl.float32)
    if SCORE_MODE == 2:
        m2 = _partition_max(part_sm_ptr + stats, num_parts, P_CHUNK)
    m2_safe = tl.where(m2 == float("-inf"), 0.0, m2)
    out_base = part_out_ptr + seq * stride_pos + head * stride_poh
    for p0 in range(0, num_parts, P_CHUNK):
        pc = p0 + p
        ok = pc < num_parts
        w = tl.exp(tl.load(part_m_ptr + stats + pc, mask=ok, other=float("-inf")) - m_safe)
        l += w * tl.load(part_l_ptr + stats + pc, mask=ok, other=0.0)
        part = tl.load(out_base + pc[:, None] * stride_pop + d[None, :],
                       mask=ok[:, None] & (d[None, :] < head_dim), other=0.0)
        acc += tl.sum(w[:, None] * part, axis=0)
        if SCORE_MODE == 2:
            w2 = tl.exp(tl.load(part_sm_ptr + stats + pc, mask=ok, other=float("-inf")) - m2_safe)
            l2 += w2 * tl.load(part_sl_ptr + stats + pc, mask=ok, other=0.0)
    total = tl.sum(l, axis=0)
    out = acc / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + d,
             out.to(out_ptr.dtype.element_ty), mask=d < head_dim)
    if SCORE_MODE == 1:
        tl.store(sm_ptr + seq * stride_ls + head * stride_lh, m)
        tl.store(sl_ptr + seq * stride_ls + head * stride_lh, total)
    if SCORE_MODE == 2:
        tl.store(sm_ptr + seq * stride_ls + head * stride_lh, m2)
        tl.store(sl_ptr + seq * stride_ls + head * stride_lh, tl.sum(l2, axis=0))


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, table_ptr, qstart_ptr, ctx_ptr,
    out_ptr,  # [T, Hq, D]
    sm_ptr, sl_ptr,  # [T, Hq] score-softmax max / sum
    logit_ptr,  # [T, Hq, max_ctx] float32 scratch for scores
    tau_ptr, u_ptr, keys_ptr, noise_layer,  # keys [S, 2] int64: (noise seed, first query position)
    scale, window, head_dim, max_ctx, num_heads,
    stride_qt, stride_qh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    stride_bt, stride_ot, stride_oh, stride_lt, stride_lh, stride_ut, stride_uh,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HAS_WINDOW: tl.constexpr,
    SCORE_MODE: tl.constexpr, HAS_U: tl.constexpr, USE_DOT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    q0 = tl.program_id(2) * BLOCK_Q
    q_start = tl.load(qstart_ptr + seq).to(tl.int32)
    q_len = tl.load(qstart_ptr + seq + 1).to(tl.int32) - q_start
    if q0 >= q_len:
        return
    ctx = tl.load(ctx_ptr + seq).to(tl.int32)
    prefix = ctx - q_len

    r = tl.arange(0, BLOCK_Q * G_PAD)
    qi = q0 + r // G_PAD
    g = r % G_PAD
    row_ok = (qi < q_len) & (g < GROUP)
    pos = prefix + qi  # the slot of each row's own token
    tok = (q_start + qi).to(tl.int64)
    heads = kv_head * GROUP + g
    d = tl.arange(0, D_PAD)
    d_ok = d < head_dim
    q = tl.load(q_ptr + tok[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    m = tl.full([BLOCK_Q * G_PAD], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_Q * G_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * G_PAD, D_PAD], tl.float32)
    m2 = tl.full([BLOCK_Q * G_PAD], float("-inf"), tl.float32)
    l2 = tl.zeros([BLOCK_Q * G_PAD], tl.float32)
    tau = 1.0
    row_keys = tl.zeros([BLOCK_Q * G_PAD], tl.uint32)
    if SCORE_MODE == 2:
        tau = tl.load(tau_ptr + seq).to(tl.float32)
        if not HAS_U:
            row_keys = _noise_rows(keys_ptr, seq, noise_layer, heads, qi)

    hi = tl.minimum(ctx, prefix + tl.minimum(q0 + BLOCK_Q, q_len))
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(prefix + q0 - window + 1, 0)
    table_row = table_ptr + seq.to(tl.int64) * stride_bt
    n_base = tl.arange(0, BLOCK_N)
    logit_rows = logit_ptr + (tok * num_heads + heads) * max_ctx
    for start in range(lo, hi, BLOCK_N):
        n = start + n_base
        n_ok = n < hi
        kv_mask = n_ok[:, None] & d_ok[None, :]
        block, offset = _slot_rows(table_row, n, n_ok, BLOCK_SIZE)
        k_off = block * stride_kcb + offset * stride_kcs + kv_head * stride_kch
        k = tl.load(k_cache_ptr + k_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        x = _qk(q, k, USE_DOT, PRECISION) * scale
        valid = row_ok[:, None] & n_ok[None, :] & (n[None, :] <= pos[:, None])
        if HAS_WINDOW:
            valid = valid & (n[None, :] > pos[:, None] - window)
        x = tl.where(valid, x, float("-inf"))
        p, alpha, m, l = _online_update(x, m, l)
        v_off = block * stride_vcb + offset * stride_vcs + kv_head * stride_vch
        v = tl.load(v_cache_ptr + v_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + _pv(p, v, USE_DOT, PRECISION)
        if SCORE_MODE != 0:
            if SCORE_MODE == 2:
                u_ptrs = u_ptr + tok[:, None] * stride_ut + heads[:, None] * stride_uh + n[None, :]
                x = _noisy_logits(x, valid, u_ptrs, row_keys, n, tau, HAS_U)
                _, _, m2, l2 = _online_update(x, m2, l2)
            tl.store(logit_rows[:, None] + n[None, :], x, mask=valid)

    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    o_ptrs = out_ptr + tok[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    if SCORE_MODE == 1:
        m2 = m
        l2 = l
    if SCORE_MODE != 0:
        tl.store(sm_ptr + tok * stride_lt + heads * stride_lh, m2, mask=row_ok)
        tl.store(sl_ptr + tok * stride_lt + heads * stride_lh, l2, mask=row_ok)


@triton.jit
def _scores_kernel(
    logit_ptr,  # [T, Hq, max_ctx] float32, raw (softmax) or perturbed (gumbel) logits
    sm_ptr, sl_ptr,  # [T, Hq] each row's final max / sum over its valid slots
    score_ptr,  # [S, Hkv, max_ctx] float32
    qstart_ptr, ctx_ptr,
    window, max_ctx, num_heads,
    stride_lt, stride_lh, stride_st, stride_sh, stride_ss, stride_sk,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
):
    """scores[s, h, j] = Σ over the sequence's query tokens and the group's heads of
    exp(logit - max) / sum. Why a separate pass: the normaliser of a slot's probability is known
    only after the attention kernel has seen every slot (and, split-K, every partition), and
    storing the logits avoids reading K a second time. Masks are rebuilt from positions, so
    scratch entries the attention kernel never wrote are never read."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    q_start = tl.load(qstart_ptr + seq).to(tl.int32)
    q_len = tl.load(qstart_ptr + seq + 1).to(tl.int32) - q_start
    ctx = tl.load(ctx_ptr + seq).to(tl.int32)
    prefix = ctx - q_len
    r = tl.arange(0, BLOCK_Q * G_PAD)
    g = r % G_PAD
    heads = kv_head * GROUP + g
    total = tl.zeros([BLOCK_N], tl.float32)
    # Queries before this tile's first slot cannot see it (causal): start after them.
    first = tl.maximum(tl.program_id(2) * BLOCK_N - prefix, 0)
    first = (first // BLOCK_Q) * BLOCK_Q
    for q0 in range(first, q_len, BLOCK_Q):
        qi = q0 + r // G_PAD
        row_ok = (qi < q_len) & (g < GROUP)
        pos = prefix + qi
        tok = (q_start + qi).to(tl.int64)
        valid = row_ok[:, None] & (n[None, :] <= pos[:, None]) & (n[None, :] < ctx)
        if HAS_WINDOW:
            valid = valid & (n[None, :] > pos[:, None] - window)
        y = tl.load(logit_ptr + (tok * num_heads + heads)[:, None] * max_ctx + n[None, :],
                    mask=valid, other=float("-inf"))
        stat = tok * stride_st + heads * stride_sh
        m = tl.load(sm_ptr + stat, mask=row_ok, other=0.0)
        s = tl.load(sl_ptr + stat, mask=row_ok, other=1.0)
        m = tl.where(m == float("-inf"), 0.0, m)
        s = tl.where(s > 0, s, 1.0)
        p = tl.where(valid, tl.exp(y - m[:, None]) / s[:, None], 0.0)
        total += tl.sum(p, axis=0)
    dst = score_ptr + seq.to(tl.int64) * stride_ss + kv_head * stride_sk + n
    tl.store(dst, total, mask=n < max_ctx)


# --------------------------------------------------------------------------- launchers


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def _tile_config(head_dim: int, dtype: torch.dtype) -> tuple[int, int, bool, str]:
    """(D_PAD, BLOCK_N, USE_DOT, PRECISION). tl.dot needs a reduction dim of >= 16 on NVIDIA
    (head_dim 8, e.g. stories260K, takes the broadcast-multiply path); float32 uses exact
    "ieee" products so the kernels match the float32 reference; see ``_qk`` for bf16 under
    the interpreter."""
    d_pad = _pow2(head_dim)
    use_dot = d_pad >= 16
    block_n = 64 if d_pad <= 64 else 32
    precision = "ieee" if dtype == torch.float32 else "tf32"
    if dtype == torch.bfloat16 and checks.interpreting():
        precision = "f32-operands"
    return d_pad, block_n, use_dot, precision


def _noise_keys(keys: torch.Tensor | None, num_seqs: int, device: torch.device) -> torch.Tensor:
    """``[num_seqs, 2]`` int64 noise keys on the device: given, or random seeds drawn from
    torch's CPU generator (so torch.manual_seed makes runs repeatable)."""
    if keys is None:
        keys = noise.random_keys(num_seqs)
    checks.require(tuple(keys.shape) == (num_seqs, 2), "noise_keys",
                   f"has shape {tuple(keys.shape)}, expected {(num_seqs, 2)}")
    return keys.to(device=device, dtype=torch.int64).contiguous()


def _want_split_k(num_seqs: int, num_kv_heads: int, max_ctx: int, partition: int,
                  device: torch.device) -> bool:
    """Split the context when it spans several partitions and the (sequence, kv-head)
    programs alone would leave most SMs idle (flash-decoding's regime: small batch, long
    context)."""
    if max_ctx <= partition:
        return False
    sms = 128
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    return num_seqs * num_kv_heads < 2 * sms


def _host_ints(*values: torch.Tensor) -> list[int]:
    """Several device scalars to Python ints with one host sync."""
    return [int(v) for v in torch.stack([v.reshape(()).long() for v in values]).tolist()]


def write_kv(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] or [num_tokens, num_kv_heads], int; < 0 = skip
) -> None:
    """Scatter new K/V rows into the paged cache; the slot may differ per kv-head."""
    checks.check_write_kv(key, value, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    per_head = slot_mapping.dim() == 2
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        slot_mapping.stride(0), slot_mapping.stride(1) if per_head else 0,
        num_kv_heads, head_dim,
        BLOCK_SIZE=k_cache.shape[1], H_PAD=_pow2(num_kv_heads), D_PAD=_pow2(head_dim),
    )


def _launch_scores(
    logits: torch.Tensor,  # [num_tokens, num_heads, max_ctx] float32
    stat_m: torch.Tensor,  # [num_tokens, num_heads] float32
    stat_l: torch.Tensor,  # [num_tokens, num_heads] float32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int
    context_lens: torch.Tensor,  # [num_seqs] int
    num_kv_heads: int,
    max_ctx: int,
    max_q_len: int,
    sliding_window: int | None,
) -> torch.Tensor:  # [num_seqs, num_kv_heads, max_ctx] float32
    num_seqs = context_lens.shape[0]
    num_heads = logits.shape[1]
    group = num_heads // num_kv_heads
    g_pad = _pow2(group)
    scores = torch.empty(num_seqs, num_kv_heads, max_ctx, dtype=torch.float32,
                         device=logits.device)
    if num_seqs == 0 or max_ctx == 0:
        return scores
    block_n = 64
    block_q = min(max(1, 32 // g_pad), _pow2(max_q_len))
    grid = (num_seqs, num_kv_heads, triton.cdiv(max_ctx, block_n))
    _scores_kernel[grid](
        logits, stat_m, stat_l, scores, query_start_loc, context_lens,
        sliding_window or 0, max_ctx, num_heads,
        logits.stride(0), logits.stride(1), stat_m.stride(0), stat_m.stride(1),
        scores.stride(0), scores.stride(1),
        GROUP=group, G_PAD=g_pad, BLOCK_Q=block_q, BLOCK_N=block_n,
        HAS_WINDOW=sliding_window is not None,
    )
    return scores


def paged_decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32/int64, padded with a valid id
    context_lens: torch.Tensor,  # [num_seqs] int32/int64: filled slots per sequence
    scale: float,
    sliding_window: int | None = None,
    score_mode: ScoreMode | None = None,
    tau: torch.Tensor | None = None,  # [num_seqs] float32 (gumbel only)
    uniforms: torch.Tensor | None = None,  # [num_seqs, num_heads, max_context] (test-only)
    *,
    noise_keys: torch.Tensor | None = None,  # [num_seqs, 2] int64: (noise seed, query position)
    noise_layer: int = 0,  # noise.layer_key(layer, first query head)
    tree_masks: torch.Tensor | None = None,  # [num_seqs] int64 (AttentionMetadata.decode_tree_masks)
    split_k: bool | None = None,
    partition_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One query token per sequence against its paged context (see reference.py).
    ``tree_masks`` hides slots of each row's last 63 as the reference does (None: no masks,
    and the kernel is compiled without the mask code).

    ``split_k`` forces (True) or forbids (False) the flash-decoding path; None lets
    ``_want_split_k`` decide. ``partition_size`` (slots, rounded up to the tile) sets its
    granularity. ``noise_keys`` and ``noise_layer`` key the Gumbel noise when ``uniforms`` is
    None (``kernels/noise.py``; random seeds without keys).
    Returns ``(out [num_seqs, num_heads, head_dim], scores [num_seqs, num_kv_heads,
    max_context] float32 or None)``.
    """
    checks.check_attention(query, k_cache, v_cache, block_tables, context_lens, scale,
                           sliding_window, score_mode, tau)
    num_seqs, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    checks.require(block_tables.shape[0] == num_seqs, "block_tables",
                   f"has {block_tables.shape[0]} rows, expected num_seqs = {num_seqs}")
    checks.check_tree_masks(tree_masks, num_seqs, query.device)
    mode = _SCORE_CODES[score_mode]
    # Without scores the grid needs only a bound on the context, so the hot decode path makes
    # no host sync (the kernel clamps each context to what its table covers). Scores need the
    # true max for their shape; that sync also buys the value checks.
    covered = block_tables.shape[1] * block_size
    max_ctx = covered
    if num_seqs and mode:
        max_ctx, min_ctx = _host_ints(context_lens.max(), context_lens.min())
        checks.require(min_ctx >= 0, "context_lens", f"has a negative entry ({min_ctx})")
        checks.check_table_covers(block_tables, block_size, max_ctx)
    has_u = mode == 2 and uniforms is not None
    if has_u:
        uniforms = checks.check_uniforms(uniforms, num_seqs, num_heads, max_ctx, query.device,
                                         "num_seqs")
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out, (query.new_zeros(0, num_kv_heads, 0, dtype=torch.float32) if mode else None)

    group = num_heads // num_kv_heads
    d_pad, block_n, use_dot, precision = _tile_config(head_dim, query.dtype)
    partition = triton.cdiv(partition_size or DEFAULT_PARTITION_SIZE, block_n) * block_n
    split = split_k if split_k is not None else _want_split_k(
        num_seqs, num_kv_heads, max_ctx, partition, query.device)
    num_parts = max(triton.cdiv(max_ctx, partition), 1) if split else 1

    f32 = dict(dtype=torch.float32, device=query.device)
    logits = torch.empty(num_seqs, num_heads, max_ctx if mode else 0, **f32)
    stat_m = torch.empty(num_seqs, num_heads, **f32)
    stat_l = torch.empty(num_seqs, num_heads, **f32)
    u = uniforms if has_u else logits
    tau_t = tau if mode == 2 else stat_m
    keys = _noise_keys(noise_keys, num_seqs, query.device) if mode == 2 and not has_u else context_lens
    if split:
        part_out = torch.empty(num_seqs, num_heads, num_parts, head_dim, **f32)
        part_m = torch.empty(num_seqs, num_heads, num_parts, **f32)
        part_l = torch.empty_like(part_m)
        part_sm = torch.empty_like(part_m) if mode == 2 else part_m
        part_sl = torch.empty_like(part_m) if mode == 2 else part_l
        dst, dst_sm, dst_sl = part_out, part_sm, part_sl
        stride_op = part_out.stride(2)
    else:
        part_m = part_l = stat_m
        dst, dst_sm, dst_sl = out, stat_m, stat_l
        stride_op = 0
    _decode_kernel[(num_seqs, num_kv_heads, num_parts)](
        query, k_cache, v_cache, block_tables, context_lens,
        context_lens if tree_masks is None else tree_masks,
        dst, part_m, part_l, dst_sm, dst_sl, logits,
        tau_t, u, keys, noise_layer & 0xFFFFFFFF,
        float(scale), sliding_window or 0, head_dim, max_ctx, num_heads, covered,
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), dst.stride(0), dst.stride(1), stride_op,
        part_m.stride(0), part_m.stride(1), stat_m.stride(0), stat_m.stride(1),
        u.stride(0), u.stride(1),
        GROUP=group, G_PAD=_pow2(group), D_PAD=d_pad, BLOCK_N=block_n, BLOCK_SIZE=block_size,
        PARTITION=partition, SPLIT=split, HAS_WINDOW=sliding_window is not None,
        SCORE_MODE=mode, HAS_U=has_u, USE_DOT=use_dot, PRECISION=precision,
        HAS_TREE=tree_masks is not None,
    )
    if split:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            part_out, part_m, part_l, part_sm, part_sl, out, stat_m, stat_l,
            num_parts, head_dim,
            part_out.stride(0), part_out.stride(1), part_out.stride(2),
            part_m.stride(0), part_m.stride(1),
            out.stride(0), out.stride(1), stat_m.stride(0), stat_m.stride(1),
            P_CHUNK=_P_CHUNK, D_PAD=d_pad, SCORE_MODE=mode,
        )
    if not mode:
        return out, None
    starts = torch.arange(num_seqs + 1, dtype=torch.int32, device=query.device)
    scores = _launch_scores(logits, stat_m, stat_l, starts, context_lens, num_kv_heads,
                            max_ctx, 1, sliding_window)
    return out, scores


def paged_prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], sequences packed back to back
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32/int64
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32/int64, cumulative query lengths
    context_lens: torch.Tensor,  # [num_seqs] int32/int64: slots after this chunk
    scale: float,
    sliding_window: int | None = None,
    score_mode: ScoreMode | None = None,
    tau: torch.Tensor | None = None,  # [num_seqs] float32 (gumbel only)
    uniforms: torch.Tensor | None = None,  # [num_tokens, num_heads, max_context] (test-only)
    *,
    noise_keys: torch.Tensor | None = None,  # [num_seqs, 2] int64: (noise seed, first query position)
    noise_layer: int = 0,  # noise.layer_key(layer, first query head)
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Several query tokens per sequence against the cached prefix plus themselves
    (slot-causal; see reference.py). The chunk's K/V must already be in the cache.
    Returns ``(out [num_tokens, num_heads, head_dim], scores [num_seqs, num_kv_heads,
    max_context] float32 or None)``."""
    checks.check_attention(query, k_cache, v_cache, block_tables, context_lens, scale,
                           sliding_window, score_mode, tau)
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = block_tables.shape[0]
    qsl = checks.check_tensor("query_start_loc", query_start_loc, 1, checks.INDEX_DTYPES,
                              query.device)
    checks.require(qsl.shape[0] == num_seqs + 1, "query_start_loc",
                   f"has {qsl.shape[0]} entries, expected num_seqs + 1 = {num_seqs + 1}")
    mode = _SCORE_CODES[score_mode]
    out = torch.empty_like(query)
    if num_seqs == 0:
        checks.require(num_tokens == 0, "query", f"has {num_tokens} tokens but no sequences")
        return out, (query.new_zeros(0, num_kv_heads, 0, dtype=torch.float32) if mode else None)
    q_lens = qsl[1:] - qsl[:-1]
    first, last, min_q, max_q, max_ctx, short = _host_ints(
        qsl[0], qsl[-1], q_lens.min(), q_lens.max(), context_lens.max(),
        (context_lens < q_lens).sum())
    checks.require(first == 0 and last == num_tokens and min_q >= 0, "query_start_loc",
                   f"must rise from 0 to num_tokens = {num_tokens}, got {first} .. {last} "
                   f"with smallest step {min_q}")
    checks.require(short == 0, "context_lens",
                   "is shorter than the query length of some sequence (the chunk's own K/V "
                   "must be in the cache and counted)")
    checks.check_table_covers(block_tables, block_size, max_ctx)
    has_u = mode == 2 and uniforms is not None
    if has_u:
        uniforms = checks.check_uniforms(uniforms, num_tokens, num_heads, max_ctx,
                                         query.device, "num_tokens")
    group = num_heads // num_kv_heads
    g_pad = _pow2(group)
    d_pad, block_n, use_dot, precision = _tile_config(head_dim, query.dtype)
    block_q = min(max(1, 64 // g_pad), _pow2(max_q))
    f32 = dict(dtype=torch.float32, device=query.device)
    logits = torch.empty(num_tokens, num_heads, max_ctx if mode else 0, **f32)
    stat_m = torch.empty(num_tokens, num_heads, **f32)
    stat_l = torch.empty(num_tokens, num_heads, **f32)
    u = uniforms if has_u else logits
    keys = _noise_keys(noise_keys, num_seqs, query.device) if mode == 2 and not has_u else context_lens
    if num_tokens and max_q:
        _prefill_kernel[(num_seqs, num_kv_heads, triton.cdiv(max_q, block_q))](
            query, k_cache, v_cache, block_tables, qsl, context_lens,
            out, stat_m, stat_l, logits,
            tau if mode == 2 else stat_m, u, keys, noise_layer & 0xFFFFFFFF,
            float(scale), sliding_window or 0, head_dim, max_ctx, num_heads,
            query.stride(0), query.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            block_tables.stride(0), out.stride(0), out.stride(1),
            stat_m.stride(0), stat_m.stride(1), u.stride(0), u.stride(1),
            GROUP=group, G_PAD=g_pad, BLOCK_Q=block_q, D_PAD=d_pad, BLOCK_N=block_n,
            BLOCK_SIZE=block_size, HAS_WINDOW=sliding_window is not None, SCORE_MODE=mode,
            HAS_U=has_u, USE_DOT=use_dot, PRECISION=precision,
        )
    if not mode:
        return out, None
    scores = _launch_scores(logits, stat_m, stat_l, qsl, context_lens, num_kv_heads, max_ctx,
                            max_q, sliding_window)
    return out, scores
