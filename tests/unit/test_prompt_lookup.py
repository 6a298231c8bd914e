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


def test_ngram_means_lookup_alone_with_default_sizes() -> None:
    """``draft="ngram"`` (or vLLM's older "[ngram]"): prompt lookup alone, n-grams 2..4 unless
    told; a min above that default is refused at the edge, naming the default."""
    from pydantic import ValidationError

    from keyserve.config import SpeculativeConfig
    from keyserve.engine.drafter import draft_lookup

    assert SpeculativeConfig(draft="ngram").lookup_only and SpeculativeConfig(draft="[ngram]").lookup_only
    assert not SpeculativeConfig(draft="default").lookup_only
    assert draft_lookup(SpeculativeConfig(draft="ngram")) == (2, 4)
    assert draft_lookup(SpeculativeConfig(draft="ngram", prompt_lookup_max=6, prompt_lookup_min=3)) == (3, 6)
    with pytest.raises(ValidationError, match="the ngram default"):
        SpeculativeConfig(draft="ngram", prompt_lookup_min=5)


def test_lookup_drafter_proposes_copies_as_point_masses() -> None:
    """``LookupDrafter`` alone: a sequence with an earlier occurrence of its last tokens gets
    the tokens that followed (marked copied), one without gets none; p = 1 at each copy when
    the step samples, no p at all when it is greedy."""
    import torch

    from keyserve.core.sampling_params import SamplingParams
    from keyserve.core.sequence import Sequence
    from keyserve.engine.lookup_drafter import LookupDrafter

    drafter = LookupDrafter(vocab_size=32, sizes=(2, 3))
    looping = Sequence("a", [5, 6, 7, 8, 5, 6], SamplingParams(temperature=0.8))
    fresh = Sequence("b", [1, 2, 3, 4], SamplingParams(temperature=0.0))
    out = drafter.propose([looping, fresh], [3, 3])
    assert out.num_draft.tolist() == [3, 0] and out.token_ids[0].tolist() == [7, 8, 5]
    assert out.copied.tolist() == [True, False]
    assert out.probs is not None and out.probs.shape == (2, 3, 32)
    assert out.probs[0].argmax(-1).tolist() == [7, 8, 5] and out.probs[0].sum().item() == 3.0
    assert out.probs[1].sum().item() == 0.0
    greedy = drafter.propose([Sequence("c", [5, 6, 7, 5, 6], SamplingParams(temperature=0.0))], [2])
    assert greedy.probs is None and greedy.token_ids.tolist() == [[7, 5]]
    assert drafter.lookup_proposals == 2 and drafter.lookup_tokens == 5
    drafter.release(looping)
    assert looping.seq_id not in drafter.lookup_index.indexes and fresh.seq_id in drafter.lookup_index.indexes
    assert isinstance(out.num_draft, torch.Tensor)
