"""Physical KV blocks: reference counts, an LRU free queue, and the prefix-cache index.

A block whose ref count drops to 0 keeps its hash and stays findable by prefix lookups until it
is reallocated; the free queue hands out the least recently freed block first, and a cached
block that is hit again is pulled out of the middle of the queue in O(1).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None  # set once the block is full and its tokens are computed
    token_ids: tuple[int, ...] | None = None  # the block's tokens, to verify a hash hit
    prev_free: "KVBlock | None" = None
    next_free: "KVBlock | None" = None

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class FreeBlockQueue:
    """Doubly-linked list of free blocks: pop from the head, push to the tail, remove anywhere."""

    def __init__(self, blocks: list[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def popleft(self) -> KVBlock:
        first = self._head.next_free
        if first is self._tail or first is None:
            raise IndexError("no free KV blocks")
        self.remove(first)
        return first

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"{block} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._len -= 1

    def _insert_after(self, anchor: KVBlock, block: KVBlock) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"{block} is already in the free queue")
        nxt = anchor.next_free
        assert nxt is not None
        block.prev_free, block.next_free = anchor, nxt
        anchor.next_free = block
        nxt.prev_free = block
        self._len += 1

    def append(self, block: KVBlock) -> None:
        """Free at the tail: reused last (keeps cached prefixes alive longest)."""
        prev = self._tail.prev_free
        assert prev is not None
        self._insert_after(prev, block)

    def appendleft(self, block: KVBlock) -> None:
        """Free at the head: reused first (blocks that hold nothing worth caching)."""
        self._insert_after(self._head, block)

    def __iter__(self):
        node = self._head.next_free
        while node is not None and node is not self._tail:
            yield node
            node = node.next_free


class BlockPool:
    """All physical blocks of one KV cache and the hash → block index of cached full blocks."""

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[int, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def allocate(self) -> KVBlock:
        """Take the least recently freed block; its cached identity, if any, is forgotten."""
        block = self.free_queue.popleft()
        self._uncache(block)
        block.ref_cnt = 1
        return block

    def _uncache(self, block: KVBlock) -> None:
        if block.block_hash is not None and self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
        block.block_hash = None
        block.token_ids = None

    def lookup(self, block_hash: int, token_ids: tuple[int, ...]) -> KVBlock | None:
        """A cached block with this hash AND these tokens (a hash collision is a miss)."""
        if not self.enable_prefix_caching:
            return None
        block = self.cached.get(block_hash)
        if block is None or block.token_ids != token_ids:
            return None
        return block

    def acquire(self, block: KVBlock) -> None:
        """One more table holds ``block`` (a prefix hit or a fork)."""
        if block.ref_cnt == 0:
            self.free_queue.remove(block)
        block.ref_cnt += 1

    def release(self, block: KVBlock) -> None:
        """One table fewer holds ``block``; at zero it becomes free but stays cached."""
        if block.ref_cnt <= 0:
            raise RuntimeError(f"double free of {block}")
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            if block.block_hash is None:
                self.free_queue.appendleft(block)
            else:
                self.free_queue.append(block)

    def cache_block(self, block: KVBlock, block_hash: int, token_ids: tuple[int, ...]) -> None:
        """Offer a full, computed block as a reusable prefix (first writer wins)."""
        if not self.enable_prefix_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:
            return
        block.block_hash = block_hash
        block.token_ids = token_ids
        self.cached[block_hash] = block

    def uncache(self, block: KVBlock) -> None:
        """Withdraw a block from the prefix index (its contents are about to change)."""
        self._uncache(block)

    def reset_prefix_cache(self) -> None:
        for block in list(self.cached.values()):
            self._uncache(block)
