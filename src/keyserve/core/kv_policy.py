"""KV budgets (docs/algorithms.md §2): which tokens a sequence keeps per (layer, kv-head), and in
which slot.

Policies: ``full`` (no eviction), ``window`` (the k most recent; a ring buffer, position p in
slot p mod k), ``streaming_llm`` (4 sink tokens + the k − 4 most recent), ``h2o`` and
``keyformer`` (the w most recent + the k − w highest accumulated attention scores S; Keyformer's
scores come from a Gumbel-perturbed softmax, H2O's from the plain softmax).

Budget k is the number of tokens a sequence holds, and attends to, at each decode step
*including* the new token: "evict, then write". Before a step the victim is chosen among the
candidates (held tokens that are neither sinks nor among the w − 1 most recent, i.e. the key
tokens plus the one leaving the recent window), the new token's K/V is written into the victim's
slot, and the step's attention mass is added to S. The new token's S starts with its own score.

Tie-breaking, everywhere: the lowest S is evicted first, then the oldest position (positions are
unique within a (layer, head), so the order is total). Window and StreamingLLM use no scores:
the oldest candidate goes (for them it is always the token leaving the recent window).

Speculative decoding: a state may hold ``num_spare`` slots beyond k transiently (drafts appended
without eviction); ``rollback`` drops the rejected ones and ``evict_down_to`` evicts several at
once, after acceptance is known, so a rejected draft never costs a kept token.

Slots are *logical* (``0 .. num_slots-1`` of the sequence, the engine maps them to physical
blocks). Slots ``0 .. num_slots-1`` are always all occupied, in every (layer, head), so the
attention kernel needs only one slot count per sequence. Compactions (prompt selection,
``evict_down_to``, ``rollback``) return ``keep [L, H, n]``: new slot j receives old slot
``keep[..., j]``; slots that stay put map to themselves, so the engine copies only where
``keep != arange``.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Literal, Sequence, get_args

import torch

from keyserve.types import ScorePooling, ScoreWindow

ScoreModeName = Literal["softmax", "gumbel"]
# Options of the scoring policies (H2O, Keyformer), after TOVA (docs/kv-budgets.md, "Scoring
# options"): which queries' attention S holds, and whether the kv-heads of a layer choose alone.
SCORE_WINDOWS: tuple[str, ...] = get_args(ScoreWindow)
SCORE_POOLINGS: tuple[str, ...] = get_args(ScorePooling)

NUM_SINKS = 4  # StreamingLLM's attention sinks: positions 0..3
_INT_MAX = torch.iinfo(torch.int64).max
_NO_BUDGET = 1 << 62  # the budget of the ``full`` policy in batched tensors


class KVPolicy(str, enum.Enum):
    FULL = "full"
    WINDOW = "window"
    STREAMING_LLM = "streaming_llm"
    H2O = "h2o"
    KEYFORMER = "keyformer"


def score_mode(policy: KVPolicy | str) -> ScoreModeName | None:
    """The attention-score output a policy needs from the kernels (None: no scores)."""
    policy = KVPolicy(policy)
    if policy is KVPolicy.KEYFORMER:
        return "gumbel"
    if policy is KVPolicy.H2O:
        return "softmax"
    return None


def keyformer_tau(step: int, max_tokens: int, tau_init: float = 1.0, tau_end: float = 2.0) -> float:
    """Keyformer's temperature at decode step ``step`` (0 = first generated token):
    τ = τ_init + step·(τ_end − τ_init)/max_tokens. The prompt phase uses τ = 1."""
    if max_tokens < 1:
        raise ValueError("max_tokens must be >= 1")
    return tau_init + step * (tau_end - tau_init) / max_tokens


def recent_window(k: int, recent_ratio: float) -> int:
    """w = round(recent_ratio·k), rounding halves up (not banker's), clamped to [0, k]."""
    return max(0, min(k, int(math.floor(recent_ratio * k + 0.5))))


@dataclass(frozen=True)
class KVBudget:
    """A policy resolved for one budget: k, how many sinks and recent tokens are protected."""

    policy: KVPolicy
    budget: int | None  # k; None = never evict (``full``)
    num_sinks: int = 0
    num_recent: int = 0
    # Scoring policies only (the others keep the defaults): ``last`` replaces S with each
    # forward's attention instead of adding it -- the engine then computes a prompt's last token
    # in a step of its own, so S at prompt selection is the last prompt query's attention (TOVA's
    # window); ``mean`` sums S as ``all`` does but ranks tokens by S over the number of queries
    # that have attended each (its own and every later one): the mean attention a token received
    # (kvpress's ObservedAttention), which does not favour a token for being old; ``layer``
    # gives every kv-head of a layer the scores summed over all of them, so the layer keeps one
    # set of tokens (TOVA's pooling; the runner sums across ranks).
    score_window: ScoreWindow = "all"
    score_pooling: ScorePooling = "kv_head"

    def __post_init__(self) -> None:
        if self.score_window not in SCORE_WINDOWS:
            raise ValueError(f"score_window must be one of {SCORE_WINDOWS}, got {self.score_window!r}")
        if self.score_pooling not in SCORE_POOLINGS:
            raise ValueError(f"score_pooling must be one of {SCORE_POOLINGS}, got {self.score_pooling!r}")

    @classmethod
    def create(
        cls, policy: KVPolicy | str, budget: int | None, recent_ratio: float = 0.3,
        score_window: ScoreWindow = "all", score_pooling: ScorePooling = "kv_head",
    ) -> "KVBudget":
        """StreamingLLM keeps min(4, k − 1) sinks so the new token always has a slot to take.
        The scoring options apply to H2O and Keyformer; the other policies ignore them."""
        policy = KVPolicy(policy)
        if policy is KVPolicy.FULL or budget is None:
            return cls(KVPolicy.FULL if budget is None else policy, None)
        if budget < 1:
            raise ValueError(f"kv budget must be >= 1 token, got {budget}")
        if policy is KVPolicy.WINDOW:
            return cls(policy, budget, 0, budget)
        if policy is KVPolicy.STREAMING_LLM:
            sinks = min(NUM_SINKS, budget - 1)
            return cls(policy, budget, sinks, budget - sinks)
        return cls(policy, budget, 0, recent_window(budget, recent_ratio), score_window, score_pooling)

    def with_budget(self, budget: int) -> "KVBudget":
        """The same rule at another k (recent share and scoring options kept)."""
        ratio = self.num_recent / self.budget if self.budget else 0.0
        return KVBudget.create(self.policy, budget, ratio, self.score_window, self.score_pooling)

    @property
    def last_query_only(self) -> bool:
        """S is the newest query's attention (the prompt's last token gets a step of its own)."""
        return self.by_score and self.score_window == "last"

    @property
    def averages_scores(self) -> bool:
        """Tokens are ranked by their mean attention (S / queries that saw them), not by S."""
        return self.by_score and self.score_window == "mean"

    @property
    def pools_layer(self) -> bool:
        return self.by_score and self.score_pooling == "layer"

    @property
    def by_score(self) -> bool:
        return self.policy in (KVPolicy.H2O, KVPolicy.KEYFORMER)

    @property
    def ring(self) -> bool:
        return self.policy is KVPolicy.WINDOW


# ---------------------------------------------------------------------------------------------
# Pure, batched tensor functions.
# ---------------------------------------------------------------------------------------------


def _col(x: torch.Tensor, ndim: int) -> torch.Tensor:
    """[B] -> [B, 1, ..., 1] with ``ndim`` dims in all."""
    return x.view(-1, *([1] * (ndim - 1)))


def candidate_mask(
    positions: torch.Tensor,  # [..., num_slots] int64, -1 = empty
    newest: torch.Tensor | int,  # broadcastable: the newest position counted as "recent"
    num_sinks: torch.Tensor | int,  # broadcastable to positions
    num_recent: torch.Tensor | int,  # broadcastable to positions
) -> torch.Tensor:  # [..., num_slots] bool
    """Held tokens that may be evicted: not a sink (position < num_sinks) and not among the
    ``num_recent`` most recent positions (position > newest − num_recent)."""
    return (positions >= num_sinks) & (positions >= 0) & (positions <= newest - num_recent)


def order_key(
    positions: torch.Tensor,  # [..., num_slots] int64, 0 <= position < 2**31
    scores: torch.Tensor,  # [..., num_slots] float32
) -> torch.Tensor:  # [..., num_slots] int64
    """(S, position) packed into one int64 whose order is the lexicographic order: the float32
    bits of S made monotone (negative floats flipped) in the high half, the position in the low
    half. Lets one ``argmin`` / ``topk`` break ties by age exactly. NaN sorts above +inf."""
    bits = (scores.float() + 0.0).view(torch.int32)  # + 0.0 turns -0.0 into 0.0
    bits = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    return (bits.long() << 32) | positions


def mean_attention(
    scores: torch.Tensor,  # [..., num_slots] float32: S, summed over every query so far
    positions: torch.Tensor,  # [..., num_slots] int64, -1 = empty
    next_position: int,  # the first position no query has come from yet
) -> torch.Tensor:  # [..., num_slots] float32
    """S / the number of queries that attended each token: those at its own position and after,
    up to ``next_position`` - 1 (causal attention). Empty slots get a count of at least 1."""
    return scores / (next_position - positions).clamp(min=1).to(scores.dtype)


def choose_victims_batched(
    positions: torch.Tensor,  # [num_seqs, num_layers, num_kv_heads, num_slots] int64, -1 = empty
    scores: torch.Tensor,  # [num_seqs, num_layers, num_kv_heads, num_slots] float32
    num_held: torch.Tensor,  # [num_seqs] int64: occupied slots (0 .. num_held-1)
    new_positions: torch.Tensor,  # [num_seqs] int64: position of the token about to be written
    budget: torch.Tensor,  # [num_seqs] int64: k (a huge value for ``full``)
    num_sinks: torch.Tensor,  # [num_seqs] int64
    num_recent: torch.Tensor,  # [num_seqs] int64: w; the new token is the first of them
    by_score: torch.Tensor,  # [num_seqs] bool: evict by S (H2O, Keyformer) or by age
) -> tuple[torch.Tensor, torch.Tensor]:  # slots [num_seqs, L, H] int64, evicted [num_seqs] bool
    """The slot each sequence's new token is written to, per (layer, kv-head), in one call.

    Under budget (num_held < k) it is the fresh slot ``num_held``; at budget it is the slot of
    the candidate with the lowest S, then the oldest position. Pure: the caller updates state.
    Sequences may mix policies (``by_score``, sinks, recent differ per row).
    """
    nd = positions.dim()
    cand = candidate_mask(
        positions, _col(new_positions, nd), _col(num_sinks, nd), _col(num_recent, nd)
    )
    key = torch.where(_col(by_score, nd), order_key(positions, scores), positions)
    victims = torch.where(cand, key, _INT_MAX).argmin(dim=-1)  # [B, L, H]
    evict = num_held >= budget  # [B]
    found = cand.gather(-1, victims.unsqueeze(-1)).squeeze(-1)
    if bool((evict[:, None, None] & ~found).any()):
        raise RuntimeError("a sequence at its KV budget has no evictable token")
    fresh = _col(num_held, nd - 1).expand_as(victims)
    return torch.where(_col(evict, nd - 1), victims, fresh), evict


def choose_victims_one(
    positions: torch.Tensor,  # [num_layers, num_kv_heads, num_slots] int64, all occupied
    scores: torch.Tensor,  # [num_layers, num_kv_heads, num_slots] float32
    new_position: int,
    num_sinks: int,
    num_recent: int,
    by_score: bool,
) -> torch.Tensor:  # [num_layers, num_kv_heads] int64
    """One sequence at its budget: the same choice as ``choose_victims_batched`` in ~5 passes
    over the slots (the hot path on CPU): ties on S are resolved by age only where they occur."""
    cand = positions <= new_position - num_recent
    if num_sinks:
        cand &= positions >= num_sinks
    if by_score:
        key = torch.where(cand, scores, float("inf"))
        victims = key.argmin(dim=-1).unsqueeze(-1)
        kmin = key.gather(-1, victims)
        # A tie exists iff the minimum without the first minimiser is still kmin.
        ties = key.scatter_(-1, victims, float("inf")).amin(dim=-1, keepdim=True) == kmin
        if bool(ties.any()):  # (no candidate at all: kmin = inf ties too; caught below)
            key.scatter_(-1, victims, kmin)
            by_age = torch.where(key == kmin, positions, _INT_MAX).argmin(dim=-1, keepdim=True)
            victims = torch.where(ties, by_age, victims)
        victims = victims.squeeze(-1)
    else:
        victims = torch.where(cand, positions, _INT_MAX).argmin(dim=-1)
    if not bool(cand.gather(-1, victims.unsqueeze(-1)).all()):
        raise RuntimeError("a sequence at its KV budget has no evictable token")
    return victims


def select_keep_mask(
    positions: torch.Tensor,  # [num_layers, num_kv_heads, num_slots] int64, -1 = empty
    scores: torch.Tensor,  # [num_layers, num_kv_heads, num_slots] float32
    num_keep: int,
    newest: int,  # newest position held (the reference of the recent window)
    num_sinks: int,
    num_recent: int,
    by_score: bool,
) -> torch.Tensor:  # [num_layers, num_kv_heads, num_slots] bool
    """Keep sinks + the ``num_recent`` most recent + the best of the rest, ``num_keep`` in all.

    Evicts the ``held − num_keep`` candidates that come first in (S ascending, position
    ascending) order — the same order ``choose_victims_*`` use one token at a time. Rows may
    hold different counts (a prefix loaded with fewer tokens in some layers); each row is
    evicted down to ``num_keep`` on its own.
    """
    occupied = positions >= 0
    evict_count = (occupied.sum(dim=-1) - num_keep).clamp(min=0)  # [L, H]
    most = int(evict_count.max()) if evict_count.numel() else 0
    if most == 0:
        return occupied
    cand = candidate_mask(positions, newest, num_sinks, num_recent)
    if bool((cand.sum(dim=-1) < evict_count).any()):
        raise RuntimeError("fewer evictable tokens than tokens to evict")
    key = order_key(positions, scores) if by_score else positions
    victims = torch.topk(torch.where(cand, key, _INT_MAX), most, dim=-1, largest=False).indices
    take = torch.arange(most, device=positions.device) < evict_count.unsqueeze(-1)  # [L, H, most]
    return occupied & ~torch.zeros_like(occupied).scatter_(-1, victims, take)


def compaction_map(
    keep_mask: torch.Tensor,  # [num_layers, num_kv_heads, num_slots] bool, same count per row
    positions: torch.Tensor,  # [num_layers, num_kv_heads, num_slots] int64
    ring: int | None = None,  # window policy: kept position p goes to slot p mod ring
) -> torch.Tensor:  # [num_layers, num_kv_heads, num_keep] int64
    """Where the kept tokens go: new slot j receives old slot ``keep[..., j]``.

    Default layout moves as little as possible: kept tokens already in slots < num_keep stay,
    the holes (ascending) are filled by the kept tokens beyond (ascending slot). With ``ring``
    the layout is the ring buffer (needs num_keep == ring and consecutive kept positions).
    """
    counts = keep_mask.sum(dim=-1)
    n = int(counts.flatten()[0]) if counts.numel() else 0
    if not bool((counts == n).all()):
        raise RuntimeError("every (layer, head) must keep the same number of tokens")
    num_slots = keep_mask.shape[-1]
    slot_ids = torch.arange(num_slots, device=keep_mask.device).expand_as(keep_mask)
    if ring is not None and n == ring:
        target = torch.where(keep_mask, positions % ring, ring)
        out = torch.full((*keep_mask.shape[:-1], ring + 1), -1, dtype=torch.long,
                         device=keep_mask.device)
        out.scatter_(-1, target, slot_ids)
        out = out[..., :ring]
        if bool((out < 0).any()):
            raise RuntimeError("ring layout needs consecutive kept positions")
        return out
    stays = keep_mask[..., :n]
    movers = torch.where(keep_mask[..., n:], slot_ids[..., n:], _INT_MAX)
    movers = torch.sort(movers, dim=-1).values  # kept slots >= n, ascending, first
    hole_rank = ((~stays).long().cumsum(dim=-1) - 1).clamp(min=0)
    if movers.shape[-1] == 0:
        return slot_ids[..., :n].clone()
    return torch.where(stays, slot_ids[..., :n], movers.gather(-1, hole_rank))


# ---------------------------------------------------------------------------------------------
# Per-sequence state.
# ---------------------------------------------------------------------------------------------


class KVBudgetState:
    """One sequence's accumulated scores and slot → position map, per (layer, kv-head).

    Lifecycle: ``append(n)`` for each prompt chunk (fresh slots) and ``accumulate(scores)``
    after its forward; ``select_prompt()`` once the prompt is in; then per decode step
    ``choose_victims()`` → write K/V there → forward → ``accumulate(scores)``. With speculative
    verification: ``choose_victims()`` for the first (certain) token, ``append(K)`` into spare
    slots for the drafts, ``accumulate``, ``rollback(accepted_len)``, ``evict_down_to()``.
    """

    def __init__(
        self,
        kv_budget: KVBudget,
        num_layers: int,
        num_kv_heads: int,
        *,
        num_spare: int = 0,
        device: torch.device | str | None = None,
    ) -> None:
        self.kv_budget = kv_budget
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.num_spare = num_spare
        self.num_slots = 0  # tokens held per (layer, head) = occupied slots 0..num_slots-1
        self.num_tokens = 0  # positions seen: the next token's position
        self.num_evicted = 0  # tokens evicted per (layer, head)
        # [num_layers] tokens held per layer while they differ (a prefix loaded with fewer
        # tokens in some layers, until prompt-phase eviction evens them out); else None
        self.layer_held: torch.Tensor | None = None
        cap = (kv_budget.budget + num_spare) if kv_budget.budget is not None else 16
        self._scores = torch.zeros(num_layers, num_kv_heads, cap, dtype=torch.float32,
                                   device=device)
        self._positions = torch.full_like(self._scores, -1, dtype=torch.long)

    # -- views ---------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self._scores.device

    @property
    def scores(self) -> torch.Tensor:  # [num_layers, num_kv_heads, num_slots] float32
        return self._scores[..., : self.num_slots]

    @property
    def positions(self) -> torch.Tensor:  # [num_layers, num_kv_heads, num_slots] int64
        return self._positions[..., : self.num_slots]

    @property
    def num_held(self) -> int:
        """Tokens held per (layer, kv-head) (the same in every one)."""
        return self.num_slots

    def stats(self) -> dict[str, int]:
        return {"kv_tokens_held": self.num_slots, "tokens_evicted": self.num_evicted}

    @property
    def at_budget(self) -> bool:
        return self.kv_budget.budget is not None and self.num_slots >= self.kv_budget.budget

    def _reserve(self, num_slots: int) -> None:
        cap = self._scores.shape[-1]
        if num_slots <= cap:
            return
        new_cap = max(num_slots, 2 * cap)
        pad = new_cap - cap
        self._scores = torch.nn.functional.pad(self._scores, (0, pad), value=0.0)
        self._positions = torch.nn.functional.pad(self._positions, (0, pad), value=-1)

    # -- growth and scores ---------------------------------------------------------------------
    def append(self, num_tokens: int) -> torch.Tensor:  # [num_tokens] or [num_layers, num_tokens]
        """Place the next ``num_tokens`` positions in fresh slots (same slots in every head):
        prompt chunks, and speculative drafts in spare slots. Evicts nothing. While layers hold
        different counts, each layer's tokens go right after its own: slots per layer."""
        if self.layer_held is not None:
            return self._append_per_layer(num_tokens)
        start = self.num_slots
        self._reserve(start + num_tokens)
        new_pos = torch.arange(self.num_tokens, self.num_tokens + num_tokens, device=self.device)
        self._positions[..., start : start + num_tokens] = new_pos
        self._scores[..., start : start + num_tokens] = 0.0
        self.num_slots += num_tokens
        self.num_tokens += num_tokens
        return torch.arange(start, start + num_tokens, device=self.device)

    def _append_per_layer(self, num_tokens: int) -> torch.Tensor:  # [num_layers, num_tokens]
        assert self.layer_held is not None
        slots = self.layer_held[:, None] + torch.arange(num_tokens, device=self.device)  # [L, n]
        self._reserve(int(slots.max()) + 1 if num_tokens else self.num_slots)
        idx = slots[:, None, :].expand(-1, self.num_kv_heads, -1)  # [L, H, n]
        new_pos = torch.arange(self.num_tokens, self.num_tokens + num_tokens, device=self.device)
        self._positions.scatter_(-1, idx, new_pos.expand_as(idx))
        self._scores.scatter_(-1, idx, 0.0)
        self.layer_held = self.layer_held + num_tokens
        self.num_slots = int(self.layer_held.max())
        self.num_tokens += num_tokens
        return slots

    def accumulate(
        self,
        step_scores: torch.Tensor,  # [num_layers, num_kv_heads, >= num_slots] float
    ) -> None:
        """S += this forward's attention mass (decode step or prefill chunk), or S = it under
        ``score_window="last"``; padding beyond the sequence's slots (batch-wide max context)
        is ignored."""
        if step_scores.shape[-1] < self.num_slots:
            raise ValueError(f"scores cover {step_scores.shape[-1]} < {self.num_slots} slots")
        add = step_scores[..., : self.num_slots].to(self.device, torch.float32)
        if self.layer_held is not None:  # a shorter layer's tail slots are empty
            add = add * (self.positions >= 0)
        if self.kv_budget.last_query_only:
            self.scores.copy_(add)
        else:
            self.scores.add_(add)

    def restore(
        self,
        positions: torch.Tensor,  # [num_layers, num_kv_heads, n] int64 positions held in slots 0..n-1
        scores: torch.Tensor,  # [num_layers, num_kv_heads, n] float accumulated scores
        num_tokens: int,  # positions seen so far (the next token's position)
    ) -> None:
        """Start from tokens loaded from elsewhere (a prefix store) instead of computed here:
        any subset of the positions before ``num_tokens``, the same count in every head of a
        layer; a layer may hold fewer (its tail padded with position -1) until prompt-phase
        eviction."""
        n = positions.shape[-1]
        self._reserve(n)
        self._positions[..., :n] = positions.to(self.device)
        self._scores[..., :n] = scores.to(self.device, torch.float32)
        held = (self._positions[:, :, :n] >= 0).sum(-1)  # [L, H]
        if not bool((held == held[:, :1]).all()):
            raise ValueError("every head of a layer must hold the same number of tokens")
        per_layer = held[:, 0]
        self.layer_held = None if bool((per_layer == n).all()) else per_layer.clone()
        self.num_slots = n
        self.num_tokens = num_tokens

    def ranking(self, next_position: int) -> torch.Tensor:  # [num_layers, num_kv_heads, num_slots]
        """What eviction ranks by, before the token at ``next_position`` is computed: S, or
        its mean over the queries so far under ``score_window="mean"``."""
        if self.kv_budget.averages_scores:
            return mean_attention(self.scores, self.positions, next_position)
        return self.scores

    # -- decode --------------------------------------------------------------------------------
    def choose_victims(self, new_position: int | None = None) -> torch.Tensor:  # [L, H] int64
        """Slot per (layer, head) for the next token ("evict, then write"); updates the state."""
        return choose_victims_batch([self], None if new_position is None else [new_position])[0]

    def _write_new(
        self,
        slots: torch.Tensor,  # [num_layers, num_kv_heads] int64
        position: int,
        evicted: bool,
    ) -> None:
        if not evicted:
            self._reserve(self.num_slots + 1)
        idx = slots.unsqueeze(-1)
        self._positions.scatter_(-1, idx, position)
        self._scores.scatter_(-1, idx, 0.0)  # the new token starts with its own score only
        self.num_tokens = position + 1
        if evicted:
            self.num_evicted += 1
        else:
            self.num_slots += 1

    # -- compaction ----------------------------------------------------------------------------
    def select_prompt(self, k: int | None = None) -> torch.Tensor:  # [L, H, min(k, held)]
        """Prompt-phase selection: keep w recent + top (k − w) by S (sinks + recent for
        StreamingLLM, the k most recent for window) and compact them into slots 0..k−1."""
        return self.evict_down_to(k)

    def evict_down_to(self, k: int | None = None) -> torch.Tensor:  # [L, H, min(k, held)]
        """Evict until ``k`` (default: the budget) tokens are held and compact; several at once
        (speculative acceptance, prompt phase). Returns ``keep`` (see the module docstring)."""
        k = self.kv_budget.budget if k is None else k
        if self.layer_held is not None and (k is None or int(self.layer_held.min()) < k):
            raise RuntimeError("a layer holds fewer tokens than the budget: layers would stay uneven")
        if self.layer_held is not None and self.num_slots <= k:
            self.layer_held = None  # every layer holds exactly k
        if k is None or self.num_slots <= k:
            return self._identity()
        rule = self.kv_budget if k == self.kv_budget.budget else self.kv_budget.with_budget(k)
        mask = select_keep_mask(
            self.positions, self.ranking(self.num_tokens), k, self.num_tokens - 1,
            rule.num_sinks, rule.num_recent, rule.by_score,
        )
        evicted_now = self.num_slots - k
        keep = self._compact(mask, ring=k if rule.ring else None)
        self.num_evicted += evicted_now
        return keep

    def rollback(self, num_tokens: int) -> torch.Tensor:  # [L, H, held after]
        """Forget every position ``>= num_tokens`` (rejected drafts); not counted as evicted.
        Tokens that replaced an evicted one cannot be rolled back unevenly across heads."""
        if num_tokens > self.num_tokens:
            raise ValueError("cannot roll forward")
        mask = (self.positions >= 0) & (self.positions < num_tokens)
        keep = self._compact(mask, ring=None)
        self.num_tokens = num_tokens
        return keep

    def _identity(self) -> torch.Tensor:  # [L, H, num_slots]
        ids = torch.arange(self.num_slots, device=self.device)
        return ids.expand(self.num_layers, self.num_kv_heads, -1).clone()

    def _compact(self, keep_mask: torch.Tensor, ring: int | None) -> torch.Tensor:
        keep = compaction_map(keep_mask, self.positions, ring=ring)
        n = keep.shape[-1]
        new_pos = self.positions.gather(-1, keep)
        new_scores = self.scores.gather(-1, keep)
        self._positions[..., : self.num_slots] = -1
        self._scores[..., : self.num_slots] = 0.0
        self._positions[..., :n] = new_pos
        self._scores[..., :n] = new_scores
        self.num_slots = n
        self.layer_held = None  # every (layer, head) now keeps the same count
        return keep


# ---------------------------------------------------------------------------------------------
# Batched entry points (the engine calls these once per step).
# ---------------------------------------------------------------------------------------------


def choose_victims_batch(
    states: Sequence[KVBudgetState],
    new_positions: Sequence[int] | None = None,  # default: each state's next position
    *,
    stacked: bool | None = None,  # default: True on CUDA, False on CPU
) -> torch.Tensor:  # [num_seqs, num_layers, num_kv_heads] int64 slots
    """Victim (or fresh) slot for every sequence's new token; writes the new tokens back.

    ``stacked=True`` stacks the states into ``[B, L, H, max_slots]`` (padding = empty) and runs
    ``choose_victims_batched`` once: few kernel launches, the right trade on a GPU. On a CPU the
    stacking copies cost more than they save, so by default each sequence runs the vectorised
    ``choose_victims_one`` (a loop over sequences, never over layers or heads). Same result.
    """
    if not states:
        return torch.empty(0, 0, 0, dtype=torch.long)
    dev = states[0].device
    newp = [s.num_tokens for s in states] if new_positions is None else list(new_positions)
    for s, p in zip(states, newp):
        if p < s.num_tokens:
            raise ValueError(f"position {p} is not after the last one ({s.num_tokens - 1})")
    evict = [s.at_budget for s in states]
    if stacked is None:
        stacked = dev.type == "cuda"
    if stacked:
        slots = _stacked_victims(states, newp)
    else:
        slots = torch.stack([
            choose_victims_one(s.positions, s.ranking(p), p, s.kv_budget.num_sinks, s.kv_budget.num_recent,
                               s.kv_budget.by_score)
            if e else torch.full((s.num_layers, s.num_kv_heads), s.num_slots, device=dev)
            for s, p, e in zip(states, newp, evict)
        ])
    for b, s in enumerate(states):
        s._write_new(slots[b], newp[b], evict[b])
    return slots


def _stacked_victims(states: Sequence[KVBudgetState], newp: list[int]) -> torch.Tensor:
    dev = states[0].device
    width = max(1, max(s.num_slots for s in states))
    pos = torch.full((len(states), states[0].num_layers, states[0].num_kv_heads, width), -1,
                     dtype=torch.long, device=dev)
    sc = torch.zeros(pos.shape, dtype=torch.float32, device=dev)
    for b, s in enumerate(states):
        pos[b, ..., : s.num_slots] = s.positions
        sc[b, ..., : s.num_slots] = s.ranking(newp[b])
    as_t = lambda xs, dtype=torch.long: torch.tensor(xs, dtype=dtype, device=dev)  # noqa: E731
    slots, _ = choose_victims_batched(
        pos,
        sc,
        as_t([s.num_slots for s in states]),
        as_t(newp),
        as_t([s.kv_budget.budget if s.kv_budget.budget is not None else _NO_BUDGET for s in states]),
        as_t([s.kv_budget.num_sinks for s in states]),
        as_t([s.kv_budget.num_recent for s in states]),
        as_t([s.kv_budget.by_score for s in states], torch.bool),
    )
    return slots


def accumulate_batch(
    states: Sequence[KVBudgetState],
    step_scores: torch.Tensor,  # [num_seqs, num_layers, num_kv_heads, max_slots] float
) -> None:
    """S += one forward's scores for every sequence (rows in ``states`` order)."""
    for b, s in enumerate(states):
        s.accumulate(step_scores[b])


def stack_layer_scores(
    per_layer: Sequence[torch.Tensor],  # num_layers x [num_seqs, num_kv_heads, max_slots]
) -> torch.Tensor:  # [num_seqs, num_layers, num_kv_heads, max_slots]
    """The kernels return scores per layer; the policy wants them per sequence."""
    return torch.stack(list(per_layer), dim=1)
