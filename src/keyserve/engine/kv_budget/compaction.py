"""Compaction: a budgeted sequence's kept tokens moved into its first blocks, the rest freed.

Two halves, one per side of the step boundary. The KV core plans it at the block level
(``plan_prompt_compaction``, ``settle_op``): which sequences are due, how many slots they keep,
which shared blocks must be copied first, and which blocks go back to the pool; it says so to
the model side in a ``CompactOp`` / ``SettleOp``. The model side (every rank, for its own
kv-heads) decides which tokens stay (``KVBudgetTracker.select_prompt`` / ``settle``) and moves
them (``compact_kv``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from keyserve.core.block_manager import BlockCopy, BlockManager
from keyserve.core.sequence import Sequence
from keyserve.engine.kv_budget.slots import physical_slots
from keyserve.engine.kv_budget.tracker import KVBudgetTracker
from keyserve.engine.step_input import CompactOp, RunnerOp, SettleOp

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: [num_blocks, block_size, H, D] x 2


# --------------------------------------------------------------- the KV core's half
def plan_prompt_compaction(
    block_manager: BlockManager,
    seqs: list[Sequence],
    ops: list[RunnerOp],
    prefix_hook: object | None = None,  # the prefix store: told before a prompt is compacted
) -> None:
    """Prompt-phase eviction for budgeted sequences whose prompt is now computed: k tokens per
    (layer, head) stay in the first blocks (moved by the model side), the rest are freed."""
    bm = block_manager
    for seq in seqs:
        if seq.is_finished or seq.kv_budget is None or seq.kv_slot_cap is not None:
            continue
        if prefix_hook is not None:
            prefix_hook.on_prompt_computed(seq)  # type: ignore[attr-defined]
        k = seq.kv_budget.budget
        assert k is not None
        if seq.num_computed_tokens > k:  # == the slots its budget state holds
            copies = bm.make_writable(seq, list(range(bm.blocks_for_slots(k))))
            if copies is None:
                continue  # the pool cannot copy shared blocks now; retry next step
            ops.append(CompactOp(seq.seq_id, list(seq.block_table), k, copies))
            bm.truncate(seq, k)
        else:
            ops.append(CompactOp(seq.seq_id, list(seq.block_table), k))
        seq.kv_slot_cap = k


def settle_op(seq: Sequence) -> SettleOp:
    """A budgeted target verified drafts: its accepted positions sit in spare slots. The model
    side keeps them and evicts down to the budget (docs/algorithms.md §3) before the caller
    drops the spare blocks."""
    return SettleOp(seq.seq_id, list(seq.block_table), seq.num_computed_tokens)


# -------------------------------------------------------------- the model side's half
def apply_compact(
    tracker: KVBudgetTracker,
    kv_caches: KVCaches,
    op: CompactOp,
    block_size: int,
    copy_blocks: Callable[[list[BlockCopy]], None],
) -> None:
    """Prompt-phase eviction: keep k tokens per (layer, head), moved into the first blocks of
    ``op.block_table`` (the engine frees the rest); shared blocks are copied first."""
    state = tracker.get(op)
    if state is None or not tracker.due_for_compaction(op):
        return
    copy_blocks(op.copies)
    if state.num_slots > op.budget:
        keep = tracker.select_prompt(op)
        if keep is not None:
            compact_kv(kv_caches, op.block_table, keep, block_size)
    else:
        tracker.select_prompt(op)


def apply_settle(tracker: KVBudgetTracker, kv_caches: KVCaches, op: SettleOp, block_size: int) -> None:
    """Speculation resolved: drop rejected spare slots and apply the evictions the kept tokens
    imply, compacted into the first blocks of ``op.block_table`` (the caller frees the rest)."""
    if tracker.get(op) is None:
        return
    keep = tracker.settle(op, op.num_tokens)
    if keep is not None:
        compact_kv(kv_caches, op.block_table, keep, block_size)


def compact_kv(
    kv_caches: KVCaches,
    block_table: list[int],
    keep: torch.Tensor,  # [num_layers, num_kv_heads, k]: new slot j <- old slot keep[..., j]
    block_size: int,
) -> None:
    """Move each (layer, head)'s kept tokens into logical slots 0..k-1 (gather, then scatter,
    so overlapping moves are safe). Only tokens whose slot changes are copied: ``keep`` fills
    holes and leaves the rest in place, so settling a speculative step moves a few tokens,
    not the whole budget."""
    num_layers, num_kv_heads, k = keep.shape
    table = torch.tensor(block_table, dtype=torch.int64, device=keep.device)
    src = physical_slots(keep, table, block_size)  # [L, H, k]
    dst = physical_slots(torch.arange(k, device=keep.device), table, block_size)  # [k]
    heads = torch.arange(num_kv_heads, device=keep.device)[:, None]
    src_rows = src * num_kv_heads + heads  # [L, H, k] rows of a [slots * H, D] view
    dst_rows = (dst[None, :] * num_kv_heads + heads).expand_as(src_rows)  # [L, H, k]
    moves = src_rows != dst_rows
    if not bool(moves.any()):
        return
    for layer, (k_cache, v_cache) in enumerate(kv_caches):
        which = moves[layer]
        src_l, dst_l = src_rows[layer][which], dst_rows[layer][which]
        if src_l.numel() == 0:
            continue
        for cache in (k_cache, v_cache):
            rows = cache.view(-1, cache.shape[-1])
            rows[dst_l] = rows[src_l]
