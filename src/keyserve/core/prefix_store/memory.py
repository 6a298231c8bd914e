"""Chunk storage of the two memory tiers: slots in the engine's block pool, and a host pool.

Both hold chunks of one layer each (``[2, chunk_size, num_kv_heads, head_dim]``: K then V) and
move whole batches of slots per call, never a token at a time.
"""

from __future__ import annotations

import torch

KVCache = tuple[torch.Tensor, torch.Tensor]  # per layer, each [num_blocks, block_size, H, D]


class BlockPoolChunks:
    """Device tier: chunk slots carved out of the engine's KV block pool.

    Slot ``s`` of layer ``l`` is layer ``l``'s slice of the reserved blocks
    ``block_ids[s*g : (s+1)*g]`` (``g = chunk_size / block_size``); the other layers' slices of
    the same blocks hold other chunks, so each reserved block stores one chunk per layer.
    """

    def __init__(self, kv_caches: list[KVCache], block_ids: list[int], chunk_size: int) -> None:
        block_size = kv_caches[0][0].shape[1]
        if chunk_size % block_size:
            raise ValueError("chunk_size must be a multiple of the block size")
        self.kv_caches = kv_caches
        self.group = chunk_size // block_size
        self.chunk_size = chunk_size
        self.block_ids = torch.tensor(block_ids, dtype=torch.int64, device=kv_caches[0][0].device)
        self.slots_per_layer = len(block_ids) // self.group

    def _blocks(self, slots: list[int]) -> torch.Tensor:  # [n * g] block ids
        s = torch.tensor(slots, dtype=torch.int64, device=self.block_ids.device)
        offs = torch.arange(self.group, device=s.device)
        return self.block_ids[(s[:, None] * self.group + offs).reshape(-1)]

    def read(self, layer: int, slots: list[int]) -> torch.Tensor:  # [n, 2, chunk, H, D]
        k, v = self.kv_caches[layer]
        blocks = self._blocks(slots)
        shape = (len(slots), self.chunk_size, *k.shape[2:])
        return torch.stack([k[blocks].view(shape), v[blocks].view(shape)], dim=1)

    def write(
        self,
        layer: int,
        slots: list[int],
        data: torch.Tensor,  # [n, 2, chunk, H, D]
    ) -> None:
        k, v = self.kv_caches[layer]
        blocks = self._blocks(slots)
        shape = (len(blocks), k.shape[1], *k.shape[2:])
        k[blocks] = data[:, 0].to(k.device, k.dtype).reshape(shape)
        v[blocks] = data[:, 1].to(v.device, v.dtype).reshape(shape)


class HostChunks:
    """Host tier: a bounded pool ``[num_layers, slots_per_layer, 2, chunk, H, D]`` in host
    memory (pinned when CUDA is there, so copies to the device can be asynchronous)."""

    def __init__(
        self, num_layers: int, slots_per_layer: int, chunk_shape: tuple[int, int, int, int], dtype: torch.dtype
    ) -> None:
        pin = torch.cuda.is_available() and slots_per_layer > 0
        self.pool = torch.empty(num_layers, slots_per_layer, *chunk_shape, dtype=dtype, pin_memory=pin)
        self.slots_per_layer = slots_per_layer

    def read(self, layer: int, slots: list[int]) -> torch.Tensor:  # [n, 2, chunk, H, D]
        return self.pool[layer, slots]

    def write(
        self,
        layer: int,
        slots: list[int],
        data: torch.Tensor,  # [n, 2, chunk, H, D]
    ) -> None:
        self.pool[layer, slots] = data.to("cpu", self.pool.dtype)
