"""What the engine hands back: one RequestOutput per request, one CompletionOutput per sample."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class RequestStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    time_to_first_token_s: float | None = None
    e2e_latency_s: float | None = None
    tokens_per_s: float | None = None  # generated tokens / time after the first token
    kv_blocks_used: int = 0  # most KV blocks held at once by the request's samples together
    prefix_cache_hit_tokens: int = 0
    kv_tokens_held: int = 0  # KV tokens per (layer, kv-head) at the end, over all samples
    kv_tokens_evicted: int = 0  # tokens dropped by the KV budget, per (layer, kv-head)
    num_preemptions: int = 0
    spec_draft_tokens: int = 0  # speculative sampling: drafted / accepted tokens
    spec_accepted_tokens: int = 0
    spec_acceptance_rate: float | None = None
    spec_tokens_per_forward: float | None = None  # mean tokens emitted per target forward

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    logprobs: list[float] | None = None
    # per token, its top alternatives (token id, logprob), most likely first (top_logprobs > 0)
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # Complete on the last output (``finished``); while in flight only prompt_tokens and
    # generated_tokens are filled (the rest would cost every step for every request).
    stats: RequestStats = field(default_factory=RequestStats)
    # Set on the last output of a request that failed inside a step (it alone was aborted:
    # finish_reason "abort"); the streaming layers raise it to the request's consumer.
    error: Exception | None = None
    # SamplingParams.prompt_logprobs: per prompt token, its log-probability under the model
    # given the tokens before it (None for the first), complete once the prompt is computed;
    # and with prompt_logprobs > 0 its top alternatives (token id, logprob), most likely first.
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    prompt_logprob_ranks: list[int | None] | None = None  # each prompt token's rank (1: likeliest)

    # The first sample's fields, for the common n == 1 case.
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    def to_dict(self) -> dict:
        return {
            "request_id": self.request_id,
            "prompt": self.prompt,
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "outputs": [asdict(o) for o in self.outputs],
            "stats": self.stats.to_dict(),
            "error": None if self.error is None else str(self.error),
            "prompt_logprobs": self.prompt_logprobs,
            "prompt_top_logprobs": self.prompt_top_logprobs,
            "prompt_logprob_ranks": self.prompt_logprob_ranks,
        }
