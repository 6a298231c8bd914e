"""What a drafter proposes for one step (``Drafter``, ``LookupDrafter``, the Ray draft actor)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Proposal:
    token_ids: torch.Tensor  # [num_seqs, max_k] int64 (0 past num_draft)
    # [num_seqs, max_k, vocab] float32 draft distributions p, on the draft's device; None when
    # every sequence is greedy (verification then compares argmaxes and never reads p)
    probs: torch.Tensor | None
    num_draft: torch.Tensor  # [num_seqs] int64: drafts actually proposed per sequence
    # [num_seqs, max_k + 1] int64 tree parents (core/spec_tree.py; column 0 the root's, -1), or
    # None: chains
    parents: torch.Tensor | None = None
    # [num_seqs] bool: the rows prompt lookup drafted (no draft-model forward); None: none did
    copied: torch.Tensor | None = None
