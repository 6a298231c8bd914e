"""Scores of a kv-head that lives on several ranks (tensor parallelism above the kv-head count).

With ``tp_size > num_kv_heads`` each kv-head is replicated on ``tp_size / num_kv_heads``
consecutive ranks (``model.parallel.kv_head_range``), and each replica sees only its own query
heads: its attention scores are a part of what one process would sum over the kv-head's whole
group. Summing the replicas' scores (docs/algorithms.md §2) gives every replica the one-process
scores, so all of them evict the same slot and their caches stay identical.
"""

from __future__ import annotations

import torch

from keyserve.kernels.metadata import LayerScores
from keyserve.model.parallel import TPContext


def sum_over_replicas(
    scores: list[LayerScores] | None,  # per layer: (decode [n_dec, 1, ctx] | None, prefill [n_pre, 1, ctx] | None)
    tp: TPContext,
    total_kv_heads: int,  # the model's kv-head count (all ranks)
) -> list[LayerScores] | None:
    """The same structure with each kv-head's scores summed over its replicas (one all-reduce
    over the group: a rank writes its scores into its kv-head's row of a zero buffer, so the sum
    of row h is the sum over kv-head h's replicas). Unchanged when no kv-head is replicated."""
    if scores is None or tp.size <= total_kv_heads:
        return scores
    head = tp.rank // (tp.size // total_kv_heads)
    parts = [t for pair in scores for t in pair if t is not None]
    flat = torch.cat([t.reshape(-1).float() for t in parts])
    buf = flat.new_zeros(total_kv_heads, flat.numel())
    buf[head] = flat
    summed = tp.reduce(buf)[head]
    out: list[LayerScores] = []
    offset = 0
    for pair in scores:
        new = []
        for t in pair:
            if t is None:
                new.append(None)
                continue
            new.append(summed[offset : offset + t.numel()].view(t.shape).to(t.dtype))
            offset += t.numel()
        out.append((new[0], new[1]))
    return out
