"""Continuous batching: which sequences run this step, and how many tokens each.

Each step has a token budget. Running sequences go first, oldest first (a decode costs one
token, an unfinished prompt gets the next chunk); then waiting sequences are admitted in arrival
order while the budget and the block pool allow. When blocks run out, the newest running
sequence is preempted: its blocks are freed and it returns to the head of the queue to be
recomputed later. Because priority is arrival order, the oldest request always makes progress:
nothing starves and nothing deadlocks.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from keyserve.core.block_manager import BlockCopy, BlockManager
from keyserve.core.block_pool import KVBlock
from keyserve.core.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # real tokens this step; K/V of tokens [computed, computed + n)
    num_lookahead: int = 0  # slots reserved for speculative draft tokens after them
    draft_token_ids: list[int] = field(default_factory=list)  # filled by the drafter
    # A score boundary (the prefix store's, ``Scheduler._score_boundary``) inside this step's
    # tokens, as the count of them before it: their scores are kept apart (0: none;
    # ``StepItem.score_split``)
    score_split: int = 0

    @property
    def num_query_tokens(self) -> int:
        """Tokens the target computes this step: the real ones plus the drafts to verify."""
        return self.num_new_tokens + len(self.draft_token_ids)

    @property
    def start(self) -> int:
        return self.seq.num_computed_tokens

    @property
    def completes(self) -> bool:
        """After this step every token is computed, so the last position yields a sample."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class StepPlan:
    decode: list[ScheduledSeq] = field(default_factory=list)  # one query token each
    # Chunks of >= 2 tokens, and speculative verifications (1 + K query tokens).
    prefill: list[ScheduledSeq] = field(default_factory=list)
    blocks_to_copy: list[BlockCopy] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def scheduled(self) -> list[ScheduledSeq]:
        return self.decode + self.prefill

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + sum(s.num_new_tokens + s.num_lookahead for s in self.prefill)

    @property
    def is_empty(self) -> bool:
        return not self.decode and not self.prefill


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 2048  # token budget per step (prefill chunk size limit)
    max_num_seqs: int = 64  # sequences running at once
    enable_chunked_prefill: bool = True


class PrefixLoader(Protocol):
    def load(self, seq: Sequence, cached: list[KVBlock], token_budget: int) -> list[KVBlock]: ...

    def unload(self, seq: Sequence) -> None: ...


def _priority(seq: Sequence) -> tuple[float, int]:
    return (seq.arrival, seq.seq_id)


def _hold_back_last(seq: Sequence, n: int, uncomputed: int) -> int:
    """A step's token count for ``seq``, less its last token when the step would finish a prompt
    of a budget that scores by the newest query only (``KVBudget.last_query_only``): that token
    then runs in a step of its own, and its attention alone scores the prompt before prompt-phase
    selection (TOVA's window), with no kernel returning one row's scores out of a chunk."""
    budget = seq.kv_budget
    if n == uncomputed > 1 and budget is not None and budget.last_query_only:
        return n - 1
    return n


def _split_at(seq: Sequence, n: int, boundary: int | None) -> int:
    """How many of a step's ``n`` tokens of ``seq`` lie before a score boundary it crosses, or 0
    when it crosses none (the prefix store's chunk boundary of a prompt scored by attention: the scores of
    the queries before it are the ones stored with the prefix). The step is not cut there:
    attention runs the two sides as two rows of one forward (``SlotPlanner``), whose scores
    before the boundary are kept apart, so a prompt ending past a boundary costs no extra
    forward (one more step before the first token on every prefix-store hit, else)."""
    done = seq.num_computed_tokens
    return boundary - done if boundary is not None and done < boundary < done + n else 0


def _seats(seq: Sequence) -> int:
    """Seats a sequence will occupy: a first sample that has not produced a token yet will
    fork its n - 1 siblings into the running set."""
    return seq.params.n if seq.sample_index == 0 and not seq.output_token_ids else 1


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # sorted by priority (oldest first)
        self.num_preemptions = 0
        # Attaches a stored prefix (KV loaded into fresh blocks) to a sequence being admitted:
        # ``load(seq, cached_blocks, token_budget) -> cached_blocks`` and ``unload(seq)``.
        self.prefix_loader: PrefixLoader | None = None

    # -------------------------------------------------------------- queueing
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """Insert an already-allocated sequence (a fork of a running one)."""
        seq.status = SequenceStatus.RUNNING
        bisect.insort_right(self.running, seq, key=_priority)  # no key list per insert: n forks were O(n^2)

    def remove(self, seq: Sequence) -> None:
        """Drop a sequence wherever it is (finished or aborted) and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)

    def _score_boundary(self, seq: Sequence) -> int | None:
        boundary = getattr(self.prefix_loader, "score_boundary", None)
        return boundary(seq) if boundary is not None else None

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -------------------------------------------------------------- schedule
    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            uncomputed = len(seq.prompt_token_ids) + len(seq.output_token_ids) - seq.num_computed_tokens
            n = min(uncomputed, budget)
            if n < uncomputed and self._wait_for_whole(uncomputed, n):
                break
            n = _hold_back_last(seq, n, uncomputed)
            if n <= 0:
                i += 1
                continue
            # A decoding sequence may speculate: reserve slots for its draft tokens too.
            ahead = min(seq.num_lookahead, budget - n) if n == uncomputed == 1 and seq.num_lookahead else 0
            while True:
                copies = self.block_manager.allocate_slots(seq, n + ahead, speculative=ahead > 0)
                if copies is not None:
                    if copies:
                        plan.blocks_to_copy += copies
                    scheduled.append(ScheduledSeq(seq, n, ahead if ahead > 0 else 0,
                                                  score_split=_split_at(seq, n, self._score_boundary(seq))))
                    budget -= n + max(ahead, 0)
                    i += 1
                    break
                if ahead > 0:  # no room to speculate: decode plainly before preempting anyone
                    ahead = 0
                    continue
                victim = self.running[-1]
                self._preempt(victim, plan)
                if victim is seq:
                    break
        if not plan.preempted:
            budget = self._admit(plan, scheduled, budget)
        for item in scheduled:
            single = item.num_new_tokens == 1 and not item.num_lookahead
            (plan.decode if single else plan.prefill).append(item)
        return plan

    def _admit(self, plan: StepPlan, scheduled: list[ScheduledSeq], budget: int) -> int:
        if not self.waiting:  # (a decode step: no per-sequence seat count)
            return budget
        bm = self.block_manager
        # Seats taken include the siblings that running first samples will still fork.
        seats = sum(_seats(s) for s in self.running)
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            # A request with n samples forks n - 1 siblings after its prompt: reserve their seats.
            group = _seats(seq)
            if seats + group > self.config.max_num_seqs and self.running:
                break
            cached = bm.find_cached_prefix(seq)
            if self.prefix_loader is not None:  # a stored prefix longer than the pool's hit
                cached = self.prefix_loader.load(seq, cached, budget)
            uncomputed = seq.num_uncomputed_tokens - len(cached) * bm.block_size
            n = min(uncomputed, budget)
            waits = self._wait_for_whole(uncomputed, n)
            n = _hold_back_last(seq, n, uncomputed)
            copies = None if waits else bm.allocate_slots(seq, n, cached)
            if copies is None:
                if self.prefix_loader is not None:
                    self.prefix_loader.unload(seq)
                break  # head of line waits: FCFS keeps admission fair
            bm.note_prefix_query(seq.num_tokens)
            plan.blocks_to_copy += copies
            self.waiting.popleft()
            self.add_running(seq)
            # (after the allocation: a cached prefix it attached counts as computed)
            scheduled.append(ScheduledSeq(seq, n, score_split=_split_at(seq, n, self._score_boundary(seq))))
            budget -= n
            seats += group
        return budget

    def _wait_for_whole(self, uncomputed: int, n: int) -> bool:
        """Without chunked prefill a sequence waits until all its tokens fit one step, unless
        they never can (a recomputation after preemption covers prompt and output): such a
        sequence is chunked anyway, or it would wait forever."""
        return (
            n < uncomputed
            and not self.config.enable_chunked_prefill
            and uncomputed <= self.config.max_num_batched_tokens
        )

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        """Free everything the sequence holds; it will be recomputed from its tokens."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.kv_slot_cap = None  # recomputation starts a fresh prompt phase
        seq.num_lookahead = 0  # and cannot speculate before it is decoding again
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        # Back to the queue in priority order, so the oldest preempted sequence returns first.
        keys = [_priority(s) for s in self.waiting]
        self.waiting.insert(bisect.bisect(keys, _priority(seq)), seq)
        plan.preempted.append(seq)
