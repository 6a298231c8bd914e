"""What an engine reports about itself: ``EngineStats`` (``LLMEngine.stats()``) and the KV core's
part of it, ``CoreStats`` (``KVCore.stats()``, sent back by the KV-block manager actor with
every step).

The same types serve the in-process engine, the Ray engine and the serving front: the async
front publishes ``engine.stats()`` after every step and ``/metrics`` reads that snapshot, so
nobody reaches into a scheduler or a block manager (which, under Ray, live in another
process). Plain frozen dataclasses, no torch: the HTTP layer imports them.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class CoreStats:
    """The KV core's counts (the KV-block pool, the prefix cache, the scheduler)."""

    num_blocks: int = 0
    num_free_blocks: int = 0
    block_size: int = 0
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # tokens found there
    num_preemptions: int = 0
    num_running_requests: int = 0  # requests with a sequence in the running batch
    num_running_seqs: int = 0
    num_waiting_seqs: int = 0  # queued for admission (new, or preempted)


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of one engine (read by ``/metrics`` and the async front): the KV core's
    counts (``core``) and what the engine itself keeps."""

    core: CoreStats = field(default_factory=CoreStats)
    num_requests_running: int = 0
    num_requests_waiting: int = 0  # admitted, none of its sequences running
    kv_tokens_evicted: int = 0  # by KV budgets, over finished requests
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_lookup_draft_tokens: int = 0  # the part of the two above that prompt lookup drafted
    spec_lookup_accepted_tokens: int = 0
    prompt_tokens: int = 0  # over finished requests
    generation_tokens: int = 0
    num_steps: int = 0
    prefix_store: dict[str, float] = field(default_factory=dict)  # empty when the store is off

    # The core's counts, by the names /metrics and the front read.
    @property
    def num_blocks(self) -> int:
        return self.core.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.core.num_free_blocks

    @property
    def block_size(self) -> int:
        return self.core.block_size

    @property
    def prefix_cache_queries(self) -> int:
        return self.core.prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        return self.core.prefix_cache_hits

    @property
    def num_preemptions(self) -> int:
        return self.core.num_preemptions

    @property
    def kv_cache_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0
