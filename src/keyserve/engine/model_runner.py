"""Executes a StepPlan on the model: pack tokens, copy blocks, forward, sample.

This is the only place that turns scheduler decisions into tensors. It knows nothing about
requests, stop conditions or text: it returns sampled tokens per sequence.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import torch

from keyserve.core.block_manager import BlockCopy
from keyserve.core.sampler import SamplingTensors, sample
from keyserve.core.scheduler import ScheduledSeq, StepPlan
from keyserve.core.sequence import Sequence
from keyserve.engine.kv_budget import BudgetDefaults, KVBudgetTracker, budget_spec, physical_slots
from keyserve.kernels.metadata import AttentionMetadata


@dataclass
class SampleRequest:
    """Rows to sample from one sequence's last logits: the sequence itself and, for a request
    with n > 1 finishing its prompt, the siblings that fork from it."""

    source: ScheduledSeq
    targets: list[Sequence]


@dataclass
class StepResult:
    tokens: dict[int, int] = field(default_factory=dict)  # seq_id -> sampled token
    logprobs: dict[int, float] = field(default_factory=dict)  # seq_id -> its logprob
    # seq_id -> [rows, vocab] float32 logits of the last rows of a verified item
    logits: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class ModelInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    last_token_index: dict[int, int]  # seq_id -> row of its last query token


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
        budget_defaults: BudgetDefaults | None = None,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.device = device
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.budget_defaults = budget_defaults or BudgetDefaults()
        self.budget = KVBudgetTracker(num_layers, num_kv_heads, block_size, device)

    # ----------------------------------------------------------------- inputs
    def prepare(self, plan: StepPlan) -> ModelInputs:
        """Pack the step's tokens; budgeted sequences get their slots from the KV policy."""
        block = self.block_size
        budget = self.budget
        dev = self.device
        ids: list[int] = []
        positions: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []  # physical slot per token (same in every layer/head)
        last_index: dict[int, int] = {}
        context_lens: list[int] = []  # per sequence: slots attended after this step's writes
        per_head: list[tuple[int, Sequence]] = []  # (token row, seq) whose slot differs per head
        modes: list[str | None] = []
        taus: list[float] = []
        for item in plan.scheduled:
            seq, start, n = item.seq, item.start, item.num_query_tokens
            row = len(ids)
            ids.extend(seq.token_ids[start : start + item.num_new_tokens])
            ids.extend(item.draft_token_ids)
            if item.draft_token_ids and seq.kv_budgeted:
                raise RuntimeError("speculative verification under a KV budget is not supported")
            pos = torch.arange(start, start + n, dtype=torch.int64)
            positions.append(pos)
            last_index[seq.seq_id] = row + n - 1
            state = budget.get(seq) if seq.kv_budgeted else None
            if seq.kv_budgeted and (state is None or start == 0):
                state = budget.start(seq, budget_spec(seq, self.budget_defaults))
            table = torch.tensor(seq.block_table, dtype=torch.int64)
            if state is None:
                logical = pos
                context_lens.append(start + n)
            elif budget.due_for_compaction(seq):  # prompt phase: fresh slots, no eviction
                logical = state.append(n)
                context_lens.append(state.num_slots)
            else:
                if n != 1:
                    raise RuntimeError("a compacted sequence can only decode one token per step")
                logical = torch.zeros(1, dtype=torch.int64)  # replaced per head below
                per_head.append((row, seq))
                context_lens.append(-1)  # filled once the victims are known
            slots.append(physical_slots(logical.cpu(), table, block))
            modes.append(budget.score_mode(seq) if state is not None else None)
            taus.append(budget.tau(seq, decoding=not budget.due_for_compaction(seq)) if state is not None else 1.0)
        slot_mapping = torch.cat(slots)
        if per_head:
            seqs = [s for _, s in per_head]
            victims = budget.decode_slots(seqs)  # [n, L, H] logical
            full = slot_mapping[None, :, None].expand(self.num_layers, -1, self.num_kv_heads).clone()
            index = {s.seq_id: i for i, s in enumerate(seqs)}
            for row, seq in per_head:
                table = torch.tensor(seq.block_table, dtype=torch.int64)
                full[:, row, :] = physical_slots(victims[index[seq.seq_id]].cpu(), table, block)
            slot_mapping = full
            sched = plan.scheduled
            for i, item in enumerate(sched):
                if context_lens[i] == -1:
                    context_lens[i] = budget.get(item.seq).num_slots
        n_dec = len(plan.decode)
        wanted = {m for m in modes if m is not None}
        score = None if not wanted else (wanted.pop() if len(wanted) == 1 else "mixed")
        meta = AttentionMetadata(
            slot_mapping=slot_mapping.to(dev),
            num_decode_seqs=n_dec,
            decode_block_tables=_pad_tables([s.seq.block_table for s in plan.decode], dev),
            decode_context_lens=torch.tensor(context_lens[:n_dec], dtype=torch.int32, device=dev),
            prefill_block_tables=_pad_tables([s.seq.block_table for s in plan.prefill], dev),
            prefill_query_start_loc=torch.tensor(
                [0] + list(itertools.accumulate(s.num_query_tokens for s in plan.prefill)),
                dtype=torch.int32,
                device=dev,
            ),
            prefill_context_lens=torch.tensor(context_lens[n_dec:], dtype=torch.int32, device=dev),
            sliding_window=self.sliding_window,
            score_mode=score,  # type: ignore[arg-type]
            tau=torch.tensor(taus, dtype=torch.float32, device=dev) if score else None,
            gumbel_rows=torch.tensor([m == "gumbel" for m in modes], device=dev) if score == "mixed" else None,
        )
        if not plan.prefill:
            meta.prefill_block_tables = meta.prefill_block_tables[:0]
        if not plan.decode:
            meta.decode_block_tables = meta.decode_block_tables[:0]
        return ModelInputs(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.cat(positions).to(dev),
            meta=meta,
            last_token_index=last_index,
        )

    def accumulate_scores(self, plan: StepPlan, meta: AttentionMetadata) -> None:
        """Add this step's attention mass to every budgeted sequence's scores."""
        if meta.score_mode is None:
            return
        layers = range(self.num_layers)
        n_dec = len(plan.decode)
        dec = torch.stack([meta.scores[l][0] for l in layers], dim=1) if n_dec else None
        pre = torch.stack([meta.scores[l][1] for l in layers], dim=1) if plan.prefill else None
        for i, item in enumerate(plan.scheduled):
            if self.budget.get(item.seq) is None:
                continue
            scores = dec[i] if i < n_dec else pre[i - n_dec]  # type: ignore[index]
            self.budget.accumulate(item.seq, scores)

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
    def forward_logits(self, inputs: ModelInputs, rows: list[int]) -> torch.Tensor:
        """Run the model and return float32 logits of the given token rows: [len(rows), vocab]."""
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
        index = torch.tensor(rows, dtype=torch.int64, device=hidden.device)
        return self.model.compute_logits(hidden.index_select(0, index)).float()

    @torch.inference_mode()
    def execute(
        self,
        plan: StepPlan,
        samples: list[SampleRequest],
        generators: dict[int, torch.Generator | None],
        logits_rows: dict[int, int] | None = None,  # seq_id -> how many last rows to return
    ) -> StepResult:
        """One forward: sample for ``samples`` and return raw logits for ``logits_rows``."""
        self.copy_blocks(plan.blocks_to_copy)
        if plan.is_empty:
            return StepResult()
        inputs = self.prepare(plan)
        rows: list[int] = []
        targets: list[Sequence] = []
        for req in samples:
            for target in req.targets:
                rows.append(inputs.last_token_index[req.source.seq.seq_id])
                targets.append(target)
        raw: list[tuple[int, int, int]] = []  # (seq_id, first row in `rows`, count)
        for seq_id, count in (logits_rows or {}).items():
            last = inputs.last_token_index[seq_id]
            raw.append((seq_id, len(rows), count))
            rows.extend(range(last - count + 1, last + 1))
        result = StepResult()
        if not rows:
            self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
            self.accumulate_scores(plan, inputs.meta)
            return result
        all_logits = self.forward_logits(inputs, rows)
        self.accumulate_scores(plan, inputs.meta)
        for seq_id, first, count in raw:
            result.logits[seq_id] = all_logits[first : first + count]
        if not targets:
            return result
        logits = all_logits[: len(targets)]
        st = SamplingTensors.from_params([t.params for t in targets], device=logits.device)
        want_logprobs = any(t.params.logprobs for t in targets)
        tokens, logprobs = sample(logits, st, [generators.get(t.seq_id) for t in targets], want_logprobs)
        token_list = tokens.tolist()
        lp_list = logprobs.tolist() if logprobs is not None else None
        for i, target in enumerate(targets):
            result.tokens[target.seq_id] = token_list[i]
            if lp_list is not None and target.params.logprobs:
                result.logprobs[target.seq_id] = lp_list[i]
        return result


def num_blocks_for_memory(memory_gb: float, bytes_per_block: int) -> int:
    return max(2, int(math.floor(memory_gb * (1 << 30) / bytes_per_block)))
