"""Repacking within a radix node: important tokens first, densely, in their own chunks.

The node's tokens are stored per layer in *storage order*; ``order[l, s]`` (the mapping list)
is the logical index (offset in the node) of the token at storage index ``s``. Logical order is
untouched, so prefix matching never sees the permutation. Storage order puts the important
tokens first, by descending score (ties by logical index), so the top-c tokens of a layer are
always its first ``ceil(c / chunk_size)`` chunks; then the rest, latest first: a request's
recent window (which H2O keeps whatever the scores) is the first few chunks after them, not
tokens spread over every chunk.
"""

from __future__ import annotations

import torch


def storage_order(
    important: torch.Tensor,  # [num_layers, n] bool
    scores: torch.Tensor | None,  # [num_layers, n] float (summed over the sampled heads) or None
    repack: bool = True,
) -> torch.Tensor:  # [num_layers, n] int64: storage index -> logical index
    num_layers, n = important.shape
    ident = torch.arange(n).expand(num_layers, n).clone()
    if not repack:
        return ident
    by_score = ident
    if scores is not None:
        by_score = torch.sort(scores.float(), dim=1, descending=True, stable=True).indices
    # one key per token: important ones by their score rank [0, n), the rest latest first [n, 2n)
    score_rank = inverse_order(by_score)
    key = torch.where(important, score_rank, 2 * n - 1 - ident)
    return torch.sort(key, dim=1).indices


def inverse_order(
    order: torch.Tensor,  # [num_layers, n] int64 storage -> logical
) -> torch.Tensor:  # [num_layers, n] int64 logical -> storage
    inv = torch.empty_like(order)
    ar = torch.arange(order.shape[1]).expand_as(order)
    return inv.scatter_(1, order, ar)


def _flat_rows(order: torch.Tensor) -> torch.Tensor:  # [num_layers * n] int64
    """Row ``l * n + order[l, s]`` for every (layer, storage index): the whole permutation as
    one index into ``[num_layers * n, ...]`` rows. One ``index_select`` / ``index_copy_`` of
    contiguous rows moves a node's KV ~1.5x faster than ``gather`` / ``scatter_`` with the
    index expanded to every element (measured on 2k-token nodes of SmolLM2, one thread)."""
    num_layers, n = order.shape
    return (order + torch.arange(num_layers)[:, None] * n).reshape(-1)


def to_storage(
    data: torch.Tensor,  # [num_layers, n, ...] in logical order
    order: torch.Tensor,  # [num_layers, n] int64
) -> torch.Tensor:  # [num_layers, n, ...] in storage order
    num_layers, n = order.shape
    rows = data.reshape(num_layers * n, -1).index_select(0, _flat_rows(order))
    return rows.view(data.shape)


def to_logical(
    stored: torch.Tensor,  # [num_layers, n, ...] in storage order
    order: torch.Tensor,  # [num_layers, n] int64
) -> torch.Tensor:  # [num_layers, n, ...] in logical order
    num_layers, n = order.shape
    out = torch.empty_like(stored)
    out.view(num_layers * n, -1).index_copy_(0, _flat_rows(order), stored.reshape(num_layers * n, -1))
    return out


def storage_chunks(
    kv: torch.Tensor,  # [num_layers, n, 2, num_kv_heads, head_dim] in logical order
    order: torch.Tensor,  # [num_layers, n] int64, n a multiple of chunk_size
    chunk_size: int,
) -> torch.Tensor:  # [num_layers, n // chunk_size, 2, chunk_size, num_kv_heads, head_dim], contiguous
    """The node's KV in storage order, laid out as its stored chunks (K rows, then V rows, of
    each chunk): one ``index_select`` where reordering and then permuting to the chunk layout
    copied the node twice."""
    num_layers, n = order.shape
    chunks = n // chunk_size
    heads, dim = kv.shape[-2:]
    src = _flat_rows(order).view(num_layers, chunks, 1, chunk_size) * 2 + torch.arange(2).view(1, 1, 2, 1)
    rows = kv.reshape(num_layers * n * 2, heads * dim).index_select(0, src.reshape(-1))
    return rows.view(num_layers, chunks, 2, chunk_size, heads, dim)


def chunk_counts(
    order: torch.Tensor,  # [num_layers, n] int64, n a multiple of chunk_size
    important: torch.Tensor,  # [num_layers, n] bool (logical order)
    chunk_size: int,
) -> torch.Tensor:  # [num_layers, n // chunk_size] int64: important tokens per stored chunk
    num_layers, n = order.shape
    return important.gather(1, order).view(num_layers, n // chunk_size, chunk_size).sum(-1)


def select_rows(
    order: torch.Tensor,  # [num_layers, n] int64 storage -> logical
    needed: torch.Tensor,  # [num_layers, n] bool (logical): tokens the load must bring
    eligible: torch.Tensor,  # [num_layers, n] bool (logical): tokens it may bring (needed ⊆ it)
    counts: torch.Tensor,  # [num_layers] int64: tokens per layer, needed <= counts <= eligible
) -> tuple[torch.Tensor, torch.Tensor]:  # logical [L, c] ascending, storage [L, c]; -1 pads
    """Each layer's needed tokens, topped up to ``counts[layer]`` with its next eligible tokens
    in storage order (the next most important). Layers may load different counts (attention
    takes a context length per layer): a row shorter than the longest is padded with -1."""
    num_layers, _ = order.shape
    need_s = needed.gather(1, order)
    elig_s = eligible.gather(1, order)
    have = need_s.sum(1)
    if bool((counts < have).any()) or bool((counts > elig_s.sum(1)).any()):
        raise ValueError("counts must lie between the needed and the eligible tokens per layer")
    extra = elig_s & ~need_s
    take = need_s | (extra & (extra.cumsum(1) <= (counts - have)[:, None]))
    c = int(counts.max()) if num_layers else 0
    # taken storage indices first (ascending), then the rest; keep the first c
    key = torch.where(take, torch.arange(take.shape[1]), take.shape[1])
    storage = torch.sort(key, dim=1).values[:, :c]
    valid = storage < take.shape[1]
    storage = torch.where(valid, storage, 0)
    logical = torch.where(valid, order.gather(1, storage), torch.iinfo(torch.int64).max)
    logical, perm = torch.sort(logical, dim=1)
    storage = storage.gather(1, perm)
    valid = valid.gather(1, perm)
    return torch.where(valid, logical, -1), torch.where(valid, storage, -1)
