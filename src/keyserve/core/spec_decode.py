"""Speculative sampling (docs/algorithms.md §3, Chen et al. 2023): the batched rejection
sampler, statistics and an adaptive choice of K.

Vocabulary (vLLM's): the *draft* model proposes K tokens with probabilities p; the *target*
scores the K + 1 positions in one forward, giving q; a draft token is *accepted* with
probability min(1, q/p); at the first rejection a *recovered* token is drawn from
norm(max(0, q − p)); when all K are accepted a *bonus* token is drawn from q at position K + 1.
The emitted tokens are then distributed exactly as sampling from q alone.

Everything random comes in as explicit uniforms (or from a ``torch.Generator``) so the sampler is
a pure, testable function. Categorical draws use the exponential race (equivalently Gumbel-max):
``argmax_i π_i / E_i`` with ``E_i = −log U_i ~ Exp(1)`` picks i with probability π_i / Σπ, with no
normalisation and never a zero-probability token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from keyserve.core.sampler import SamplingTensors, processed_probs
from keyserve.core.sampling_params import SamplingParams

PAD_TOKEN_ID = -1


class RejectionOutput(NamedTuple):
    output_token_ids: torch.Tensor  # [num_seqs, max_draft + 1] int64, PAD_TOKEN_ID after the end
    num_accepted: torch.Tensor  # [num_seqs] int64: accepted draft tokens (emitted = this + 1)


def exponential_race(
    probs: torch.Tensor,  # [..., vocab] non-negative, need not sum to 1
    uniforms: torch.Tensor,  # [..., vocab] in [0, 1)
) -> torch.Tensor:  # [...] int64
    """One categorical draw per row from explicit uniforms (see the module docstring).

    Rows must have some positive mass; tokens with zero probability never win.
    """
    tiny = torch.finfo(torch.float32).tiny
    # E in [tiny, 88]: U = 0 and U = 1 (−log 1 = −0.0 would flip signs) both stay finite.
    expo = (-torch.log(uniforms.to(torch.float32).clamp(min=tiny))).clamp(min=tiny)
    ratio = probs.to(torch.float32) / expo
    return torch.where(probs > 0, ratio, -1.0).argmax(dim=-1)


def rejection_sample(
    draft_probs: torch.Tensor,  # [num_seqs, max_draft, vocab] p at each draft position
    target_probs: torch.Tensor,  # [num_seqs, max_draft + 1, vocab] q at each position
    draft_token_ids: torch.Tensor,  # [num_seqs, max_draft] int64 (anything past num_draft)
    accept_uniforms: torch.Tensor | None = None,  # [num_seqs, max_draft] in [0, 1)
    draw_uniforms: torch.Tensor | None = None,  # [num_seqs, vocab] in [0, 1), recovered/bonus
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
    ``draw_uniforms``), at the position where it stops.

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
        draw_uniforms = torch.rand(num_seqs, vocab, generator=generator, device=dev)
    if num_draft is None:
        num_draft = torch.full((num_seqs,), max_draft, dtype=torch.long, device=dev)
    num_draft = num_draft.to(dev, torch.long)

    steps = torch.arange(max_draft + 1, device=dev)  # [max_draft + 1]
    ids = draft_token_ids.to(dev, torch.long).clamp(min=0)  # [num_seqs, max_draft]
    p_tok = draft_probs.float().gather(-1, ids[..., None]).squeeze(-1)  # [num_seqs, max_draft]
    q_tok = target_probs[:, :max_draft].float().gather(-1, ids[..., None]).squeeze(-1)
    in_range = steps[:max_draft] < num_draft[:, None]  # [num_seqs, max_draft]
    accepted = (accept_uniforms.to(p_tok) * p_tok < q_tok) & in_range
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # [num_seqs] first rejection

    # The one distribution each row samples from: recovered at a rejection, bonus otherwise.
    rows = torch.arange(num_seqs, device=dev)
    q_stop = target_probs[rows, num_accepted].float()  # [num_seqs, vocab]
    is_bonus = num_accepted >= num_draft  # [num_seqs]
    if max_draft > 0:
        p_stop = draft_probs[rows, num_accepted.clamp(max=max_draft - 1)].float()
        residual = (q_stop - p_stop).clamp(min=0.0)
        use_q = is_bonus | (residual.sum(dim=-1) <= 0)
        dist = torch.where(use_q[:, None], q_stop, residual)
    else:
        dist = q_stop
    token = exponential_race(dist, draw_uniforms)  # [num_seqs]

    padded = torch.cat([ids, ids.new_full((num_seqs, 1), PAD_TOKEN_ID)], dim=1)
    j = num_accepted[:, None]
    out = torch.where(steps < j, padded, torch.where(steps == j, token[:, None], PAD_TOKEN_ID))
    return RejectionOutput(out, num_accepted)


def verify_drafts(
    logits: list[torch.Tensor],  # per sequence: [1 + num_draft, vocab] raw target logits
    draft_probs: torch.Tensor,  # [num_seqs, max_draft, vocab] draft distributions p
    draft_token_ids: list[list[int]],  # per sequence: its num_draft drafts
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> list[tuple[list[int], list[float] | None, int]]:
    """Modified rejection sampling for all speculating sequences at once; per sequence the
    emitted tokens (accepted drafts + the recovered or bonus token), their logprobs when asked,
    and the number of accepted drafts. Runs where the per-sequence generators live."""
    b, k_max, vocab = draft_probs.shape
    num_draft = torch.tensor([len(d) for d in draft_token_ids], dtype=torch.int64)
    tokens_in = torch.zeros(b, k_max, dtype=torch.int64)
    for row, drafts in enumerate(draft_token_ids):
        tokens_in[row, : len(drafts)] = torch.tensor(drafts, dtype=torch.int64)
    raw = torch.full((b, k_max + 1, vocab), float("-inf"))
    raw[:, :, 0] = 0.0  # padding rows: a harmless valid distribution
    for row, seq_logits in enumerate(logits):
        raw[row, : seq_logits.shape[0]] = seq_logits.to(raw.device)
    st = SamplingTensors.from_params(params).expand(k_max + 1)
    target_probs = processed_probs(raw.view(b * (k_max + 1), vocab), st).view(b, k_max + 1, vocab)
    accept_u = torch.empty(b, max(k_max, 1))
    draw_u = torch.empty(b, vocab)
    for row, gen in enumerate(generators):
        accept_u[row] = torch.rand(accept_u.shape[1], generator=gen)
        draw_u[row] = torch.rand(vocab, generator=gen)
    out = rejection_sample(
        draft_probs.cpu(), target_probs, tokens_in, accept_u[:, :k_max], draw_u, num_draft=num_draft
    )
    results = []
    for row, p in enumerate(params):
        a = int(out.num_accepted[row])
        tokens = out.output_token_ids[row, : a + 1].tolist()
        lps = None
        if p.logprobs:
            lp = torch.log_softmax(raw[row, : a + 1], dim=-1)
            lps = lp.gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()
        results.append((tokens, lps, a))
    return results


# ---------------------------------------------------------------------------------------------
# Statistics and adaptive K.
# ---------------------------------------------------------------------------------------------


def _total(x: torch.Tensor | int | list[int]) -> int:
    if isinstance(x, torch.Tensor):
        return int(x.sum().item())
    if isinstance(x, int):
        return x
    return int(sum(x))


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
        acc = num_accepted if isinstance(num_accepted, torch.Tensor) else torch.tensor(num_accepted)
        drafted = (num_draft if isinstance(num_draft, torch.Tensor)
                   else torch.as_tensor(num_draft)).to(acc.device).expand_as(acc)
        self.num_draft_tokens += _total(drafted)
        self.num_accepted_tokens += _total(acc)
        self.num_emitted_tokens += _total(acc) + acc.numel()
        self.num_steps += acc.numel()
        self.num_rejections += _total(acc < drafted)

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


def expected_tokens(alpha: float, k: int) -> float:
    """E[tokens per target forward] with K drafts each accepted w.p. α independently:
    1 + α + … + α^K = (1 − α^{K+1}) / (1 − α)."""
    return sum(alpha**i for i in range(k + 1))


def expected_speedup(alpha: float, k: int, cost_ratio: float) -> float:
    """Tokens per unit time relative to plain decoding: a step costs K draft forwards (c each)
    plus one target forward (1), so the gain is expected_tokens / (c·K + 1)."""
    return expected_tokens(alpha, k) / (cost_ratio * k + 1.0)


@dataclass
class AdaptiveK:
    """Picks K from a running estimate of α to maximise ``expected_speedup(α, K, c)``.

    α is estimated as accepted / tested (see ``AcceptanceStats.per_token_acceptance``) over
    exponentially decayed counts, starting from ``prior_alpha`` worth ``prior_weight`` trials.
    With α → 1 it picks ``k_max`` (when c < 1); when α < c even K = 1 does not pay, so it picks
    ``k_min`` (set ``k_min = 0`` to allow switching speculation off).
    """

    k_min: int = 1
    k_max: int = 8
    cost_ratio: float = 0.1  # c = one draft forward / one target forward
    decay: float = 0.9  # weight of the past per observe() call
    prior_alpha: float = 0.7
    prior_weight: float = 4.0
    _accepted: float = field(init=False)
    _tested: float = field(init=False)

    def __post_init__(self) -> None:
        if not 0 <= self.k_min <= self.k_max:
            raise ValueError("need 0 <= k_min <= k_max")
        self._accepted = self.prior_alpha * self.prior_weight
        self._tested = self.prior_weight

    def observe(
        self,
        num_draft: torch.Tensor | int | list[int],  # [num_seqs] or scalar
        num_accepted: torch.Tensor | list[int],  # [num_seqs]
    ) -> None:
        acc = num_accepted if isinstance(num_accepted, torch.Tensor) else torch.tensor(num_accepted)
        drafted = (num_draft if isinstance(num_draft, torch.Tensor)
                   else torch.as_tensor(num_draft)).to(acc.device).expand_as(acc)
        a = _total(acc)
        self._accepted = self.decay * self._accepted + a
        self._tested = self.decay * self._tested + a + _total(acc < drafted)

    @property
    def alpha(self) -> float:
        return self._accepted / self._tested if self._tested > 0 else self.prior_alpha

    def choose(self) -> int:
        """The K in [k_min, k_max] with the highest expected speed-up (smallest on ties)."""
        alpha = min(max(self.alpha, 0.0), 1.0)
        ks = range(self.k_min, self.k_max + 1)
        return max(ks, key=lambda k: (expected_speedup(alpha, k, self.cost_ratio), -k))
