"""The draft's training prompts: distinct, deterministic, and never the prompts the acceptance
tool measures on (``HELD_OUT_PROMPTS``; "Why is the sky blue?" used to be in both)."""

from __future__ import annotations

import pytest

from keyserve.training.prompts import HELD_OUT_PROMPTS, build_prompts


def test_held_out_prompts_are_never_trained_on() -> None:
    prompts = build_prompts(3540)
    assert len(set(prompts)) == 3540
    assert not set(prompts) & set(HELD_OUT_PROMPTS)


def test_prompts_are_deterministic_and_refuse_more_than_there_are() -> None:
    assert build_prompts(50, seed=3) == build_prompts(50, seed=3)
    with pytest.raises(ValueError, match="distinct prompts"):
        build_prompts(100_000)


def test_acceptance_measures_on_the_held_out_prompts() -> None:
    from keyserve.training.acceptance import CHAT_PROMPTS

    assert CHAT_PROMPTS == HELD_OUT_PROMPTS
