"""Padded training batches over the recorded answers, and the distillation loss.

A sequence is ``prompt + answer[:-1]``; the draft is trained at the positions that predict the
answer's tokens (the prompt is context only: speculation always starts after it). The target's
recorded top-k rows are mapped into the draft's pruned vocabulary for the loss.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from keyserve.training.records import TeacherData


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, T] int64, right-padded with 0
    positions: torch.Tensor  # [B, T] int64
    rows: torch.Tensor  # [M] int64 batch row of each predicting position
    cols: torch.Tensor  # [M] int64 time index of each predicting position
    teacher_idx: torch.Tensor  # [M, k] int64 draft-vocab index of the target's top-k (-1: none)
    teacher_lp: torch.Tensor  # [M, k] float32 the target's log-probabilities of them
    teacher_top1: torch.Tensor  # [M] int64 the target's most likely token (full vocab)

    @property
    def num_targets(self) -> int:
        return int(self.rows.numel())


def _length(data: TeacherData, i: int) -> int:
    prompt = int(data.prompt_offsets[i + 1] - data.prompt_offsets[i])
    gen = int(data.gen_offsets[i + 1] - data.gen_offsets[i])
    return prompt + max(gen - 1, 0)


def make_batch(data: TeacherData, seqs: list[int], head_map: torch.Tensor) -> Batch:
    """Pad ``seqs`` into one batch; ``head_map``: [vocab] full id -> draft index or -1."""
    answers = [data.answer(i) for i in seqs]
    width = max(len(a.prompt) + len(a.tokens) - 1 for a in answers)
    ids = torch.zeros(len(answers), width, dtype=torch.int64)
    rows, cols, top_ids, top_lp = [], [], [], []
    for r, a in enumerate(answers):
        seq = a.prompt + a.tokens[:-1]
        ids[r, : len(seq)] = torch.tensor(seq, dtype=torch.int64)
        p, g = len(a.prompt), len(a.tokens)
        rows.append(torch.full((g,), r, dtype=torch.int64))
        cols.append(torch.arange(p - 1, p - 1 + g))
        top_ids.append(a.topk_ids.long())
        top_lp.append(a.topk_logprobs.float())
    full_ids = torch.cat(top_ids)
    return Batch(
        input_ids=ids,
        positions=torch.arange(width).expand(len(answers), width),
        rows=torch.cat(rows),
        cols=torch.cat(cols),
        teacher_idx=head_map[full_ids],
        teacher_lp=torch.cat(top_lp),
        teacher_top1=full_ids[:, 0],
    )


def plan_batches(
    data: TeacherData, seqs: list[int], batch_tokens: int, rng: random.Random
) -> list[list[int]]:
    """Group sequences of similar length so ``rows * longest`` stays within ``batch_tokens``
    (little padding), in a shuffled order."""
    order = sorted(seqs, key=lambda i: _length(data, i))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = max(_length(data, j) for j in current + [i])
        if current and longest * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    rng.shuffle(batches)
    return batches


def distill_loss(
    logits: torch.Tensor,  # [M, N] the draft's logits over its vocabulary
    teacher_idx: torch.Tensor,  # [M, k] int64 draft index of the target's top-k, -1 = none
    teacher_lp: torch.Tensor,  # [M, k] float32 the target's log-probabilities
    argmax_weight: float = 0.0,
) -> torch.Tensor:  # [] mean KL(target || draft) over positions (+ the weighted argmax term)
    """Forward KL from the target's top-k distribution, restricted to the draft's vocabulary
    and renormalised there (the draft cannot place mass anywhere else); with ``argmax_weight``
    plus that times ``argmax_loss``, both from one log-softmax of the logits."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    present = teacher_idx >= 0
    draft_lp = logp.gather(1, teacher_idx.clamp_min(0))  # [M, k]
    q = teacher_lp.exp() * present
    q = q / q.sum(-1, keepdim=True).clamp_min(1e-12)
    log_q = torch.log(q.clamp_min(1e-30))
    kl = (q * (log_q - draft_lp)).sum(-1).mean()
    return kl + argmax_weight * _argmax_nll(logp, teacher_idx, teacher_lp) if argmax_weight else kl


def argmax_loss(
    logits: torch.Tensor,  # [M, N] the draft's logits over its vocabulary
    teacher_idx: torch.Tensor,  # [M, k] int64 draft index of the target's top-k, -1 = none
    teacher_lp: torch.Tensor,  # [M, k] float32 the target's log-probabilities
) -> torch.Tensor:  # [] mean cross-entropy of the draft at the target's likeliest token
    """Cross-entropy against the target's argmax: what greedy acceptance rewards (the draft's
    argmax must be the target's; the forward KL also spends the draft's capacity on the rest
    of the distribution). Positions whose argmax the draft's vocabulary lacks are left out."""
    return _argmax_nll(torch.log_softmax(logits.float(), dim=-1), teacher_idx, teacher_lp)


def _argmax_nll(
    logp: torch.Tensor,  # [M, N] the draft's log-probabilities
    teacher_idx: torch.Tensor,  # [M, k] int64
    teacher_lp: torch.Tensor,  # [M, k] float32
) -> torch.Tensor:  # [] ``argmax_loss`` from log-probabilities already taken
    top = teacher_lp.argmax(-1, keepdim=True)  # [M, 1]
    idx = teacher_idx.gather(1, top)[:, 0]  # [M]
    valid = idx >= 0
    if not bool(valid.any()):
        return logp.sum() * 0.0
    return -logp[valid].gather(1, idx[valid, None]).mean()


def overlap(
    logits: torch.Tensor,  # [M, N]
    teacher_idx: torch.Tensor,  # [M, k] int64
    teacher_lp: torch.Tensor,  # [M, k] float32
) -> torch.Tensor:  # [M] sum_x min(p(x), q(x)) over the target's top-k
    """The speculative acceptance probability at temperature 1 for each position (a lower
    bound: mass outside the recorded top-k is ignored)."""
    p = torch.softmax(logits.float(), dim=-1).gather(1, teacher_idx.clamp_min(0))
    p = p * (teacher_idx >= 0)
    return torch.minimum(p, teacher_lp.exp()).sum(-1)
