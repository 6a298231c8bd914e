"""The model side's KV-budget state: one ``KVBudgetState`` per budgeted sequence, per rank.

Each rank holds whole kv-heads, so each keeps its own states and evicts on its own
(docs/algorithms.md §2). The tracker is where a step's eviction decisions are taken: the victim
slots of decoding sequences (``decode_slots``: Keyformer and H2O by accumulated score, window
and StreamingLLM by age -- the pure choice is ``core.kv_policy.choose_victims_batch``), the
prompt-phase selection (``select_prompt``) and the settling of speculation (``settle``); and
where the attention scores the kernels return are accumulated (``accumulate_step``).
"""

from __future__ import annotations

import copy
from typing import Protocol

import torch

from keyserve.core.kv_policy import KVBudget, KVBudgetState, choose_victims_batch, score_mode
from keyserve.engine.kv_budget.slots import ScoreRows
from keyserve.engine.step_input import StepItem, describe_failure
from keyserve.kernels.metadata import LayerScores


class HasSeqId(Protocol):
    """What the tracker keys its states by: a ``Sequence``, a ``StepItem``, an op's id."""

    @property
    def seq_id(self) -> int: ...


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
        # Keyformer's noise seeds for requests without a seed (``keyformer.noise_keys``): a
        # stream of its own, seeded from torch's initial seed without drawing from the global
        # generator, so every tensor-parallel rank draws the same seeds.
        self.noise_generator = torch.Generator().manual_seed(torch.initial_seed() ^ 0x4B657946)
        # seq_id -> its scores [L, H, boundary] as of a prompt chunk's score boundary (the
        # queries before it only: ``StepItem.score_split``), until the prefix store takes them
        self.boundary_scores: dict[int, torch.Tensor] = {}

    def start(self, seq: HasSeqId, kv_budget: KVBudget) -> KVBudgetState:
        """A fresh prompt phase (new request, or recomputation after preemption)."""
        state = KVBudgetState(kv_budget, self.num_layers, self.num_kv_heads, device=self.device)
        self.states[seq.seq_id] = state
        self.compacted.discard(seq.seq_id)
        self.pending.pop(seq.seq_id, None)
        return state

    def fork(self, parent_id: int, child_id: int) -> None:
        state = self.states.get(parent_id)
        if state is None:
            return
        self.states[child_id] = copy.deepcopy(state)
        if parent_id in self.compacted:
            self.compacted.add(child_id)

    def release(self, seq: HasSeqId) -> None:
        self.release_id(seq.seq_id)

    def release_id(self, seq_id: int) -> None:
        self.states.pop(seq_id, None)
        self.compacted.discard(seq_id)
        self.pending.pop(seq_id, None)
        self.boundary_scores.pop(seq_id, None)

    def get(self, seq: HasSeqId) -> KVBudgetState | None:
        return self.states.get(seq.seq_id)

    def stats(self, seq_id: int) -> tuple[int, int] | None:
        """(tokens held, tokens evicted) per (layer, kv-head), or None if not budgeted."""
        state = self.states.get(seq_id)
        return None if state is None else (state.num_slots, state.num_evicted)

    # ------------------------------------------------------------ step inputs
    def decode_slots(self, seqs: list[StepItem]) -> torch.Tensor:  # [n, L, H] logical slots
        """Where each decoding sequence's new token goes, per (layer, head), in one call: a
        fresh slot under budget, the evicted token's slot at budget. This is where Keyformer
        and H2O evict during decode (lowest accumulated score, then the oldest)."""
        return choose_victims_batch([self.states[s.seq_id] for s in seqs])

    def score_mode(self, seq: HasSeqId) -> str | None:
        state = self.states.get(seq.seq_id)
        return None if state is None else score_mode(state.kv_budget.policy)

    # ---------------------------------------------------------- after forward
    def accumulate(
        self,
        seq: HasSeqId,
        scores: torch.Tensor,  # [num_layers, num_kv_heads, >= num_slots]
    ) -> None:
        self.states[seq.seq_id].accumulate(scores)

    def accumulate_step(
        self,
        score_rows: list[ScoreRows],
        # per layer: (decode [n_dec, H, ctx] | None, prefill [n_pre, H, ctx] | None); None when
        # the forward computed no scores (no H2O / Keyformer sequence in the step)
        scores: list[LayerScores] | None,
        failed: dict[int, str] | None = None,
    ) -> None:
        """Add one forward's attention mass to every budgeted sequence's scores; a verifying
        sequence's per-row scores wait for the verdict (``settle``). A sequence whose own state
        refuses them goes to ``failed`` (raises without it)."""
        if scores is None:
            return
        dec = _stack_layers([s[0] for s in scores]) if scores[0][0] is not None else None
        pre = _stack_layers([s[1] for s in scores]) if scores[0][1] is not None else None
        for item, is_dec, first, count in score_rows:
            rows = (dec if is_dec else pre)[first : first + count]  # type: ignore[index]
            try:
                if item.verifies and count > 1:
                    self.hold_rows(item, rows)  # [K + 1, L, H, max_ctx]
                elif count == 2:  # a prompt chunk split at its score boundary
                    self.accumulate_split(item, rows[0], rows[1])
                else:
                    self.accumulate(item, rows[0])
            except Exception as e:  # noqa: BLE001 — this sequence's budget state; fails it alone
                if failed is None:
                    raise
                failed[item.seq_id] = describe_failure("KV budget scores", e)

    def accumulate_split(
        self,
        item: StepItem,
        before: torch.Tensor,  # [num_layers, num_kv_heads, >= num_slots] the queries before the boundary
        after: torch.Tensor,  # [num_layers, num_kv_heads, >= num_slots] the queries from it on
    ) -> None:
        """Add a split prompt chunk's scores, keeping the sequence's scores as they stood once
        the queries before the boundary had added theirs (``boundary_scores``)."""
        state = self.states[item.seq_id]
        state.accumulate(before)
        boundary = item.start + item.score_split
        self.boundary_scores[item.seq_id] = state.scores[..., :boundary].clone()
        state.accumulate(after)

    def expect_rows(self, seq: HasSeqId, first_position: int) -> None:
        """A verification forward of ``seq`` starts at ``first_position`` (in spare slots)."""
        self.pending[seq.seq_id] = (first_position, None)

    def hold_rows(
        self,
        seq: HasSeqId,
        scores: torch.Tensor,  # [K + 1, num_layers, num_kv_heads, max_ctx] one row per position
    ) -> None:
        """Keep a verification forward's per-row scores until the verdict: only the accepted
        positions' attention counts (a rejected draft was never part of the sequence)."""
        first, _ = self.pending[seq.seq_id]
        self.pending[seq.seq_id] = (first, scores)

    def settled_stats(self, item: StepItem, num_accepted: int) -> tuple[int, int]:
        """(held, evicted) of a budgeted sequence that verified drafts, as it will be once
        settled: the accepted positions kept, then evictions down to the budget."""
        state = self.states[item.seq_id]
        held = state.num_slots - item.num_query_tokens + num_accepted + 1
        k = state.kv_budget.budget if state.kv_budget.budget is not None else held
        return min(held, k), state.num_evicted + max(0, held - k)

    # ------------------------------------------------------------- compaction
    def settle(self, seq: HasSeqId, num_tokens: int) -> torch.Tensor | None:
        """Speculation resolved: the scores of the accepted rows are accumulated (verification
        of a target under a budget), positions ``>= num_tokens`` (rejected tokens in spare
        slots) are forgotten, then the policy evicts down to the budget with the scores so far.
        Returns ``keep [L, H, n]`` for ``compact_kv``, or None when nothing moves."""
        state = self.states[seq.seq_id]
        first_position, rows = self.pending.pop(seq.seq_id, (0, None))
        if rows is not None and num_tokens > first_position:
            accepted = rows[: num_tokens - first_position]  # [accepted + 1, L, H, max_ctx]
            # the newest accepted query's attention alone under score_window="last"
            state.accumulate(accepted[-1] if state.kv_budget.last_query_only else accepted.sum(dim=0))
        held = state.num_slots
        kept = state.rollback(num_tokens)  # [L, H, n1]: indices into the old slots
        keep = kept.gather(-1, state.evict_down_to())  # evict_down_to indexes the rolled-back slots
        return None if _moves_nothing(keep, held) else keep

    def due_for_compaction(self, seq: HasSeqId) -> bool:
        return seq.seq_id in self.states and seq.seq_id not in self.compacted

    def select_prompt(self, seq: HasSeqId) -> torch.Tensor | None:
        """Prompt-phase selection (where a prompt's tokens are evicted, all but k at once);
        returns ``keep [L, H, k]`` or None when nothing moves."""
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


def _stack_layers(
    per_layer: list[torch.Tensor],  # num_layers x [num_seqs, num_kv_heads, max_ctx of that layer]
) -> torch.Tensor:  # [num_seqs, num_layers, num_kv_heads, max_ctx] zero-padded
    """Layers may attend over different context lengths (a sequence whose layers hold different
    counts): pad each layer's scores to the widest before stacking."""
    width = max(t.shape[-1] for t in per_layer)
    if any(t.shape[-1] != width for t in per_layer):
        per_layer = [torch.nn.functional.pad(t, (0, width - t.shape[-1])) for t in per_layer]
    return torch.stack(per_layer, dim=1)
