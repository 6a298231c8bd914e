"""Prompt lookup (core/prompt_lookup.py) against a brute-force scan of the same rule."""

from __future__ import annotations

import random

import pytest

from keyserve.core.prompt_lookup import PromptLookup


def _brute(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Longest n first; the latest earlier occurrence whose next token exists."""
    for n in range(max_n, min_n - 1, -1):
        if len(tokens) < n + 1:
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_matches_a_brute_force_scan_while_the_sequence_grows() -> None:
    rng = random.Random(0)
    checked = hits = 0
    for trial in range(60):
        min_n, max_n = rng.choice([(1, 1), (1, 3), (2, 2), (2, 4), (3, 5)])
        vocab = rng.choice([3, 5, 12])
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 30))]
        output: list[int] = []
        lookup = PromptLookup(min_n, max_n)
        for _ in range(40):
            lookup.sync(prompt, output)
            assert len(lookup) == len(prompt) + len(output)
            for k in (1, 3, 6):
                want = _brute(prompt + output, min_n, max_n, k)
                assert lookup.propose(k) == want, (trial, min_n, max_n, k)
                checked += 1
                hits += bool(want)
            output.extend(rng.randrange(vocab) for _ in range(rng.randint(1, 4)))  # a step's tokens
    assert hits > checked // 4 and hits < checked  # both outcomes exercised


def test_prefers_the_longest_match_then_the_latest() -> None:
    lookup = PromptLookup(1, 3)
    #            0  1  2  3  4  5  6  7  8  9
    lookup.sync([7, 1, 2, 9, 5, 2, 8, 1, 2], [])
    # the 2-gram (1, 2) occurred at 1-2 (followed by 9); the 1-gram (2,) more recently at 5 (8)
    assert lookup.propose(3) == [9, 5, 2]
    lookup.sync([7, 1, 2, 9, 5, 2, 8, 1, 2], [4, 2])
    assert lookup.propose(2) == [4, 2]  # (4, 2) never occurred; (2,) latest at 8, then 4


def test_min_n_and_short_continuations() -> None:
    lookup = PromptLookup(2, 4)
    lookup.sync([1, 2, 3, 4], [])
    assert lookup.propose(4) == []  # no 2-gram repeats; a 1-gram would, but min_n is 2
    lookup.sync([1, 2, 3, 4], [1, 2])
    assert lookup.propose(8) == [3, 4, 1, 2]  # up to the end of the sequence, not k
    lookup.sync([5, 5, 5], [])
    assert lookup.propose(4) == [5]  # the match overlaps the suffix: one token follows it
    assert lookup.propose(0) == []


def test_a_shorter_sequence_is_indexed_again() -> None:
    lookup = PromptLookup(1, 2)
    lookup.sync(list(range(100)), [1])
    assert lookup.propose(2) == [2, 3]
    lookup.sync([4, 6, 4], [])
    assert len(lookup) == 3 and lookup.propose(2) == [6, 4]


def test_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError):
        PromptLookup(0, 2)
    with pytest.raises(ValueError):
        PromptLookup(3, 2)


def test_engine_options_name_the_sizes() -> None:
    from pydantic import ValidationError

    from keyserve.config import EngineConfig, SpeculativeConfig
    from keyserve.engine.drafter import draft_lookup

    config = EngineConfig.from_flat(model="m", draft="d", prompt_lookup_max=3)
    assert draft_lookup(config.spec) == (2, 3)
    assert draft_lookup(SpeculativeConfig()) is None  # off by default
    with pytest.raises(ValidationError, match="prompt_lookup_min"):
        SpeculativeConfig(prompt_lookup_max=2, prompt_lookup_min=3)
