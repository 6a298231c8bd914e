"""A request's state as the scheduler and block manager see it."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from keyserve.core.sampling_params import SamplingParams

if TYPE_CHECKING:  # a type only: a Sequence needs no torch
    from keyserve.core.kv_policy import KVBudget


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context length
    ABORT = "abort"  # cancelled by the caller (e.g. an HTTP client disconnected)


_seq_counter = itertools.count()


@dataclass(eq=False)
class Sequence:
    """One token stream: a prompt and what has been generated after it.

    ``num_computed_tokens`` counts tokens whose K/V are in the cache (prefix-cache hits
    included); the scheduler schedules ``num_tokens - num_computed_tokens`` more. After a
    preemption it drops to 0 and the whole stream is recomputed.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: float = 0.0
    sample_index: int = 0  # which of the request's n samples this is
    seq_id: int = field(default_factory=lambda: next(_seq_counter))
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    # per generated token, the top alternatives (token id, logprob) of SamplingParams.top_logprobs
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prefix-cache hit tokens at the last admission
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # hashes of full computed blocks
    # Leading blocks of block_table already offered to the prefix cache (the block manager's
    # watermark: each step offers only the blocks completed since).
    num_offered_blocks: int = 0
    num_preemptions: int = 0
    # KV budgets: the most KV slots this sequence may hold (None = one slot per token). Set by
    # the KV-policy layer; the block manager never allocates blocks beyond it.
    kv_slot_cap: int | None = None
    # The KV budget it runs under (None: it keeps every token), resolved once when its request
    # is added (``engine.kv_budget.request_budget``) and carried wherever the sequence goes.
    kv_budget: KVBudget | None = None
    num_lookahead: int = 0  # draft tokens to verify at the next decode step (speculation)
    kv_tokens_held: int = 0  # per (layer, kv-head), recorded when a budgeted sequence ends
    kv_tokens_evicted: int = 0
    # Stop strings: the text emitted so far is kept by the detokenizer, not here.
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, index: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < n else self.output_token_ids[index - n]

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens ``[start, end)`` (a step's new tokens), without building the whole list."""
        prompt, n = self.prompt_token_ids, len(self.prompt_token_ids)
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        if end <= n:
            return prompt[start:end]
        return prompt[start:] + self.output_token_ids[: end - n]

    def kv_slots_for(self, num_tokens: int) -> int:
        """KV slots needed to hold ``num_tokens`` computed tokens under this sequence's cap."""
        return num_tokens if self.kv_slot_cap is None else min(num_tokens, self.kv_slot_cap)

    @property
    def kv_budgeted(self) -> bool:
        """A sequence under a KV budget neither reuses nor offers cached prefixes: its eviction
        scores need every prompt query, and its blocks will be rewritten by compaction."""
        return self.kv_budget is not None

    @property
    def prefix_cacheable(self) -> bool:
        """A sequence whose KV is compressed must never offer its blocks as a cached prefix."""
        return not self.kv_budgeted and self.kv_slot_cap is None

    @property
    def reuses_prefixes(self) -> bool:
        """Whether admission may attach cached or stored KV of its prompt's head. Not for a
        sequence that asks for prompt log-probabilities: they come from the prompt rows'
        logits, which a reused prefix never computes (vLLM skips the cache alike)."""
        return self.prefix_cacheable and self.params.prompt_logprobs is None

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def in_prefill(self) -> bool:
        """True while more than the newest token still needs computing."""
        return self.num_uncomputed_tokens > 1

    def append_token(self, token_id: int, logprob: float | None = None,
                     top: list[tuple[int, float]] | None = None) -> None:
        self.output_token_ids.append(token_id)
        if logprob is not None:
            self.output_logprobs.append(logprob)
        if top is not None:
            self.output_top_logprobs.append(top)
