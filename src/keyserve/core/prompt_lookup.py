"""Prompt lookup: draft tokens copied from earlier in the sequence itself (n-gram matching).

Small models repeat themselves, answers quote their prompts, code repeats identifiers: where the
last ``n`` tokens of a sequence occurred before, the tokens that followed them then are a good
guess for what follows now. On SmolLM2-135M's greedy answers to the speculative bench's chat
prompts the target's next token was the token after the latest earlier occurrence of the
last 2-4 tokens 70 % of the time where such an occurrence existed (a third of the positions),
against 44 % for the distilled draft at those positions (docs/speculative.md, "Prompt lookup").

A lookup costs no model forward, so the drafter proposes these tokens instead of running the
draft model for that sequence. As a proposal it is a point mass: p(x) = 1 for the copied token,
which rejection sampling handles exactly (accepted with probability q(x), else a token drawn
from q with x removed), so output stays the target's.

Pure Python + NumPy: one growing int32 array per sequence, searched with a sliding-window
comparison (tens of microseconds at a few thousand tokens), longest n first, latest occurrence
first (vLLM's ``prompt_lookup_max``/``prompt_lookup_min`` semantics, latest rather than first
match: the recent past predicts better in a looping answer).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class PromptLookup:
    """The tokens of one sequence so far, and the lookup over them."""

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"prompt lookup n-gram sizes need 1 <= min ({min_n}) <= max ({max_n})")
        self.min_n, self.max_n = min_n, max_n
        self._tokens = np.zeros(64, dtype=np.int64)
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def sync(self, prompt: Sequence[int], output: Sequence[int]) -> None:
        """Catch up with the sequence's tokens (``prompt`` then ``output``). Sequences only
        grow; one that got shorter (a caller's reuse) is indexed again from scratch."""
        total = len(prompt) + len(output)
        if total < self._len:
            self._len = 0
        if total == self._len:
            return
        if total > len(self._tokens):
            grown = np.zeros(max(total, 2 * len(self._tokens)), dtype=np.int64)
            grown[: self._len] = self._tokens[: self._len]
            self._tokens = grown
        start = self._len
        if start < len(prompt):
            self._tokens[start : len(prompt)] = prompt[start:]
            start = len(prompt)
        self._tokens[start:total] = output[start - len(prompt) :]
        self._len = total

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the sequence's last
        n tokens, for the largest n in [min_n, max_n] that occurred before; [] if none did."""
        length = self._len
        if k <= 0:
            return []
        tokens = self._tokens[:length]
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = tokens[length - n :]
            # windows starting at 0 .. length - n - 1: each ends before the suffix's last token,
            # so the token after it exists
            windows = sliding_window_view(tokens[: length - 1], n)  # [length - n, n]
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tokens[start : min(start + k, length)].tolist()
        return []
