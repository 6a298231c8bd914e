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

Pure Python + NumPy: one growing int64 array per sequence; a lookup is one vectorised pass over
it (microseconds at a few thousand tokens) and a few comparisons per candidate; longest n first,
latest occurrence first (vLLM's ``prompt_lookup_max``/``prompt_lookup_min`` semantics, latest
rather than first match: the recent past predicts better in a looping answer).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


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
        n tokens, for the largest n in [min_n, max_n] that occurred before; [] if none did.

        One vectorised pass finds the earlier occurrences of the last token; each is then
        extended backwards, at most max_n - 1 comparisons of those candidates alone."""
        length = self._len
        if k <= 0 or length < self.min_n + 1:
            return []
        tokens = self._tokens[:length]
        # ends of earlier occurrences: before the last token, so the token after each exists
        ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])
        if ends.size == 0:
            return []
        matched = np.ones(ends.size, dtype=np.int64)  # how many tokens each end matches, backwards
        alive = np.ones(ends.size, dtype=bool)
        for back in range(1, min(self.max_n, length - 1)):
            prev = ends - back
            alive &= prev >= 0
            alive[alive] = tokens[prev[alive]] == tokens[length - 1 - back]
            matched += alive
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            hits = np.flatnonzero(matched >= n)
            if hits.size:
                start = int(ends[hits[-1]]) + 1
                return tokens[start : min(start + k, length)].tolist()
        return []
