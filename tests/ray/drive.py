"""Drive any model runner (in-process ``ModelRunner`` or a Ray ``TargetGroup``) with StepInputs
from a ``KVCore``: greedy tokens plus the logits of every computed row."""

from __future__ import annotations

import torch

from keyserve.core.sampling_params import SamplingParams
from keyserve.core.scheduler import SchedulerConfig
from keyserve.core.sequence import FinishReason, Sequence
from keyserve.engine.kv_core import KVCore
from keyserve.engine.step_input import StepOutput


def greedy_with_logits(
    runner, prompts: list[list[int]], max_tokens: int, num_blocks: int, block_size: int = 16,
    max_num_batched_tokens: int = 2048,
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Per prompt: its greedy tokens and [prompt + max_tokens - 1, vocab] logits."""
    core = KVCore(num_blocks, block_size, False, SchedulerConfig(max_num_batched_tokens, 64, True), 10_000)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    seqs = [Sequence(f"r{i}", list(p), params) for i, p in enumerate(prompts)]
    for seq in seqs:
        core.add([seq])
    rows: dict[int, list[torch.Tensor]] = {s.seq_id: [] for s in seqs}
    while core.has_work:
        step = core.schedule().step
        assert step is not None
        for item in step.items:
            item.return_logits = item.num_query_tokens
        out = runner.execute(step)
        kept = StepOutput()
        for item in step.items:
            rows[item.seq_id].append(out.logits[item.seq_id])
            if item.sample_seq_ids:
                seq = next(s for s in seqs if s.seq_id == item.seq_id)
                kept.tokens[item.seq_id] = out.tokens[item.seq_id]
                if len(seq.output_token_ids) + 1 >= max_tokens:
                    kept.finished[item.seq_id] = FinishReason.LENGTH
        core.commit(kept)
    assert core.block_manager.num_free_blocks == num_blocks
    return [s.output_token_ids for s in seqs], [torch.cat(rows[s.seq_id]) for s in seqs]
