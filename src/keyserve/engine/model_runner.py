"""Executes a StepPlan on the model: pack tokens, copy blocks, forward, sample.

This is the only place that turns scheduler decisions into tensors. It knows nothing about
requests, stop conditions or text: it returns sampled tokens per sequence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from keyserve.core.block_manager import BlockCopy
from keyserve.core.sampler import SamplingTensors, sample
from keyserve.core.scheduler import ScheduledSeq, StepPlan
from keyserve.core.sequence import Sequence
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


def kv_cache_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        sliding_window: int | None,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.device = device

    # ----------------------------------------------------------------- inputs
    def prepare(self, plan: StepPlan) -> ModelInputs:
        block = self.block_size
        ids: list[int] = []
        pos_chunks: list[torch.Tensor] = []
        slot_chunks: list[torch.Tensor] = []
        last_index: dict[int, int] = {}
        dec_positions = []
        dec_slots = []
        for item in plan.decode:
            seq = item.seq
            p = item.start
            ids.append(seq.token_at(p))
            dec_positions.append(p)
            dec_slots.append(seq.block_table[p // block] * block + p % block)
            last_index[seq.seq_id] = len(ids) - 1
        if plan.decode:
            pos_chunks.append(torch.tensor(dec_positions, dtype=torch.int64))
            slot_chunks.append(torch.tensor(dec_slots, dtype=torch.int64))
        query_start = [0]
        for item in plan.prefill:
            seq = item.seq
            start, n = item.start, item.num_new_tokens
            ids.extend(seq.token_ids[start : start + n])
            positions = torch.arange(start, start + n, dtype=torch.int64)
            table = torch.tensor(seq.block_table, dtype=torch.int64)
            pos_chunks.append(positions)
            slot_chunks.append(table[positions // block] * block + positions % block)
            query_start.append(query_start[-1] + n)
            last_index[seq.seq_id] = len(ids) - 1
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.cat(slot_chunks).to(dev),
            num_decode_seqs=len(plan.decode),
            decode_block_tables=_pad_tables([s.seq.block_table for s in plan.decode], dev),
            decode_context_lens=torch.tensor(
                [s.start + 1 for s in plan.decode], dtype=torch.int32, device=dev
            ),
            prefill_block_tables=_pad_tables([s.seq.block_table for s in plan.prefill], dev),
            prefill_query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=dev),
            prefill_context_lens=torch.tensor(
                [s.start + s.num_new_tokens for s in plan.prefill], dtype=torch.int32, device=dev
            ),
            sliding_window=self.sliding_window,
        )
        if not plan.prefill:
            meta.prefill_block_tables = meta.prefill_block_tables[:0]
        if not plan.decode:
            meta.decode_block_tables = meta.decode_block_tables[:0]
        return ModelInputs(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.cat(pos_chunks).to(dev),
            meta=meta,
            last_token_index=last_index,
        )

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
    ) -> StepResult:
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
        if not rows:
            self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)
            return StepResult()
        logits = self.forward_logits(inputs, rows)
        st = SamplingTensors.from_params([t.params for t in targets], device=logits.device)
        want_logprobs = any(t.params.logprobs for t in targets)
        tokens, logprobs = sample(logits, st, [generators.get(t.seq_id) for t in targets], want_logprobs)
        result = StepResult()
        token_list = tokens.tolist()
        lp_list = logprobs.tolist() if logprobs is not None else None
        for i, target in enumerate(targets):
            result.tokens[target.seq_id] = token_list[i]
            if lp_list is not None and target.params.logprobs:
                result.logprobs[target.seq_id] = lp_list[i]
        return result


def num_blocks_for_memory(memory_gb: float, bytes_per_block: int) -> int:
    return max(2, int(math.floor(memory_gb * (1 << 30) / bytes_per_block)))
