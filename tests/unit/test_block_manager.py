"""BlockManager under random operation sequences, checked against a shadow KV memory.

The state machine drives the manager the way the scheduler, the engine and the KV-policy layer
do (admit with a prefix lookup, grow, compute chunks, fork, roll back, compact under a KV cap,
free) and mirrors every K/V write into ``self.kv``: a copy of the physical memory in which slot
``s`` of block ``b`` holds the token prefix whose last token was written there (the K/V of a
token depends on everything before it). That turns the invariants into exact checks:

* no leak, no double free: free blocks + distinct held blocks == num_blocks, the free queue
  holds exactly the ref-0 blocks, each once;
* ref_cnt of every block == number of live block tables holding it (with multiplicity);
* copy-on-write: no write ever lands in a block with ref_cnt > 1;
* the prefix index maps each hash to a block carrying that hash, and a cached block's memory
  is exactly the prefix its hash names, so a prefix hit hands out K/V computed for the very
  tokens of the new sequence (not merely equal block tokens);
* every live sequence reads its own tokens back through its block table;
* ``allocate_slots``/``make_writable`` returning None change nothing;
* after freeing everything the pool is entirely free.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

import keyserve.core.block_manager as bm_mod
from keyserve.core.block_manager import BlockManager, hash_block
from keyserve.core.kv_policy import KVBudget
from keyserve.core.sampling_params import SamplingParams
from keyserve.core.sequence import Sequence

PARAMS = SamplingParams()
BUDGET = KVBudget.create("h2o", 8)
MAX_TOKENS = 24  # per sequence: keeps examples short while spanning several blocks
Slot = tuple[int, ...] | tuple[str, int] | None  # a token prefix, a compaction marker, or empty


def _prefix_chain(tokens: tuple[int, ...], block_size: int, num_blocks: int) -> list[int]:
    """The chained hashes of the first ``num_blocks`` full blocks of ``tokens``."""
    hashes: list[int] = []
    for i in range(num_blocks):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block(parent, tokens[i * block_size : (i + 1) * block_size]))
    return hashes


class BlockManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.bm: BlockManager
        self.kv: dict[int, list[Slot]] = {}
        self.live: list[Sequence] = []
        self.prompts: list[list[int]] = []  # earlier prompts, to build shared prefixes from
        self.counter = 0

    # ------------------------------------------------------------------ helpers
    @property
    def B(self) -> int:
        return self.bm.block_size

    def _pick(self, data: st.DataObject, seqs: list[Sequence]) -> Sequence:
        return seqs[data.draw(st.integers(0, len(seqs) - 1), label="seq")]

    def _snapshot(self, seq: Sequence) -> tuple:
        pool = self.bm.pool
        return (
            [(b.ref_cnt, b.block_hash, b.token_ids) for b in pool.blocks],
            [b.block_id for b in pool.free_queue],
            {h: b.block_id for h, b in pool.cached.items()},
            list(seq.block_table),
            seq.num_computed_tokens,
            seq.num_cached_tokens,
            list(seq.block_hashes),
            seq.kv_slot_cap,
            self.bm.prefix_hits,
        )

    def _slot_of(self, seq: Sequence, t: int) -> int:
        """Where token ``t`` is written: its own slot, or a ring slot once at the KV cap (the
        window policy; any evicted slot is possible in general, the ring is one valid choice)."""
        return t if seq.kv_slot_cap is None or t < seq.kv_slot_cap else t % seq.kv_slot_cap

    def _write(self, block_id: int, offset: int, value: Slot) -> None:
        ref = self.bm.pool.blocks[block_id].ref_cnt
        assert ref == 1, f"write into block {block_id} with ref_cnt {ref} (copy-on-write missed)"
        self.kv[block_id][offset] = value

    def _apply_copies(self, seq: Sequence, copies: list[tuple[int, int]]) -> None:
        for src, dst in copies:
            assert dst in seq.block_table and src not in seq.block_table
            assert self.bm.pool.blocks[src].ref_cnt >= 1, "copied from a freed block"
            assert self.bm.pool.blocks[dst].ref_cnt == 1
            self.kv[dst] = list(self.kv[src])

    def _compute(self, seq: Sequence, n: int, copies: list[tuple[int, int]]) -> None:
        """What the model runner does for a scheduled chunk, then the engine's bookkeeping."""
        self._apply_copies(seq, copies)
        tokens = tuple(seq.token_ids)
        start = seq.num_computed_tokens
        for t in range(start, start + n):
            slot = self._slot_of(seq, t)
            self._write(seq.block_table[slot // self.B], slot % self.B, tokens[: t + 1])
        seq.num_computed_tokens += n
        cached_before = dict(self.bm.pool.cached)
        self.bm.commit_computed(seq)
        if not seq.prefix_cacheable:
            assert self.bm.pool.cached == cached_before, "a budgeted sequence offered blocks"

    def _new_prompt(self, data: st.DataObject) -> list[int]:
        tokens = st.integers(0, 1)
        if self.prompts and data.draw(st.booleans(), label="reuse prefix"):
            base = self.prompts[data.draw(st.integers(0, len(self.prompts) - 1))]
            cut = data.draw(st.integers(0, len(base)))
            suffix = data.draw(st.lists(tokens, min_size=0 if cut else 1, max_size=6))
            prompt = (base[:cut] + suffix)[:MAX_TOKENS - 2]
        else:
            prompt = data.draw(st.lists(tokens, min_size=1, max_size=MAX_TOKENS - 2))
        return prompt

    # -------------------------------------------------------------------- rules
    @initialize(
        block_size=st.sampled_from([1, 2, 4]),
        num_blocks=st.integers(1, 14),
        prefix_caching=st.sampled_from([True, True, True, False]),
    )
    def setup(self, block_size: int, num_blocks: int, prefix_caching: bool) -> None:
        self.bm = BlockManager(num_blocks, block_size, prefix_caching)
        self.kv = {i: [None] * block_size for i in range(num_blocks)}

    @rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        """A waiting request is admitted: prefix lookup, then its first chunk."""
        prompt = self._new_prompt(data)
        self.prompts.append(prompt)
        self.counter += 1
        seq = Sequence(f"r{self.counter}", prompt, PARAMS)
        # The engine gives requests their KV budget: they neither reuse nor offer prefixes.
        seq.kv_budget = data.draw(st.sampled_from([None, None, None, BUDGET]), label="budget")
        cached = self.bm.find_cached_prefix(seq)
        assert not (seq.kv_budgeted and cached), "a budgeted sequence took a cached prefix"
        assert len(cached) * self.B < seq.num_tokens, "a hit must leave a token to compute"
        tokens = tuple(seq.token_ids)
        for i, block in enumerate(cached):
            expect = [tokens[: i * self.B + j + 1] for j in range(self.B)]
            assert self.kv[block.block_id] == expect, "prefix hit with foreign K/V"
        n = data.draw(st.integers(1, seq.num_tokens - len(cached) * self.B), label="chunk")
        before = self._snapshot(seq)
        copies = self.bm.allocate_slots(seq, n, cached)
        if copies is None:
            assert self._snapshot(seq) == before, "failed allocation changed state"
            return
        assert copies == [], "cached blocks are full: nothing of theirs is written"
        assert seq.num_cached_tokens == len(cached) * self.B
        self.live.append(seq)
        self._compute(seq, n, copies)

    @precondition(lambda self: any(s.num_tokens < MAX_TOKENS for s in self.live))
    @rule(data=st.data())
    def append_tokens(self, data: st.DataObject) -> None:
        """A sampled token (or K speculative drafts) joins the sequence, not yet computed."""
        seq = self._pick(data, [s for s in self.live if s.num_tokens < MAX_TOKENS])
        k = data.draw(st.integers(1, min(3, MAX_TOKENS - seq.num_tokens)), label="k")
        for tok in data.draw(st.lists(st.integers(0, 1), min_size=k, max_size=k)):
            seq.append_token(tok)

    @precondition(lambda self: any(s.num_uncomputed_tokens > 0 for s in self.live))
    @rule(data=st.data())
    def compute(self, data: st.DataObject) -> None:
        """A decode step or prefill chunk of a running sequence."""
        seq = self._pick(data, [s for s in self.live if s.num_uncomputed_tokens > 0])
        n = data.draw(st.integers(1, seq.num_uncomputed_tokens), label="n")
        before = self._snapshot(seq)
        need, free = self.bm.blocks_needed(seq, n), self.bm.num_free_blocks
        assert self._snapshot(seq) == before, "blocks_needed changed state"
        copies = self.bm.allocate_slots(seq, n)
        assert (copies is None) == (need > free), "blocks_needed disagrees with allocate_slots"
        if copies is not None:  # what it took: new blocks and copies (each copy frees nothing here)
            assert free - self.bm.num_free_blocks == need
        if copies is None:
            assert self._snapshot(seq) == before, "failed allocation changed state"
            slots_after = seq.kv_slots_for(seq.num_computed_tokens + n)
            new_blocks = max(0, self.bm.blocks_for_slots(slots_after) - len(seq.block_table))
            shared = sum(self.bm.pool.blocks[b].ref_cnt > 1 for b in seq.block_table)
            assert self.bm.num_free_blocks < new_blocks + shared, "refused although it fits"
            return
        self._compute(seq, n, copies)

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        """An n > 1 sibling (or beam) shares everything the parent holds."""
        parent = self._pick(data, self.live)
        child = Sequence(
            parent.request_id,
            list(parent.prompt_token_ids),
            PARAMS,
            sample_index=parent.sample_index + 1,
            output_token_ids=list(parent.output_token_ids),
            kv_budget=parent.kv_budget,  # the engine gives every sample of a request its budget
        )
        refs = [self.bm.pool.blocks[b].ref_cnt for b in parent.block_table]
        free = self.bm.num_free_blocks
        self.bm.fork(parent, child)
        self.live.append(child)
        assert child.block_table == parent.block_table
        assert child.num_computed_tokens == parent.num_computed_tokens
        assert child.kv_slot_cap == parent.kv_slot_cap, "the child inherits the parent's layout"
        assert self.bm.num_free_blocks == free
        counts = Counter(parent.block_table)
        for b, r in zip(parent.block_table, refs):
            assert self.bm.pool.blocks[b].ref_cnt == r + counts[b]

    @precondition(lambda self: any(s.kv_slot_cap is None for s in self.live))
    @rule(data=st.data())
    def rollback(self, data: st.DataObject) -> None:
        """Speculative rejection: keep ``L`` computed tokens, drop rejected output tokens."""
        seq = self._pick(data, [s for s in self.live if s.kv_slot_cap is None])
        keep = data.draw(st.integers(0, seq.num_computed_tokens), label="keep")
        del seq.output_token_ids[max(0, keep - seq.num_prompt_tokens) :]
        self.bm.truncate(seq, keep)
        seq.num_computed_tokens = keep
        assert len(seq.block_table) == self.bm.blocks_for_slots(keep)

    @precondition(lambda self: any(s.kv_slot_cap is None and s.num_computed_tokens for s in self.live))
    @rule(data=st.data())
    def set_kv_cap(self, data: st.DataObject) -> None:
        """The KV-policy layer caps a sequence; above the cap it compacts in place first."""
        seq = self._pick(data, [s for s in self.live if s.kv_slot_cap is None and s.num_computed_tokens])
        cap = data.draw(st.integers(1, seq.num_computed_tokens + 4), label="cap")
        if cap >= seq.num_computed_tokens:
            seq.kv_slot_cap = cap
            return
        keep = self.bm.blocks_for_slots(cap)
        before = self._snapshot(seq)
        copies = self.bm.make_writable(seq, list(range(keep)))
        if copies is None:
            assert self._snapshot(seq) == before, "failed make_writable changed state"
            return
        self._apply_copies(seq, copies)
        for s in range(cap):  # the kept tokens are compacted into slots 0..cap-1
            self._write(seq.block_table[s // self.B], s % self.B, ("compacted", seq.seq_id))
        self.bm.truncate(seq, cap)
        seq.kv_slot_cap = cap

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq = self._pick(data, self.live)
        self.live.remove(seq)
        self.bm.free(seq)
        assert seq.block_table == []

    @precondition(lambda self: bool(self.live))
    @rule()
    def free_all(self) -> None:
        for seq in self.live:
            self.bm.free(seq)
        self.live = []
        self._check_all_free()

    # --------------------------------------------------------------- invariants
    @invariant()
    def refcounts_and_free_queue(self) -> None:
        pool = self.bm.pool
        held = Counter(b for s in self.live for b in s.block_table)
        for block in pool.blocks:
            assert block.ref_cnt == held[block.block_id], f"{block}: held {held[block.block_id]}x"
        queue = [b.block_id for b in pool.free_queue]
        assert len(queue) == len(set(queue)) == len(pool.free_queue), "block freed twice"
        assert set(queue) == {b.block_id for b in pool.blocks if b.ref_cnt == 0}
        assert pool.num_free_blocks + len(held) == pool.num_blocks, "leaked blocks"

    @invariant()
    def prefix_index_is_truthful(self) -> None:
        pool = self.bm.pool
        if not pool.enable_prefix_caching:
            assert pool.cached == {} and all(b.block_hash is None for b in pool.blocks)
            return
        for h, block in pool.cached.items():
            assert block.block_hash == h and block.token_ids is not None
        for block in pool.blocks:
            if block.block_hash is not None:
                assert pool.cached.get(block.block_hash) is block
                # Its memory is one prefix, laid out at its own positions...
                mem = self.kv[block.block_id]
                last = mem[-1]
                assert isinstance(last, tuple) and all(isinstance(t, int) for t in last), (
                    f"{block} is cached but holds {mem}"
                )
                start = len(last) - self.B
                assert start % self.B == 0
                assert mem == [last[: start + j + 1] for j in range(self.B)], (
                    f"{block} is cached but was overwritten: {mem}"
                )
                # ... named exactly by the block's hash and tokens.
                assert block.token_ids == last[start:]
                assert block.block_hash == _prefix_chain(last, self.B, start // self.B + 1)[-1]

    @invariant()
    def sequences_read_their_own_tokens(self) -> None:
        for seq in self.live:
            slots = seq.kv_slots_for(seq.num_computed_tokens)
            assert len(seq.block_table) == self.bm.blocks_for_slots(slots), "blocks not on demand"
            if seq.kv_slot_cap is not None:
                continue  # compacted: which token sits where is the policy's business
            tokens = tuple(seq.token_ids)
            for t in range(seq.num_computed_tokens):
                got = self.kv[seq.block_table[t // self.B]][t % self.B]
                assert got == tokens[: t + 1], f"seq {seq.seq_id} token {t}: {got}"

    def _check_all_free(self) -> None:
        pool = self.bm.pool
        assert pool.num_free_blocks == pool.num_blocks
        assert all(b.ref_cnt == 0 for b in pool.blocks)

    def teardown(self) -> None:
        if not hasattr(self, "bm"):
            return
        for seq in self.live:
            self.bm.free(seq)
        self._check_all_free()


BlockManagerMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestBlockManagerStateMachine = BlockManagerMachine.TestCase


# ------------------------------------------------------------------------ targeted unit tests
def _computed(bm: BlockManager, tokens: list[int], n: int | None = None) -> Sequence:
    """Admit ``tokens`` with a prefix lookup and compute ``n`` (default: all) of them."""
    seq = Sequence("r", list(tokens), PARAMS)
    cached = bm.find_cached_prefix(seq)
    todo = (len(tokens) if n is None else n) - len(cached) * bm.block_size
    assert bm.allocate_slots(seq, todo, cached) is not None
    seq.num_computed_tokens += todo
    bm.commit_computed(seq)
    return seq


def test_prefix_hit_reuses_full_blocks_never_the_last_token() -> None:
    bm = BlockManager(16, 4)
    a = _computed(bm, list(range(12)))
    assert [bm.pool.blocks[b].block_hash is not None for b in a.block_table] == [True] * 3
    # Same 12 tokens: only 2 blocks may be reused (the last token must be computed again).
    b = Sequence("b", list(range(12)), PARAMS)
    hits = bm.find_cached_prefix(b)
    assert [h.block_id for h in hits] == a.block_table[:2]
    # A diverging second block stops the run at the first block.
    c = Sequence("c", [0, 1, 2, 3, 9, 9, 9, 9, 8], PARAMS)
    assert [h.block_id for h in bm.find_cached_prefix(c)] == a.block_table[:1]
    # The same second block after a different first block is not a hit (chained hashes).
    d = Sequence("d", [9, 9, 9, 9, 4, 5, 6, 7, 8], PARAMS)
    assert bm.find_cached_prefix(d) == []


def test_prefix_hit_on_freed_blocks_revives_them() -> None:
    bm = BlockManager(4, 2)
    a = _computed(bm, [1, 2, 3, 4, 5])
    a_blocks = list(a.block_table)
    bm.free(a)
    assert bm.num_free_blocks == 4
    b = _computed(bm, [1, 2, 3, 4, 6])
    assert b.num_cached_tokens == 4 and b.block_table[:2] == a_blocks[:2]
    assert bm.prefix_hits == 4
    assert bm.num_free_blocks == 1


def test_prefix_lookup_verifies_tokens_on_hash_collision(monkeypatch: pytest.MonkeyPatch) -> None:
    """Even if every block hashed alike, a hit needs equal tokens."""
    monkeypatch.setattr(bm_mod, "hash_block", lambda parent, tokens, extra=(): 7)
    bm = BlockManager(8, 2)
    _computed(bm, [1, 2, 3, 4, 5])
    assert bm.find_cached_prefix(Sequence("x", [9, 9, 9], PARAMS)) == []
    assert len(bm.find_cached_prefix(Sequence("y", [1, 2, 0], PARAMS))) == 1


def test_allocation_failure_admits_nothing() -> None:
    bm = BlockManager(3, 2)
    _computed(bm, [1, 2, 3, 4])  # 2 blocks, both cached and held
    seq = Sequence("s", [1, 2, 3, 4, 5, 6, 7, 8, 9], PARAMS)
    hits = bm.find_cached_prefix(seq)
    assert len(hits) == 2
    refs = [h.ref_cnt for h in hits]
    assert bm.allocate_slots(seq, 5, hits) is None  # needs 3 more blocks, 1 free
    assert seq.block_table == [] and seq.num_computed_tokens == 0
    assert [h.ref_cnt for h in hits] == refs and bm.num_free_blocks == 1


def test_fork_then_write_copies_the_partial_block() -> None:
    bm = BlockManager(8, 4)
    parent = _computed(bm, [1, 2, 3, 4, 5, 6])  # blocks: full + partial (2 of 4)
    child = Sequence("r", [1, 2, 3, 4, 5, 6], PARAMS, sample_index=1)
    bm.fork(parent, child)
    parent.append_token(7)
    child.append_token(8)
    copies = bm.allocate_slots(child, 1)
    assert copies == [(parent.block_table[1], child.block_table[1])]
    assert child.block_table[0] == parent.block_table[0]  # the full block stays shared
    assert bm.allocate_slots(parent, 1) == []  # now exclusively the parent's
    assert [bm.pool.blocks[b].ref_cnt for b in parent.block_table] == [2, 1]


def test_fork_block_aligned_needs_no_copy() -> None:
    bm = BlockManager(8, 2)
    parent = _computed(bm, [1, 2, 3, 4])
    child = Sequence("r", [1, 2, 3, 4], PARAMS, sample_index=1)
    bm.fork(parent, child)
    child.append_token(5)
    assert bm.allocate_slots(child, 1) == []
    assert len(child.block_table) == 3 and child.block_table[:2] == parent.block_table


def test_rollback_into_a_cached_block_withdraws_it() -> None:
    """After a rollback the tail block is rewritten with other tokens: it must leave the
    prefix index, or a later request would get K/V of tokens it does not have."""
    bm = BlockManager(8, 4)
    seq = _computed(bm, [1, 2, 3, 4, 5, 6, 7, 8])
    tail = bm.pool.blocks[seq.block_table[1]]
    assert tail.block_hash is not None
    del seq.output_token_ids[:]
    seq.prompt_token_ids[6:] = []  # keep 6 tokens (as if 7, 8 were rejected drafts)
    bm.truncate(seq, 6)
    seq.num_computed_tokens = 6
    seq.append_token(0)
    seq.append_token(0)
    assert bm.allocate_slots(seq, 2) == []
    assert tail.block_hash is None
    other = Sequence("o", [1, 2, 3, 4, 5, 6, 7, 8, 9], PARAMS)
    assert len(bm.find_cached_prefix(other)) == 1  # only the untouched first block


def test_rewritten_block_is_offered_again_once_full() -> None:
    """Each commit offers only the blocks completed since the last one (a watermark), so a
    block rewritten after a rollback must be offered again once it is full again -- with the
    tokens it now holds."""
    bm = BlockManager(8, 4)
    seq = _computed(bm, [1, 2, 3, 4, 5, 6, 7, 8])
    assert seq.num_offered_blocks == 2
    del seq.prompt_token_ids[6:]
    bm.truncate(seq, 6)
    seq.num_computed_tokens = 6
    seq.append_token(9)
    seq.append_token(9)
    assert bm.allocate_slots(seq, 2) == []
    assert seq.num_offered_blocks == 1
    seq.num_computed_tokens = 8
    bm.commit_computed(seq)
    assert bm.pool.blocks[seq.block_table[1]].block_hash is not None
    other = Sequence("o", [1, 2, 3, 4, 5, 6, 9, 9, 1], PARAMS)
    assert len(bm.find_cached_prefix(other)) == 2  # the rewritten block, by its new tokens


def test_commit_offers_each_block_once() -> None:
    """Decoding one token at a time reads a block's tokens only when the block completes: the
    per-step cost of prefix caching does not grow with the sequence."""
    bm = BlockManager(16, 4)
    seq = _computed(bm, [1, 2, 3])
    reads: list[int] = []
    real = bm._block_tokens
    bm._block_tokens = lambda s, i: reads.append(i) or real(s, i)  # type: ignore[method-assign]
    for t in range(20):
        seq.append_token(t)
        assert bm.allocate_slots(seq, 1) is not None
        seq.num_computed_tokens += 1
        bm.commit_computed(seq)
    assert seq.num_offered_blocks == 5
    assert sorted(reads) == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]  # hash + cache, once per block


def test_writes_at_the_kv_cap_withdraw_cached_blocks() -> None:
    """At its cap a sequence overwrites evicted slots anywhere: its cached blocks must leave
    the prefix index (shared ones are copied instead)."""
    bm = BlockManager(8, 2)
    seq = _computed(bm, [1, 2, 3, 4])
    seq.kv_slot_cap = 4
    seq.append_token(5)
    assert bm.allocate_slots(seq, 1) == []
    assert all(bm.pool.blocks[b].block_hash is None for b in seq.block_table)
    assert bm.find_cached_prefix(Sequence("o", [1, 2, 3, 4, 5], PARAMS)) == []


def test_crossing_the_kv_cap_in_one_step_copies_shared_blocks() -> None:
    bm = BlockManager(8, 2)
    parent = _computed(bm, [1, 2, 3])
    parent.kv_slot_cap = 4
    child = Sequence("r", [1, 2, 3], PARAMS, sample_index=1)
    bm.fork(parent, child)
    for t in (4, 5, 6):  # one fresh slot (3), then two overwrites of evicted slots
        child.append_token(t)
    copies = bm.allocate_slots(child, 3)
    assert copies is not None and sorted(s for s, _ in copies) == sorted(parent.block_table)
    assert not set(child.block_table) & set(parent.block_table)


def test_hash_block_is_deterministic_and_chained() -> None:
    h0 = hash_block(None, (1, 2))
    assert h0 == hash_block(None, (1, 2))
    assert h0 != hash_block(None, (2, 1))
    assert hash_block(h0, (3, 4)) != hash_block(None, (3, 4))
    assert hash_block(h0, (3, 4), ("lora-a",)) != hash_block(h0, (3, 4), ("lora-b",))


def test_hash_block_is_the_same_in_every_process() -> None:
    """Ray actors and an on-disk prefix store must agree on a prefix's identity."""
    import subprocess
    import sys

    code = "from keyserve.core.block_manager import hash_block as h; print(h(h(None, (1, 2)), (3,)))"
    outs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        .stdout.strip()
        for _ in range(2)
    }
    assert outs == {str(hash_block(hash_block(None, (1, 2)), (3,)))}


def test_block_size_validation() -> None:
    with pytest.raises(ValueError):
        BlockManager(4, 0)
