"""One eviction choice per layer: the scores of a layer's kv-heads summed (``score_pooling="layer"``).

TOVA scores a token by its attention averaged over all of a layer's heads and keeps one set of
tokens per layer; keyserve's default lets each kv-head keep its own. Under the option every
kv-head of a layer is given the same scores -- the sum over all the layer's kv-heads -- so all
of them evict the same positions (ties broken by age, the same everywhere), and their slot maps
stay identical.

The sum is taken here, on the model side, before the tracker accumulates, because under tensor
parallelism a rank holds only some kv-heads: the ranks first exchange their heads' scores (one
all-reduce into a ``[num_kv_heads, ...]`` buffer, each kv-head written by its first replica
only) and every rank then adds the heads in the same order, 0 to H − 1. The arithmetic is the
same at every TP size, so TP = N evicts exactly what TP = 1 does.
"""

from __future__ import annotations

import torch

from keyserve.engine.kv_budget.slots import ScoreRows
from keyserve.kernels.metadata import LayerScores
from keyserve.model.parallel import TPContext, kv_head_range


def pooled_rows(score_rows: list[ScoreRows]) -> tuple[list[int], list[int]]:
    """(decode rows, prefill rows) of the step's score tensors whose sequence pools per layer."""
    dec: list[int] = []
    pre: list[int] = []
    for item, is_dec, first, count in score_rows:
        budget = item.budget
        if budget is not None and budget.pools_layer:
            (dec if is_dec else pre).extend(range(first, first + count))
    return dec, pre


def pool_over_layer(
    scores: list[LayerScores] | None,  # per layer: (decode [n_dec, H, ctx] | None, prefill [n_pre, H, ctx] | None)
    score_rows: list[ScoreRows],
    tp: TPContext,
    total_kv_heads: int,  # the model's kv-head count (all ranks)
) -> list[LayerScores] | None:
    """The same structure with the rows of layer-pooling sequences replaced, in every local
    kv-head, by the sum over all the layer's kv-heads (in head order). Other rows unchanged;
    no copy and no collective when no sequence of the step pools."""
    if scores is None:
        return None
    rows = pooled_rows(score_rows)
    if not rows[0] and not rows[1]:
        return scores
    device = next(t for pair in scores for t in pair if t is not None).device
    index = [torch.tensor(r, device=device) for r in rows]  # per kind (decode, prefill): pooled rows
    # [num_layers x kinds] pieces of this rank's heads: [local_heads, rows, ctx]
    pieces = []
    for pair in scores:
        for kind, t in enumerate(pair):
            if t is not None and rows[kind]:
                pieces.append(t.index_select(0, index[kind]).transpose(0, 1).float())
    first, count = kv_head_range(total_kv_heads, tp)
    if tp.size > 1:
        buf = pieces[0].new_zeros(total_kv_heads, sum(p[0].numel() for p in pieces))
        if tp.size <= total_kv_heads or tp.rank % (tp.size // total_kv_heads) == 0:
            buf[first : first + count] = torch.cat([p.reshape(count, -1) for p in pieces], dim=1)
        buf = tp.reduce(buf)
        heads = [buf[h] for h in range(total_kv_heads)]
    else:
        heads = [torch.cat([p[h].reshape(-1) for p in pieces]) for h in range(total_kv_heads)]
    total = heads[0].clone()
    for h in heads[1:]:
        total += h  # head order, the same on every rank and at every TP size
    out: list[LayerScores] = []
    offset = 0
    for pair in scores:
        new: list[torch.Tensor | None] = []
        for kind, t in enumerate(pair):
            if t is None or not rows[kind]:
                new.append(t)
                continue
            n = len(rows[kind]) * t.shape[-1]
            summed = total[offset : offset + n].view(len(rows[kind]), 1, t.shape[-1])
            offset += n
            t = t.clone()
            t[index[kind]] = summed.to(t.dtype).expand(-1, t.shape[1], -1)
            new.append(t)
        out.append((new[0], new[1]))
    return out
