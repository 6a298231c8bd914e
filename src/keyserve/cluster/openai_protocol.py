"""OpenAI-compatible request and response bodies (pydantic).

Requests are strict: unknown fields are a 400 naming them (a misspelt ``kv_polcy`` is not
silently ignored), no string is coerced to a number or a boolean (``"max_tokens": "5"`` and
``"stream": "yes"`` are 400s), and every number is finite. The fields that map to
``SamplingParams`` take its bounds (``_sp``), so the OpenAPI schema shows the same ranges the
server enforces; ``to_sampling_params`` maps the fields across. Bounds that depend on the loaded
model (vocabulary, context length) are checked by ``OpenAIServing``.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from keyserve.core.sampling_params import (
    INT64_MAX,
    KVPolicyName,
    MAX_TOP_LOGPROBS,
    SamplingParams,
    ScorePooling,
    ScoreWindow,
    TokenId,
)

MAX_LOGPROBS = MAX_TOP_LOGPROBS  # completions' logprobs / chat's top_logprobs: alternatives per token
MAX_PROMPTS = 1024  # prompts in one completions request (each is one engine request)


def _sp(kind: Any, name: str) -> Any:
    """``kind`` with the bounds of ``SamplingParams.<name>`` (one source of truth for ranges)."""
    return Annotated[(kind, *SamplingParams.model_fields[name].metadata)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=(), strict=True, allow_inf_nan=False)


class StreamOptions(_Request):
    include_usage: bool = Field(False, description="Send a last chunk with the usage (empty choices).")
    continuous_usage_stats: bool = Field(
        False, description="vLLM's: with include_usage, every chunk carries the usage so far."
    )


class _SamplingFields(_Request):
    """Fields both endpoints share: OpenAI's, then keyserve's and vLLM's extensions."""

    model: str | None = Field(None, description="The served model's name; None means that model.")
    n: _sp(int, "n") = Field(1, description="Samples per prompt.")
    temperature: _sp(float, "temperature") | None = Field(None, description="0 is greedy; default 1.")
    top_p: _sp(float, "top_p") | None = Field(None, description="Nucleus sampling mass; default 1.")
    seed: _sp(int, "seed") | None = Field(None, description="Makes sampling reproducible.")
    stop: str | _sp(list[str], "stop") | None = Field(
        None, description="Stop strings (not included in the text)."
    )
    stream: bool = Field(False, description="Server-sent events ending in `data: [DONE]`.")
    stream_options: StreamOptions | None = Field(None, description="Streaming options.")
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, description="Only 0 is supported.")
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, description="Only 0 is supported.")
    logit_bias: dict[str, float] | None = Field(None, description="Only empty is supported.")
    user: str | None = Field(None, description="End-user id (logged, not used).")
    # keyserve / vLLM extensions
    top_k: _sp(int, "top_k") | None = Field(
        None, description="Keep the k most likely tokens (0: off; above the vocabulary: clamped to it)."
    )
    min_p: _sp(float, "min_p") | None = Field(None, description="Drop tokens below min_p * p_max.")
    ignore_eos: bool | None = Field(None, description="Keep generating past the EOS token.")
    stop_token_ids: _sp(list[TokenId], "stop_token_ids") | None = Field(
        None, description="Extra stop token ids (each below the vocabulary size)."
    )
    kv_policy: KVPolicyName | None = Field(None, description="KV eviction policy.")
    kv_budget: _sp(float, "kv_budget") | None = Field(
        None, description="KV budget: prompt fraction (<=1) or tokens (at most the context length)."
    )
    recent_ratio: _sp(float, "recent_ratio") | None = Field(
        None, description="Share of the KV budget kept recent."
    )
    kv_score_window: ScoreWindow | None = Field(
        None, description="H2O/Keyformer scores: 'all' queries' attention summed, the 'last' query's only, "
        "or the 'mean' over the queries that saw each token."
    )
    kv_score_pooling: ScorePooling | None = Field(
        None, description="H2O/Keyformer: each 'kv_head' keeps its own tokens, or one set per 'layer'."
    )
    speculative: bool | None = Field(None, description="Use the draft model (needs one loaded).")
    num_speculative_tokens: _sp(int, "num_speculative_tokens") | None = Field(
        None, description="Draft tokens per step (K)."
    )
    prompt_logprobs: _sp(int, "prompt_logprobs") | None = Field(
        None, description="vLLM's: every prompt token's log-probability, rank and text, with this many "
        "alternatives (null for the first token), as `prompt_logprobs` on each choice (completions) or on "
        "the response (chat). Not with stream. Such a request reuses no cached prefix."
    )

    def _unsupported(self) -> list[tuple[str, str]]:
        bad = []
        if self.presence_penalty:
            bad.append(("presence_penalty", "presence_penalty is not supported (only 0)"))
        if self.frequency_penalty:
            bad.append(("frequency_penalty", "frequency_penalty is not supported (only 0)"))
        if self.logit_bias:
            bad.append(("logit_bias", "logit_bias is not supported"))
        if self.stream_options is not None and not self.stream:
            bad.append(("stream_options", "stream_options is only allowed when stream is true"))
        if self.prompt_logprobs is not None and self.stream:
            bad.append(("prompt_logprobs", "prompt_logprobs is not supported with stream (as in vLLM)"))
        return bad

    def _params(self, max_tokens: int, logprobs: bool, top_logprobs: int = 0) -> SamplingParams:
        fields: dict[str, Any] = dict(
            n=self.n, max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
            seed=self.seed, stop=self.stop, top_k=self.top_k, min_p=self.min_p,
            ignore_eos=self.ignore_eos, stop_token_ids=self.stop_token_ids,
            kv_policy=self.kv_policy, kv_budget=self.kv_budget, recent_ratio=self.recent_ratio,
            kv_score_window=self.kv_score_window, kv_score_pooling=self.kv_score_pooling,
            speculative=self.speculative, num_speculative_tokens=self.num_speculative_tokens,
            logprobs=logprobs, top_logprobs=top_logprobs, prompt_logprobs=self.prompt_logprobs,
        )
        return SamplingParams(**{k: v for k, v in fields.items() if v is not None})

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage in every chunk (vLLM's ``continuous_usage_stats``, which needs ``include_usage``)."""
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)


MaxTokens = _sp(int, "max_tokens")
PromptIds = Annotated[list[TokenId], Field(min_length=1)]


class CompletionRequest(_SamplingFields):
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)] | PromptIds | Annotated[
        list[PromptIds], Field(min_length=1, max_length=MAX_PROMPTS)
    ] = Field(description="Text, token ids, or a list of either (one choice group per prompt).")
    max_tokens: MaxTokens | None = Field(
        16, description="Tokens to generate at most (default 16; at most the context length)."
    )
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = Field(
        None, description="Return the chosen tokens' log-probabilities and, per token, the N most "
        "likely alternatives under the model's distribution (top_logprobs; the chosen token too, "
        "so up to N + 1 entries). 0: the chosen tokens' only."
    )
    echo: bool = Field(False, description="Prepend the prompt to the text; with logprobs, the prompt "
                       "tokens' log-probabilities (the first token's null) and alternatives come first "
                       "(what lm-eval's loglikelihood reads).")
    suffix: str | None = Field(None, description="Not supported.")
    best_of: _sp(int, "n") | None = Field(None, description="Only best_of == n is supported.")

    def unsupported(self) -> list[tuple[str, str]]:
        bad = self._unsupported()
        if self.suffix:
            bad.append(("suffix", "suffix is not supported"))
        if self.best_of is not None and self.best_of != self.n:
            bad.append(("best_of", "best_of other than n is not supported"))
        return bad

    def to_sampling_params(self, max_model_len: int) -> SamplingParams:
        limit = self.max_tokens if self.max_tokens is not None else max_model_len
        params = self._params(limit, self.logprobs is not None, self.logprobs or 0)
        if self.echo and self.logprobs is not None:  # the echoed prompt's tokens get theirs too
            params = params.model_copy(update={"prompt_logprobs": max(self.logprobs, self.prompt_logprobs or 0)})
        return params

    def max_tokens_param(self) -> str:
        return "max_tokens"


class TextPart(_Request):
    type: Literal["text"] = Field(description="Only text parts are supported.")
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = Field(None, description="Text, or a list of text parts.")
    name: str | None = None

    def as_template_dict(self) -> dict[str, Any]:
        """The message as sent; ``LLMEngine.apply_chat_template`` makes it what the template
        expects (``template_message``: developer is system, parts joined, no content is ""),
        as for ``LLM.chat`` and batch jobs."""
        return self.model_dump(exclude_none=True)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, description="The conversation so far.")
    max_tokens: MaxTokens | None = Field(None, description="Deprecated alias of max_completion_tokens.")
    max_completion_tokens: MaxTokens | None = Field(
        None, description="Tokens to generate at most (at most the context length); default: the "
        "rest of the context."
    )
    logprobs: bool = Field(False, description="Return the chosen tokens' log-probabilities.")
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = Field(
        None, description="With logprobs: the N most likely alternatives of each token under the "
        "model's distribution."
    )
    tools: list[dict[str, Any]] | None = Field(None, description="Not supported.")
    tool_choice: Any = Field(None, description="Only 'none' is supported.")
    response_format: dict[str, Any] | None = Field(None, description="Only {'type': 'text'}.")
    parallel_tool_calls: bool | None = Field(None, description="Ignored without tools.")

    def unsupported(self) -> list[tuple[str, str]]:
        bad = self._unsupported()
        if self.top_logprobs and not self.logprobs:  # as OpenAI and vLLM answer
            bad.append(("top_logprobs", "top_logprobs needs logprobs set to true"))
        if self.tools:
            bad.append(("tools", "tool calling is not supported"))
        if self.tool_choice not in (None, "none"):
            bad.append(("tool_choice", "tool calling is not supported"))
        if self.response_format and self.response_format.get("type") != "text":
            bad.append(("response_format", "only response_format {'type': 'text'} is supported"))
        return bad

    def to_sampling_params(self, max_model_len: int) -> SamplingParams:
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._params(limit if limit is not None else max_model_len, self.logprobs,
                            (self.top_logprobs or 0) if self.logprobs else 0)

    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


# ---------------------------------------------------------------- responses
class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(0, description="Prompt tokens served from the prefix cache.")


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] | None = None  # null entries: echoed first token
    text_offset: list[int] = Field(default_factory=list)

    def followed_by(self, more: "CompletionLogprobs") -> "CompletionLogprobs":
        """These entries, then ``more``'s (an echoed prompt's, then the generated tokens')."""
        top = None
        if self.top_logprobs is not None or more.top_logprobs is not None:
            top = (self.top_logprobs or [None] * len(self.tokens)) + (more.top_logprobs or [None] * len(more.tokens))
        return CompletionLogprobs(tokens=self.tokens + more.tokens, token_logprobs=self.token_logprobs + more.token_logprobs,
                                  top_logprobs=top, text_offset=self.text_offset + more.text_offset)


class PromptLogprob(BaseModel):
    """vLLM's ``Logprob`` in a ``prompt_logprobs`` entry."""

    logprob: float
    rank: int | None = None  # 1: the model's likeliest token at that position
    decoded_token: str | None = None


# per prompt token: null for the first, else token id -> its entry (the token's own and the alternatives')
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's extension, when asked for


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatTokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[dict[str, Any]] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's extension, when asked for


class DeltaMessage(BaseModel):
    """Only what changed: ``{"role": "assistant", "content": ""}`` first, then ``{"content"}``,
    and ``{}`` with the finish reason."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "keyserve"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
