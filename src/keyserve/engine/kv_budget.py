"""KV budgets in the engine: per-sequence policy state, per-(layer, head) slots, compaction.

The pure policy (which token to keep) lives in ``core.kv_policy``; this module turns its
decisions into slot mappings for the KV write, context lengths for attention, score requests
for the kernels, and the physical moves that compact a prompt into its first blocks so the rest
go back to the pool. A budgeted sequence's *logical* slot ``s`` lives at physical slot
``block_table[s // B] * B + s % B``, like any other.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from keyserve.core.kv_policy import (
    BudgetSpec,
    KVBudgetState,
    KVPolicy,
    choose_victims_batch,
    keyformer_tau,
    score_mode,
)
from keyserve.core.sequence import Sequence


@dataclass
class BudgetDefaults:
    policy: str = "full"
    budget: float | None = None


def budget_spec(seq: Sequence, defaults: BudgetDefaults) -> BudgetSpec | None:
    """The policy and k a request runs under (its own fields, else the server defaults)."""
    p = seq.params
    policy = p.kv_policy or defaults.policy
    budget = p.kv_budget if p.kv_budget is not None else defaults.budget
    return resolve_budget(policy, budget, seq.num_prompt_tokens, p.recent_ratio)


def resolve_budget(
    policy: str, budget: float | None, num_prompt_tokens: int, recent_ratio: float
) -> BudgetSpec | None:
    """k from a budget given as a fraction of the prompt (<= 1) or a token count (> 1);
    None when nothing is ever evicted (``full``, or no budget)."""
    if policy == "full" or budget is None:
        return None
    k = max(1, int(round(budget * num_prompt_tokens))) if budget <= 1.0 else int(budget)
    return BudgetSpec.create(policy, k, recent_ratio)


class KVBudgetTracker:
    """Runner-side state of every sequence that runs under a KV budget."""

    def __init__(self, num_layers: int, num_kv_heads: int, block_size: int, device: torch.device) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.block_size = block_size
        self.device = device
        self.states: dict[int, KVBudgetState] = {}
        self.compacted: set[int] = set()
        # Verification under a budget: seq_id -> (first verified position, per-row scores
        # [K + 1, L, H, max_ctx] or None until the forward returns them), kept until settled.
        self.pending: dict[int, tuple[int, torch.Tensor | None]] = {}

    def start(self, seq: Sequence, spec: BudgetSpec) -> KVBudgetState:
        """A fresh prompt phase (new request, or recomputation after preemption)."""
        state = KVBudgetState(spec, self.num_layers, self.num_kv_heads, device=self.device)
        self.states[seq.seq_id] = state
        self.compacted.discard(seq.seq_id)
        self.pending.pop(seq.seq_id, None)
        return state

    def fork(self, parent: Sequence, child: Sequence) -> None:
        state = self.states.get(parent.seq_id)
        if state is None:
            return
        self.states[child.seq_id] = copy.deepcopy(state)
        if parent.seq_id in self.compacted:
            self.compacted.add(child.seq_id)

    def release(self, seq: Sequence) -> None:
        self.states.pop(seq.seq_id, None)
        self.compacted.discard(seq.seq_id)
        self.pending.pop(seq.seq_id, None)

    def get(self, seq: Sequence) -> KVBudgetState | None:
        return self.states.get(seq.seq_id)

    # ------------------------------------------------------------ step inputs
    def decode_slots(self, seqs: list[Sequence]) -> torch.Tensor:  # [n, L, H] logical slots
        """Where each decoding sequence's new token goes, per (layer, head), in one call:
        a fresh slot under budget, the evicted token's slot at budget."""
        return choose_victims_batch([self.states[s.seq_id] for s in seqs])

    def tau(self, seq: Sequence, decoding: bool) -> float:
        """Keyformer's temperature: 1 in the prompt phase, then the linear schedule."""
        state = self.states[seq.seq_id]
        if not decoding or state.spec.policy is not KVPolicy.KEYFORMER:
            return 1.0
        step = max(0, len(seq.output_token_ids) - 1)
        return keyformer_tau(step, seq.params.max_tokens, seq.params.tau_init, seq.params.tau_end)

    def score_mode(self, seq: Sequence) -> str | None:
        state = self.states.get(seq.seq_id)
        return None if state is None else score_mode(state.spec.policy)

    # ---------------------------------------------------------- after forward
    def accumulate(
        self,
        seq: Sequence,
        scores: torch.Tensor,  # [num_layers, num_kv_heads, >= num_slots]
    ) -> None:
        self.states[seq.seq_id].accumulate(scores)

    def expect_rows(self, seq: Sequence, first_position: int) -> None:
        """A verification forward of ``seq`` starts at ``first_position`` (in spare slots)."""
        self.pending[seq.seq_id] = (first_position, None)

    def hold_rows(
        self,
        seq: Sequence,
        scores: torch.Tensor,  # [K + 1, num_layers, num_kv_heads, max_ctx] one row per position
    ) -> None:
        """Keep a verification forward's per-row scores until the verdict: only the accepted
        positions' attention counts (a rejected draft was never part of the sequence)."""
        first, _ = self.pending[seq.seq_id]
        self.pending[seq.seq_id] = (first, scores)

    def settle(self, seq: Sequence, num_tokens: int) -> torch.Tensor | None:
        """Speculation resolved: the scores of the accepted rows are accumulated (verification
        of a target under a budget), positions ``>= num_tokens`` (rejected tokens in spare
        slots) are forgotten, then the policy evicts down to the budget with the scores so far.
        Returns ``keep [L, H, n]`` for ``compact_kv``, or None when nothing moves."""
        state = self.states[seq.seq_id]
        first_position, rows = self.pending.pop(seq.seq_id, (0, None))
        if rows is not None and num_tokens > first_position:
            state.accumulate(rows[: num_tokens - first_position].sum(dim=0))
        held = state.num_slots
        kept = state.rollback(num_tokens)  # [L, H, n1]: indices into the old slots
        keep = kept.gather(-1, state.evict_down_to())  # evict_down_to indexes the rolled-back slots
        return None if _moves_nothing(keep, held) else keep

    def due_for_compaction(self, seq: Sequence) -> bool:
        return seq.seq_id in self.states and seq.seq_id not in self.compacted

    def select_prompt(self, seq: Sequence) -> torch.Tensor | None:
        """Prompt-phase selection; returns ``keep [L, H, k]`` or None when nothing moves."""
        state = self.states[seq.seq_id]
        self.compacted.add(seq.seq_id)
        held = state.num_slots
        keep = state.select_prompt()
        return None if _moves_nothing(keep, held) else keep


def _moves_nothing(
    keep: torch.Tensor,  # [num_layers, num_kv_heads, n] new slot j <- old slot keep[..., j]
    held: int,
) -> bool:
    """True when a selection keeps every one of ``held`` slots where it is."""
    return keep.shape[-1] == held and bool((keep == torch.arange(held, device=keep.device)).all())


def physical_slots(
    logical: torch.Tensor,  # [...] int64 logical slots of one sequence
    block_table: torch.Tensor,  # [num_blocks] int64
    block_size: int,
) -> torch.Tensor:  # [...] int64
    return block_table[logical // block_size] * block_size + logical % block_size


def compact_kv(
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    block_table: list[int],
    keep: torch.Tensor,  # [num_layers, num_kv_heads, k]: new slot j <- old slot keep[..., j]
    block_size: int,
) -> None:
    """Move each (layer, head)'s kept tokens into logical slots 0..k-1 (gather, then scatter,
    so overlapping moves are safe). Only tokens whose slot changes are copied: ``keep`` fills
    holes and leaves the rest in place, so settling a speculative step moves a few tokens,
    not the whole budget."""
    num_layers, num_kv_heads, k = keep.shape
    table = torch.tensor(block_table, dtype=torch.int64, device=keep.device)
    src = physical_slots(keep, table, block_size)  # [L, H, k]
    dst = physical_slots(torch.arange(k, device=keep.device), table, block_size)  # [k]
    heads = torch.arange(num_kv_heads, device=keep.device)[:, None]
    src_rows = src * num_kv_heads + heads  # [L, H, k] rows of a [slots * H, D] view
    dst_rows = (dst[None, :] * num_kv_heads + heads).expand_as(src_rows)  # [L, H, k]
    moves = src_rows != dst_rows
    if not bool(moves.any()):
        return
    for layer, (k_cache, v_cache) in enumerate(kv_caches):
        which = moves[layer]
        src_l, dst_l = src_rows[layer][which], dst_rows[layer][which]
        if src_l.numel() == 0:
            continue
        for cache in (k_cache, v_cache):
            rows = cache.view(-1, cache.shape[-1])
            rows[dst_l] = rows[src_l]
