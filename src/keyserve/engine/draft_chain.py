"""Greedy draft forwards without the runner's step machinery: the K draft forwards of a greedy
proposal, each fed the tokens the one before drew.

Why: a draft forward of the default draft (2 layers, an 8,192-token head) costs ~0.7 ms of
native kernels on the 2-core EPYC, and going through ``ModelRunner.execute`` added ~0.3 ms to
each: a ``StepInput`` built and packed again (``prepare``), the step's bookkeeping, and logits
spread over the full 49,152-token vocabulary (``-inf`` outside the head) only for an argmax.
At K = 4 that was ~1.2 ms of a ~26 ms speculative step (issue 19's step-cost target missed it
by 0.8 ms). Here, while the batch's rows stay the same one-token decodes, the next forward's
inputs are the last one's with every position one further on (a block table refreshed only
when a row's grew), and a pruned head's argmax is taken over its own tokens.

Only what ``execute`` would do for these rows is done: sequences without a KV budget (no slot
planning, no scores, no seeds), every one greedy, one new token each. Anything else takes the
runner's usual path, as does the first forward of a proposal (its catch-up rows).
"""

from __future__ import annotations

import dataclasses

import torch

from keyserve.core.sampler import row_argmax
from keyserve.engine.model_runner import ModelInputs, ModelRunner, pad_tables
from keyserve.kernels.metadata import AttentionMetadata


def _head_logits(
    runner: ModelRunner,
    inputs: ModelInputs,
    rows: list[int],  # the token rows whose next-token logits are wanted
) -> tuple[torch.Tensor, torch.Tensor | None]:  # [len(rows), head or vocab] logits, head ids
    """One forward; each of ``rows``' logits over a pruned head's own tokens (with its ids,
    ascending) or, under CUDA graphs or with a full head, over the whole vocabulary (ids None)."""
    model = runner.model
    head_ids: torch.Tensor | None = getattr(model, "head_token_ids", None)
    if runner.graphs is not None or head_ids is None:  # CUDA graphs, or a full head: the runner's way
        logits, _ = runner.forward_logits(inputs, rows)
        assert logits is not None
        return logits, None
    index = torch.tensor(rows, dtype=torch.int64, device=inputs.input_ids.device)
    hidden, _ = model(inputs.input_ids, inputs.positions, runner.kv_caches, inputs.meta, index)
    return model.compute_head_logits(hidden), head_ids  # type: ignore[operator]


def greedy_tokens(
    runner: ModelRunner,
    inputs: ModelInputs,
    rows: list[int],  # the token rows whose next token is wanted
) -> torch.Tensor:  # [len(rows)] int64 argmax token ids
    """One forward; the argmax token of each of ``rows``. A pruned head (``compute_head_logits``
    and ``head_token_ids``, ascending) is argmaxed over its own tokens: the same first maximum as
    over the full vocabulary, where every other token is ``-inf``."""
    logits, head_ids = _head_logits(runner, inputs, rows)
    drawn = row_argmax(logits)
    return drawn if head_ids is None else head_ids[drawn]


def confident_greedy_tokens(
    runner: ModelRunner,
    inputs: ModelInputs,
    rows: list[int],  # the token rows whose next token is wanted
) -> tuple[torch.Tensor, torch.Tensor]:  # [len(rows)] int64 argmax ids, [len(rows)] float32 their probability
    """``greedy_tokens`` and the draft's probability of each (``max_probability``): what a
    confidence threshold stops a chain on."""
    logits, head_ids = _head_logits(runner, inputs, rows)
    drawn = row_argmax(logits)
    return (drawn if head_ids is None else head_ids[drawn]), max_probability(logits)


def max_probability(logits: torch.Tensor) -> torch.Tensor:  # [n, vocab] -> [n] float32
    """Each row's largest softmax probability at temperature 1: the draft's confidence in its
    own argmax (tokens outside a pruned head are ``-inf``, probability 0)."""
    logits = logits.float()
    return torch.exp(logits.amax(-1) - torch.logsumexp(logits, -1))


def top_tokens(
    runner: ModelRunner,
    inputs: ModelInputs,
    rows: list[int],  # the token rows whose likeliest next tokens are wanted
    k: int,
) -> torch.Tensor:  # [len(rows), k] int64 token ids, likeliest first
    """One forward; the ``k`` likeliest next tokens of each of ``rows`` (a tree's children).
    A pruned head is ranked over its own tokens (``greedy_tokens``); with k = 1 this is that
    function's argmax."""
    if k == 1:
        return greedy_tokens(runner, inputs, rows)[:, None]
    logits, head_ids = _head_logits(runner, inputs, rows)
    ranked = torch.topk(logits, k, dim=-1).indices
    return ranked if head_ids is None else head_ids[ranked]


def tree_level_inputs(
    tokens: list[int],  # each row's node token
    positions: list[int],  # each row's position (its root's + its depth)
    slots: list[int],  # each row's physical KV slot
    tables: list[list[int]],  # each row's block table (its sequence's)
    context_lens: list[int],  # each row's context length (its slot's logical index + 1)
    masks: list[int],  # each row's tree mask (AttentionMetadata.decode_tree_masks)
    sliding_window: int | None,
    device: torch.device,
) -> ModelInputs:
    """One forward over one depth of draft trees: every row a decode row that sees its
    sequence's prefix, its ancestors and itself."""
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        num_decode_seqs=len(tokens),
        decode_block_tables=pad_tables(tables, device),
        decode_context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        prefill_block_tables=torch.zeros(0, 1, dtype=torch.int32, device=device),
        prefill_query_start_loc=torch.zeros(1, dtype=torch.int32, device=device),
        prefill_context_lens=torch.zeros(0, dtype=torch.int32, device=device),
        sliding_window=sliding_window,
        decode_tree_masks=torch.tensor(masks, dtype=torch.int64, device=device),
    )
    return ModelInputs(torch.tensor(tokens, dtype=torch.int64, device=device),
                       torch.tensor(positions, dtype=torch.int64, device=device), meta, {})


def next_decode_inputs(
    inputs: ModelInputs,  # the last forward's: one-token decode rows only
    tokens: torch.Tensor,  # [num_rows] int64, each row's next input token
    tables: list[list[int]] | None,  # each row's block table, if any grew since; else None
    block_size: int,
) -> ModelInputs:
    """The inputs of the forward after ``inputs``, over the same rows, one position further."""
    meta = inputs.meta
    positions = inputs.positions + 1  # [num_rows]
    block_tables = meta.decode_block_tables
    if tables is not None:
        block_tables = pad_tables(tables, block_tables.device)
    rows = torch.arange(positions.shape[0], device=positions.device)
    blocks = block_tables[rows, positions // block_size].to(torch.int64)  # [num_rows]
    slot_mapping = blocks * block_size + positions % block_size
    meta = dataclasses.replace(meta, slot_mapping=slot_mapping, decode_block_tables=block_tables,
                               decode_context_lens=meta.decode_context_lens + 1)
    return ModelInputs(tokens.to(inputs.input_ids.device), positions, meta, inputs.last_token_index)
