"""Which KV budget a request runs under: resolved once, when the engine adds the request.

The result (a ``KVBudget``, or None for a request that keeps every token) is stored on each
of the request's sequences (``Sequence.kv_budget``) and travels with them -- to the KV core,
its actor, the prefix store and into every ``StepItem`` -- so nothing downstream re-resolves it
or needs the server's defaults.
"""

from __future__ import annotations

from dataclasses import dataclass

from keyserve.core.kv_policy import KVBudget
from keyserve.core.sampling_params import SamplingParams
from keyserve.types import ScorePooling, ScoreWindow


@dataclass(frozen=True)
class BudgetDefaults:
    """The budget of requests that name none (``CacheConfig.default_kv_policy`` / ``_budget``)."""

    policy: str = "full"
    budget: float | None = None


def request_budget(params: SamplingParams, num_prompt_tokens: int, defaults: BudgetDefaults) -> KVBudget | None:
    """The policy and k a request runs under (its own fields, else the server defaults)."""
    policy = params.kv_policy or defaults.policy
    budget = params.kv_budget if params.kv_budget is not None else defaults.budget
    return resolve_budget(policy, budget, num_prompt_tokens, params.recent_ratio,
                          params.kv_score_window, params.kv_score_pooling)


def resolve_budget(
    policy: str, budget: float | None, num_prompt_tokens: int, recent_ratio: float,
    score_window: ScoreWindow = "all", score_pooling: ScorePooling = "kv_head",
) -> KVBudget | None:
    """k from a budget given as a fraction of the prompt (<= 1) or a token count (> 1);
    None when nothing is ever evicted (``full``, or no budget)."""
    if policy == "full" or budget is None:
        return None
    k = max(1, int(round(budget * num_prompt_tokens))) if budget <= 1.0 else int(budget)
    return KVBudget.create(policy, k, recent_ratio, score_window, score_pooling)
