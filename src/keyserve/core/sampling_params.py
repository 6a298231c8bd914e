"""Per-request generation parameters, validated at the edge.

An invalid value raises ``pydantic.ValidationError`` whose message names the field and the
allowed range; the engine never sees it. Every number is finite and bounded here, by limits
that hold for any model; the serving layer adds the bounds that depend on the loaded model
(vocabulary size, context length) before a request reaches the engine.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from keyserve.types import KVPolicyName, ScorePooling, ScoreWindow

INT64_MAX = 2**63 - 1
MAX_STOP_STRINGS = 64  # stop strings per request
MAX_STOP_CHARS = 4096  # characters per stop string
MAX_STOP_TOKEN_IDS = 1024
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]


MAX_TOP_LOGPROBS = 20  # OpenAI's cap on completions' logprobs and chat's top_logprobs

class SamplingParams(BaseModel):
    """What to sample and when to stop (OpenAI's fields plus vLLM's and keyserve's own)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    n: int = Field(1, ge=1, le=64, description="Samples per prompt; they share the prompt's KV.")
    max_tokens: int = Field(16, ge=1, le=1_000_000, description="Tokens to generate at most.")
    temperature: float = Field(1.0, ge=0.0, le=100.0, description="0 means greedy.")
    top_k: int = Field(
        0, ge=0, le=INT64_MAX,
        description="Keep the k most likely tokens; 0 disables (a k at or above the vocabulary "
        "size is the same as 0).",
    )
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="Drop tokens below min_p * p_max.")
    seed: int | None = Field(None, ge=0, le=INT64_MAX, description="Per-request seed.")
    stop: list[str] = Field(
        default_factory=list, max_length=MAX_STOP_STRINGS,
        description=f"Stop strings (not included), at most {MAX_STOP_STRINGS} of at most "
        f"{MAX_STOP_CHARS} characters each.",
    )
    stop_token_ids: list[TokenId] = Field(
        default_factory=list, max_length=MAX_STOP_TOKEN_IDS, description="Extra stop tokens."
    )
    ignore_eos: bool = Field(False, description="Keep generating past the EOS token.")
    logprobs: bool = Field(False, description="Return the log-probability of each chosen token.")
    top_logprobs: int = Field(
        0, ge=0, le=MAX_TOP_LOGPROBS,
        description=f"Alternatives per generated token (at most {MAX_TOP_LOGPROBS}): the most likely "
        "tokens of the model's own distribution at that position, with their log-probabilities.",
    )
    prompt_logprobs: int | None = Field(
        None, ge=0, le=MAX_TOP_LOGPROBS,
        description="The log-probability of every prompt token after the first (vLLM's prompt_logprobs: "
        "what scoring and lm-eval's loglikelihood read), with this many alternatives each (0: none). "
        "Such a request reuses no cached prefix: every prompt row is computed.",
    )

    # KV budgets (docs/algorithms.md §2).
    kv_policy: KVPolicyName | None = Field(
        None, description="KV eviction policy; None takes the server-wide default."
    )
    kv_budget: float | None = Field(
        None,
        gt=0.0,
        le=float(2**31 - 1),
        description="Tokens kept per (layer, kv-head): a fraction of the prompt if <= 1, "
        "else an absolute token count.",
    )
    recent_ratio: float = Field(0.3, ge=0.0, le=1.0, description="Share of the budget kept recent.")
    tau_init: float = Field(1.0, gt=0.0, le=100.0, description="Keyformer's initial Gumbel temperature.")
    tau_end: float = Field(2.0, gt=0.0, le=100.0, description="Keyformer's final Gumbel temperature.")
    kv_score_window: ScoreWindow = Field(
        "all", description="H2O/Keyformer: 'all' sums every query's attention into a token's score; "
        "'last' scores by the newest query's attention only (TOVA's window); 'mean' ranks by the "
        "summed attention over the number of queries that saw the token (kvpress's ObservedAttention)."
    )
    kv_score_pooling: ScorePooling = Field(
        "kv_head", description="H2O/Keyformer: 'kv_head' lets each kv-head keep its own tokens; "
        "'layer' keeps one set per layer, by the scores summed over its kv-heads (TOVA's pooling)."
    )

    # Speculative sampling (docs/algorithms.md §3).
    speculative: bool | None = Field(
        None, description="Use the draft model; None follows the engine's default."
    )
    num_speculative_tokens: int | None = Field(
        None, ge=1, le=16, description="Draft tokens per step (K); None uses the engine's."
    )

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: object) -> object:
        if value is None:
            return []
        if isinstance(value, str):
            return [value]
        return value

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, value: list[str]) -> list[str]:
        if any(s == "" for s in value):
            raise ValueError("stop strings must be non-empty")
        if any(len(s) > MAX_STOP_CHARS for s in value):
            raise ValueError(f"stop strings must have at most {MAX_STOP_CHARS} characters")
        for s in value:
            try:
                s.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("stop strings must be valid Unicode (no lone surrogates)") from None
        return value

    @field_validator("kv_budget")
    @classmethod
    def _integral_absolute_budget(cls, value: float | None) -> float | None:
        if value is not None and value > 1.0 and value != int(value):
            raise ValueError("kv_budget above 1 is a token count and must be a whole number")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> "SamplingParams":
        if self.tau_end < self.tau_init:
            raise ValueError("tau_end must be >= tau_init")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5  # see core.sampler.GREEDY_BELOW

    def budget_tokens(self, prompt_len: int) -> int | None:
        """The budget k in tokens for a prompt of ``prompt_len`` tokens, or None (no budget)."""
        if self.kv_budget is None or self.kv_policy in (None, "full"):
            return None
        if self.kv_budget <= 1.0:
            return max(1, int(round(self.kv_budget * prompt_len)))
        return int(self.kv_budget)
