"""BlockPool and FreeBlockQueue: the physical layer under the block manager.

These pin down the behaviours prefix caching relies on: O(1) removal of a cached free block
from the middle of the LRU queue, the order in which free blocks are reused (blocks holding
nothing worth caching first, cached blocks least-recently-freed first), hash hits verified by
tokens, and reallocation forgetting a block's cached identity.
"""

from __future__ import annotations

import pytest

from keyserve.core.block_pool import BlockPool, FreeBlockQueue, KVBlock


def _ids(queue: FreeBlockQueue) -> list[int]:
    return [b.block_id for b in queue]


def _walk_back(queue: FreeBlockQueue) -> list[int]:
    """The queue read tail to head through ``prev_free``: both link directions must agree."""
    out = []
    node = queue._tail.prev_free
    while node is not None and node is not queue._head:
        out.append(node.block_id)
        node = node.prev_free
    return out[::-1]


# ----------------------------------------------------------------------------- FreeBlockQueue
def test_queue_fifo_order_and_len() -> None:
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert len(q) == 5 and _ids(q) == [0, 1, 2, 3, 4] == _walk_back(q)
    assert q.popleft().block_id == 0
    assert q.popleft().block_id == 1
    assert len(q) == 3 and _ids(q) == [2, 3, 4] == _walk_back(q)


@pytest.mark.parametrize("victim", [0, 2, 4])
def test_queue_remove_head_middle_tail(victim: int) -> None:
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[victim])
    expected = [i for i in range(5) if i != victim]
    assert _ids(q) == expected == _walk_back(q)
    assert len(q) == 4
    assert blocks[victim].prev_free is None and blocks[victim].next_free is None


class _CountingBlock(KVBlock):
    """A block that counts how often any block's links are read."""

    reads = 0

    def __getattribute__(self, name: str):  # noqa: ANN204
        if name in ("prev_free", "next_free"):
            type(self).reads += 1
        return object.__getattribute__(self, name)


@pytest.mark.parametrize("n", [10, 10_000])
def test_queue_remove_is_constant_time(n: int) -> None:
    """Removing from the middle touches only the block and its two neighbours, however long
    the queue (counted link reads, not timed, so the check is deterministic)."""
    blocks = [_CountingBlock(i) for i in range(n)]
    q = FreeBlockQueue(blocks)
    _CountingBlock.reads = 0
    q.remove(blocks[n // 2])
    assert _CountingBlock.reads <= 4
    assert len(q) == n - 1


def test_queue_append_appendleft() -> None:
    blocks = [KVBlock(i) for i in range(4)]
    q = FreeBlockQueue([blocks[0]])
    q.append(blocks[1])
    q.appendleft(blocks[2])
    q.append(blocks[3])
    assert _ids(q) == [2, 0, 1, 3] == _walk_back(q)


def test_queue_rejects_double_insert_and_foreign_remove() -> None:
    blocks = [KVBlock(i) for i in range(3)]
    q = FreeBlockQueue(blocks[:2])
    with pytest.raises(ValueError):
        q.append(blocks[0])
    with pytest.raises(ValueError):
        q.appendleft(blocks[1])
    with pytest.raises(ValueError):
        q.remove(blocks[2])
    assert _ids(q) == [0, 1] and len(q) == 2


def test_queue_popleft_empty() -> None:
    q = FreeBlockQueue([])
    with pytest.raises(IndexError):
        q.popleft()


# --------------------------------------------------------------------------------- BlockPool
def test_pool_rejects_empty() -> None:
    with pytest.raises(ValueError):
        BlockPool(0)


def test_allocate_release_roundtrip() -> None:
    pool = BlockPool(3)
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    assert [a.ref_cnt, b.ref_cnt, c.ref_cnt] == [1, 1, 1]
    assert pool.num_free_blocks == 0 and pool.usage == 1.0
    with pytest.raises(IndexError):
        pool.allocate()
    for blk in (a, b, c):
        pool.release(blk)
    assert pool.num_free_blocks == 3 and pool.usage == 0.0


def test_double_free_raises_and_changes_nothing() -> None:
    pool = BlockPool(2)
    blk = pool.allocate()
    pool.release(blk)
    before = _ids(pool.free_queue)
    with pytest.raises(RuntimeError, match="double free"):
        pool.release(blk)
    assert _ids(pool.free_queue) == before and blk.ref_cnt == 0


def test_lru_order_hashless_reused_first_cached_last() -> None:
    """A freed block without a hash goes to the head (nothing to lose); a cached one to the
    tail, so among cached blocks the least recently freed is evicted first."""
    pool = BlockPool(4)
    blocks = [pool.allocate() for _ in range(4)]
    pool.cache_block(blocks[0], 100, (0,))
    pool.cache_block(blocks[1], 101, (1,))
    # Free order: cached 1, hashless 2, cached 0, hashless 3.
    for i in (1, 2, 0, 3):
        pool.release(blocks[i])
    assert _ids(pool.free_queue) == [3, 2, 1, 0]
    # Reuse takes the hashless blocks (most recently freed first), then cached block 1
    # (freed before block 0), and only then block 0.
    order = [pool.allocate().block_id for _ in range(4)]
    assert order == [3, 2, 1, 0]


def test_cached_block_survives_free_until_reallocated() -> None:
    pool = BlockPool(2)
    blk = pool.allocate()
    pool.cache_block(blk, 7, (1, 2))
    pool.release(blk)
    assert pool.lookup(7, (1, 2)) is blk  # still findable while free
    other = pool.allocate()  # the hashless block goes first
    assert other is not blk and pool.lookup(7, (1, 2)) is blk
    pool.release(other)


def test_acquire_revives_cached_free_block_from_middle() -> None:
    pool = BlockPool(4)
    blocks = [pool.allocate() for _ in range(4)]
    for i, blk in enumerate(blocks):
        pool.cache_block(blk, 10 + i, (i,))
        pool.release(blk)
    assert _ids(pool.free_queue) == [0, 1, 2, 3]
    hit = pool.lookup(12, (2,))
    assert hit is blocks[2]
    pool.acquire(hit)
    assert hit.ref_cnt == 1 and hit.block_hash == 12
    assert _ids(pool.free_queue) == [0, 1, 3] == _walk_back(pool.free_queue)
    assert pool.num_free_blocks == 3
    # Acquiring a held block only bumps its count.
    pool.acquire(hit)
    assert hit.ref_cnt == 2 and pool.num_free_blocks == 3
    pool.release(hit)
    pool.release(hit)
    assert _ids(pool.free_queue) == [0, 1, 3, 2]  # back at the tail: most recently freed


def test_hash_collision_with_different_tokens_is_a_miss() -> None:
    pool = BlockPool(2)
    blk = pool.allocate()
    pool.cache_block(blk, 42, (1, 2, 3))
    assert pool.lookup(42, (1, 2, 3)) is blk
    assert pool.lookup(42, (1, 2, 4)) is None
    assert pool.lookup(42, (1, 2)) is None
    assert pool.lookup(43, (1, 2, 3)) is None


def test_cache_block_first_writer_wins() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(), pool.allocate()
    pool.cache_block(a, 5, (9,))
    pool.cache_block(b, 5, (9,))  # same content computed twice: the index keeps the first
    assert pool.cached[5] is a and b.block_hash is None
    pool.cache_block(a, 6, (8,))  # a block already cached is never re-keyed
    assert a.block_hash == 5 and 6 not in pool.cached


def test_allocate_forgets_old_hash() -> None:
    pool = BlockPool(1)
    blk = pool.allocate()
    pool.cache_block(blk, 99, (4, 5))
    pool.release(blk)
    again = pool.allocate()
    assert again is blk
    assert again.block_hash is None and again.token_ids is None
    assert 99 not in pool.cached and pool.lookup(99, (4, 5)) is None


def test_uncache_only_removes_own_entry() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(), pool.allocate()
    pool.cache_block(a, 1, (1,))
    b.block_hash = 1  # a stale hash on another block must not evict a's entry
    pool.uncache(b)
    assert pool.cached[1] is a and b.block_hash is None
    pool.uncache(a)
    assert pool.cached == {} and a.block_hash is None and a.token_ids is None


def test_prefix_caching_disabled() -> None:
    pool = BlockPool(2, enable_prefix_caching=False)
    blk = pool.allocate()
    pool.cache_block(blk, 1, (1,))
    assert pool.cached == {} and blk.block_hash is None and pool.lookup(1, (1,)) is None


def test_reset_prefix_cache() -> None:
    pool = BlockPool(3)
    blocks = [pool.allocate() for _ in range(3)]
    for i, blk in enumerate(blocks):
        pool.cache_block(blk, i, (i,))
    pool.release(blocks[0])
    pool.reset_prefix_cache()
    assert pool.cached == {} and all(b.block_hash is None for b in blocks)
    assert blocks[1].ref_cnt == 1 and pool.num_free_blocks == 1
