"""SamplingParams validation: every bad value is rejected at the edge, by name and range.

The HTTP layer turns a ``ValidationError`` into a 400 whose message is shown to the caller, so
the message must say which field is wrong and what would be right.
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from keyserve.core.sampling_params import SamplingParams

# (field values, field name expected in the message, range wording expected in the message)
INVALID = [
    ({"temperature": -0.1}, "temperature", "greater than or equal to 0"),
    ({"temperature": 101}, "temperature", "less than or equal to 100"),
    ({"top_p": 0.0}, "top_p", "greater than 0"),
    ({"top_p": 1.5}, "top_p", "less than or equal to 1"),
    ({"top_k": -1}, "top_k", "greater than or equal to 0"),
    ({"min_p": -0.5}, "min_p", "greater than or equal to 0"),
    ({"min_p": 1.01}, "min_p", "less than or equal to 1"),
    ({"n": 0}, "n", "greater than or equal to 1"),
    ({"n": 65}, "n", "less than or equal to 64"),
    ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ({"max_tokens": -3}, "max_tokens", "greater than or equal to 1"),
    ({"seed": -1}, "seed", "greater than or equal to 0"),
    ({"recent_ratio": 1.2}, "recent_ratio", "less than or equal to 1"),
    ({"kv_budget": 0}, "kv_budget", "greater than 0"),
    ({"kv_budget": -0.5}, "kv_budget", "greater than 0"),
    ({"kv_budget": 100.5}, "kv_budget", "whole number"),
    ({"tau_init": 0}, "tau_init", "greater than 0"),
    ({"tau_init": 2.0, "tau_end": 1.5}, "tau_end", "tau_end must be >= tau_init"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens", "greater than or equal to 1"),
    ({"num_speculative_tokens": 17}, "num_speculative_tokens", "less than or equal to 16"),
    ({"stop": [""]}, "stop", "non-empty"),
    ({"stop": ["ok", ""]}, "stop", "non-empty"),
    ({"stop": ""}, "stop", "non-empty"),
    ({"kv_policy": "lru"}, "kv_policy", "'full', 'window', 'streaming_llm', 'h2o' or 'keyformer'"),
    ({"kv_score_window": "first"}, "kv_score_window", "'all', 'last' or 'mean'"),
    ({"kv_score_pooling": "head"}, "kv_score_pooling", "'kv_head' or 'layer'"),
    ({"top_k": 1.5}, "top_k", "integer"),
    ({"temperature": "hot"}, "temperature", "number"),
    ({"frobnicate": 1}, "frobnicate", "Extra inputs are not permitted"),
    ({"best_of": 2}, "best_of", "Extra inputs are not permitted"),
    # Finite and within int64 / what any model can use (issue 16).
    ({"temperature": float("nan")}, "temperature", "finite number"),
    ({"top_p": float("inf")}, "top_p", "finite number"),
    ({"tau_init": float("inf")}, "tau_init", "finite number"),
    ({"kv_budget": float("nan")}, "kv_budget", "finite number"),
    ({"kv_budget": 2.0**31}, "kv_budget", "less than or equal to 2147483647"),
    ({"top_k": 2**63}, "top_k", "less than or equal to 9223372036854775807"),
    ({"seed": 2**63}, "seed", "less than or equal to 9223372036854775807"),
    ({"stop_token_ids": [-1]}, "stop_token_ids", "greater than or equal to 0"),
    ({"stop_token_ids": [2**64]}, "stop_token_ids", "less than or equal to 9223372036854775807"),
    ({"stop_token_ids": list(range(1025))}, "stop_token_ids", "at most 1024 items"),
    ({"stop": ["x"] * 65}, "stop", "at most 64 items"),
    ({"stop": ["x" * 4097]}, "stop", "at most 4096 characters"),
    ({"stop": ["ok", "\ud800"]}, "stop", "lone surrogates"),
]


@pytest.mark.parametrize(("kwargs", "field", "allowed"), INVALID, ids=[str(k) for k, *_ in INVALID])
def test_invalid_value_names_field_and_range(kwargs: dict, field: str, allowed: str) -> None:
    with pytest.raises(ValidationError) as info:
        SamplingParams(**kwargs)
    message = str(info.value)
    assert field in message
    assert allowed in message
    # The error is located at the offending field (tau_end's rule spans the whole model).
    locs = [".".join(str(p) for p in e["loc"]) for e in info.value.errors()]
    assert any(loc == field or loc.startswith(field + ".") for loc in locs) or field == "tau_end"


def test_defaults_are_valid_and_sensible() -> None:
    p = SamplingParams()
    assert (p.n, p.max_tokens, p.temperature, p.top_k, p.top_p, p.min_p) == (1, 16, 1.0, 0, 1.0, 0.0)
    assert p.stop == [] and p.seed is None and not p.greedy


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.0},
        {"temperature": 100.0},
        {"top_p": 1.0},
        {"top_p": 1e-6},
        {"min_p": 1.0},
        {"n": 64},
        {"max_tokens": 1},
        {"seed": 0},
        {"seed": 2**63 - 1},
        {"kv_budget": 1.0},
        {"kv_budget": 0.01},
        {"kv_budget": 512},
        {"kv_budget": 512.0},
        {"tau_init": 1.5, "tau_end": 1.5},
        {"recent_ratio": 0.0},
        {"num_speculative_tokens": 16},
        {"top_k": 2**63 - 1},
        {"stop_token_ids": [0, 2**63 - 1]},
        {"stop": ["x" * 4096] * 64},
        {"kv_budget": 2**31 - 1},
    ],
    ids=lambda kw: str(kw),
)
def test_boundary_values_are_accepted(kwargs: dict) -> None:
    SamplingParams(**kwargs)


def test_stop_string_becomes_a_list() -> None:
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=None).stop == []
    assert SamplingParams(stop=["a", "b"]).stop == ["a", "b"]


def test_frozen() -> None:
    p = SamplingParams()
    with pytest.raises(ValidationError):
        p.temperature = 0.5  # type: ignore[misc]


def test_greedy() -> None:
    assert SamplingParams(temperature=0).greedy
    assert not SamplingParams(temperature=0.01).greedy


@pytest.mark.parametrize(
    ("kwargs", "prompt_len", "expected"),
    [
        ({}, 100, None),  # no budget asked
        ({"kv_budget": 0.5}, 100, None),  # a budget without a policy: the engine default decides
        ({"kv_policy": "full", "kv_budget": 0.5}, 100, None),  # full never evicts
        ({"kv_policy": "keyformer"}, 100, None),  # a policy without a budget
        ({"kv_policy": "keyformer", "kv_budget": 0.5}, 100, 50),
        ({"kv_policy": "h2o", "kv_budget": 0.2}, 101, 20),  # round(20.2)
        ({"kv_policy": "h2o", "kv_budget": 0.25}, 10, 2),  # round(2.5) -> 2 (banker's)
        ({"kv_policy": "window", "kv_budget": 0.001}, 10, 1),  # at least one token
        ({"kv_policy": "window", "kv_budget": 1.0}, 37, 37),  # 1.0 is a fraction: the prompt
        ({"kv_policy": "streaming_llm", "kv_budget": 64}, 1000, 64),  # absolute
        ({"kv_policy": "streaming_llm", "kv_budget": 64.0}, 10, 64),  # absolute, prompt shorter
    ],
)
def test_budget_tokens(kwargs: dict, prompt_len: int, expected: int | None) -> None:
    assert SamplingParams(**kwargs).budget_tokens(prompt_len) == expected
