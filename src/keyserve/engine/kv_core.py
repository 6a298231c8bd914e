"""The scheduler side of the engine: sequences, block tables, scheduling, and what follows a step.

``KVCore`` is the single owner of KV allocation for the target model: the block manager (block
tables, ref counts, copy-on-write), the prefix-cache index, continuous batching and the
block-level half of KV budgets (``kv_budget.compaction``: compaction frees blocks here; which
tokens to keep is decided on the model side, per rank). Per step it is asked once for a
``StepInput`` (``schedule``) and told once what the step produced (``commit``); in between it
holds the step in flight. Every call answers with a ``CoreReply``. The in-process engine calls
it directly; the KV-block manager actor wraps it unchanged.

It never sees text: stop conditions are checked by the engine, which commits the step's output
as they left it (``StepOutput``: the tokens each sequence kept, which ones finished).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from keyserve.core.block_manager import BlockManager
from keyserve.core.prompt_logprobs import prompt_logprob_rows
from keyserve.core.scheduler import ScheduledSeq, Scheduler, SchedulerConfig, StepPlan
from keyserve.core.sequence import FinishReason, Sequence, SequenceStatus
from keyserve.engine.kv_budget.compaction import plan_prompt_compaction, settle_op
from keyserve.engine.stats import CoreStats
from keyserve.engine.step_input import ForkOp, ReleaseOp, RetainOp, RunnerOp, SeqInfo, StepInput, StepItem, StepOutput



class SeqStat(NamedTuple):
    """Scheduler-side facts the engine reports in request statistics."""

    num_blocks: int
    num_preemptions: int
    num_cached_tokens: int
    num_computed_tokens: int


@dataclass
class CoreReply:
    """What the KV core answers to ``schedule``, ``commit`` and ``finish``."""

    step: StepInput | None = None  # ``schedule``: the next step (None: nothing to run)
    ops: list[RunnerOp] = field(default_factory=list)  # for the model side, in order
    seq_stats: dict[int, SeqStat] = field(default_factory=dict)  # sequences it changed


@dataclass
class _InFlight:
    plan: StepPlan
    targets: dict[int, list[Sequence]]  # seq_id -> sequences sampled from its last row
    forced: set[int]  # seq_ids whose token is teacher-forced
    bases: dict[int, int]  # seq_id -> output tokens it had when scheduled (what commit appends to)


class KVCore:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        scheduler_config: SchedulerConfig,
        max_model_len: int,
    ) -> None:
        self.block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.scheduler = Scheduler(scheduler_config, self.block_manager)
        self.max_model_len = max_model_len
        self.seqs: dict[int, Sequence] = {}
        self.pending: dict[int, list[Sequence]] = {}  # parent seq_id -> siblings not yet forked
        # sibling seq_id -> its parent's, from ``add`` until the sibling finishes: ``_finish``
        # finds an aborted sibling's list at once (a scan of every list was 0.3 ms a finish
        # with 320 requests of n = 64 queued, most of a 20k-sample test's engine time).
        self.pending_parent: dict[int, int] = {}
        self.forced: dict[int, list[int]] = {}  # seq_id -> teacher-forced output tokens
        self.known: set[int] = set()  # sequences whose SeqInfo the model side holds
        self.inflight: _InFlight | None = None
        self.num_steps = 0
        self._lookahead_set = False  # some running sequence may hold a nonzero num_lookahead
        # The prefix store: told of a budgeted prompt just computed, before it is compacted.
        self.prefix_hook: object | None = None

    # -------------------------------------------------------------- requests
    def add(
        self, seqs: list[Sequence], pending: list[Sequence] | None = None, forced: list[int] | None = None
    ) -> None:
        """Queue a request's sequences (their KV budget already resolved: ``Sequence.kv_budget``);
        ``pending`` siblings fork from ``seqs[0]`` once its prompt is computed. Also how a
        rebuilt core gets unfinished work back."""
        for seq in seqs + list(pending or []):
            self.seqs[seq.seq_id] = seq
        if pending:
            self.pending[seqs[0].seq_id] = list(pending)
            for sibling in pending:
                self.pending_parent[sibling.seq_id] = seqs[0].seq_id
        if forced is not None:
            self.forced[seqs[0].seq_id] = list(forced)
        for seq in seqs:
            self.scheduler.add(seq)

    def finish(self, seq_id: int, reason: FinishReason) -> CoreReply:
        """End a sequence outside a step (abort); frees its blocks."""
        result = CoreReply()
        seq = self.seqs.get(seq_id)
        if seq is not None:
            self._finish(seq, reason, result.ops)
            result.seq_stats[seq_id] = self._stat(seq)
        return result

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def stats(self) -> CoreStats:
        """The counts the engine reports (``EngineStats``)."""
        bm, s = self.block_manager, self.scheduler
        return CoreStats(
            bm.num_blocks, bm.num_free_blocks, bm.block_size, bm.prefix_queries, bm.prefix_hits,
            s.num_preemptions, len({seq.request_id for seq in s.running}), len(s.running), len(s.waiting),
        )

    def waiting_request_ids(self) -> list[str]:
        """Requests with a sequence waiting to be admitted, in queue order."""
        return list(dict.fromkeys(seq.request_id for seq in self.scheduler.waiting))

    # -------------------------------------------------------------- schedule
    def schedule(self, lookahead: dict[int, int] | None = None, multi_step: bool = False) -> CoreReply:
        """The next step's input (or None) and the stats of sequences it preempted.
        ``lookahead``: seq_id -> draft tokens to reserve KV for (the engine's
        ``SpeculativeDecoder.lookaheads``; None = no speculation this step). Only a decoding
        sequence gets them, and under a KV budget only once its prompt-phase selection is done.
        ``multi_step``: the lookahead is extra decode steps the model side runs itself
        (``core/multi_step.py``), not slots for drafts."""
        if multi_step and lookahead and not self._round_fits(lookahead):
            lookahead, multi_step = None, False  # a plain step, as with one step per round
        if lookahead is None:  # no speculation this step (the common case: no per-sequence work)
            if self._lookahead_set:
                for seq in self.scheduler.running:
                    seq.num_lookahead = 0
                self._lookahead_set = False
        else:
            for seq in self.scheduler.running:
                decoding = seq.num_uncomputed_tokens == 1
                selecting = seq.kv_budgeted and seq.kv_slot_cap is None
                seq.num_lookahead = lookahead.get(seq.seq_id, 0) if decoding and not selecting else 0
            self._lookahead_set = True
        plan = self.scheduler.schedule()
        stats = {s.seq_id: self._stat(s) for s in plan.preempted}
        if plan.is_empty:
            return CoreReply(None, seq_stats=stats)
        flight = _InFlight(plan, {}, set(), {})
        items = []
        infos: dict[int, SeqInfo] = {}
        known = self.known
        for scheduled in plan.scheduled:
            seq = scheduled.seq
            seq_id, outputs = seq.seq_id, seq.output_token_ids
            completes = scheduled.completes
            forced = self.forced.get(seq_id) if self.forced else None
            targets = None
            if completes and forced is not None:
                item = _item(scheduled, forced_token_id=forced[len(outputs)])
                flight.forced.add(seq_id)
            elif completes:
                targets = [seq]
                if seq.sample_index == 0 and not outputs:
                    targets += self.pending.get(seq_id, [])
                flight.targets[seq_id] = targets
                item = _item(scheduled, sample_seq_ids=[t.seq_id for t in targets])
            else:
                item = _item(scheduled)
            if multi_step and scheduled.num_lookahead:
                item.decode_rows = True  # its first token is a decode row, as are the next ones
            if seq.params.prompt_logprobs is not None and seq.sample_index == 0:
                _ask_prompt_logprobs(item, seq)
            items.append(item)
            flight.bases[seq_id] = len(outputs)  # siblings: none (not in bases)
            if seq_id not in known:
                infos[seq_id] = SeqInfo(seq.params, seq.sample_index)
                known.add(seq_id)
            for s in targets[1:] if targets else ():
                if s.seq_id not in known:
                    infos[s.seq_id] = SeqInfo(s.params, s.sample_index)
                    known.add(s.seq_id)
        self.inflight = flight
        step = StepInput(items, len(plan.decode), list(plan.blocks_to_copy), infos, step=self.num_steps,
                         multi_step=multi_step)
        self.num_steps += 1
        return CoreReply(step, seq_stats=stats)

    def _round_fits(self, lookahead: dict[int, int]) -> bool:
        """Whether the free blocks hold what every running sequence's next token and its
        round's extra ones take (``BlockManager.blocks_needed``, the count the scheduler's
        ``allocate_slots`` makes). The scheduler reserves a sequence's extra slots before it
        reaches the next ones: a round that took the last blocks would preempt a sequence that
        one step would not."""
        bm = self.block_manager
        need = sum(bm.blocks_needed(seq, 1 + lookahead.get(seq.seq_id, 0), speculative=seq.seq_id in lookahead)
                   for seq in self.scheduler.running)
        return need <= bm.num_free_blocks

    # ---------------------------------------------------------------- commit
    def commit(self, out: StepOutput) -> CoreReply:
        """Apply the step in flight as the engine's stop checks left its output (``tokens``
        kept per sequence, ``finished``, ``num_accepted``): computed tokens, rollback of
        rejected drafts, forks of siblings, appended tokens, finished sequences, prompt
        compaction under KV budgets. A scheduled sequence absent from ``out.tokens`` emitted
        nothing (a prompt chunk, or its request failed in the step)."""
        flight, self.inflight = self.inflight, None
        result = CoreReply()
        if flight is None:
            return result
        bm = self.block_manager
        ops = result.ops
        plan = flight.plan
        emitted, accepted = out.tokens, out.num_accepted
        for item in plan.scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
            bm.commit_computed(item.seq)
            if self.prefix_hook is not None:
                self.prefix_hook.on_computed(item.seq)  # type: ignore[attr-defined]
        live = [it for it in plan.scheduled if it.seq.seq_id in emitted and it.seq.seq_id in self.seqs]
        for item in live:
            seq = item.seq
            if seq.seq_id not in accepted:
                if item.num_lookahead and seq.kv_slot_cap is not None:
                    bm.truncate(seq, seq.kv_slots_for(seq.num_computed_tokens))  # unused spare
                continue
            seq.num_computed_tokens += accepted[seq.seq_id]  # the accepted drafts' KV is valid
            if seq.kv_slot_cap is not None:  # budgeted: settled before the spare blocks go below
                ops.append(settle_op(seq))
            bm.truncate(seq, seq.kv_slots_for(seq.num_computed_tokens))  # drop rejected slots
            if not self._apply(seq, flight.bases[seq.seq_id], out, ops):
                bm.commit_computed(seq)
        if flight.forced:
            forced = [it.seq for it in live if it.seq.seq_id in flight.forced]
            for seq in forced:
                self._apply(seq, flight.bases[seq.seq_id], out, ops)
            plan_prompt_compaction(bm, forced, ops, self.prefix_hook)
        sampled: list[Sequence] = []
        for item in live:
            source = item.seq
            targets = flight.targets.get(source.seq_id)
            if targets is None or source.seq_id in accepted:
                continue
            if len(targets) == 1:  # one sample: no siblings to fork
                if self.pending:
                    self.pending.pop(source.seq_id, None)
                self._apply(source, flight.bases[source.seq_id], out, ops)
                sampled.append(source)
                continue
            # Siblings fork from the computed prompt before any token can finish (and free) it.
            # A budgeted prompt is compacted first, while its blocks are private: the siblings
            # share the k kept slots. Compacted after the fork, each sibling had to copy shared
            # blocks, and where the pool could not, compaction waited for a later step -- whose
            # decode scores then chose other tokens than the request chooses alone.
            plan_prompt_compaction(bm, [source], ops, self.prefix_hook)
            for target in targets[1:]:
                bm.fork(source, target)
                ops.append(ForkOp(source.seq_id, target.seq_id))
                self.pending[source.seq_id].remove(target)
                self.scheduler.add_running(target)
            self.pending.pop(source.seq_id, None)
            for target in targets:
                if target.seq_id in emitted:
                    self._apply(target, flight.bases.get(target.seq_id, 0), out, ops)
            sampled += targets
        plan_prompt_compaction(bm, sampled, ops, self.prefix_hook)
        stats = result.seq_stats
        for item in plan.scheduled:
            seq = item.seq
            stats[seq.seq_id] = SeqStat(len(seq.block_table), seq.num_preemptions,
                                        seq.num_cached_tokens, seq.num_computed_tokens)
        for seq in sampled:  # forked siblings (their sources are reported above)
            if seq.seq_id not in stats:
                stats[seq.seq_id] = self._stat(seq)
        return result

    def _apply(self, seq: Sequence, base: int, out: StepOutput, ops: list[RunnerOp]) -> bool:
        """Append the sequence's kept tokens to its ``base`` output tokens (already there when
        the engine shares the object); finish it if the step did. True if it finished."""
        tokens = out.tokens[seq.seq_id]
        have = len(seq.output_token_ids)
        if have == base:
            seq.output_token_ids.extend(tokens)
        elif have != base + len(tokens):
            raise RuntimeError(f"sequence {seq.seq_id}: {have} output tokens, the step expects {base}")
        reason = out.finished.get(seq.seq_id)
        if reason is not None:
            self._finish(seq, reason, ops)
            return True
        return False

    def _finish(self, seq: Sequence, reason: FinishReason, ops: list[RunnerOp]) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = seq.finish_reason or reason
        self.scheduler.remove(seq)
        ops.append(ReleaseOp(seq.seq_id))
        self.seqs.pop(seq.seq_id, None)
        self.forced.pop(seq.seq_id, None)
        self.known.discard(seq.seq_id)
        parent = self.pending_parent.pop(seq.seq_id, None)  # an unforked sibling (aborted)
        siblings = self.pending.get(parent) if parent is not None else None
        if siblings is not None and seq in siblings:
            siblings.remove(seq)
        self.pending.pop(seq.seq_id, None)

    def _stat(self, seq: Sequence) -> SeqStat:
        return SeqStat(len(seq.block_table), seq.num_preemptions, seq.num_cached_tokens, seq.num_computed_tokens)

    # -------------------------------------------------------------- recovery
    def reset_model_side(self) -> list[RunnerOp]:
        """The model side lost its KV (a shard was replaced): drop the step in flight,
        recompute every running sequence from its tokens, forget cached prefixes."""
        self.inflight = None
        for seq in list(self.scheduler.running):
            self.scheduler._preempt(seq, StepPlan())  # frees its blocks; recomputed later
        self.block_manager.reset_prefix_cache()
        self.known.clear()
        return [RetainOp(sorted(self.seqs))]

    def check_consistent(self) -> None:
        """Block accounting: every held reference belongs to a live sequence."""
        bm = self.block_manager
        refs: dict[int, int] = {}
        for seq in self.seqs.values():
            for block_id in seq.block_table:
                refs[block_id] = refs.get(block_id, 0) + 1
        for block in bm.pool.blocks:
            if block.ref_cnt != refs.get(block.block_id, 0):
                raise AssertionError(f"block {block.block_id}: ref {block.ref_cnt} != {refs.get(block.block_id, 0)}")
        held = len(refs)
        if bm.num_free_blocks != bm.num_blocks - held:
            raise AssertionError(f"{bm.num_free_blocks} free blocks, expected {bm.num_blocks - held}")


def _ask_prompt_logprobs(item: StepItem, seq: Sequence) -> None:
    """Mark the rows of a prompt chunk whose log-probabilities the request asked for (again
    after a preemption: the engine keeps the first)."""
    prompt = seq.prompt_token_ids
    rows = prompt_logprob_rows(len(prompt), item.start, item.num_new_tokens)
    if rows:
        item.prompt_logprob_rows = rows
        end = item.start + item.num_new_tokens
        item.next_prompt_token = prompt[end] if end < len(prompt) else -1


def _item(scheduled: ScheduledSeq, **fields: object) -> StepItem:
    """The message for one scheduled sequence (its new tokens read from the sequence)."""
    seq, start = scheduled.seq, scheduled.start
    return StepItem(
        seq_id=seq.seq_id,
        token_ids=seq.token_slice(start, start + scheduled.num_new_tokens),
        start=start,
        block_table=list(seq.block_table),
        num_lookahead=scheduled.num_lookahead,
        draft_token_ids=list(scheduled.draft_token_ids),
        num_output_tokens=len(seq.output_token_ids),
        budget=seq.kv_budget,
        score_split=scheduled.score_split,
        **fields,  # type: ignore[arg-type]
    )
