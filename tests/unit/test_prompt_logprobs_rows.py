"""core/prompt_logprobs.py: which rows of a prompt chunk carry prompt log-probabilities, the
token each predicts, and how the pieces join (chunks in order; a chunk again after a
preemption keeps the first values)."""

from __future__ import annotations

import pytest

from keyserve.core.prompt_logprobs import merge_prompt_logprobs, prompt_logprob_rows, prompt_logprob_targets


@pytest.mark.parametrize("prompt,start,n,want", [
    (10, 0, 10, 9),  # the whole prompt in one chunk: the last row predicts the first output
    (10, 0, 4, 4),  # a first chunk: every row predicts a prompt token (the last one the next chunk's)
    (10, 4, 4, 4),
    (10, 8, 2, 1),  # the prompt's last chunk
    (10, 9, 1, 0),  # only the last prompt token: nothing to report
    (10, 10, 1, 0),  # a decode step
    (10, 0, 14, 9),  # a recompute after a preemption: prompt and outputs in one chunk
    (1, 0, 1, 0),  # a one-token prompt has no prompt log-probability past the null one
])
def test_rows(prompt: int, start: int, n: int, want: int) -> None:
    assert prompt_logprob_rows(prompt, start, n) == want


def test_targets_are_the_next_tokens_then_the_token_after_the_chunk() -> None:
    assert prompt_logprob_targets([5, 6, 7], 3, 8) == [6, 7, 8]
    assert prompt_logprob_targets([5, 6, 7], 2, -1) == [6, 7]


def test_merge_appends_in_order_keeps_what_it_has_and_refuses_a_gap() -> None:
    have: list = [None]
    merge_prompt_logprobs(have, 1, [-1.0, -2.0])
    merge_prompt_logprobs(have, 3, [-3.0])
    assert have == [None, -1.0, -2.0, -3.0]
    merge_prompt_logprobs(have, 1, [-9.0, -9.0, -9.0, -4.0])  # the same chunk again, then one more
    assert have == [None, -1.0, -2.0, -3.0, -4.0]
    with pytest.raises(RuntimeError, match="position 7"):
        merge_prompt_logprobs(have, 7, [-5.0])
