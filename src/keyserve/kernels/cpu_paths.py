"""Fast CPU paths for paged attention without score output: gather, then fused SDPA.

The explicit-logits code in ``reference.py`` materialises ``[heads, queries, slots]`` logits and
runs softmax as separate ops; on a CPU that is several times slower than torch's fused
``scaled_dot_product_attention`` (flash kernel with GQA). When no scores are requested the
reference functions route here instead:

- K/V are gathered with ``index_select`` straight into head-major order, in reusable per-thread
  workspace buffers (a fresh multi-MB tensor per call costs page faults that rival the
  attention itself);
- decode batches are cut into groups of sequences whose gathered K/V fit ``GROUP_BYTES``, so the
  copy is still in the last-level cache when SDPA reads it;
- a sliding window gathers only the blocks inside the window.

Semantics are those of ``reference.py`` (slot-causal masks, empty sequences give zeros).
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from keyserve.kernels import noise
from keyserve.kernels.native import decode as native_decode
from keyserve.kernels.workspace import scratch

GROUP_BYTES = 8 << 20  # gathered K+V per decode group: well inside a 32 MiB L3

# Per thread: tensor-parallel ranks may run as threads of one process (tests do).
_local = threading.local()


def _buffer(name: str, like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A reusable scratch tensor of ``shape`` in ``like``'s dtype and device."""
    return scratch(name, shape, like.dtype, like.device)


def _gather(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    blocks: torch.Tensor,  # [num_seqs, n] int: physical block ids
    name: str,
    rows: torch.Tensor | None,  # [num_seqs * num_kv_heads * n * block_size] from _head_rows
) -> torch.Tensor:  # [num_seqs, num_kv_heads, n * block_size, head_dim]
    """Gather whole blocks, head-major when the cache is contiguous (``rows`` given): SDPA
    reads ``[seq, head, slot, dim]`` with unit-stride slots markedly faster than the cache's
    token-major order, and one gather per 256-byte head row costs about what one per block
    does. Otherwise gather token-major blocks and return a strided view."""
    num_seqs, n = blocks.shape
    _, block_size, heads, dim = cache.shape
    if rows is not None:
        out = _buffer(name, cache, (rows.numel(), dim))
        torch.index_select(cache.view(-1, dim), 0, rows, out=out)
        return out.view(num_seqs, heads, n * block_size, dim)
    out = _buffer(name, cache, (num_seqs * n, block_size, heads, dim))
    torch.index_select(cache, 0, blocks.reshape(-1), out=out)
    return out.view(num_seqs, n * block_size, heads, dim).transpose(1, 2)


def _head_offsets(block_size: int, heads: int, device: torch.device) -> torch.Tensor:
    """[1, heads, 1, block_size] row offsets of (head, offset) inside one block (cached)."""
    cache = _local.__dict__.setdefault("offsets", {})
    key = (block_size, heads, device)
    if key not in cache:
        h = torch.arange(heads, device=device)[:, None]
        o = torch.arange(block_size, device=device)[None, :]
        cache[key] = (h + o * heads)[None, :, None, :]
    return cache[key]


def _gather_kv(
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    blocks: torch.Tensor,  # [num_seqs, n] int
) -> tuple[torch.Tensor, torch.Tensor]:  # 2 x [num_seqs, num_kv_heads, n * block_size, head_dim]
    rows = None
    if k_cache.is_contiguous() and v_cache.is_contiguous():
        _, block_size, heads, _ = k_cache.shape
        # row of (block b, head h, offset o) in the cache seen as [-1, head_dim]
        rows = (blocks.long()[:, None, :, None] * (block_size * heads)
                + _head_offsets(block_size, heads, blocks.device)).reshape(-1)
    return _gather(k_cache, blocks, "k", rows), _gather(v_cache, blocks, "v", rows)


def _groups(lens: list[int], bytes_per_slot: int, budget: int) -> list[tuple[int, int]]:
    """Consecutive [start, end) groups whose gathered K/V stay under ``budget`` bytes."""
    groups, start, longest = [], 0, 0
    for i, n in enumerate(lens):
        longest_if = max(longest, n)
        if i > start and (i + 1 - start) * longest_if * bytes_per_slot > budget:
            groups.append((start, i))
            start, longest_if = i, n
        longest = longest_if
    if lens:
        groups.append((start, len(lens)))
    return groups


# Slots a decode row's tree mask covers (AttentionMetadata.decode_tree_masks): bits 0..62 of
# an int64, bit i for slot L-1-i; older slots are always visible.
TREE_BITS = 63


def tree_visible(
    slots: torch.Tensor,  # [..., num_slots] int64 logical slots
    lens: torch.Tensor,  # int64 context lengths, broadcastable against slots
    masks: torch.Tensor,  # int64 tree masks (-1: every slot), broadcastable against slots
) -> torch.Tensor:  # bool, the broadcast shape
    """Which slots a row's tree mask shows: slot t of a row with context L is visible iff
    L-1-t >= 63 or bit L-1-t of its mask is set. The shift is clamped to 0..63 (shifts past
    63 are undefined); slots at or past L come out as bit 0 and must be masked by the caller."""
    back = lens - 1 - slots
    bit = torch.bitwise_right_shift(masks, back.clamp(0, TREE_BITS)) & 1
    return (back >= TREE_BITS) | (bit == 1)


def decode_sdpa(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int
    lens: list[int],  # filled slots per sequence
    scale: float,
    sliding_window: int | None,
    tree_masks: torch.Tensor | None = None,  # [num_seqs] int64 (see tree_visible)
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    if tree_masks is not None and bool((tree_masks == -1).all()):
        tree_masks = None  # every slot visible: the unmasked path, the same bits as no masks
    slot_bytes = 2 * num_kv_heads * head_dim * k_cache.element_size()
    groups = _groups(lens, slot_bytes, GROUP_BYTES)
    if len(groups) == 1 and min(lens) > 0:  # one group: no output buffer to stitch into
        return _decode_group(query, k_cache, v_cache, block_tables, lens, scale, sliding_window, tree_masks)
    out = torch.zeros_like(query)
    for s0, s1 in groups:
        if max(lens[s0:s1]) > 0:
            out[s0:s1] = _decode_group(query[s0:s1], k_cache, v_cache, block_tables[s0:s1],
                                       lens[s0:s1], scale, sliding_window,
                                       None if tree_masks is None else tree_masks[s0:s1])
    return out


def _decode_group(
    query: torch.Tensor,  # [g, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [g, max_blocks] int
    lens: list[int],  # g lengths, at least one > 0
    scale: float,
    sliding_window: int | None,
    tree_masks: torch.Tensor | None = None,  # [g] int64
) -> torch.Tensor:  # [g, num_heads, head_dim]
    block_size = k_cache.shape[1]
    hi, shortest = max(lens), min(lens)
    lo = 0 if sliding_window is None else max(0, shortest - sliding_window)
    b0, b1 = lo // block_size, (hi + block_size - 1) // block_size
    k, v = _gather_kv(k_cache, v_cache, block_tables[:, b0:b1])
    q = query.unsqueeze(2).to(k.dtype)  # [g, num_heads, 1, head_dim]
    first = b0 * block_size
    mask = keep = None
    if shortest == hi and tree_masks is None:  # equal lengths: slice the slots instead of masking
        start = 0 if sliding_window is None else max(0, hi - sliding_window) - first
        k, v = k[:, :, start : hi - first], v[:, :, start : hi - first]
    else:
        slots = torch.arange(first, b1 * block_size, device=query.device)[None, :]
        ctx = torch.tensor(lens, device=query.device)[:, None]
        keep = slots < ctx
        if sliding_window is not None:
            keep &= slots >= ctx - sliding_window
        if tree_masks is not None:
            keep &= tree_visible(slots, ctx, tree_masks.to(query.device, torch.int64)[:, None])
        mask = keep[:, None, None, :]  # [g, 1, 1, slots]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    o = o.squeeze(2).to(query.dtype)
    if tree_masks is not None:  # rows with nothing visible: zeros, as for empty rows
        o[~keep.any(dim=1)] = 0.0
    elif shortest == 0:  # fully masked rows: zeros, whatever the SDPA backend returns
        o[torch.tensor(lens, device=query.device) == 0] = 0.0
    return o


def prefill_sdpa(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int
    starts: list[int],  # [num_seqs + 1] query offsets
    lens: list[int],  # slots after this chunk, per sequence
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    out = torch.zeros_like(query)
    block_size = k_cache.shape[1]
    device = query.device
    for i, ctx in enumerate(lens):
        q_start, q_end = starts[i], starts[i + 1]
        q_len = q_end - q_start
        if q_len == 0 or ctx == 0:
            continue
        prefix = ctx - q_len
        lo = 0 if sliding_window is None else max(0, prefix - sliding_window + 1)
        b0, b1 = lo // block_size, (ctx + block_size - 1) // block_size
        k, v = _gather_kv(k_cache, v_cache, block_tables[i : i + 1, b0:b1])
        q = query[q_start:q_end].transpose(0, 1).unsqueeze(0).to(k.dtype)  # [1, H, q_len, D]
        if prefix == 0 and (sliding_window is None or sliding_window >= q_len):
            # A fresh prompt: top-left causal is exactly the mask below (query i sees slots 0..i,
            # the last block's padding slots lie beyond every query), and torch's flash kernel
            # takes it without a materialised mask, about twice as fast.
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        elif (sliding_window is None and q_len >= SPLIT_MIN_QUERIES and _FLASH_LSE is not None
              and q.dtype in _FLASH_DTYPES):
            o = _prefix_then_causal(q, k[:, :, :ctx], v[:, :, :ctx], prefix, scale)
        else:
            rows = torch.arange(q_len, device=device)[:, None] + prefix
            cols = torch.arange(b0 * block_size, b1 * block_size, device=device)[None, :]
            keep = (cols <= rows) & (cols < ctx)
            if sliding_window is not None:
                keep &= cols > rows - sliding_window
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=scale, enable_gqa=True)
        out[q_start:q_end] = o[0].transpose(0, 1).to(query.dtype)
    return out


# torch's CPU flash kernel with its log-sum-exp (a private op: guarded, the masked path is the
# fallback). On an older or newer torch without it nothing changes but speed.
_FLASH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_DTYPES = (torch.float32, torch.bfloat16)
# Below this many queries (speculative verification, small chunks) the masked half is small
# and one masked pass beats two passes and a merge.
SPLIT_MIN_QUERIES = 32


def _prefix_then_causal(
    q: torch.Tensor,  # [1, num_heads, q_len, head_dim]
    k: torch.Tensor,  # [1, num_kv_heads, prefix + q_len, head_dim]
    v: torch.Tensor,  # [1, num_kv_heads, prefix + q_len, head_dim]
    prefix: int,
    scale: float,
) -> torch.Tensor:  # [1, num_heads, q_len, head_dim]
    """A chunk after ``prefix`` cached slots, as two flash passes merged by their log-sum-exp:
    every query over the whole prefix (no mask), and the chunk over itself with ``is_causal``.
    A materialised slot-causal mask would make the flash kernel compute the chunk's masked
    half too: with a 16-token prefix hit that doubles the attention of the whole prompt."""
    assert _FLASH_LSE is not None
    num_heads, q_len, head_dim = q.shape[1], q.shape[2], q.shape[3]
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    # Over the prefix no query is masked: fold the group's heads into rows (no K/V copy).
    qg = q.reshape(1, num_kv_heads, group * q_len, head_dim)
    o1, lse1 = _FLASH_LSE(qg, k[:, :, :prefix], v[:, :, :prefix], scale=scale)[:2]
    o1 = o1.reshape(1, num_heads, q_len, head_dim).float()
    lse1 = lse1.reshape(1, num_heads, q_len)
    kc = k[:, :, prefix:].repeat_interleave(group, dim=1)  # [1, num_heads, q_len, head_dim]
    vc = v[:, :, prefix:].repeat_interleave(group, dim=1)
    o2, lse2 = _FLASH_LSE(q, kc, vc, is_causal=True, scale=scale)[:2]
    lse = torch.logaddexp(lse1, lse2)
    o1.mul_(torch.exp(lse1 - lse).unsqueeze(-1))
    return o1.addcmul_(o2.float(), torch.exp(lse2 - lse).unsqueeze(-1)).to(q.dtype)


SCORE_CHUNK_BYTES = 16 << 20  # logits of one query chunk: [heads, rows, slots] float32


def prefill_sdpa_scores(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int
    starts: list[int],  # [num_seqs + 1] query offsets
    lens: list[int],  # slots after this chunk, per sequence
    scale: float,
    sliding_window: int | None,
    score_mode: str,
    tau: torch.Tensor | None,  # [num_seqs] float (gumbel only)
    uniforms: torch.Tensor | None = None,  # [num_tokens, num_heads, max_context] (tests)
    noise_keys: torch.Tensor | None = None,  # [num_seqs, 2] int64: (noise seed, first query position)
    noise_layer: int = 0,  # noise.layer_key(layer, first query head)
) -> tuple[torch.Tensor, torch.Tensor]:  # out [num_tokens, num_heads, head_dim], scores
    """Prefill attention that also returns the KV-budget scores ([num_seqs, num_kv_heads,
    max_context] float32, summed over the chunk's queries and the group's heads).

    The scores come from batched matmuls over query chunks whose logits stay within
    ``SCORE_CHUNK_BYTES``, softmaxed and summed; a chunk stops at its last query's slot (the
    causal triangle's masked half is never computed) and only its diagonal block is masked.
    Under H2O the same probabilities give the output (one more matmul with V, instead of a
    second pass through fused SDPA); Keyformer's scores come from noisy logits, so its output
    is fused SDPA's as in ``prefill_sdpa``. The reference instead materialises ``[heads,
    queries, slots]`` logits with separate passes for output and scores. Keyformer's noise is
    ``kernels/noise.py``'s function of (``noise_keys`` row, layer and head, position, slot)."""
    gumbel = score_mode == "gumbel"
    native_noise = gumbel and query.device.type == "cpu" and native_decode.library() is not None
    if gumbel:
        if uniforms is None:
            keys = (noise_keys if noise_keys is not None else noise.random_keys(len(lens))).tolist()
        out = prefill_sdpa(query, k_cache, v_cache, block_tables, starts, lens, scale, sliding_window)
    else:
        out = torch.zeros_like(query)
    num_heads, head_dim = query.shape[1], query.shape[2]
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    max_ctx = max(lens) if lens else 0
    scores = torch.zeros(len(lens), num_kv_heads, max_ctx, dtype=torch.float32, device=query.device)
    device = query.device
    for i, ctx in enumerate(lens):
        q_start, q_end = starts[i], starts[i + 1]
        q_len = q_end - q_start
        if q_len == 0 or ctx == 0:
            continue
        prefix = ctx - q_len
        lo = 0 if sliding_window is None else max(0, prefix - sliding_window + 1)
        b0, b1 = lo // block_size, (ctx + block_size - 1) // block_size
        first = b0 * block_size
        k, v = _gather_kv(k_cache, v_cache, block_tables[i : i + 1, b0:b1])
        k = k[0, :, : ctx - first].float()  # [num_kv_heads, slots, head_dim]
        v = v[0, :, : ctx - first].float()
        slots = ctx - first
        q = query[q_start:q_end].float().mul(scale).view(q_len, num_kv_heads, group, head_dim)
        q = q.permute(1, 2, 0, 3)  # [num_kv_heads, group, q_len, head_dim]
        cols = torch.arange(first, ctx, device=device)[None, :]
        rows_per_chunk = max(1, SCORE_CHUNK_BYTES // (4 * num_heads * slots))
        for r0 in range(0, q_len, rows_per_chunk):
            r1 = min(q_len, r0 + rows_per_chunk)
            n = r1 - r0
            width = prefix + r1 - first  # slots after the chunk's last query are masked for all its rows
            qc = q[:, :, r0:r1].reshape(num_kv_heads, group * n, head_dim)
            logits = torch.bmm(qc, k[:, :width].transpose(1, 2))  # [Hkv, group * n, width]
            logits = logits.view(num_kv_heads, group, n, width)
            pos = torch.arange(r0, r1, device=device)[:, None] + prefix
            # causal masking touches only the diagonal block (slots of this chunk's own queries)
            d0 = max(0, prefix + r0 - first) if sliding_window is None else 0
            masked = cols[:, d0:width] > pos  # [n, width - d0]
            if sliding_window is not None:
                masked |= cols[:, :width] <= pos - sliding_window
            if gumbel:
                if uniforms is None and native_noise:  # ζ in one native pass, the same bits
                    seed, first_pos = keys[i]
                    zeta = native_decode.gumbel_noise_native(
                        seed, first_pos, noise_layer, num_heads, range(r0, r1), range(first, first + width))
                    logits = logits.add_(zeta.view(num_kv_heads, group, n, width)).div_(tau[i].float())
                else:
                    if uniforms is not None:
                        u = uniforms[q_start + r0 : q_start + r1, :, first : first + width].float()
                        u = u.view(n, num_kv_heads, group, width).permute(1, 2, 0, 3).clone()
                    else:
                        seed, first_pos = keys[i]
                        u = noise.chunk_uniforms(seed, first_pos, noise_layer, num_heads, range(r0, r1),
                                                 range(first, first + width))
                        u = u.to(device).view(num_kv_heads, group, n, width)
                    # Gumbel noise -log(-log U), in place (torch's exponential_ is ~6x slower on CPU)
                    u.clamp_(1e-20, 1.0 - 1e-7).log_().neg_().log_()
                    logits = logits.sub_(u).div_(tau[i].float())
            logits[..., d0:].masked_fill_(masked, float("-inf"))
            probs = torch.softmax(logits, dim=-1)  # every row keeps its own slot: no empty row
            scores[i, :, first : first + width] += probs.sum(dim=(1, 2))
            if not gumbel:
                o = torch.bmm(probs.view(num_kv_heads, group * n, width), v[:, :width])  # [Hkv, group * n, D]
                o = o.view(num_kv_heads, group, n, head_dim).permute(2, 0, 1, 3)
                out[q_start + r0 : q_start + r1] = o.reshape(n, num_heads, head_dim).to(out.dtype)
    return out, scores
