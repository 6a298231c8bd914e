"""Block tables on top of the block pool: allocate on demand, prefix hits, fork, copy-on-write.

Every method either succeeds completely or changes nothing (so the scheduler can try an
allocation and preempt when it fails). Copies that copy-on-write requires are returned as
``(src_block_id, dst_block_id)`` pairs for the model runner to execute before the next forward.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Callable

from keyserve.core.block_pool import BlockPool, KVBlock
from keyserve.core.sequence import Sequence

BlockCopy = tuple[int, int]


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...], extra_keys: tuple = ()) -> int:
    """Chained block hash h_i = H(h_{i-1}, tokens_i, extra): equal hashes imply equal prefixes.

    SHA-256, not the builtin ``hash``: the builtin hashes ``None`` by address before Python
    3.12, so chains differed per process (Ray actors, an on-disk prefix store), and its tuple
    hash is not collision resistant. The pool compares a hit's own tokens, but not the tokens
    before them, so only a collision-resistant chain keeps crafted prompts from reading another
    request's K/V (vLLM's CVE-2025-25183)."""
    h = hashlib.sha256()
    h.update(b"-" if parent_hash is None else parent_hash.to_bytes(33, "little", signed=True))
    h.update(struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids))
    h.update(repr(extra_keys).encode())
    return int.from_bytes(h.digest(), "little")


class BlockManager:
    """Owns the mapping from sequences to physical blocks (one pool for all layers)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # tokens found there
        # Called with a sequence about to lose its blocks (finish, abort, preemption) while its
        # KV is still intact: the prefix store's chance to keep it.
        self.on_free: Callable[[Sequence], None] | None = None

    # ----------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def blocks_for_slots(self, num_slots: int) -> int:
        return -(-num_slots // self.block_size)

    def _block_tokens(self, seq: Sequence, index: int) -> tuple[int, ...]:
        start = index * self.block_size
        return tuple(seq.token_at(i) for i in range(start, start + self.block_size))

    def _chain_hashes(self, seq: Sequence, num_full_blocks: int) -> list[int]:
        """``seq.block_hashes``, extended to at least the first ``num_full_blocks`` full blocks
        (it may hold more: read only the first ``num_full_blocks``)."""
        hashes = seq.block_hashes
        while len(hashes) < num_full_blocks:
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, self._block_tokens(seq, len(hashes))))
        return hashes

    def find_cached_prefix(self, seq: Sequence) -> list[KVBlock]:
        """The longest run of leading full blocks already cached, never the whole sequence
        (at least one token must be computed to produce logits)."""
        if not self.pool.enable_prefix_caching or seq.block_table or not seq.reuses_prefixes:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for i, block_hash in enumerate(self._chain_hashes(seq, max_blocks)[:max_blocks]):
            block = self.pool.lookup(block_hash, self._block_tokens(seq, i))
            if block is None:
                break
            hits.append(block)
        return hits

    # ------------------------------------------------------------- allocation
    def allocate_slots(
        self,
        seq: Sequence,
        num_new_tokens: int,
        cached_prefix: list[KVBlock] | None = None,
        speculative: bool = False,
    ) -> list[BlockCopy] | None:
        """Make room for ``num_new_tokens`` more computed tokens (after taking ``cached_prefix``
        hits, for a sequence being admitted). Returns the copy-on-write copies, or None, with
        nothing changed, when the pool is too small.

        ``speculative``: the tokens include drafts to verify. A sequence under a KV budget then
        writes all of them into spare slots past the ones it holds (evictions wait for the
        verdict, docs/algorithms.md §3), and the settling that follows may move tokens into any
        of its blocks, so every held block must be writable."""
        if not cached_prefix and not speculative and num_new_tokens == 1 and seq.kv_slot_cap is None:
            # A decode step (most calls): the new slot lies in a private, unhashed last block
            # -- nothing to allocate, copy or withdraw. Anything else takes the general path.
            computed, table = seq.num_computed_tokens, seq.block_table
            if computed < len(table) * self.block_size:
                block = self.pool.blocks[table[computed // self.block_size]]
                if block.ref_cnt == 1 and block.block_hash is None:
                    return []
        cached_prefix = cached_prefix or []
        if cached_prefix and seq.block_table:
            raise ValueError("a cached prefix can only be attached to a sequence without blocks")
        num_cached_tokens = len(cached_prefix) * self.block_size
        computed = seq.num_computed_tokens + num_cached_tokens
        new_blocks, written, cow = self._growth(seq, num_new_tokens, len(cached_prefix), speculative)
        # Cached blocks with ref 0 sit in the free queue; acquiring them shrinks it.
        revived = sum(1 for b in cached_prefix if b.ref_cnt == 0)
        if new_blocks + len(cow) > self.pool.num_free_blocks - revived:
            return None
        for block in cached_prefix:
            self.pool.acquire(block)
            seq.block_table.append(block.block_id)
        if cached_prefix:
            seq.num_computed_tokens = computed
            seq.num_cached_tokens = num_cached_tokens
            self.prefix_hits += num_cached_tokens
        copies = [self._copy_on_write(seq, index) for index in cow]
        # A block rewritten in place (the tail after a rollback into a block that had been
        # full, any block once past the cap) no longer holds what its hash names.
        for index in written:
            self.pool.uncache(self.pool.blocks[seq.block_table[index]])
        if written:
            seq.num_offered_blocks = min(seq.num_offered_blocks, written[0])
        for _ in range(new_blocks):
            seq.block_table.append(self.pool.allocate().block_id)
        return copies

    def blocks_needed(self, seq: Sequence, num_new_tokens: int, speculative: bool = False) -> int:
        """Free blocks ``allocate_slots(seq, num_new_tokens, speculative=...)`` would take now
        (new blocks and copy-on-write copies), changing nothing: what a step can ask of the pool
        before it is planned (``KVCore``'s multi-step rounds)."""
        new_blocks, _, cow = self._growth(seq, num_new_tokens, 0, speculative)
        return new_blocks + len(cow)

    def _growth(
        self, seq: Sequence, num_new_tokens: int, num_cached_blocks: int, speculative: bool
    ) -> tuple[int, list[int], list[int]]:
        """For ``num_new_tokens`` more computed tokens after ``num_cached_blocks`` prefix hits:
        the blocks to append, the indices of held blocks the writes touch, and those of them to
        copy first (shared)."""
        computed = seq.num_computed_tokens + num_cached_blocks * self.block_size
        slots_now = seq.kv_slots_for(computed)
        spare = speculative and seq.kv_slot_cap is not None
        slots_after = slots_now + num_new_tokens if spare else seq.kv_slots_for(computed + num_new_tokens)
        held = len(seq.block_table) + num_cached_blocks
        new_blocks = max(0, self.blocks_for_slots(slots_after) - held)
        # The first slot written lies in the current last block if that block is partly filled
        # (or, under a KV budget, anywhere among the held blocks): copy it first if it is shared.
        cap = seq.kv_slot_cap
        writes_past_cap = cap is not None and (spare or computed + num_new_tokens > cap)
        written = self._blocks_written(seq, slots_now, slots_after, writes_past_cap)
        cow = [i for i in written if self.pool.blocks[seq.block_table[i]].ref_cnt > 1]
        return new_blocks, written, cow

    def grow_to(self, seq: Sequence, num_slots: int) -> bool:
        """Hold blocks for at least ``num_slots`` slots, appending fresh ones; all or nothing.
        For a private sequence whose slot count is decided outside the token count (a draft
        mirror under a KV budget: k kept slots plus spare slots for speculative tokens)."""
        need = self.blocks_for_slots(num_slots) - len(seq.block_table)
        if need > self.pool.num_free_blocks:
            return False
        for _ in range(max(0, need)):
            seq.block_table.append(self.pool.allocate().block_id)
        return True

    def _blocks_written(
        self, seq: Sequence, slots_now: int, slots_after: int, writes_past_cap: bool
    ) -> list[int]:
        """Indices in the block table of held blocks that the next writes touch."""
        if writes_past_cap:
            # Any token beyond its budget goes into an evicted slot anywhere in its blocks
            # (also when the step starts below the cap and crosses it).
            indices = range(len(seq.block_table))
        else:
            first = slots_now // self.block_size
            last = min(self.blocks_for_slots(slots_after), len(seq.block_table))
            indices = range(first, last)
        return list(indices)

    def _copy_on_write(self, seq: Sequence, index: int) -> BlockCopy:
        old = self.pool.blocks[seq.block_table[index]]
        new = self.pool.allocate()
        self.pool.release(old)
        seq.block_table[index] = new.block_id
        return (old.block_id, new.block_id)

    def make_writable(self, seq: Sequence, block_indices: list[int]) -> list[BlockCopy] | None:
        """Copy-on-write for in-place edits of held blocks (KV-budget compaction); also
        withdraws the sequence's own blocks from the prefix index. None if the pool is short."""
        shared = [i for i in block_indices if self.pool.blocks[seq.block_table[i]].ref_cnt > 1]
        if len(shared) > self.pool.num_free_blocks:
            return None
        copies = [self._copy_on_write(seq, i) for i in shared]
        for i in block_indices:
            self.pool.uncache(self.pool.blocks[seq.block_table[i]])
        if block_indices:
            seq.num_offered_blocks = min(seq.num_offered_blocks, min(block_indices))
        return copies

    def commit_computed(self, seq: Sequence) -> None:
        """Offer the sequence's full blocks completed since the last offer to the prefix cache
        (a block whose content is already cached under another id stays private)."""
        if not self.pool.enable_prefix_caching or not seq.prefix_cacheable:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if num_full <= seq.num_offered_blocks:
            return
        hashes = self._chain_hashes(seq, num_full)
        for i in range(seq.num_offered_blocks, num_full):
            block = self.pool.blocks[seq.block_table[i]]
            if block.block_hash is None:
                self.pool.cache_block(block, hashes[i], self._block_tokens(seq, i))
        seq.num_offered_blocks = num_full

    def note_prefix_query(self, num_tokens: int) -> None:
        self.prefix_queries += num_tokens

    # ------------------------------------------------------------ sharing/free
    def fork(self, parent: Sequence, child: Sequence) -> None:
        """``child`` shares all of ``parent``'s blocks; the first write into a shared block
        copies it."""
        if child.block_table:
            raise ValueError("fork target already holds blocks")
        for block_id in parent.block_table:
            self.pool.acquire(self.pool.blocks[block_id])
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_offered_blocks = parent.num_offered_blocks
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_cached_tokens = parent.num_cached_tokens
        # The shared blocks are laid out under the parent's cap (compacted, ring slots): the
        # child must size and copy-on-write its writes by the same cap.
        child.kv_slot_cap = parent.kv_slot_cap

    def truncate(self, seq: Sequence, num_slots: int) -> None:
        """Keep only the blocks that hold the first ``num_slots`` slots (speculative rollback,
        KV-budget compaction)."""
        keep = self.blocks_for_slots(num_slots)
        while len(seq.block_table) > keep:
            self.pool.release(self.pool.blocks[seq.block_table.pop()])
        num_full = num_slots // self.block_size
        if len(seq.block_hashes) > num_full:
            del seq.block_hashes[num_full:]
        seq.num_offered_blocks = min(seq.num_offered_blocks, num_full)

    def free(self, seq: Sequence) -> None:
        """Release all of a sequence's blocks, tail first so the tail is evicted first."""
        if self.on_free is not None and seq.block_table:
            self.on_free(seq)
        for block_id in reversed(seq.block_table):
            self.pool.release(self.pool.blocks[block_id])
        seq.block_table = []
        seq.num_offered_blocks = 0

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()
