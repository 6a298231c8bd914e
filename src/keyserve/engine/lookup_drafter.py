"""Prompt lookup as a drafter: the lookup part of ``Drafter`` (drafts copied from earlier in
the sequence, ``core/prompt_lookup.py``) and ``LookupDrafter``, which drafts by lookup alone.

``LookupDrafter`` is speculation without a draft model (vLLM's ``ngram`` method,
``draft="ngram"``): nothing to load, no KV pool, no forward. It proposes only where a
sequence's last n tokens occurred before; the others decode plainly that step (zero drafts).
Every draft is a point mass (p = 1 at the copy), so rejection sampling keeps the output the
target's. It has the same ``propose``/``release`` as ``Drafter``, so the engine, the Ray draft
actor and adaptive K drive it unchanged.
"""

from __future__ import annotations

import torch

from keyserve.core.prompt_lookup import PromptLookup
from keyserve.core.sampler import SamplingTensors
from keyserve.core.sequence import Sequence
from keyserve.engine.proposal import Proposal


class LookupIndexes:
    """Each target sequence's lookup index and what they proposed (counters read by the bench
    and the tests: chain proposals, i.e. sequence-steps, and tokens)."""

    def __init__(self, sizes: tuple[int, int] | None) -> None:
        self.sizes = sizes  # (min n, max n); None: off
        self.indexes: dict[int, PromptLookup] = {}
        self.proposals = 0
        self.tokens = 0

    def fill(self, targets: list[Sequence], num_draft: list[int],
             tokens: torch.Tensor,  # [len(targets), max(num_draft)] int64, written in place
             proposed: list[int]) -> set[int]:
        """Look up every sequence that wants drafts; where its last n tokens occurred before,
        the tokens that followed them go into ``tokens`` and ``proposed``. Returns the rows
        filled."""
        if self.sizes is None:
            return set()
        filled = set()
        for i, target in enumerate(targets):
            if num_draft[i] <= 0:
                continue
            found = self._synced(target).propose(num_draft[i])
            if found:
                tokens[i, : len(found)] = torch.tensor(found, dtype=torch.int64)
                proposed[i] = len(found)
                filled.add(i)
                self.proposals += 1
                self.tokens += len(found)
        return filled

    def peek(self, target: Sequence, k: int) -> int:
        """How many tokens a lookup would copy for ``target`` now (at most ``k``; 0: no
        match), counting nothing: the engine asks before choosing K (lookup-aware K,
        ``engine/speculative.py``), and the drafter's own lookup over the same tokens then
        finds the same match."""
        if self.sizes is None or k <= 0:
            return 0
        return len(self._synced(target).propose(k))

    def _synced(self, target: Sequence) -> PromptLookup:
        """The sequence's index, caught up with its tokens (made on first use)."""
        assert self.sizes is not None
        index = self.indexes.get(target.seq_id)
        if index is None:
            index = self.indexes[target.seq_id] = PromptLookup(*self.sizes)
        index.sync(target.prompt_token_ids, target.output_token_ids)
        return index

    def drop(self, seq_id: int) -> None:
        self.indexes.pop(seq_id, None)

    def clear(self) -> None:
        self.indexes.clear()


def point_masses(
    probs: torch.Tensor | None,  # [b, k_max, vocab] float32 draft distributions, or None: none yet
    rows: set[int],
    tokens: torch.Tensor,  # [b, k_max] int64 drafts
    proposed: list[int],
    vocab_size: int,
    device: torch.device,
) -> torch.Tensor:  # [b, k_max, vocab] float32
    """Copied drafts as distributions: p = 1 at the copy, for the rows in ``rows`` (a step
    that samples needs p for every draft it verifies)."""
    if probs is None:
        probs = torch.zeros(tokens.shape[0], tokens.shape[1], vocab_size, dtype=torch.float32, device=device)
    ordered = sorted(rows)
    r = [i for i in ordered for _ in range(proposed[i])]
    c = [j for i in ordered for j in range(proposed[i])]
    dev = probs.device
    probs[torch.tensor(r, device=dev), torch.tensor(c, device=dev), tokens[r, c].to(dev)] = 1.0
    return probs


def copied_rows(num_seqs: int, rows: set[int]) -> torch.Tensor | None:  # [num_seqs] bool
    """``Proposal.copied`` for the rows prompt lookup filled (None when it filled none)."""
    if not rows:
        return None
    copied = torch.zeros(num_seqs, dtype=torch.bool)
    copied[sorted(rows)] = True
    return copied


class LookupDrafter:
    """Drafts by prompt lookup alone (module doc): the ``Drafter`` interface with no model."""

    supports_trees = False  # a tree needs a model's ranking of alternatives

    def __init__(self, vocab_size: int, sizes: tuple[int, int], device: torch.device | None = None) -> None:
        self.vocab_size = vocab_size
        self.device = device or torch.device("cpu")
        self.lookup_index = LookupIndexes(sizes)
        self.mirrors: dict[int, Sequence] = {}  # never any: nothing mirrors the target

    @property
    def lookup_proposals(self) -> int:
        return self.lookup_index.proposals

    @property
    def lookup_tokens(self) -> int:
        return self.lookup_index.tokens

    @torch.inference_mode()
    def propose(self, targets: list[Sequence], num_draft: list[int]) -> Proposal:
        b, k_max = len(targets), max(num_draft, default=0)
        tokens = torch.zeros(b, k_max, dtype=torch.int64)
        proposed = [0] * b
        rows = self.lookup_index.fill(targets, num_draft, tokens, proposed)
        probs = None
        if rows and not SamplingTensors.from_params([t.params for t in targets]).all_greedy:
            probs = point_masses(None, rows, tokens, proposed, self.vocab_size, self.device)
        return Proposal(tokens, probs, torch.tensor(proposed, dtype=torch.int64), copied=copied_rows(b, rows))

    def propose_tree(self, targets: list[Sequence], trees: list[list[int]]) -> Proposal:
        raise NotImplementedError("prompt lookup drafts chains (supports_trees is False)")

    def release(self, target: Sequence) -> None:
        self.lookup_index.drop(target.seq_id)

    def release_all(self) -> None:
        self.lookup_index.clear()
