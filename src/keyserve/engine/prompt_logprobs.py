"""The model side of prompt log-probabilities: the prompt rows' logits, a slice at a time.

A prompt chunk can be the whole step's token budget (2,048 rows): its logits at once would be
[2048, 49152] float32, 400 MB. The rows' final hidden states leave the model instead
(``ModelRunner.forward_rows``'s ``hidden_rows``) and go through the LM head ``ROWS_PER_PASS``
at a time; each pass keeps only the target token's log-probability, its rank in the row's
distribution (1: the likeliest, as vLLM's ``Logprob.rank``) and the top alternatives.
Every tensor-parallel rank runs the same passes: the vocab-parallel head gathers onto rank 0
in each.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from keyserve.core.prompt_logprobs import prompt_logprob_targets
from keyserve.core.sampler import top_entries
from keyserve.engine.step_input import StepItem

ROWS_PER_PASS = 256  # [256, vocab] float32 logits at a time: 50 MB for a 49k vocabulary


def prompt_rows(items: list[StepItem], last_row: dict[int, int]) -> list[tuple[StepItem, int]]:
    """The items that ask, each with the step row of its chunk's first token."""
    return [(it, last_row[it.seq_id] - it.num_query_tokens + 1) for it in items if it.prompt_logprob_rows]


def prompt_logprobs(
    logits_fn: Callable[[torch.Tensor], torch.Tensor | None],
    hidden: torch.Tensor,  # [sum of the items' prompt_logprob_rows, hidden_size], in item order
    items: list[StepItem],  # those that ask (prompt_rows), the order of ``hidden``
    top_counts: list[int],  # alternatives per item (SamplingParams.prompt_logprobs)
) -> dict[int, tuple[int, list[float], list[list[tuple[int, float]]], list[int]]]:
    """seq_id -> (first position, each row's target log-probability, its top alternatives,
    the target's rank); empty on a shard that is not the driver (it took part in every gather)."""
    targets: list[int] = []
    counts: list[int] = []
    for item, n in zip(items, top_counts, strict=True):
        targets += prompt_logprob_targets(item.token_ids, item.prompt_logprob_rows, item.next_prompt_token)
        counts += [n] * item.prompt_logprob_rows
    values: list[float] = []
    ranks: list[int] = []
    tops: list[list[tuple[int, float]]] = []
    for a in range(0, hidden.shape[0], ROWS_PER_PASS):
        logits = logits_fn(hidden[a : a + ROWS_PER_PASS])  # [rows, vocab] on the driver
        if logits is None:
            continue
        logp = torch.log_softmax(logits.float(), dim=-1)
        want = torch.tensor(targets[a : a + ROWS_PER_PASS], dtype=torch.int64, device=logp.device)
        chosen = logp.gather(1, want[:, None])  # [rows, 1]
        values += chosen.squeeze(1).tolist()
        ranks += ((logp > chosen).sum(-1) + 1).tolist()
        tops += top_entries(logp, counts[a : a + ROWS_PER_PASS])
    if not values:
        return {}
    out = {}
    row = 0
    for item in items:
        n = item.prompt_logprob_rows
        out[item.seq_id] = (item.start + 1, values[row : row + n], tops[row : row + n], ranks[row : row + n])
        row += n
    return out
