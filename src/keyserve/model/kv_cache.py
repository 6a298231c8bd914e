"""Allocation of the paged KV cache the model's attention layers read and write."""

from __future__ import annotations

import torch

from keyserve.kernels import huge_pages
from keyserve.model.config import ModelConfig
from keyserve.model.parallel import TPContext, kv_head_range

KVCache = tuple[torch.Tensor, torch.Tensor]  # (k_cache, v_cache), each [blocks, B, kv_heads, d]


def allocate_kv_cache(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    tp_rank: int = 0,
    tp_size: int = 1,
) -> list[KVCache]:
    """One zeroed tensor ``[layers, 2, num_blocks, block_size, local_kv_heads, head_dim]`` viewed
    as a ``(k_cache, v_cache)`` pair per layer.

    Zeroed, not empty: attention gathers whole blocks and masks the unused slots by probability
    0, and ``0 * NaN`` from uninitialised memory would poison the output. With tensor
    parallelism each rank holds only its own kv heads. On the CPU the pool is on huge pages
    (kernels/huge_pages.py: decode reads scattered blocks of it every step).
    """
    _, local_heads = kv_head_range(config.num_key_value_heads, TPContext(tp_rank, tp_size))
    shape = (config.num_hidden_layers, 2, num_blocks, block_size, local_heads, config.head_dim)
    if torch.device(device).type == "cpu":
        cache = huge_pages.zeros(shape, dtype)
    else:
        cache = torch.zeros(shape, dtype=dtype, device=device)
    return [(cache[i, 0], cache[i, 1]) for i in range(config.num_hidden_layers)]


def kv_cache_bytes_per_block(
    config: ModelConfig, block_size: int, dtype: torch.dtype, tp_size: int = 1
) -> int:
    """Bytes one block costs across all layers (K and V) on one rank, for sizing the pool."""
    _, local_heads = kv_head_range(config.num_key_value_heads, TPContext(0, tp_size))
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * block_size * local_heads * config.head_dim * itemsize
