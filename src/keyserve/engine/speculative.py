"""Speculative sampling in the engine step (docs/algorithms.md §3): how many drafts, propose,
verify.

Per step, every decoding sequence that speculates gets ``K`` draft tokens from the draft worker;
the target scores all ``K + 1`` positions in the same forward as the rest of the batch;
``verify_drafts`` (run by the model runner, where the per-sequence generators live) decides
with the pure, vectorised ``rejection_sample`` what is accepted; the engine appends the
accepted tokens plus one recovered or bonus token and rolls both KV caches back to that length.
``SpeculativeDecoder`` keeps the engine-side part: how many drafts, statistics, adaptive K.
"""

from __future__ import annotations

import torch

from keyserve.config import SpecConfig
from keyserve.core.sampler import SamplingTensors, processed_probs
from keyserve.core.sampling_params import SamplingParams
from keyserve.core.sequence import Sequence
from keyserve.core.spec_decode import AcceptanceStats, AdaptiveK, rejection_sample
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
