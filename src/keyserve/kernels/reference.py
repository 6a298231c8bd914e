"""Pure-torch paged attention and KV writes.

These are the CPU path of the engine and the oracle the Triton kernels are tested against.
Without score output, attention goes through ``cpu_paths`` (block gather into reused buffers,
then torch's fused SDPA); with score output it materialises the logits here, vectorised over
sequences (decode) or once per sequence per layer (prefill), never per token.

Cache layout (one layer): ``k_cache``/``v_cache`` are ``[num_blocks, block_size, num_kv_heads,
head_dim]``. A *slot* is ``block_id * block_size + offset``; a sequence's *logical* slot ``i`` lives
in physical block ``block_table[i // block_size]``. Keys are stored after rotary embedding, so
attention is order-independent over slots.

Score output (for KV budgets, docs/algorithms.md §2): per (sequence, kv-head, logical slot)
the attention mass summed over the query heads of the group (and over the query tokens of a
prefill chunk):
``"softmax"`` gives ``softmax(x)`` (H2O), ``"gumbel"`` gives ``softmax((x + ζ) / τ)`` with
``ζ = -log(-log U)`` (Keyformer). ``U`` is a hash of the row's noise key (``noise_keys``: its
seed and query position), the layer and head (``noise_layer``) and the slot (``kernels/noise.py``),
so a row's noise does not depend on its batch; without keys each row gets a random seed.
``uniforms`` lets a test fix ``U``.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from keyserve.kernels import checks, cpu_paths, noise

ScoreMode = Literal["softmax", "gumbel"]

_TINY = 1e-20


def gumbel_from_uniform(u: torch.Tensor) -> torch.Tensor:
    """ζ = -log(-log U), with U clamped away from 0 and 1 so ζ stays finite."""
    u = u.clamp(_TINY, 1.0 - 1e-7)
    return -torch.log(-torch.log(u))


def write_kv_reference(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] or [num_tokens, num_kv_heads], int64; < 0 = skip
) -> None:
    """Scatter new K/V rows into the cache; the slot may differ per kv-head."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    if slot_mapping.dim() == 1:
        valid = slot_mapping >= 0
        slots = slot_mapping[valid]
        k_flat = k_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
        v_flat = v_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
        k_flat[slots] = key[valid].to(k_cache.dtype)
        v_flat[slots] = value[valid].to(v_cache.dtype)
        return
    heads = torch.arange(num_kv_heads, device=slot_mapping.device)
    rows = slot_mapping * num_kv_heads + heads  # [num_tokens, num_kv_heads]
    valid = slot_mapping >= 0
    k_rows = k_cache.view(-1, head_dim)
    v_rows = v_cache.view(-1, head_dim)
    k_rows[rows[valid]] = key[valid].to(k_cache.dtype)
    v_rows[rows[valid]] = value[valid].to(v_cache.dtype)


def gather_kv(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [num_seqs, max_blocks] int
    num_slots: int,
) -> torch.Tensor:  # [num_seqs, num_slots, num_kv_heads, head_dim]
    """Gather the first ``num_slots`` logical slots of each sequence."""
    block_size = cache.shape[1]
    num_blocks = (num_slots + block_size - 1) // block_size
    table = block_table[:, :num_blocks].long()
    gathered = cache[table]  # [num_seqs, num_blocks, block_size, H, D]
    num_seqs = block_table.shape[0]
    return gathered.reshape(num_seqs, num_blocks * block_size, *cache.shape[2:])[:, :num_slots]


def _check_score_args(score_mode: ScoreMode | None, tau: torch.Tensor | None) -> None:
    if score_mode not in (None, "softmax", "gumbel"):
        raise ValueError(f"score_mode: expected None, 'softmax' or 'gumbel', got {score_mode!r}")
    if score_mode == "gumbel" and tau is None:
        raise ValueError("tau: score_mode='gumbel' needs the per-sequence temperature")


def _masked_softmax_scores(
    logits: torch.Tensor,  # [..., num_slots] float32, masked entries = -inf
    mask: torch.Tensor,  # broadcastable to logits, True = attend
    score_mode: ScoreMode,
    tau: torch.Tensor | None,  # broadcastable to logits
    uniforms: torch.Tensor | None,  # same shape as logits (gumbel only)
) -> torch.Tensor:
    if score_mode == "softmax":
        return _safe_softmax(logits)
    assert uniforms is not None
    noisy = (logits + gumbel_from_uniform(uniforms.to(logits.dtype))) / tau
    noisy = noisy.masked_fill(~mask, float("-inf"))
    return _safe_softmax(noisy)


def _safe_softmax(logits: torch.Tensor) -> torch.Tensor:
    """Softmax whose fully-masked rows are zeros instead of NaN (empty sequences)."""
    probs = torch.softmax(logits, dim=-1)
    return torch.nan_to_num(probs, nan=0.0)


def paged_decode_attention_reference(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32, padded with any valid id
    context_lens: torch.Tensor,  # [num_seqs] int32: filled slots per sequence
    scale: float,
    sliding_window: int | None = None,
    score_mode: ScoreMode | None = None,
    tau: torch.Tensor | None = None,  # [num_seqs] float32 (gumbel only)
    uniforms: torch.Tensor | None = None,  # [num_seqs, num_heads, max_context] (test-only)
    *,
    noise_keys: torch.Tensor | None = None,  # [num_seqs, 2] int64: (noise seed, query position)
    noise_layer: int = 0,  # noise.layer_key(layer, first query head)
    tree_masks: torch.Tensor | None = None,  # [num_seqs] int64 (AttentionMetadata.decode_tree_masks)
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One query token per sequence against its paged context.

    ``tree_masks`` hides some of each row's last 63 slots (tree speculation: a node sees the
    prefix, its ancestors and itself); hidden slots are treated as absent, scores included.
    Returns ``(out [num_seqs, num_heads, head_dim], scores [num_seqs, num_kv_heads, max_context]
    or None)`` where ``max_context = max(context_lens)``.
    """
    _check_score_args(score_mode, tau)
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    checks.check_tree_masks(tree_masks, num_seqs, query.device)
    if score_mode is None:
        lens = context_lens.tolist()
        return cpu_paths.decode_sdpa(
            query, k_cache, v_cache, block_tables, lens, scale, sliding_window, tree_masks
        ), None
    max_ctx = int(context_lens.max().item()) if num_seqs else 0
    out = torch.zeros_like(query)
    if num_seqs == 0 or max_ctx == 0:
        scores = query.new_zeros(num_seqs, num_kv_heads, max_ctx, dtype=torch.float32)
        return out, (scores if score_mode else None)
    k = gather_kv(k_cache, block_tables, max_ctx).float()  # [S, T, Hkv, D]
    v = gather_kv(v_cache, block_tables, max_ctx).float()
    q = query.float().view(num_seqs, num_kv_heads, group, head_dim)
    logits = torch.einsum("shgd,sthd->shgt", q, k) * scale  # [S, Hkv, G, T]
    slots = torch.arange(max_ctx, device=query.device)
    lens = context_lens.to(query.device).long()[:, None]
    mask = slots[None, :] < lens  # [S, T]
    if sliding_window is not None:
        mask &= slots[None, :] > lens - 1 - sliding_window
    if tree_masks is not None:
        mask &= cpu_paths.tree_visible(slots[None, :], lens, tree_masks.to(query.device, torch.int64)[:, None])
    mask4 = mask[:, None, None, :]
    logits = logits.masked_fill(~mask4, float("-inf"))
    probs = _safe_softmax(logits)
    out = torch.einsum("shgt,sthd->shgd", probs, v).reshape(num_seqs, num_heads, head_dim)
    scores = None
    if score_mode is not None:
        tau4 = None if tau is None else tau.float().view(num_seqs, 1, 1, 1)
        u = None
        if score_mode == "gumbel":
            if uniforms is None:
                keys = noise_keys if noise_keys is not None else noise.random_keys(num_seqs)
                uniforms = noise.decode_uniforms(keys, noise_layer, num_heads, max_ctx).to(query.device)
            u = uniforms.view(num_seqs, num_kv_heads, group, max_ctx)
        scores = _masked_softmax_scores(logits, mask4, score_mode, tau4, u).sum(dim=2)
    return out.to(query.dtype), scores


def paged_prefill_attention_reference(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], sequences packed back to back
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32, cumulative query lengths
    context_lens: torch.Tensor,  # [num_seqs] int32: slots after this chunk (prefix + chunk)
    scale: float,
    sliding_window: int | None = None,
    score_mode: ScoreMode | None = None,
    tau: torch.Tensor | None = None,  # [num_seqs] float32 (gumbel only)
    uniforms: torch.Tensor | None = None,  # [num_tokens, num_heads, max_context] (test-only)
    *,
    noise_keys: torch.Tensor | None = None,  # [num_seqs, 2] int64: (noise seed, first query position)
    noise_layer: int = 0,  # noise.layer_key(layer, first query head)
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Several query tokens per sequence (chunked prefill, speculative verification).

    The chunk's own K/V must already be written to the cache. Query ``j`` of a sequence whose
    cached prefix holds ``P = context_len - query_len`` slots attends to slots ``0 .. P + j``
    (slot-causal), and with a sliding window only to slots ``> P + j - sliding_window``.
    Returns ``(out [num_tokens, num_heads, head_dim], scores [num_seqs, num_kv_heads,
    max_context] or None)``; scores sum over the chunk's queries and the group's heads.
    """
    _check_score_args(score_mode, tau)
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    num_seqs = block_tables.shape[0]
    starts = query_start_loc.tolist()
    lens = context_lens.tolist()
    if score_mode is None:
        return cpu_paths.prefill_sdpa(
            query, k_cache, v_cache, block_tables, starts, lens, scale, sliding_window
        ), None
    max_ctx = max(lens) if lens else 0
    if score_mode == "gumbel" and uniforms is None:
        keys = (noise_keys if noise_keys is not None else noise.random_keys(num_seqs)).tolist()
    out = torch.zeros_like(query)
    scores = (
        query.new_zeros(num_seqs, num_kv_heads, max_ctx, dtype=torch.float32)
        if score_mode is not None
        else None
    )
    for i in range(num_seqs):
        q_start, q_end, ctx = starts[i], starts[i + 1], lens[i]
        q_len = q_end - q_start
        if q_len == 0 or ctx == 0:
            continue
        prefix = ctx - q_len
        k = gather_kv(k_cache, block_tables[i : i + 1], ctx)[0].float()  # [ctx, Hkv, D]
        v = gather_kv(v_cache, block_tables[i : i + 1], ctx)[0].float()
        q = query[q_start:q_end].float().view(q_len, num_kv_heads, group, head_dim)
        logits = torch.einsum("jhgd,thd->hgjt", q, k) * scale  # [Hkv, G, q_len, ctx]
        rows = torch.arange(q_len, device=query.device)[:, None] + prefix
        cols = torch.arange(ctx, device=query.device)[None, :]
        mask = cols <= rows  # [q_len, ctx]
        if sliding_window is not None:
            mask &= cols > rows - sliding_window
        logits = logits.masked_fill(~mask, float("-inf"))
        probs = _safe_softmax(logits)
        o = torch.einsum("hgjt,thd->jhgd", probs, v).reshape(q_len, num_heads, head_dim)
        out[q_start:q_end] = o.to(query.dtype)
        if scores is not None:
            tau_i = None if tau is None else tau[i].float()
            u = None
            if uniforms is not None:
                u = uniforms[q_start:q_end, :, :ctx].float()
                u = u.view(q_len, num_kv_heads, group, ctx).permute(1, 2, 0, 3)
            elif score_mode == "gumbel":
                seed, first = keys[i]
                u = noise.chunk_uniforms(seed, first, noise_layer, num_heads, range(q_len), range(ctx))
                u = u.to(query.device).view(num_kv_heads, group, q_len, ctx)
            s = _masked_softmax_scores(logits, mask, score_mode, tau_i, u)  # [Hkv, G, q, ctx]
            scores[i, :, :ctx] = s.sum(dim=(1, 2))
    return out, scores


def dense_causal_attention(
    query: torch.Tensor,  # [q_len, num_heads, head_dim]
    key: torch.Tensor,  # [kv_len, num_kv_heads, head_dim]
    value: torch.Tensor,  # [kv_len, num_kv_heads, head_dim]
    scale: float | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [q_len, num_heads, head_dim]
    """Plain attention over contiguous tokens, the last ``q_len`` of which are the queries.

    The independent oracle for the paged paths (tests only)."""
    q_len, num_heads, head_dim = query.shape
    kv_len, num_kv_heads, _ = key.shape
    scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
    group = num_heads // num_kv_heads
    k = key.float().repeat_interleave(group, dim=1)
    v = value.float().repeat_interleave(group, dim=1)
    logits = torch.einsum("qhd,khd->hqk", query.float(), k) * scale
    rows = torch.arange(q_len)[:, None] + (kv_len - q_len)
    cols = torch.arange(kv_len)[None, :]
    mask = cols <= rows
    if sliding_window is not None:
        mask &= cols > rows - sliding_window
    probs = _safe_softmax(logits.masked_fill(~mask, float("-inf")))
    return torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
