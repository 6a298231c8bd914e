"""Bounded tiers (device, host): which chunk sits in which slot, and which leaves first.

A chunk holds ``chunk_size`` tokens of *one* layer (importance and repacking are per layer),
so a chunk of layer ``l`` can only go to a layer-``l`` slot: each tier has ``slots_per_layer``
slots per layer and one min-heap per layer. Priorities are totally ordered tuples; admission
takes a free slot, else replaces the tier's minimum if the newcomer ranks strictly higher.
"""

from __future__ import annotations

from typing import Any

from keyserve.core.prefix_store.heap import IndexedMinHeap

ChunkKey = tuple[int, int, int]  # (node_id, layer, chunk index in storage order)


class TierIndex:
    def __init__(self, name: str, num_layers: int, slots_per_layer: int) -> None:
        if slots_per_layer < 0:
            raise ValueError("slots_per_layer must be >= 0")
        self.name = name
        self.num_layers = num_layers
        self.slots_per_layer = slots_per_layer
        self.heaps: list[IndexedMinHeap[ChunkKey]] = [IndexedMinHeap() for _ in range(num_layers)]
        self._free: list[list[int]] = [list(range(slots_per_layer - 1, -1, -1)) for _ in range(num_layers)]
        self.slots: dict[ChunkKey, int] = {}
        self.evictions = 0

    def __contains__(self, key: object) -> bool:
        return key in self.slots

    def __len__(self) -> int:
        return len(self.slots)

    def slot(self, key: ChunkKey) -> int:
        return self.slots[key]

    def would_admit(self, layer: int, priority: Any) -> bool:
        if self._free[layer]:
            return True
        heap = self.heaps[layer]
        return bool(heap) and priority > heap.peek()[0]

    def admit(self, key: ChunkKey, priority: Any) -> tuple[int | None, tuple[ChunkKey, int] | None]:
        """Place ``key``: returns (its slot or None if it ranks too low, the chunk evicted to make
        room and its old slot, or None)."""
        if key in self.slots:
            self.heaps[key[1]].push(key, priority)
            return self.slots[key], None
        layer = key[1]
        evicted = None
        if self._free[layer]:
            slot = self._free[layer].pop()
        elif self.would_admit(layer, priority):
            _, victim = self.heaps[layer].pop()
            slot = self.slots.pop(victim)
            evicted = (victim, slot)
            self.evictions += 1
        else:
            return None, None
        self.slots[key] = slot
        self.heaps[layer].push(key, priority)
        return slot, evicted

    def update(self, key: ChunkKey, priority: Any) -> None:
        self.heaps[key[1]].push(key, priority)

    def remove(self, key: ChunkKey) -> int:
        """Drop ``key`` (its node left the store); returns the freed slot."""
        self.heaps[key[1]].remove(key)
        slot = self.slots.pop(key)
        self._free[key[1]].append(slot)
        return slot

    def eviction_order(self, layer: int) -> list[ChunkKey]:
        """The layer's chunks, first to be evicted first (for tests and inspection)."""
        return [k for _, k in sorted((self.heaps[layer].priority(k), k) for k in self.heaps[layer].keys())]
