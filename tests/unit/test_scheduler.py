"""Scheduler + block manager driven by a fake engine loop (no model).

``FakeEngine`` does what ``LLMEngine.step`` does, minus the model: schedule, execute the
block copies, "run" the model, advance ``num_computed_tokens`` and commit, then for each
sequence whose tokens are all computed fork its pending ``n > 1`` siblings, append a
deterministic token and retire finished sequences. The "model" writes each scheduled token's
(position, token) into a shadow KV memory through the block table and, before sampling, reads
the whole context back through the block table: any lost, stale or shared-but-overwritten K/V
(a wrong prefix hit, a missed copy-on-write, a preempted sequence not recomputed) fails there,
and the sampled token is a function of what was read, so outputs match a solo run only if the
cache served the right K/V.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keyserve.core.block_manager import BlockManager
from keyserve.core.kv_policy import KVBudget
from keyserve.core.sampling_params import SamplingParams
from keyserve.core.scheduler import Scheduler, SchedulerConfig, StepPlan
from keyserve.core.sequence import Sequence, SequenceStatus

VOCAB = 3  # a tiny alphabet: prompts and outputs repeat, so prefix hits are common


def next_token(context: list[tuple[int, int]], sample_index: int) -> int:
    """The fake model: a deterministic function of the K/V it read (and the sample index, so
    n > 1 siblings diverge after the prompt)."""
    return (sum((p + 1) * t for p, t in context) + 7 * sample_index + len(context)) % VOCAB


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int
    n: int = 1
    arrival_step: int = 0
    seqs: list[Sequence] = field(default_factory=list)


class FakeEngine:
    def __init__(
        self,
        num_blocks: int,
        block_size: int = 4,
        max_num_batched_tokens: int = 64,
        max_num_seqs: int = 16,
        enable_chunked_prefill: bool = True,
        enable_prefix_caching: bool = True,
    ) -> None:
        self.B = block_size
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.config = SchedulerConfig(max_num_batched_tokens, max_num_seqs, enable_chunked_prefill)
        self.sched = Scheduler(self.config, self.bm)
        self.kv: list[list[tuple[int, int] | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.pending: dict[int, list[Sequence]] = {}  # sample 0's seq_id -> siblings to fork
        self.finished: list[Sequence] = []
        self.plans: list[StepPlan] = []
        # Per step: (seq, start, num_new_tokens) as scheduled (``item.start`` moves on after).
        self.history: list[list[tuple[Sequence, int, int]]] = []
        self.splits: list[dict[int, int]] = []  # per step: seq_id -> its score split (0: none)
        self.clock = 0.0

    # ---------------------------------------------------------------- requests
    def add(self, prompt: list[int], max_tokens: int, n: int = 1) -> list[Sequence]:
        self.clock += 1.0
        params = SamplingParams(n=n, max_tokens=max_tokens)
        seqs = [
            Sequence(f"r{self.clock:g}", list(prompt), params, arrival=self.clock, sample_index=i)
            for i in range(n)
        ]
        self.pending[seqs[0].seq_id] = seqs[1:]
        self.sched.add(seqs[0])
        return seqs

    # -------------------------------------------------------------------- step
    def step(self) -> StepPlan:
        running_before = list(self.sched.running)
        plan = self.sched.schedule()
        self.check_plan(plan, running_before)
        self.plans.append(plan)
        self.history.append([(i.seq, i.start, i.num_new_tokens) for i in plan.scheduled])
        self.splits.append({i.seq.seq_id: i.score_split for i in plan.scheduled})
        for src, dst in plan.blocks_to_copy:
            self.kv[dst] = list(self.kv[src])
        completing = [item for item in plan.scheduled if item.completes]
        for item in plan.scheduled:  # the forward pass writes the step's K/V ...
            seq = item.seq
            for t in range(item.start, item.start + item.num_new_tokens):
                block = self.bm.pool.blocks[seq.block_table[t // self.B]]
                assert block.ref_cnt == 1, f"seq {seq.seq_id} writes shared {block}"
                self.kv[block.block_id][t % self.B] = (t, seq.token_at(t))
        contexts = {item.seq.seq_id: self.read_context(item.seq) for item in completing}
        for item in plan.scheduled:  # ... then the engine's bookkeeping
            item.seq.num_computed_tokens += item.num_new_tokens
            self.bm.commit_computed(item.seq)
        for item in completing:
            seq = item.seq
            targets = [seq]
            if seq.sample_index == 0 and not seq.output_token_ids:
                targets += self.pending.pop(seq.seq_id, [])
            for sibling in targets[1:]:
                self.bm.fork(seq, sibling)
                self.sched.add_running(sibling)
            for target in targets:
                target.append_token(next_token(contexts[seq.seq_id], target.sample_index))
                if len(target.output_token_ids) >= target.params.max_tokens:
                    target.status = SequenceStatus.FINISHED
                    self.sched.remove(target)
                    self.finished.append(target)
        self.check_state()
        return plan

    def read_context(self, seq: Sequence) -> list[tuple[int, int]]:
        """Attention's view: every position's K/V gathered through the block table."""
        context = []
        for t in range(seq.num_tokens):
            got = self.kv[seq.block_table[t // self.B]][t % self.B]
            assert got == (t, seq.token_at(t)), f"seq {seq.seq_id} pos {t}: K/V of {got}"
            context.append(got)
        return context

    # -------------------------------------------------------------- invariants
    def check_plan(self, plan: StepPlan, running_before: list[Sequence]) -> None:
        cfg = self.config
        assert plan.num_tokens <= cfg.max_num_batched_tokens
        assert all(item.num_new_tokens == 1 for item in plan.decode)
        assert all(item.num_new_tokens >= 2 for item in plan.prefill)
        ids = [item.seq.seq_id for item in plan.scheduled]
        assert len(ids) == len(set(ids)), "a sequence scheduled twice"
        for item in plan.scheduled:
            seq = item.seq
            assert seq.status is SequenceStatus.RUNNING and seq in self.sched.running
            assert 1 <= item.num_new_tokens <= seq.num_uncomputed_tokens
            if not cfg.enable_chunked_prefill:  # whole, unless it can never fit one step
                held_back = seq.kv_budget is not None and seq.kv_budget.last_query_only and (
                    item.num_new_tokens == seq.num_uncomputed_tokens - 1)  # its last token runs alone next
                assert item.completes or held_back or seq.num_uncomputed_tokens > cfg.max_num_batched_tokens
            slots = seq.kv_slots_for(item.start + item.num_new_tokens)
            assert len(seq.block_table) == self.bm.blocks_for_slots(slots)
        for seq in plan.preempted:
            assert seq in running_before, "only running sequences are preempted"
            assert seq.seq_id not in ids
            assert seq.status is SequenceStatus.WAITING and seq in self.sched.waiting
            assert seq.num_computed_tokens == 0 and seq.block_table == []
        if plan.preempted:
            assert all(item.seq in running_before for item in plan.scheduled), (
                "admitted a request in a step that had to preempt"
            )

    def check_state(self) -> None:
        sched, pool = self.sched, self.bm.pool
        # Seats: running sequences plus the siblings their prompts will fork.
        assert len(sched.running) <= self.config.max_num_seqs
        held = Counter(b for s in sched.running for b in s.block_table)
        assert all(not s.block_table for s in sched.waiting)
        for block in pool.blocks:
            assert block.ref_cnt == held[block.block_id]
        assert pool.num_free_blocks + len(held) == pool.num_blocks
        # Priority order: every running sequence is older than every waiting one.
        keys = [(s.arrival, s.seq_id) for s in sched.running]
        assert keys == sorted(keys)
        wkeys = [(s.arrival, s.seq_id) for s in sched.waiting]
        assert wkeys == sorted(wkeys)
        if keys and wkeys:
            assert keys[-1] < wkeys[0], "a newer request runs while an older one waits"

    def oldest(self) -> Sequence | None:
        seqs = list(self.sched.running) + list(self.sched.waiting)
        return min(seqs, key=lambda s: (s.arrival, s.seq_id)) if seqs else None


def run_workload(engine: FakeEngine, requests: list[Request], max_steps: int) -> int:
    """Submit each request at its arrival step; step until all finish. Every step the oldest
    unfinished sequence must progress. Returns the number of steps taken."""
    by_step: dict[int, list[Request]] = {}
    for r in requests:
        by_step.setdefault(r.arrival_step, []).append(r)
    last_arrival = max(by_step)
    steps = 0
    for clock in range(max_steps + last_arrival + 1):
        for r in by_step.get(clock, []):
            r.seqs = engine.add(r.prompt, r.max_tokens, r.n)
        if not engine.sched.has_work:
            if clock >= last_arrival:
                break
            continue
        oldest = engine.oldest()
        plan = engine.step()
        steps += 1
        assert oldest in [item.seq for item in plan.scheduled], (
            f"step {steps}: the oldest sequence {oldest.seq_id} made no progress"
        )
    else:
        pytest.fail(f"not done after {max_steps} steps")
    assert not engine.sched.has_work and not engine.pending
    assert engine.bm.num_free_blocks == engine.bm.num_blocks
    return steps


def solo_outputs(requests: list[Request], block_size: int) -> list[list[list[int]]]:
    """Each request alone in a roomy engine: the reference outputs."""
    outs = []
    for r in requests:
        eng = FakeEngine(num_blocks=256, block_size=block_size, max_num_batched_tokens=4096)
        seqs = eng.add(r.prompt, r.max_tokens, r.n)
        while eng.sched.has_work:
            eng.step()
        outs.append([list(s.output_token_ids) for s in seqs])
    return outs


def blocks_needed(r: Request, block_size: int) -> int:
    return -(-(len(r.prompt) + r.max_tokens) // block_size)


# ------------------------------------------------------------------------------ behaviours
def test_continuous_batching_requests_join_and_leave_between_steps() -> None:
    eng = FakeEngine(num_blocks=64, block_size=4)
    a = eng.add([1, 2, 1, 2, 1], max_tokens=4)[0]
    p1 = eng.step()
    assert [i.seq for i in p1.prefill] == [a] and p1.prefill[0].num_new_tokens == 5
    b = eng.add([2, 2, 2], max_tokens=6)[0]
    p2 = eng.step()  # a decodes while b's prompt is prefilled in the same step
    assert [i.seq for i in p2.decode] == [a] and [i.seq for i in p2.prefill] == [b]
    eng.step()
    eng.step()  # a's 4th token: a leaves
    assert a.status is SequenceStatus.FINISHED and a not in eng.sched.running
    c = eng.add([0], max_tokens=2)[0]
    p5 = eng.step()  # c (a one-token prompt: a single query, hence a "decode") joins
    assert {i.seq for i in p5.scheduled} == {b, c}
    assert all(i.num_new_tokens == 1 for i in p5.scheduled) and not p5.prefill
    while eng.sched.has_work:
        eng.step()
    assert [len(s.output_token_ids) for s in (a, b, c)] == [4, 6, 2]
    assert eng.bm.num_free_blocks == eng.bm.num_blocks


def test_chunked_prefill_respects_token_budget() -> None:
    eng = FakeEngine(num_blocks=64, block_size=4, max_num_batched_tokens=8)
    a = eng.add([1] * 30, max_tokens=3)[0]
    chunks = []
    while not a.output_token_ids:
        plan = eng.step()
        assert plan.num_tokens <= 8
        chunks.append(plan.prefill[0].num_new_tokens)
    assert chunks == [8, 8, 8, 6]
    # A decode and a new prompt share the budget: 1 + 7, then the rest.
    b = eng.add([2] * 10, max_tokens=1)[0]
    plan = eng.step()
    assert [(i.seq, i.num_new_tokens) for i in plan.scheduled] == [(a, 1), (b, 7)]
    assert not b.output_token_ids  # a partial chunk samples nothing
    plan = eng.step()
    assert [(i.seq, i.num_new_tokens) for i in plan.scheduled] == [(a, 1), (b, 3)]
    assert len(b.output_token_ids) == 1 and b.status is SequenceStatus.FINISHED


def test_without_chunking_a_prompt_waits_for_a_step_it_fits_in() -> None:
    eng = FakeEngine(num_blocks=64, block_size=4, max_num_batched_tokens=8,
                     enable_chunked_prefill=False)
    a = eng.add([1] * 3, max_tokens=4)[0]
    eng.step()
    b = eng.add([2] * 8, max_tokens=1)[0]
    plan = eng.step()  # a's decode leaves 7 < 8: b waits whole
    assert [i.seq for i in plan.scheduled] == [a] and b in eng.sched.waiting
    while eng.sched.has_work:
        eng.step()
    assert len(b.output_token_ids) == 1


def test_without_chunking_an_oversized_recomputation_is_chunked() -> None:
    """A preempted sequence recomputes prompt + output, which may exceed the step budget
    even though its prompt did not: it must still run (chunked), not wait forever."""
    eng = FakeEngine(num_blocks=4, block_size=4, max_num_batched_tokens=8,
                     enable_chunked_prefill=False, enable_prefix_caching=False)
    a = eng.add([1] * 5, max_tokens=6)[0]
    eng.step()
    b = eng.add([2] * 7, max_tokens=6)[0]
    for _ in range(60):
        if not eng.sched.has_work:
            break
        eng.step()
    assert b.num_preemptions >= 1 and not eng.sched.has_work
    assert [len(a.output_token_ids), len(b.output_token_ids)] == [6, 6]
    recomputes = [n for step in eng.history for q, start, n in step if q is b and start == 0]
    assert recomputes[-1] == 8  # the first chunk of the 7 + k > 8 token recomputation


def test_prefix_hit_reduces_tokens_scheduled() -> None:
    eng = FakeEngine(num_blocks=64, block_size=4)
    prompt = [1, 2, 0, 1, 2, 2, 0, 1, 1, 0, 2, 1]
    a = eng.add(prompt, max_tokens=2)[0]
    eng.step()
    a_blocks = list(a.block_table)
    # Same prompt + more: its 3 full prompt blocks are computed and cached.
    b = eng.add(prompt + [0, 0], max_tokens=2)[0]
    eng.step()
    assert (b, 12, 2) in eng.history[-1] and b.num_cached_tokens == 12
    assert b.block_table[:3] == a_blocks[:3]
    # The same prompt exactly: the last block is recomputed (a token must produce logits).
    c = eng.add(prompt, max_tokens=2)[0]
    eng.step()
    assert (c, 8, 4) in eng.history[-1] and c.num_cached_tokens == 8
    while eng.sched.has_work:
        eng.step()
    solo = solo_outputs([Request(prompt, 2), Request(prompt + [0, 0], 2)], 4)
    assert [a.output_token_ids] == solo[0] and [b.output_token_ids] == solo[1]
    assert c.output_token_ids == a.output_token_ids


def test_identical_prompts_in_one_step_both_compute() -> None:
    """No hit on blocks still being computed in the same step."""
    eng = FakeEngine(num_blocks=64, block_size=4)
    a = eng.add([1] * 9, max_tokens=1)[0]
    b = eng.add([1] * 9, max_tokens=1)[0]
    plan = eng.step()
    assert [i.num_new_tokens for i in plan.scheduled] == [9, 9]
    assert a.num_cached_tokens == b.num_cached_tokens == 0


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_preemption_when_blocks_run_out_and_recompute(prefix_caching: bool) -> None:
    # 4 blocks of 2 slots; each request grows to 3 + 5 - 1 = 7 computed tokens (4 blocks).
    eng = FakeEngine(num_blocks=4, block_size=2, enable_prefix_caching=prefix_caching)
    reqs = [Request([1, 2, 0], 5), Request([2, 0, 1], 5)]
    a = eng.add(reqs[0].prompt, 5)[0]
    b = eng.add(reqs[1].prompt, 5)[0]
    preempted_at = None
    recompute = None
    while eng.sched.has_work:
        tokens_before = b.num_tokens
        plan = eng.step()
        if plan.preempted and preempted_at is None:
            assert plan.preempted == [b], "the newest request is the victim"
            assert a in [i.seq for i in plan.scheduled]
            preempted_at = len(eng.plans)
            assert b.num_preemptions == 1 and eng.sched.num_preemptions >= 1
        elif preempted_at is not None and recompute is None:
            recompute = next(((s, n) for q, s, n in eng.history[-1] if q is b), None)
            tokens_at_recompute = tokens_before
    assert preempted_at is not None and recompute is not None
    start, n = recompute
    assert start + n == tokens_at_recompute, "the recomputation covers all tokens so far"
    if not prefix_caching:  # nothing to reuse: from scratch
        assert start == 0
    assert [[a.output_token_ids], [b.output_token_ids]] == solo_outputs(reqs, 2)


def test_preempted_sequence_recomputes_prompt_and_outputs() -> None:
    eng = FakeEngine(num_blocks=4, block_size=2, enable_prefix_caching=False)
    a = eng.add([1, 2, 0], 5)[0]
    b = eng.add([2, 0, 1], 5)[0]
    while not b.num_preemptions:
        eng.step()
    generated = len(b.output_token_ids)
    assert generated >= 1 and b.num_computed_tokens == 0
    while True:
        eng.step()
        item = next(((s, n) for q, s, n in eng.history[-1] if q is b), None)
        if item is not None:
            break
    assert item == (0, 3 + generated)
    assert len(b.output_token_ids) == generated + 1  # and it sampled its next token
    assert a.status is SequenceStatus.FINISHED  # b came back once a had left


def test_single_sequence_using_the_whole_pool_finishes() -> None:
    """A request that needs every block completes even while others compete for them."""
    eng = FakeEngine(num_blocks=3, block_size=4, max_num_batched_tokens=5)
    big = Request([1, 2, 0, 1, 2], 8)  # 12 tokens at most = all 3 blocks
    others = [Request([2, 1], 6, arrival_step=i) for i in range(1, 4)]
    run_workload(eng, [big] + others, max_steps=200)
    assert [r.seqs[0].output_token_ids for r in [big] + others] == [
        o[0] for o in solo_outputs([big] + others, 4)
    ]


def test_max_num_seqs_reserves_seats_for_n_samples() -> None:
    """Two n=3 requests with 4 seats: the second waits until the first's samples leave."""
    eng = FakeEngine(num_blocks=64, block_size=4, max_num_seqs=4)
    r1 = eng.add([1, 2, 0], max_tokens=3, n=3)
    r2 = eng.add([2, 2, 1], max_tokens=3, n=3)
    eng.step()  # FakeEngine.check_state asserts len(running) <= 4 after the forks
    assert len(eng.sched.running) == 3 and r2[0] in eng.sched.waiting
    while eng.sched.has_work:
        eng.step()
    assert all(len(s.output_token_ids) == 3 for s in r1 + r2)
    assert len({tuple(s.output_token_ids) for s in r1}) > 1  # the samples differ


def test_n_samples_share_the_prompt_blocks() -> None:
    eng = FakeEngine(num_blocks=64, block_size=4)
    seqs = eng.add([1, 2, 0, 1, 2, 0, 1, 2], max_tokens=4, n=3)  # two full prompt blocks
    eng.step()
    tables = [s.block_table for s in seqs]
    assert tables[0] == tables[1] == tables[2]
    assert all(eng.bm.pool.blocks[b].ref_cnt == 3 for b in tables[0])
    eng.step()  # each writes its first generated token into its own new block
    assert tables[0][:2] == seqs[1].block_table[:2] == seqs[2].block_table[:2]
    assert len({s.block_table[2] for s in seqs}) == 3


def test_decode_and_prefill_classification() -> None:
    eng = FakeEngine(num_blocks=64, block_size=4, max_num_batched_tokens=6)
    a = eng.add([1, 1, 1], max_tokens=5)[0]
    eng.step()
    b = eng.add([2] * 7, max_tokens=2)[0]
    plan = eng.step()
    assert [i.seq for i in plan.decode] == [a] and [i.seq for i in plan.prefill] == [b]
    assert plan.prefill[0].num_new_tokens == 5 and not b.output_token_ids
    assert len(a.output_token_ids) == 2  # a decode always completes: one token sampled
    plan = eng.step()  # b's last 2 prompt tokens: a prefill that completes
    assert [i.seq for i in plan.prefill] == [b] and len(b.output_token_ids) == 1
    plan = eng.step()
    assert {i.seq for i in plan.decode} == {a, b} and not plan.prefill
    assert plan.num_tokens == 2


@pytest.mark.parametrize("chunked", [True, False])
def test_last_query_budget_gets_its_last_prompt_token_alone(chunked: bool) -> None:
    """Under ``kv_score_window="last"`` the step that would finish a prompt holds its last token
    back: that token runs alone next step (a decode row), so its attention alone scores the
    prompt. Without chunked prefill too (the hold-back is not a chunk that waits); a prompt
    that a step's budget splits anyway, and other sequences, are unchanged."""
    eng = FakeEngine(num_blocks=64, block_size=4, max_num_batched_tokens=16, enable_chunked_prefill=chunked)
    last = eng.add([1] * 7, max_tokens=3)[0]
    last.kv_budget = KVBudget.create("keyformer", 4, 0.25, score_window="last")
    plain = eng.add([2] * 5, max_tokens=3)[0]
    plain.kv_budget = KVBudget.create("keyformer", 4, 0.25)  # the default window: no hold-back
    plan = eng.step()
    assert {(i.seq, i.num_new_tokens) for i in plan.prefill} == {(last, 6), (plain, 5)}
    assert not last.output_token_ids and len(plain.output_token_ids) == 1
    plan = eng.step()
    assert (last, 1) in {(i.seq, i.num_new_tokens) for i in plan.decode} and len(last.output_token_ids) == 1
    long = eng.add([3] * 40, max_tokens=2)[0]
    long.kv_budget = KVBudget.create("h2o", 8, 0.25, score_window="last")
    while len(long.output_token_ids) < 2:
        eng.step()
    steps = [n for h in eng.history for s, _, n in h if s is long]
    assert sum(steps[:-2]) == 39 and steps[-2:] == [1, 1]  # chunks of 39, the last prompt token alone, a decode


def test_remove_waiting_request_frees_nothing_twice() -> None:
    eng = FakeEngine(num_blocks=2, block_size=4, max_num_seqs=1)
    a = eng.add([1, 2], max_tokens=3)[0]
    b = eng.add([2, 1], max_tokens=3)[0]
    eng.step()
    assert b in eng.sched.waiting
    eng.sched.remove(b)  # an abort while waiting
    eng.sched.remove(a)  # an abort while running
    assert not eng.sched.has_work and eng.bm.num_free_blocks == 2


# -------------------------------------------------------------------- random workloads
@st.composite
def workloads(draw: st.DrawFn) -> tuple[dict, list[Request]]:
    block_size = draw(st.sampled_from([1, 2, 4]))
    chunked = draw(st.sampled_from([True, True, False]))
    max_seqs = draw(st.integers(1, 6))
    budget = draw(st.integers(1 if chunked else 6, 24))
    num_requests = draw(st.integers(1, 10))
    requests = []
    for _ in range(num_requests):
        prompt = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=14))
        requests.append(
            Request(
                prompt,
                draw(st.integers(1, 8)),
                draw(st.sampled_from([1, 1, 1, 2, 3]).filter(lambda n: n <= max_seqs)),
                draw(st.integers(0, 12)),
            )
        )
    # The pool fits the largest single sequence, and is often that tight.
    need = max(blocks_needed(r, block_size) for r in requests)
    num_blocks = need + draw(st.sampled_from([0, 0, 1, 3, 40]))
    if not chunked:  # every prompt fits one step (a recomputation after preemption may not)
        budget = max(budget, max(len(r.prompt) for r in requests))
    config = dict(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_batched_tokens=budget,
        max_num_seqs=max_seqs,
        enable_chunked_prefill=chunked,
        enable_prefix_caching=draw(st.sampled_from([True, True, False])),
    )
    return config, requests


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_finish_without_starvation(workload: tuple[dict, list[Request]]) -> None:
    """Tiny pools, mixed lengths, staggered arrivals, n > 1: the oldest sequence progresses
    every step, so all finish within sum(prompt + max_tokens) busy steps, with the tokens a
    solo run gives."""
    config, requests = workload
    eng = FakeEngine(**config)
    bound = sum((len(r.prompt) + r.max_tokens) * r.n for r in requests)
    steps = run_workload(eng, requests, max_steps=bound)
    assert steps <= bound
    solo = solo_outputs(requests, config["block_size"])
    assert [[list(s.output_token_ids) for s in r.seqs] for r in requests] == solo


def test_many_concurrent_requests_tiny_pool_preempts_and_matches_solo() -> None:
    """32 mixed requests on a pool that holds ~3 of them at a time: preemption is certain."""
    rng = random.Random(0)
    requests = [
        Request([rng.randrange(VOCAB) for _ in range(rng.randint(1, 20))], rng.randint(1, 12))
        for _ in range(32)
    ]
    eng = FakeEngine(num_blocks=16, block_size=4, max_num_batched_tokens=16, max_num_seqs=8)
    bound = sum(len(r.prompt) + r.max_tokens for r in requests)
    run_workload(eng, requests, max_steps=bound)
    assert eng.sched.num_preemptions > 0
    solo = solo_outputs(requests, 4)
    assert [[r.seqs[0].output_token_ids] for r in requests] == solo


class _Boundaries:
    """A prefix loader that only names score boundaries (the prefix store's ``score_boundary``:
    a prompt scored by attention keeps its scores apart at its last whole chunk)."""

    def __init__(self, at: dict[int, int]) -> None:
        self.at = at  # seq_id -> boundary

    def score_boundary(self, seq: Sequence) -> int | None:
        return self.at.get(seq.seq_id)

    def load(self, seq, cached, budget):  # the scheduler asks it for stored prefixes too
        return cached


def test_a_step_crossing_a_score_boundary_is_marked_not_cut() -> None:
    """A prefill step that crosses a boundary the prefix loader names is not cut there (no
    extra forward before the first token): it carries the boundary as its score split, whether
    the prompt starts waiting or is mid-way through chunked prefill; steps that do not cross
    one carry none; the steps and outputs are the ones without boundaries."""
    def run(boundaries: bool) -> tuple[list[list[int]], list[list[tuple[int, int, int]]]]:
        eng = FakeEngine(num_blocks=64, max_num_batched_tokens=12)
        a = eng.add([1, 2, 0] * 7, max_tokens=3)[0]  # 21 tokens: boundary 16
        b = eng.add([2, 1] * 5, max_tokens=3)[0]  # 10 tokens: boundary 8
        if boundaries:
            eng.sched.prefix_loader = _Boundaries({a.seq_id: 16, b.seq_id: 8})
        spans = {a.seq_id: [], b.seq_id: []}
        while eng.sched.has_work:
            eng.step()
            for seq, start, n in eng.history[-1]:
                if seq.seq_id in spans and start < seq.num_prompt_tokens:
                    spans[seq.seq_id].append((start, start + n, eng.splits[-1][seq.seq_id]))
        return [a.output_token_ids, b.output_token_ids], [spans[a.seq_id], spans[b.seq_id]]

    plain_out, (plain_a, plain_b) = run(False)
    out, (spans_a, spans_b) = run(True)
    assert out == plain_out
    assert [(s, e) for s, e, _ in spans_a] == [(s, e) for s, e, _ in plain_a]  # no step cut
    assert [(s, e) for s, e, _ in spans_b] == [(s, e) for s, e, _ in plain_b]
    assert all(split == 0 for *_, split in plain_a + plain_b)
    for spans, at in ((spans_a, 16), (spans_b, 8)):
        assert any(s < at < e for s, e, _ in spans)  # this workload crosses both boundaries
        assert all(split == (at - s if s < at < e else 0) for s, e, split in spans)
