"""Executes a StepInput on the model: apply ops, copy blocks, pack tokens, forward, sample.

This is the only place that turns scheduler decisions into tensors. It consumes one
``StepInput`` per step -- the same message whether the runner sits in the engine's process or
is one tensor-parallel shard in a Ray actor -- and knows nothing about requests, stop
conditions or text. Per-sequence state that must persist across steps lives here: sampling
parameters and generators (sampling happens here, on the driver rank), and KV-budget states
(rank-local: each rank holds whole kv-heads, docs/algorithms.md §2).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from keyserve.core.block_manager import BlockCopy
from keyserve.core.kv_policy import KVPolicy, keyformer_tau
from keyserve.core.sampler import SamplingTensors, make_generator, sample
from keyserve.core.spec_decode import verify_drafts
from keyserve.core.scheduler import StepPlan
from keyserve.engine.kv_budget import KVBudgetTracker, compact_kv, physical_slots
from keyserve.engine.step_input import (
    CompactOp,
    ForkOp,
    ReleaseOp,
    RetainOp,
    RunnerOp,
    SeqInfo,
    SettleOp,
    StepInput,
    StepItem,
    StepOutput,
    logits_step_input,
)
from keyserve.kernels.metadata import AttentionMetadata

# hidden rows [n, hidden] -> float32 logits [n, vocab] (None on a shard that is not the driver)
LogitsFn = Callable[[torch.Tensor], torch.Tensor | None]


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    last_token_index: dict[int, int]  # seq_id -> row of its last query token
    # Budgeted items whose scores come back: (item, in the decode rows?, first row, rows).
    score_rows: list[tuple["StepItem", bool, int, int]] = field(default_factory=list)


@dataclass
class _Rows:
    """Attention rows of one kind (decode or prefill), one entry per attended sequence."""

    tables: list[list[int]] = field(default_factory=list)
    context_lens: list[int] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    modes: list[str | None] = field(default_factory=list)
    taus: list[float] = field(default_factory=list)
    # row -> [num_layers] context lengths, for a sequence whose layers hold different counts
    layer_context_lens: dict[int, list[int]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.tables)

    def context_lens_tensor(self, num_layers: int, device: torch.device) -> torch.Tensor:
        """[num_rows] int32, or [num_layers, num_rows] when some row's layers differ."""
        lens = torch.tensor(self.context_lens, dtype=torch.int32)
        if self.layer_context_lens:
            lens = lens.expand(num_layers, -1).clone()
            for row, per_layer in self.layer_context_lens.items():
                lens[:, row] = torch.tensor(per_layer, dtype=torch.int32)
        return lens.to(device)

    def truncate(self, num_rows: int) -> None:
        """Drop the rows from ``num_rows`` on (a sequence that left the batch)."""
        for rows in (self.tables, self.context_lens, self.query_lens, self.modes, self.taus):
            del rows[num_rows:]
        for row in [r for r in self.layer_context_lens if r >= num_rows]:
            del self.layer_context_lens[row]

    def add(self, table: list[int], context_len: int, query_len: int, mode: str | None, tau: float) -> None:
        self.tables.append(table)
        self.context_lens.append(context_len)
        self.query_lens.append(query_len)
        self.modes.append(mode)
        self.taus.append(tau)


@dataclass(frozen=True)
class _Ref:
    """The budget tracker keys its states by ``.seq_id`` only."""

    seq_id: int


@contextlib.contextmanager
def _seeded_cpu_generator(seed: int) -> Iterator[None]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _pad_tables(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    width = max((len(t) for t in tables), default=0) or 1
    out = torch.zeros(len(tables), width, dtype=torch.int32)
    for i, table in enumerate(tables):
        if table:
            out[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
    return out.to(device)


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        sliding_window: int | None,
        device: torch.device,
        num_layers: int,
        num_kv_heads: int,
        logits_fn: LogitsFn | None = None,
        is_driver: bool = True,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.device = device
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.budget = KVBudgetTracker(num_layers, num_kv_heads, block_size, device)
        self.logits_fn: LogitsFn = logits_fn or model.compute_logits
        self.is_driver = is_driver  # tensor-parallel rank 0: the one that samples
        self.seq_infos: dict[int, SeqInfo] = {}
        self.generators: dict[int, torch.Generator | None] = {}

    # -------------------------------------------------------------- state ops
    def apply_ops(self, ops: list[RunnerOp]) -> dict[int, tuple[int, int]]:
        """Apply the scheduler side's per-sequence decisions; returns budget stats of the
        sequences they changed."""
        changed: dict[int, tuple[int, int]] = {}
        for op in ops:
            if isinstance(op, ForkOp):
                self.budget.fork(_Ref(op.parent_id), _Ref(op.child_id))
            elif isinstance(op, (CompactOp, SettleOp)):
                if isinstance(op, CompactOp):
                    self._compact(op)
                else:
                    self._settle(op)
                state = self.budget.states.get(op.seq_id)
                if state is not None:
                    changed[op.seq_id] = (state.num_slots, state.num_evicted)
            elif isinstance(op, ReleaseOp):
                self.release(op.seq_id)
            elif isinstance(op, RetainOp):
                keep = set(op.seq_ids)
                for seq_id in set(self.seq_infos) | set(self.budget.states) | set(self.generators):
                    if seq_id not in keep:
                        self.release(seq_id)
        return changed

    def release(self, seq_id: int) -> None:
        self.budget.release(_Ref(seq_id))
        self.seq_infos.pop(seq_id, None)
        self.generators.pop(seq_id, None)

    def _compact(self, op: CompactOp) -> None:
        """Keep k tokens per (layer, head), moved into the first blocks (the engine frees the rest)."""
        ref = _Ref(op.seq_id)
        state = self.budget.get(ref)
        if state is None or not self.budget.due_for_compaction(ref):
            return
        self.copy_blocks(op.copies)
        if state.num_slots > op.budget:
            keep = self.budget.select_prompt(ref)
            if keep is not None:
                compact_kv(self.kv_caches, op.block_table, keep, self.block_size)
        else:
            self.budget.select_prompt(ref)

    def _settle(self, op: SettleOp) -> None:
        """Drop rejected spare slots and apply the evictions the kept tokens imply."""
        ref = _Ref(op.seq_id)
        if self.budget.get(ref) is None:
            return
        keep = self.budget.settle(ref, op.num_tokens)
        if keep is not None:
            compact_kv(self.kv_caches, op.block_table, keep, self.block_size)

    def _tau(self, item: StepItem, decoding: bool, offset: int = 0) -> float:
        """Keyformer's temperature: 1 in the prompt phase, then the linear schedule (``offset``:
        the row's distance from the item's first query, for verification rows)."""
        state = self.budget.states[item.seq_id]
        if not decoding or state.spec.policy is not KVPolicy.KEYFORMER:
            return 1.0
        p = self.seq_infos[item.seq_id].params
        step = max(0, item.num_output_tokens - 1 + offset)
        return keyformer_tau(step, p.max_tokens, p.tau_init, p.tau_end)

    # ----------------------------------------------------------------- inputs
    def prepare(self, step: StepInput, failed: dict[int, str] | None = None) -> ModelInputs | None:
        """Pack the step's tokens; budgeted sequences get their slots from the KV policy.

        Attention runs over ``[decode rows | prefill chunks]``. A budgeted sequence verifying
        drafts (docs/algorithms.md §3) writes its K + 1 positions into spare slots past the
        ones it holds and evicts nothing until the verdict is known; it contributes K + 1
        *decode* rows over its one block table, row i attending to the held slots plus the new
        ones up to its own (causal), so the kernels return its attention scores per row and
        only the accepted rows' scores are accumulated when it settles
        (``KVBudgetTracker.settle``).

        ``failed`` (seq_id -> why) collects the budgeted sequences whose own budget could not
        be planned; they are left out of the batch (None if nothing is left to run). Without
        it such an error raises."""
        block = self.block_size
        budget = self.budget
        dev = self.device
        n_dec = step.num_decode
        rest = step.items[n_dec:]
        spare_verify = [it for it in rest if it.verifies and it.budget is not None]
        chunks = [it for it in rest if not (it.verifies and it.budget is not None)]
        dec = _Rows()  # one query token each
        pre = _Rows()  # chunks of one or more query tokens
        ids: list[int] = []
        positions: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []  # physical slot per token (same in every layer/head)
        last_index: dict[int, int] = {}
        per_head: list[tuple[int, StepItem, _Rows, int]] = []  # slot differs per head
        score_rows: list[tuple[StepItem, bool, int, int]] = []  # (item, decode?, first row, rows)
        for index, item in enumerate(step.items[:n_dec] + spare_verify + chunks):
            start, n = item.start, item.num_query_tokens
            verifies = n_dec <= index < n_dec + len(spare_verify)
            row = len(ids)
            ids.extend(item.token_ids)
            ids.extend(item.draft_token_ids)
            pos = torch.arange(start, start + n, dtype=torch.int64)
            positions.append(pos)
            last_index[item.seq_id] = row + n - 1
            rows = dec if index < n_dec or verifies else pre
            table = item.block_table
            if item.budget is None:
                rows.add(table, start + n, n, None, 1.0)
                slots.append(physical_slots(pos, torch.tensor(table, dtype=torch.int64), block))
                continue
            marks = (len(rows), len(score_rows), len(per_head), len(slots))
            try:
                state = budget.get(item)
                if state is None or start == 0:
                    state = budget.start(item, item.budget)  # type: ignore[arg-type]
                mode = budget.score_mode(item)
                decoding = not budget.due_for_compaction(item)
                score_rows.append((item, rows is dec, len(rows), n if verifies else 1))
                if verifies:
                    if not decoding:
                        raise RuntimeError("speculative verification of a budgeted prompt")
                    held = state.num_slots
                    logical = state.append(n)
                    budget.expect_rows(item, start)
                    for i in range(n):
                        rows.add(table, held + i + 1, 1, mode, self._tau(item, True, offset=i))
                elif not decoding or item.spare:
                    # Prompt phase, or the draft's speculative tokens: fresh slots, no eviction.
                    logical = state.append(n)  # [n], or [L, n] while its layers hold different counts
                    rows.add(table, state.num_slots, n, mode, self._tau(item, decoding))
                    if state.layer_held is not None:
                        rows.layer_context_lens[len(rows) - 1] = state.layer_held.tolist()
                else:
                    if n != 1:
                        raise RuntimeError("a compacted sequence can only decode one token per step")
                    logical = torch.zeros(1, dtype=torch.int64)  # replaced per head below
                    per_head.append((row, item, rows, len(rows)))
                    rows.add(table, -1, 1, mode, self._tau(item, True))  # context once victims are known
                slots.append(physical_slots(logical.cpu(), torch.tensor(table, dtype=torch.int64), block))
            except Exception as e:  # noqa: BLE001 — its own budget (policy, k, Keyformer schedule)
                # This sequence alone leaves the step: undo what it added to the batch (its
                # half-made budget state goes when its request is aborted).
                del ids[row:], score_rows[marks[1]:], per_head[marks[2]:], slots[marks[3]:]
                positions.pop()
                last_index.pop(item.seq_id)
                rows.truncate(marks[0])
                if failed is None:
                    raise
                failed[item.seq_id] = _failure("KV budget", e)
        if not ids:  # every sequence failed
            return None
        per_layer_slots = bool(per_head) or any(s.dim() == 2 for s in slots)
        if per_layer_slots:
            L = self.num_layers
            per_layer = torch.cat([s.expand(L, -1) for s in slots], dim=1)  # [L, num_tokens]
            full = per_layer[:, :, None].expand(-1, -1, self.num_kv_heads).clone()
        else:
            slot_mapping = torch.cat(slots)
        if per_head:
            victims = budget.decode_slots([it for _, it, _, _ in per_head])  # [n, L, H] logical
            for i, (row, item, rows, index) in enumerate(per_head):
                table = torch.tensor(item.block_table, dtype=torch.int64)
                full[:, row, :] = physical_slots(victims[i].cpu(), table, block)
                rows.context_lens[index] = budget.states[item.seq_id].num_slots
        if per_layer_slots:
            slot_mapping = full
        modes = dec.modes + pre.modes
        wanted = {m for m in modes if m is not None}
        score = None if not wanted else (wanted.pop() if len(wanted) == 1 else "mixed")
        meta = AttentionMetadata(
            slot_mapping=slot_mapping.to(dev),
            num_decode_seqs=len(dec),
            decode_block_tables=_pad_tables(dec.tables, dev),
            decode_context_lens=dec.context_lens_tensor(self.num_layers, dev),
            prefill_block_tables=_pad_tables(pre.tables, dev),
            prefill_query_start_loc=torch.tensor(
                [0] + list(itertools.accumulate(pre.query_lens)), dtype=torch.int32, device=dev
            ),
            prefill_context_lens=pre.context_lens_tensor(self.num_layers, dev),
            sliding_window=self.sliding_window,
            score_mode=score,  # type: ignore[arg-type]
            tau=torch.tensor(dec.taus + pre.taus, dtype=torch.float32, device=dev) if score else None,
            gumbel_rows=torch.tensor([m == "gumbel" for m in modes], device=dev) if score == "mixed" else None,
        )
        if not pre.tables:
            meta.prefill_block_tables = meta.prefill_block_tables[:0]
        if not dec.tables:
            meta.decode_block_tables = meta.decode_block_tables[:0]
        return ModelInputs(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.cat(positions).to(dev),
            meta=meta,
            last_token_index=last_index,
            score_rows=score_rows,
        )

    def accumulate_scores(self, inputs: ModelInputs, failed: dict[int, str] | None = None) -> None:
        """Add this step's attention mass to every budgeted sequence's scores; a verifying
        sequence's per-row scores wait for the verdict (``KVBudgetTracker.settle``). A
        sequence whose own state refuses them goes to ``failed`` (raises without it)."""
        meta = inputs.meta
        if meta.score_mode is None:
            return
        layers = range(self.num_layers)
        dec = _stack_layers([meta.scores[l][0] for l in layers]) if meta.num_decode_seqs else None
        pre = _stack_layers([meta.scores[l][1] for l in layers]) if meta.num_prefill_seqs else None
        for item, is_dec, first, count in inputs.score_rows:
            scores = (dec if is_dec else pre)[first : first + count]  # type: ignore[index]
            try:
                if count > 1:
                    self.budget.hold_rows(item, scores)  # [K + 1, L, H, max_ctx]
                else:
                    self.budget.accumulate(item, scores[0])
            except Exception as e:  # noqa: BLE001 — this sequence's budget state; fails it alone
                if failed is None:
                    raise
                failed[item.seq_id] = _failure("KV budget scores", e)

    # ---------------------------------------------------------------- execute
    def copy_blocks(self, copies: list[BlockCopy]) -> None:
        if not copies:
            return
        src = torch.tensor([c[0] for c in copies], device=self.device)
        dst = torch.tensor([c[1] for c in copies], device=self.device)
        for k_cache, v_cache in self.kv_caches:
            k_cache[dst] = k_cache[src]
            v_cache[dst] = v_cache[src]

    @torch.inference_mode()
    def forward_logits(self, inputs: ModelInputs, rows: list[int]) -> torch.Tensor | None:
        """Run the model; float32 logits of the given token rows, [len(rows), vocab] (None on a
        shard that is not the driver: the vocab-parallel LM head gathers onto rank 0)."""
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        index = torch.tensor(rows, dtype=torch.int64, device=hidden.device)
        return self.logits_fn(hidden.index_select(0, index))

    @torch.inference_mode()
    def execute(
        self,
        step: StepInput | StepPlan,
        draft_probs: torch.Tensor | None = None,  # [num_drafted, max_draft, vocab] draft p
        generators: object = None,  # legacy (StepPlan) call only; ignored
        logits_rows: dict[int, int] | None = None,  # legacy: seq_id -> last rows to return
    ) -> StepOutput:
        """One forward for the whole batch: sample, verify drafts, return logits as asked.
        (A bare StepPlan, the older form, only runs the forward and returns logits.)"""
        start = time.perf_counter()
        out = self._execute(step, draft_probs, logits_rows)
        out.execute_s = time.perf_counter() - start
        return out

    def _execute(
        self,
        step: StepInput | StepPlan,
        draft_probs: torch.Tensor | None,
        logits_rows: dict[int, int] | None,
    ) -> StepOutput:
        if isinstance(step, StepPlan):
            step = logits_step_input(step, rows=0)
            for item in step.items:
                item.return_logits = (logits_rows or {}).get(item.seq_id, 0)
            draft_probs = None
        if draft_probs is not None:
            draft_probs = draft_probs.to(self.device)
        self.apply_ops(step.ops)
        failed: dict[int, str] = {}  # seq_id -> why (its own content); empty in a normal step
        for seq_id, info in step.seq_infos.items():
            self.seq_infos[seq_id] = info
            if seq_id not in self.generators:  # a generator's stream survives a rescheduling
                try:
                    self.generators[seq_id] = make_generator(info.params.seed, info.sample_index)
                except Exception as e:  # noqa: BLE001 — its seed; fails it alone
                    failed[seq_id] = _failure("seed", e)
        self.copy_blocks(step.block_copies)
        out = StepOutput(failed=failed)
        if step.is_empty:
            return out
        if failed:  # a sequence that cannot even start leaves the batch before it is packed
            step = _without(step, failed)
        inputs = self.prepare(step, failed)
        items = step.items if not failed else [it for it in step.items if not _touches(it, failed)]
        if inputs is None:
            return out
        last = inputs.last_token_index
        verify = [it for it in items if it.verifies]
        forced = [it for it in items if it.forced_token_id is not None]
        sampled = [it for it in items if it.sample_seq_ids and not it.verifies and it.forced_token_id is None]
        targets = [t for it in sampled for t in it.sample_seq_ids]
        rows = [last[it.seq_id] for it in sampled for _ in it.sample_seq_ids]
        raw: list[tuple[StepItem, int, int]] = []  # (item, first row in `rows`, count)
        for item, count in itertools.chain(
            ((it, it.num_query_tokens) for it in verify),
            ((it, 1) for it in forced),
            ((it, it.return_logits) for it in items if it.return_logits),
        ):
            raw.append((item, len(rows), count))
            end = last[item.seq_id]
            rows.extend(range(end - count + 1, end + 1))
        with self._keyformer_noise(items):
            if rows:
                all_logits = self.forward_logits(inputs, rows)
            else:
                self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
                all_logits = None
        self.accumulate_scores(inputs, failed)
        if not self.is_driver:
            return out
        for item in items:
            state = self.budget.states.get(item.seq_id)
            if state is not None:
                out.kv_stats[item.seq_id] = (state.num_slots, state.num_evicted)
        if all_logits is None:
            return out
        raw_logits = {item.seq_id: all_logits[first : first + n] for item, first, n in raw}
        for item in items:
            if item.return_logits:
                out.logits[item.seq_id] = raw_logits[item.seq_id]
        for item in forced:
            token = item.forced_token_id
            try:
                lp = torch.log_softmax(raw_logits[item.seq_id][-1].float(), dim=-1)[token]
            except Exception as e:  # noqa: BLE001 — its forced token; fails it alone
                failed[item.seq_id] = _failure("forced token", e)
                continue
            out.tokens[item.seq_id] = [token]  # type: ignore[list-item]
            out.logprobs[item.seq_id] = [float(lp)]
        if targets:  # before verification: both may draw from the global RNG, in this order
            self._sample(targets, all_logits[: len(targets)], out)
        if verify:
            self._verify(verify, raw_logits, draft_probs, out)
            verify = [it for it in verify if it.seq_id not in failed] if failed else verify
            self._settled_stats([it for it in verify if it.budget is not None], out)
        return out

    def _keyformer_noise(self, items: list[StepItem]) -> contextlib.AbstractContextManager[object]:
        """Keyformer's Gumbel noise comes from torch's generator inside the attention kernels.
        When every Keyformer sequence in the step has a seed, the forward draws it from a
        generator seeded by (seed, sample, position) of those sequences, so a seeded request
        (alone, or in the same batch) evicts the same tokens every time; the global generator
        is left where it was. Otherwise the noise is fresh."""
        keys = []
        for item in items:
            if item.budget is None or item.budget.policy is not KVPolicy.KEYFORMER:
                continue
            info = self.seq_infos.get(item.seq_id)
            if info is None or info.params.seed is None:
                return contextlib.nullcontext()
            keys.append((info.params.seed, info.sample_index, item.start))
        if not keys:
            return contextlib.nullcontext()
        seed = 0x9E3779B97F4A7C15
        for request_seed, sample_index, start in keys:
            for part in (request_seed, sample_index, start):
                seed = ((seed ^ part) * 0x100000001B3) & 0x7FFFFFFFFFFFFFFF
        return _seeded_cpu_generator(seed)

    def _settled_stats(self, items: list[StepItem], out: StepOutput) -> None:
        """KV stats of budgeted sequences that verified drafts, as they will be once settled:
        the accepted positions kept, then evictions down to the budget."""
        for item in items:
            state = self.budget.states[item.seq_id]
            held = state.num_slots - item.num_query_tokens + out.num_accepted[item.seq_id] + 1
            k = state.spec.budget if state.spec.budget is not None else held
            out.kv_stats[item.seq_id] = (min(held, k), state.num_evicted + max(0, held - k))

    def _sample(self, targets: list[int], logits: torch.Tensor, out: StepOutput) -> None:
        """One token per target row (``logits`` [len(targets), vocab]). If the batch raises,
        each row is sampled alone (the error path) and the rows that still raise fail their
        sequence alone. Their parameters are processed before any generator draws, so the
        others' seeded streams are where the batch left them and each draws what it would
        have drawn in the batch."""
        try:
            self._sample_rows(targets, logits, out)
        except Exception as e:  # noqa: BLE001
            self._per_row("sampling", e, targets, lambda i: self._sample_rows(targets[i : i + 1], logits[i : i + 1], out), out)

    def _sample_rows(self, targets: list[int], logits: torch.Tensor, out: StepOutput) -> None:
        params = [self.seq_infos[t].params for t in targets]
        st = SamplingTensors.from_params(params, device=logits.device)
        want_logprobs = any(p.logprobs for p in params)
        gens = [self.generators.get(t) for t in targets]
        tokens, logprobs = sample(logits, st, gens, want_logprobs)
        token_list = tokens.tolist()
        lp_list = logprobs.tolist() if logprobs is not None else None
        for i, target in enumerate(targets):
            out.tokens[target] = [token_list[i]]
            if lp_list is not None and params[i].logprobs:
                out.logprobs[target] = [lp_list[i]]

    def _verify(
        self,
        items: list[StepItem],
        raw_logits: dict[int, torch.Tensor],  # seq_id -> [1 + num_draft, vocab]
        draft_probs: torch.Tensor | None,  # [num_drafted, max_draft, vocab]
        out: StepOutput,
    ) -> None:
        """Rejection sampling of every verifying sequence at once; per sequence on the error
        path, like ``_sample``."""
        if draft_probs is None:
            raise RuntimeError("a step with draft tokens needs the draft probabilities")
        try:
            self._verify_rows(items, raw_logits, draft_probs, out)
        except Exception as e:  # noqa: BLE001
            self._per_row("speculative verification", e, [it.seq_id for it in items],
                          lambda i: self._verify_rows(items[i : i + 1], raw_logits, draft_probs, out), out)

    def _verify_rows(self, items: list[StepItem], raw_logits: dict[int, torch.Tensor],
                     draft_probs: torch.Tensor, out: StepOutput) -> None:
        results = verify_drafts(
            [raw_logits[it.seq_id] for it in items],
            draft_probs[torch.tensor([it.draft_row for it in items], dtype=torch.int64)],
            [it.draft_token_ids for it in items],
            [self.seq_infos[it.seq_id].params for it in items],
            [self.generators.get(it.seq_id) for it in items],
        )
        for item, (tokens, logprobs, accepted) in zip(items, results):
            out.tokens[item.seq_id] = tokens
            if logprobs is not None:
                out.logprobs[item.seq_id] = logprobs
            out.num_accepted[item.seq_id] = accepted

    @staticmethod
    def _per_row(what: str, error: Exception, seq_ids: list[int], run_row: Callable[[int], None],
                 out: StepOutput) -> None:
        """The error path of a batched stage: run each row alone; the rows that raise fail
        their sequence. If none does, the batch's error was not any one row's: re-raise it."""
        culprits = 0
        for i, seq_id in enumerate(seq_ids):
            try:
                run_row(i)
            except Exception as e:  # noqa: BLE001
                out.failed[seq_id] = _failure(what, e)
                culprits += 1
        if not culprits:
            raise error


def _failure(what: str, error: BaseException) -> str:
    """Why a sequence failed, for its request's error message."""
    text = f"{what} failed: {type(error).__name__}: {error}"
    return text if len(text) <= 300 else text[:297] + "..."


def _touches(item: StepItem, failed: dict[int, str]) -> bool:
    """The item runs a failed sequence (or samples into one: a sibling fails the request)."""
    return item.seq_id in failed or any(t in failed for t in item.sample_seq_ids)


def _without(step: StepInput, failed: dict[int, str]) -> StepInput:
    """The step without the items that touch failed sequences (decode items stay first)."""
    decode = [it for it in step.items[: step.num_decode] if not _touches(it, failed)]
    rest = [it for it in step.items[step.num_decode :] if not _touches(it, failed)]
    return dataclasses.replace(step, items=decode + rest, num_decode=len(decode))


def _stack_layers(
    per_layer: list[torch.Tensor],  # num_layers x [num_seqs, num_kv_heads, max_ctx of that layer]
) -> torch.Tensor:  # [num_seqs, num_layers, num_kv_heads, max_ctx] zero-padded
    """Layers may attend over different context lengths (a sequence whose layers hold different
    counts): pad each layer's scores to the widest before stacking."""
    width = max(t.shape[-1] for t in per_layer)
    if any(t.shape[-1] != width for t in per_layer):
        per_layer = [torch.nn.functional.pad(t, (0, width - t.shape[-1])) for t in per_layer]
    return torch.stack(per_layer, dim=1)
