"""The draft's pruned LM-head vocabulary: the tokens the target actually puts mass on.

At batch 1 the LM head is the draft's largest read (49k x 576 for SmolLM2, more than two
decoder layers), and a chat model's answers use a small part of its vocabulary. Tokens are
ranked by the target's own probability mass over its answers (top-k soft counts, which also
credits likely-but-unsampled tokens); special tokens (EOS, chat markers) are always kept.
"""

from __future__ import annotations

import torch

from keyserve.training.records import TeacherData


def token_mass(data: TeacherData, vocab_size: int) -> torch.Tensor:  # [vocab] float64
    """Summed target probability of every token over all recorded positions (top-k only)."""
    probs = data.topk_logprobs.float().exp().double().reshape(-1)
    ids = data.topk_ids.long().reshape(-1)
    return torch.zeros(vocab_size, dtype=torch.float64).index_add_(0, ids, probs)


def select_vocab(
    data: TeacherData, vocab_size: int, size: int, always: list[int]
) -> torch.Tensor:  # [min(size, vocab_size)] int64, sorted ascending
    """The ``size`` tokens with the most target mass, ``always`` included first."""
    size = min(size, vocab_size)
    forced = sorted({t for t in always if 0 <= t < vocab_size})
    if len(forced) > size:
        raise ValueError(f"{len(forced)} special tokens do not fit a vocabulary of {size}")
    mass = token_mass(data, vocab_size)
    mass[forced] = float("inf")
    # Ties (tokens never seen) are broken by id so the choice is deterministic.
    order = torch.argsort(mass, descending=True, stable=True)
    return order[:size].sort().values


def coverage(
    data: TeacherData, ids: torch.Tensor, vocab_size: int  # ids: [N] int64 the draft's tokens
) -> float:
    """Share of the target's recorded top-k probability mass that falls inside ``ids``."""
    mass = token_mass(data, vocab_size)
    total = float(mass.sum())
    return float(mass[ids].sum()) / total if total > 0 else 1.0


def index_map(
    ids: torch.Tensor, vocab_size: int  # ids: [N] int64 the draft's tokens
) -> torch.Tensor:  # [vocab] int64
    """Full-vocabulary id -> position in ``ids`` (-1 where the draft has no row)."""
    table = torch.full((vocab_size,), -1, dtype=torch.int64)
    table[ids] = torch.arange(ids.numel())
    return table
