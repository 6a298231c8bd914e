"""The model side of multi-step scheduling: a round's extra decode steps, run back to back.

``core/multi_step.py`` decides which sequences take extra steps and the KV core reserves their
slots (``StepItem.num_lookahead``, as for draft tokens). After the round's first forward has
sampled each sequence's next token, step j feeds every sequence with ``num_lookahead >= j`` the
token step j - 1 sampled, at position ``start + j``, and samples again with the sequence's own
generator: the same draws, in the same order, as j more single steps (a seeded request gives
the same tokens whatever the number of steps per round). The answer is a verified run whose
every draft was accepted (``tokens``: 1 + k, ``num_accepted``: k), which the engine's stop
checks cut and the KV core commits as it commits drafts.

Under tensor parallelism rank 0 samples and broadcasts each step's tokens; every rank runs the
same forwards (same rows, same collectives).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from keyserve.engine.step_input import StepInput, StepItem, StepOutput


def decode_on(runner: Any, items: list[StepItem], out: StepOutput | None) -> None:
    """Run ``items``' extra decode steps on ``runner``, the ``ModelRunner`` (untyped: it imports
    this module, and tests/unit/test_import_layers.py forbids the cycle). ``out``: the round's
    answer so far, whose ``tokens`` hold each item's first sample (rank 0), extended here; None
    on the other ranks. A sequence whose sampling fails in a later step fails alone
    (``out.failed``); its row runs on with a placeholder token so that every rank keeps the
    same batch."""
    if not items:
        return
    tokens = [out.tokens[it.seq_id][0] if out is not None and it.seq_id in out.tokens else 0 for it in items]
    tp = runner.model.tp
    for j in range(1, max(it.num_lookahead for it in items) + 1):
        live = [i for i, it in enumerate(items) if it.num_lookahead >= j]
        if tp.size > 1:
            tokens = _broadcast(tokens, runner.device)
        batch = [StepItem(items[i].seq_id, [tokens[i]], items[i].start + j, items[i].block_table,
                          sample_seq_ids=[items[i].seq_id]) for i in live]
        inputs = runner.prepare(StepInput(batch, len(batch)))
        assert inputs is not None  # plain decode rows: nothing to plan, nothing can fail
        logits, _ = runner.forward_logits(inputs, list(range(len(batch))))
        if out is None or logits is None:
            continue
        sampled = StepOutput()
        seq_ids = [it.seq_id for it in batch]
        runner.sample(seq_ids, logits, sampled)
        for i, seq_id in zip(live, seq_ids):
            if seq_id in out.failed:
                continue
            if seq_id in sampled.failed:
                out.failed[seq_id] = sampled.failed[seq_id]
                for part in (out.tokens, out.logprobs, out.top_logprobs, out.num_accepted):
                    part.pop(seq_id, None)
                continue
            tokens[i] = token = sampled.tokens[seq_id][0]
            out.tokens[seq_id].append(token)
            if seq_id in sampled.logprobs:
                out.logprobs[seq_id].append(sampled.logprobs[seq_id][0])
            if seq_id in sampled.top_logprobs:
                out.top_logprobs[seq_id].append(sampled.top_logprobs[seq_id][0])
            out.num_accepted[seq_id] = j


def _broadcast(tokens: list[int], device: torch.device) -> list[int]:
    """Rank 0's tokens on every rank of the tensor-parallel group."""
    t = torch.tensor(tokens, dtype=torch.int64, device=device)
    dist.broadcast(t, src=0)
    return t.tolist()
