"""Prompt log-probabilities: which rows of a prompt chunk carry them, of which tokens, and how
the pieces a request receives (chunk by chunk, again after a preemption) join up.

Row i of a chunk at positions ``start .. start + n - 1`` predicts the token at ``start + i + 1``.
A prompt of P tokens has log-probabilities at positions 1 .. P - 1 (position 0 has no context:
None, as in vLLM and OpenAI); the row of position P - 1 predicts the first generated token,
which belongs to the sampler, not to the prompt.
"""

from __future__ import annotations


def prompt_logprob_rows(num_prompt_tokens: int, start: int, num_new_tokens: int) -> int:
    """How many leading rows of the chunk predict a prompt token."""
    return max(0, min(num_new_tokens, num_prompt_tokens - 1 - start))


def prompt_logprob_targets(token_ids: list[int], rows: int, next_prompt_token: int) -> list[int]:
    """The token each of the chunk's first ``rows`` rows predicts: the chunk's own next token,
    and for a row at the chunk's end the prompt token after the chunk."""
    n = len(token_ids)
    return [token_ids[i + 1] if i + 1 < n else next_prompt_token for i in range(rows)]


def merge_prompt_logprobs(
    have: list,  # per prompt position so far (position 0: None)
    first: int,  # position of values[0]
    values: list,
) -> None:
    """Append the values that continue ``have``; positions already there (a chunk computed
    again after a preemption) are kept as they were. A gap cannot arise (chunks run in order
    and such a request takes no cached prefix): it raises rather than misplace values."""
    if first > len(have):
        raise RuntimeError(f"prompt log-probabilities from position {first}, but only {len(have)} known")
    have.extend(values[len(have) - first :])
