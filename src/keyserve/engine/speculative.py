"""Speculative sampling in the engine step (docs/algorithms.md §3): how many drafts, propose,
verify.

Per step, every decoding sequence that speculates gets ``K`` draft tokens from the draft worker;
the target scores all ``K + 1`` positions in the same forward as the rest of the batch;
``core.spec_decode.verify_drafts`` (run by the model runner, where the per-sequence generators
live) decides with the pure, vectorised ``rejection_sample`` what is accepted; the engine
appends the accepted tokens plus one recovered or bonus token and rolls both KV caches back to
that length.
``SpeculativeDecoder`` keeps the engine-side part: how many drafts, statistics, adaptive K.
"""

from __future__ import annotations

from keyserve.config import SpecConfig
from keyserve.core.sequence import Sequence
from keyserve.core.spec_decode import AcceptanceStats, AdaptiveK
from keyserve.engine.draft_worker import DraftWorker


class SpeculativeDecoder:
    def __init__(self, drafter: DraftWorker | None, config: SpecConfig, cost_ratio: float) -> None:
        self.drafter = drafter
        self.config = config
        self.cost_ratio = cost_ratio
        self.stats = AcceptanceStats()  # engine total
        self.request_stats: dict[str, AcceptanceStats] = {}
        self._adaptive: dict[int, AdaptiveK] = {}

    def enabled_for(self, seq: Sequence) -> bool:
        want = seq.params.speculative
        return self.config.speculative_by_default if want is None else want

    def lookahead(self, seq: Sequence, max_model_len: int) -> int:
        """Draft tokens for this sequence's next decode step (0 = decode plainly)."""
        if not self.enabled_for(seq):
            return 0
        if seq.kv_budgeted and seq.kv_slot_cap is None:
            return 0  # under a budget, the prompt-phase selection comes first
        k = seq.params.num_speculative_tokens or self.config.num_speculative_tokens
        if self.config.adaptive_k:
            adaptive = self._adaptive.get(seq.seq_id)
            if adaptive is None:
                adaptive = self._adaptive[seq.seq_id] = AdaptiveK(
                    k_min=1, k_max=k, cost_ratio=self.cost_ratio
                )
            k = adaptive.choose()
        # A step emits up to K + 1 tokens: never draft past max_tokens or the context.
        room = min(
            seq.params.max_tokens - len(seq.output_token_ids), max_model_len - seq.num_tokens
        )
        return max(0, min(k, room - 1))

    def record(self, request_id: str, num_draft: int, num_accepted: int) -> None:
        """Statistics of one verification (engine total and per request)."""
        self.stats.update([num_draft], [num_accepted])
        self.request_stats.setdefault(request_id, AcceptanceStats()).update([num_draft], [num_accepted])

    def adapt(self, seq_id: int, num_draft: int, num_accepted: int) -> None:
        """Feed adaptive K's acceptance estimate (the scheduler side picks K)."""
        adaptive = self._adaptive.get(seq_id)
        if adaptive is not None and num_draft:
            adaptive.observe([num_draft], [num_accepted])

    def forget(self, seq_id: int) -> None:
        self._adaptive.pop(seq_id, None)

    def release(self, seq: Sequence) -> None:
        if self.drafter is not None:
            self.drafter.release(seq)
        self.forget(seq.seq_id)

    def pop_request_stats(self, request_id: str) -> AcceptanceStats | None:
        return self.request_stats.pop(request_id, None)

