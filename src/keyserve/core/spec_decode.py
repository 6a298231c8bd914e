"""Speculative sampling (docs/algorithms.md §3, Chen et al. 2023): the batched rejection
sampler, statistics and an adaptive choice of K.

Vocabulary (vLLM's): the *draft* model proposes K tokens with probabilities p; the *target*
scores the K + 1 positions in one forward, giving q; a draft token is *accepted* with
probability min(1, q/p); at the first rejection a *recovered* token is drawn from
norm(max(0, q − p)); when all K are accepted a *bonus* token is drawn from q at position K + 1.
The emitted tokens are then distributed exactly as sampling from q alone.

``verify_drafts`` is the engine's entry, once per step for every verifying sequence, on the
device the logits live on: greedy batches only compare drafts with the target's argmax; sampled
ones gather p and q at the drafted tokens and build the residual only for rows that reject.

Everything random comes in as explicit uniforms (or from a ``torch.Generator``) so the sampler is
a pure, testable function. Categorical draws are by inverse CDF (``core.sampler.inverse_cdf``):
one float64 uniform per row picks i with probability π_i / Σπ, with no normalisation and never
a zero-probability token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from keyserve.core.sampler import SamplingTensors, inverse_cdf, processed_probs, row_uniforms, uniforms

PAD_TOKEN_ID = -1


class RejectionOutput(NamedTuple):
    output_token_ids: torch.Tensor  # [num_seqs, max_draft + 1] int64, PAD_TOKEN_ID after the end
    num_accepted: torch.Tensor  # [num_seqs] int64: accepted draft tokens (emitted = this + 1)


def rejection_sample(
    draft_probs: torch.Tensor,  # [num_seqs, max_draft, vocab] p at each draft position
    target_probs: torch.Tensor,  # [num_seqs, max_draft + 1, vocab] q at each position
    draft_token_ids: torch.Tensor,  # [num_seqs, max_draft] int64 (anything past num_draft)
    accept_uniforms: torch.Tensor | None = None,  # [num_seqs, max_draft] in [0, 1)
    draw_uniforms: torch.Tensor | None = None,  # [num_seqs] in [0, 1), recovered/bonus
    *,
    num_draft: torch.Tensor | None = None,  # [num_seqs] int64 in 0..max_draft; default max_draft
    generator: torch.Generator | None = None,  # draws whichever uniforms were not given
) -> RejectionOutput:
    """Modified rejection sampling for a whole batch, vectorised over sequences and positions.

    Accepts x̃_t iff ``r_t · p(x̃_t) < q(x̃_t)`` (that is r < min(1, q/p) for r in [0, 1), with
    p(x̃) = 0 accepted iff q(x̃) > 0) for t = 1..n until the first rejection. At the first
    rejection, position j, the next token is drawn from norm(max(0, q_j − p_j)) — or from q_j
    if that is all zeros, which happens only when q_j ≤ p_j everywhere, i.e. q_j == p_j — and
    after n acceptances the bonus is drawn from q_n. Each row uses one draw (one row of
    ``draw_uniforms``), at the position where it stops. The residual is built only for the
    rows that reject: the accept test needs p and q at the drafted tokens alone.

    Greedy (one-hot p and q) reduces to exact matching against the target's argmax: a draft
    token is accepted iff it is the target's argmax, and the recovered / bonus token is that
    argmax.
    """
    num_seqs, max_draft, vocab = draft_probs.shape
    if target_probs.shape != (num_seqs, max_draft + 1, vocab):
        raise ValueError(f"target_probs {tuple(target_probs.shape)} != "
                         f"{(num_seqs, max_draft + 1, vocab)}")
    dev = target_probs.device
    if accept_uniforms is None:
        accept_uniforms = torch.rand(num_seqs, max_draft, generator=generator, device=dev)
    if draw_uniforms is None:
        draw_uniforms = torch.rand(num_seqs, dtype=torch.float64, generator=generator, device=dev)
    if num_draft is None:
        num_draft = torch.full((num_seqs,), max_draft, dtype=torch.long, device=dev)
    ids = draft_token_ids.to(dev, torch.long).clamp(min=0)  # [num_seqs, max_draft]
    p_tok = draft_probs.to(dev).float().gather(-1, ids[..., None]).squeeze(-1)  # [num_seqs, max_draft]
    q_tok = target_probs[:, :max_draft].float().gather(-1, ids[..., None]).squeeze(-1)
    accepted = accept_uniforms.to(p_tok) * p_tok < q_tok  # [num_seqs, max_draft]
    num_accepted = first_rejection(accepted, num_draft.to(dev, torch.long))
    rows = torch.arange(num_seqs, device=dev)
    dist = target_probs[rows, num_accepted].float()  # [num_seqs, vocab] q where each row stops
    if max_draft > 0:
        dist = with_residuals(dist, draft_probs.to(dev), num_accepted, num_accepted < num_draft.to(dev))
    token = inverse_cdf(dist, draw_uniforms)  # [num_seqs]
    return RejectionOutput(emitted(ids, num_accepted, token), num_accepted)


def first_rejection(
    accepted: torch.Tensor,  # [num_seqs, max_draft] bool: each draft passes its own test
    num_draft: torch.Tensor,  # [num_seqs] int64 drafts actually proposed
) -> torch.Tensor:  # [num_seqs] int64 accepted drafts (the run before the first failure)
    """Drafts count only up to the first one that fails (or the last one proposed)."""
    steps = torch.arange(accepted.shape[1], device=accepted.device)
    return (accepted & (steps < num_draft[:, None])).long().cumprod(dim=1).sum(dim=1)


def with_residuals(
    q_stop: torch.Tensor,  # [num_seqs, vocab] q at the position where each row stops
    draft_probs: torch.Tensor,  # [num_seqs, max_draft, vocab] p
    num_accepted: torch.Tensor,  # [num_seqs] int64 the stop position
    rejects: torch.Tensor,  # [num_seqs] bool: the row stopped at a rejected draft
) -> torch.Tensor:  # [num_seqs, vocab] what each row draws from
    """norm(max(0, q − p)) in the rows that reject (q where that is all zero, i.e. q == p);
    the others keep q. Only rejecting rows read p: a bonus row's draw is q's alone."""
    index = rejects.nonzero().squeeze(-1)  # [num_rejects]
    if index.numel() == 0:
        return q_stop
    q_rej = q_stop.index_select(0, index)  # [num_rejects, vocab]
    p_rej = draft_probs[index, num_accepted.index_select(0, index)].float()  # [num_rejects, vocab]
    residual = (q_rej - p_rej).clamp_(min=0.0)
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    return q_stop.index_copy(0, index, torch.where(empty, q_rej, residual))


def emitted(
    ids: torch.Tensor,  # [num_seqs, max_draft] int64 drafts
    num_accepted: torch.Tensor,  # [num_seqs] int64
    token: torch.Tensor,  # [num_seqs] int64 the recovered or bonus token
) -> torch.Tensor:  # [num_seqs, max_draft + 1] int64, PAD_TOKEN_ID after the end
    """Accepted drafts, then the one drawn token, then padding."""
    steps = torch.arange(ids.shape[1] + 1, device=ids.device)
    padded = torch.cat([ids, ids.new_full((ids.shape[0], 1), PAD_TOKEN_ID)], dim=1)
    j = num_accepted[:, None]
    return torch.where(steps < j, padded, torch.where(steps == j, token[:, None], PAD_TOKEN_ID))


class VerifyOutput(NamedTuple):
    output_token_ids: torch.Tensor  # [num_seqs, max_draft + 1] int64, PAD_TOKEN_ID after the end
    num_accepted: torch.Tensor  # [num_seqs] int64
    logprobs: torch.Tensor | None  # [num_seqs, max_draft + 1] raw-model logprobs of emitted tokens


def verify_drafts(
    target_logits: torch.Tensor,  # [num_seqs, max_draft + 1, vocab] raw target logits
    draft_token_ids: torch.Tensor,  # [num_seqs, max_draft] int64 (anything past num_draft)
    num_draft: torch.Tensor,  # [num_seqs] int64
    st: SamplingTensors,  # one row per sequence
    generators: list[torch.Generator | None],  # per sequence (None: the global RNG)
    draft_probs: torch.Tensor | None = None,  # [num_seqs, max_draft, vocab] p; None if all greedy
    want_logprobs: bool = False,
) -> VerifyOutput:
    """Verify a whole step's drafts in one batched call on the logits' device, with no copy to
    the host: the engine's hot path. An all-greedy batch only compares the drafts with the
    target's argmax (no softmax, no randomness, no draft probabilities). Otherwise q is
    processed (temperature, top-k, top-p, min-p) for every position at once and
    ``rejection_sample`` decides; each sequence's uniforms come from its own generator, so a
    seeded request draws the same whatever shares its batch."""
    num_seqs, positions, vocab = target_logits.shape
    max_draft = positions - 1
    dev = target_logits.device
    ids = draft_token_ids.to(dev, torch.long).clamp(min=0)  # [num_seqs, max_draft]
    num_draft = num_draft.to(dev, torch.long)
    if st.all_greedy:
        argmax = target_logits.argmax(dim=-1)  # [num_seqs, max_draft + 1]
        num_accepted = first_rejection(ids == argmax[:, :max_draft], num_draft)
        token = argmax.gather(1, num_accepted[:, None]).squeeze(1)
        out = emitted(ids, num_accepted, token)
    else:
        if draft_probs is None:
            raise ValueError("sampled (temperature > 0) verification needs the draft probabilities")
        q = processed_probs(target_logits.reshape(-1, vocab).float(), st.expand(positions))
        # a seeded row draws as many accept uniforms as it has drafts, not the batch's widest
        accept_u = uniforms(num_seqs, max_draft, generators, dev, widths=num_draft)  # [num_seqs, max_draft]
        draw_u = row_uniforms(generators, dev)  # [num_seqs] float64
        out, num_accepted = rejection_sample(draft_probs, q.view(num_seqs, positions, vocab), ids,
                                             accept_u, draw_u, num_draft=num_draft)
    logprobs = None
    if want_logprobs:
        logprobs = torch.log_softmax(target_logits.float(), dim=-1).gather(-1, out.clamp(min=0)[..., None])
        logprobs = logprobs.squeeze(-1)
    return VerifyOutput(out, num_accepted, logprobs)


# ---------------------------------------------------------------------------------------------
# Statistics and adaptive K.
# ---------------------------------------------------------------------------------------------


@dataclass
class AcceptanceStats:
    """Counts per request or in total (add them). One *step* = one sequence verified by one
    target forward, so ``mean_tokens_per_forward`` is per sequence, whatever the batch size."""

    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0
    num_steps: int = 0
    num_rejections: int = 0  # steps that ended in a rejected draft (not by running out)

    def update(
        self,
        num_draft: torch.Tensor | int | list[int],  # [num_seqs] or a per-step scalar
        num_accepted: torch.Tensor | list[int],  # [num_seqs]
    ) -> None:
        drafted, acc = draft_counts(num_draft, num_accepted)
        accepted = sum(acc)
        self.num_draft_tokens += sum(drafted)
        self.num_accepted_tokens += accepted
        self.num_emitted_tokens += accepted + len(acc)
        self.num_steps += len(acc)
        self.num_rejections += sum(a < d for a, d in zip(acc, drafted))

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted (vLLM's "draft acceptance rate")."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def per_token_acceptance(self) -> float:
        """α̂ = accepted / tested: the maximum-likelihood estimate of the per-token acceptance
        probability α (tokens after a rejection are never tested, so accepted/drafted
        underestimates α for K > 1)."""
        tested = self.num_accepted_tokens + self.num_rejections
        return self.num_accepted_tokens / tested if tested else 0.0

    @property
    def mean_tokens_per_forward(self) -> float:
        return self.num_emitted_tokens / self.num_steps if self.num_steps else 0.0

    def __add__(self, other: "AcceptanceStats") -> "AcceptanceStats":
        return AcceptanceStats(
            self.num_draft_tokens + other.num_draft_tokens,
            self.num_accepted_tokens + other.num_accepted_tokens,
            self.num_emitted_tokens + other.num_emitted_tokens,
            self.num_steps + other.num_steps,
            self.num_rejections + other.num_rejections,
        )

    def as_dict(self) -> dict[str, float]:
        return {
            "draft_tokens": self.num_draft_tokens,
            "accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "per_token_acceptance": self.per_token_acceptance,
            "mean_tokens_per_forward": self.mean_tokens_per_forward,
        }


# Adaptive K lives in its own module; re-exported here, where it used to be.
from keyserve.core.adaptive_k import AdaptiveK, draft_counts, expected_speedup, expected_tokens  # noqa: E402,F401
