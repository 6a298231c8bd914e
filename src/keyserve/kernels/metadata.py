"""What one forward step tells every attention layer about the batch.

Tokens are packed ``[decode tokens | prefill tokens]``: the first ``num_decode_seqs`` sequences
contribute exactly one query token each; the remaining sequences contribute a chunk of one or
more query tokens (prompt chunks, recomputation after preemption, speculative verification).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from keyserve.kernels.reference import ScoreMode

# What one attention layer returns beside its output when ``score_mode`` is set: (decode scores
# [num_decode_seqs, num_kv_heads, max_ctx] | None, prefill scores [num_prefill_seqs,
# num_kv_heads, max_ctx] | None), each None when the step has no rows of that kind.
LayerScores = tuple[torch.Tensor | None, torch.Tensor | None]


@dataclass
class AttentionMetadata:
    # [num_tokens] int64 physical slot of every token's K/V (same in every layer), or
    # [num_layers, num_tokens, num_kv_heads] when KV budgets write per (layer, head); < 0 = skip.
    slot_mapping: torch.Tensor
    num_decode_seqs: int
    decode_block_tables: torch.Tensor  # [num_decode_seqs, max_blocks] int32
    # [num_decode_seqs] int32, slots incl. the new token; or [num_layers, num_decode_seqs]
    # when a sequence's layers hold different counts (see ``layer_context_lens``)
    decode_context_lens: torch.Tensor
    prefill_block_tables: torch.Tensor  # [num_prefill_seqs, max_blocks] int32
    prefill_query_start_loc: torch.Tensor  # [num_prefill_seqs + 1] int32, relative to prefill part
    prefill_context_lens: torch.Tensor  # [num_prefill_seqs] or [num_layers, num_prefill_seqs] int32
    sliding_window: int | None = None  # layers of a sliding-window model, when slot == position
    # Score output for KV budgets: None, "softmax" (H2O), "gumbel" (Keyformer), or "mixed"
    # (both in one batch: rows in ``gumbel_rows`` get Gumbel scores, the others plain ones).
    score_mode: ScoreMode | Literal["mixed"] | None = None
    gumbel_rows: torch.Tensor | None = None  # [num_seqs] bool, decode seqs first ("mixed" only)
    tau: torch.Tensor | None = None  # [num_seqs] float32, decode seqs first then prefill seqs
    # Keyformer's noise per row (kernels/noise.py): [num_seqs, 2] int64 (noise seed, position of
    # the row's first query token), decode seqs first; None: every row draws a random seed
    noise_keys: torch.Tensor | None = None
    # Tree speculation: [num_decode_seqs] int64 mask per decode row over the last slots of its
    # context. With L the row's context length in the layer, bit i (0 <= i <= 62) says whether
    # slot L-1-i is visible (bit 0: the row's own token); slots L-1-i with i >= 63 are always
    # visible and bit 63 is ignored; -1 shows every slot (a normal decode row). Hidden slots
    # leave the softmax as if absent (output and scores; their scores are 0); combines with
    # ``sliding_window``. None: no masks (the fast path).
    decode_tree_masks: torch.Tensor | None = None  # [num_decode_seqs] int64

    @property
    def num_prefill_seqs(self) -> int:
        return int(self.prefill_block_tables.shape[0])

    def layer_slot_mapping(self, layer_idx: int) -> torch.Tensor:
        """[num_tokens] or [num_tokens, num_kv_heads] slots for one layer."""
        if self.slot_mapping.dim() == 3:
            return self.slot_mapping[layer_idx]
        return self.slot_mapping

    def layer_context_lens(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(decode [num_decode_seqs], prefill [num_prefill_seqs]) context lengths of one layer."""
        dec, pre = self.decode_context_lens, self.prefill_context_lens
        return (dec[layer_idx] if dec.dim() == 2 else dec, pre[layer_idx] if pre.dim() == 2 else pre)
