"""Speculative sampling in the engine step (SPEC §3): how many drafts, propose, verify.

Per step, every decoding sequence that speculates gets ``K`` draft tokens from the draft worker;
the target scores all ``K + 1`` positions in the same forward as the rest of the batch; the
pure, vectorised ``rejection_sample`` decides what is accepted; the engine appends the accepted
tokens plus one recovered or bonus token and rolls both KV caches back to that length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from keyserve.config import SpecConfig
from keyserve.core.sampler import SamplingTensors, processed_probs
from keyserve.core.scheduler import ScheduledSeq
from keyserve.core.sequence import Sequence
from keyserve.core.spec_decode import AcceptanceStats, AdaptiveK, rejection_sample
from keyserve.engine.draft_worker import DraftWorker, Proposal


@dataclass
class Verified:
    token_ids: list[int]  # accepted drafts + the recovered or bonus token
    logprobs: list[float] | None
    num_draft: int
    num_accepted: int


class SpeculativeDecoder:
    def __init__(self, drafter: DraftWorker, config: SpecConfig, cost_ratio: float) -> None:
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
        if seq.kv_budgeted or not self.enabled_for(seq):
            return 0
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

    def propose(self, items: list[ScheduledSeq]) -> Proposal:
        proposal = self.drafter.propose([it.seq for it in items], [it.num_lookahead for it in items])
        for row, item in enumerate(items):
            n = int(proposal.num_draft[row])
            item.draft_token_ids = proposal.token_ids[row, :n].tolist()
        return proposal

    def verify(
        self,
        items: list[ScheduledSeq],
        proposal: Proposal,
        logits: dict[int, torch.Tensor],  # seq_id -> [1 + num_draft, vocab] target logits
        generators: dict[int, torch.Generator | None],
    ) -> list[Verified]:
        """Modified rejection sampling for all speculating sequences at once."""
        b = len(items)
        k_max = proposal.token_ids.shape[1]
        vocab = proposal.probs.shape[-1]
        num_draft = proposal.num_draft
        raw = torch.full((b, k_max + 1, vocab), float("-inf"))
        raw[:, :, 0] = 0.0  # padding rows: a harmless valid distribution
        for row, item in enumerate(items):
            seq_logits = logits[item.seq.seq_id]
            raw[row, : seq_logits.shape[0]] = seq_logits.to(raw.device)
        st = SamplingTensors.from_params([it.seq.params for it in items]).expand(k_max + 1)
        target_probs = processed_probs(raw.view(b * (k_max + 1), vocab), st).view(b, k_max + 1, vocab)
        accept_u = torch.empty(b, max(k_max, 1))
        draw_u = torch.empty(b, vocab)
        for row, item in enumerate(items):
            gen = generators.get(item.seq.seq_id)
            accept_u[row] = torch.rand(accept_u.shape[1], generator=gen)
            draw_u[row] = torch.rand(vocab, generator=gen)
        out = rejection_sample(
            proposal.probs, target_probs, proposal.token_ids, accept_u[:, :k_max], draw_u,
            num_draft=num_draft,
        )
        self.stats.update(num_draft, out.num_accepted)
        results = []
        for row, item in enumerate(items):
            a = int(out.num_accepted[row])
            tokens = out.output_token_ids[row, : a + 1].tolist()
            lps = None
            if item.seq.params.logprobs:
                lp = torch.log_softmax(raw[row, : a + 1], dim=-1)
                lps = lp.gather(-1, torch.tensor(tokens)[:, None])[:, 0].tolist()
            n = int(num_draft[row])
            stats = self.request_stats.setdefault(item.seq.request_id, AcceptanceStats())
            stats.update([n], [a])
            adaptive = self._adaptive.get(item.seq.seq_id)
            if adaptive is not None and n:
                adaptive.observe([n], [a])
            results.append(Verified(tokens, lps, n, a))
        return results

    def release(self, seq: Sequence) -> None:
        self.drafter.release(seq)
        self._adaptive.pop(seq.seq_id, None)

    def pop_request_stats(self, request_id: str) -> AcceptanceStats | None:
        return self.request_stats.pop(request_id, None)
