"""Megatron-style linear layers that hold one tensor-parallel shard of a full weight.

Column-parallel layers (fused q/k/v, fused gate/up) keep the output rows of this rank's heads
or intermediate slice; row-parallel layers (o_proj, down_proj) keep the matching input columns
and all-reduce their partial sums. At ``tp_size == 1`` every shard is the whole weight and the
all-reduce is a no-op, so the single-process path pays nothing for the split.

Weights are loaded from *full* (unsharded) Hugging Face tensors: each layer slices its own part
in ``load_shard``, so one checkpoint serves any ``tp_size``. Across processes the all-reduce is
``dist_all_reduce`` and the LM head is vocab-parallel (``VocabParallelHead``: each rank projects
its slice of the vocabulary, rank 0 gathers the full logits).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from keyserve.model.matmul import linear

AllReduce = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class TPContext:
    """This shard's rank, the group size and the all-reduce that joins row-parallel outputs."""

    rank: int = 0
    size: int = 1
    all_reduce: AllReduce | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tp_rank {self.rank} is outside tp_size {self.size}")

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the group (identity at tp_size 1)."""
        if self.size == 1:
            return x
        if self.all_reduce is None:
            raise RuntimeError("tp_size > 1 needs an all_reduce hook")
        return self.all_reduce(x)


def split_evenly(total: int, parts: int, what: str) -> int:
    """Per-rank size of a dimension that must divide evenly across ``parts`` ranks."""
    if total % parts:
        raise ValueError(f"{what} = {total} is not divisible by tp_size {parts}")
    return total // parts


def kv_head_range(num_kv_heads: int, tp: TPContext) -> tuple[int, int]:
    """(first kv head, count) held by this rank.

    With fewer kv heads than ranks each kv head is replicated on ``tp_size / num_kv_heads``
    consecutive ranks (the vLLM convention), so every rank still holds one.
    """
    if num_kv_heads >= tp.size:
        per_rank = split_evenly(num_kv_heads, tp.size, "num_key_value_heads")
        return tp.rank * per_rank, per_rank
    replicas = split_evenly(tp.size, num_kv_heads, "tp_size / num_key_value_heads")
    return tp.rank // replicas, 1


def _empty(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    """An uninitialised frozen parameter: the loader overwrites it, so random init is waste."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class QKVParallelLinear(nn.Module):
    """Fused ``[q; k; v]`` projection holding this rank's query and kv heads."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        bias: bool,
        tp: TPContext,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.num_heads = split_evenly(num_heads, tp.size, "num_attention_heads")
        self.q_head_start = tp.rank * self.num_heads
        self.kv_head_start, self.num_kv_heads = kv_head_range(num_kv_heads, tp)
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        self.weight = _empty(out, hidden_size, dtype=dtype, device=device)
        self.bias = _empty(out, dtype=dtype, device=device) if bias else None

    def _rows(self, shard: str) -> tuple[int, int, int]:
        """(offset in the fused weight, first row in the full tensor, row count) of a shard."""
        d, q, kv = self.head_dim, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if shard == "q":
            return 0, self.q_head_start * d, q
        if shard == "k":
            return q, self.kv_head_start * d, kv
        if shard == "v":
            return q + kv, self.kv_head_start * d, kv
        raise ValueError(f"unknown qkv shard {shard!r}")

    def load_shard(
        self,
        shard: str,  # "q", "k" or "v"
        tensor: torch.Tensor,  # full weight [heads * head_dim, hidden] or bias [heads * head_dim]
        is_bias: bool = False,
    ) -> None:
        offset, start, count = self._rows(shard)
        target = self.bias if is_bias else self.weight
        if target is None:
            raise ValueError(f"checkpoint has a {shard}_proj bias but the config says attention_bias=False")
        target.data[offset : offset + count].copy_(tensor[start : start + count])

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, hidden] -> [n, (q + 2 kv) * d]
        return linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(nn.Module):
    """Fused ``[gate; up]`` projection holding this rank's slice of each."""

    def __init__(
        self,
        in_features: int,
        out_features: int,  # per part, unsharded (intermediate_size)
        num_parts: int,
        bias: bool,
        tp: TPContext,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        self.part_size = split_evenly(out_features, tp.size, "intermediate_size")
        self.start = tp.rank * self.part_size
        self.weight = _empty(num_parts * self.part_size, in_features, dtype=dtype, device=device)
        self.bias = _empty(num_parts * self.part_size, dtype=dtype, device=device) if bias else None

    def load_shard(
        self,
        part: int,
        tensor: torch.Tensor,  # full weight [out_features, in] or bias [out_features]
        is_bias: bool = False,
    ) -> None:
        target = self.bias if is_bias else self.weight
        if target is None:
            raise ValueError("checkpoint has an MLP bias but the config says mlp_bias=False")
        rows = slice(part * self.part_size, (part + 1) * self.part_size)
        target.data[rows].copy_(tensor[self.start : self.start + self.part_size])

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, in] -> [n, parts * part_size]
        return linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Holds input columns ``[rank * in/tp, (rank + 1) * in/tp)``; sums partials over ranks."""

    def __init__(
        self,
        in_features: int,  # unsharded
        out_features: int,
        bias: bool,
        tp: TPContext,
        dtype: torch.dtype,
        device: torch.device | str,
        in_granule: int = 1,  # shard boundaries fall on multiples of this (head_dim for o_proj)
    ) -> None:
        super().__init__()
        self.tp = tp
        units = split_evenly(in_features // in_granule, tp.size, "row-parallel input")
        self.in_per_rank = units * in_granule
        self.start = tp.rank * self.in_per_rank
        self.weight = _empty(out_features, self.in_per_rank, dtype=dtype, device=device)
        self.bias = _empty(out_features, dtype=dtype, device=device) if bias else None

    def load_shard(self, tensor: torch.Tensor, is_bias: bool = False) -> None:
        """``tensor``: full weight [out, in] (columns sliced) or bias [out] (kept whole)."""
        if is_bias:
            if self.bias is None:
                raise ValueError("checkpoint has a bias the config does not declare")
            self.bias.data.copy_(tensor)
            return
        self.weight.data.copy_(tensor[:, self.start : self.start + self.in_per_rank])

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, in / tp] -> [n, out]
        if self.tp.size == 1:
            return linear(x, self.weight, self.bias)
        out = self.tp.reduce(linear(x, self.weight))
        return out if self.bias is None else out + self.bias  # the bias is added once, after the sum


class ReplicatedEmbedding(nn.Module):
    """Token embedding kept whole on every rank (its lookup reads only the rows it needs)."""

    def __init__(
        self, vocab_size: int, hidden_size: int, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        self.weight = _empty(vocab_size, hidden_size, dtype=dtype, device=device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [n] long -> [n, hidden]
        return F.embedding(ids, self.weight)


def dist_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The all-reduce of a tensor-parallel group: ``torch.distributed`` sums ``x`` over every
    rank in place (``TPContext.all_reduce`` of a shard in a Ray actor)."""
    dist.all_reduce(x)
    return x


class VocabParallelHead:
    """Logits from this rank's rows of the LM head, gathered onto rank 0 (None elsewhere)."""

    def __init__(self, weight: torch.Tensor, rank: int, size: int) -> None:  # weight [vocab, hidden]
        self.vocab = weight.shape[0]
        self.rank, self.size = rank, size
        self.per_rank = math.ceil(self.vocab / size)
        start = min(self.vocab, rank * self.per_rank)
        self.weight = weight[start : min(self.vocab, start + self.per_rank)]

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor | None:  # [n, hidden] -> [n, vocab]
        local = F.linear(hidden, self.weight).float()
        if local.shape[1] < self.per_rank:  # the last slice of a vocab that does not divide
            local = F.pad(local, (0, self.per_rank - local.shape[1]))
        local = local.contiguous()
        if self.rank != 0:
            dist.gather(local, dst=0)
            return None
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.gather(local, parts, dst=0)
        return torch.cat(parts, dim=1)[:, : self.vocab]
