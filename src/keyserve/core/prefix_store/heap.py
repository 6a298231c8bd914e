"""An indexed binary min-heap: priorities of keys can change or keys leave from the middle.

Each of the device and host tiers keeps one (per layer) and evicts its minimum first; a chunk
whose access count changes moves in O(log n) instead of being re-inserted with lazy deletion.
"""

from __future__ import annotations

from typing import Any, Generic, Hashable, TypeVar

K = TypeVar("K", bound=Hashable)


class IndexedMinHeap(Generic[K]):
    def __init__(self) -> None:
        self._heap: list[tuple[Any, K]] = []  # (priority, key)
        self._pos: dict[K, int] = {}

    def __len__(self) -> int:
        return len(self._heap)

    def __contains__(self, key: object) -> bool:
        return key in self._pos

    def priority(self, key: K) -> Any:
        return self._heap[self._pos[key]][0]

    def peek(self) -> tuple[Any, K]:
        if not self._heap:
            raise IndexError("empty heap")
        return self._heap[0]

    def push(self, key: K, priority: Any) -> None:
        """Insert ``key`` or change its priority."""
        if key in self._pos:
            i = self._pos[key]
            old = self._heap[i][0]
            self._heap[i] = (priority, key)
            if priority < old:
                self._up(i)
            else:
                self._down(i)
            return
        self._heap.append((priority, key))
        self._pos[key] = len(self._heap) - 1
        self._up(len(self._heap) - 1)

    def pop(self) -> tuple[Any, K]:
        if not self._heap:
            raise IndexError("empty heap")
        top = self._heap[0]
        self.remove(top[1])
        return top

    def remove(self, key: K) -> Any:
        """Take ``key`` out wherever it is; returns its priority."""
        i = self._pos.pop(key)
        prio = self._heap[i][0]
        last = self._heap.pop()
        if i < len(self._heap):
            self._heap[i] = last
            self._pos[last[1]] = i
            self._up(i)
            self._down(self._pos[last[1]])
        return prio

    def keys(self) -> list[K]:
        return [k for _, k in self._heap]

    def _swap(self, i: int, j: int) -> None:
        h = self._heap
        h[i], h[j] = h[j], h[i]
        self._pos[h[i][1]] = i
        self._pos[h[j][1]] = j

    def _up(self, i: int) -> None:
        h = self._heap
        while i > 0:
            parent = (i - 1) // 2
            if h[i][0] < h[parent][0]:
                self._swap(i, parent)
                i = parent
            else:
                return

    def _down(self, i: int) -> None:
        h = self._heap
        n = len(h)
        while True:
            left, right, smallest = 2 * i + 1, 2 * i + 2, i
            if left < n and h[left][0] < h[smallest][0]:
                smallest = left
            if right < n and h[right][0] < h[smallest][0]:
                smallest = right
            if smallest == i:
                return
            self._swap(i, smallest)
            i = smallest
