"""keyserve's configuration: pydantic models with a description on every field.

The same models validate CLI flags, Python keyword arguments, YAML files and (later) the
``args`` of a Ray Serve / KubeRay deployment, so a bad value fails the same way everywhere.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from keyserve.types import KVPolicyName

DEFAULT_MODEL = "SmolLM2-135M-Instruct"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class ModelConfig(_Strict):
    model: str = Field(
        DEFAULT_MODEL,
        description="A local Hugging Face directory, a GGUF file, or the default model's name.",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Weights and KV-cache dtype (float16 only on CUDA)."
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Where the model runs.")
    max_model_len: int | None = Field(
        None, ge=2, description="Context length limit; defaults to the model's own."
    )


class CacheConfig(_Strict):
    block_size: int = Field(16, ge=1, le=256, description="Token slots per KV block.")
    num_blocks: int | None = Field(
        None, ge=2, description="KV blocks in the pool; overrides kv_cache_memory_gb."
    )
    kv_cache_memory_gb: float = Field(
        2.0, gt=0.0, description="Memory for the KV pool when num_blocks is not given."
    )
    enable_prefix_caching: bool = Field(True, description="Reuse KV of identical prefixes.")
    default_kv_policy: KVPolicyName = Field(
        "full", description="KV policy for requests that do not name one."
    )
    default_kv_budget: float | None = Field(
        None, gt=0.0, description="KV budget for requests that do not give one."
    )


class PrefixStoreConfig(_Strict):
    """The importance-aware multi-tier prefix KV store (IMPRESS, docs/algorithms.md §5); off by
    default.

    Flat options (``EngineConfig.from_flat``, ``LLM(...)``) name these ``prefix_store_<field>``,
    and ``prefix_store=True`` turns the store on."""

    enabled: bool = Field(False, description="Store finished/preempted prefixes and load them back.")
    chunk_size: int | None = Field(
        None, ge=1, description="Tokens per stored chunk (a multiple of block_size; default block_size)."
    )
    device_tokens: int = Field(
        0, ge=0, description="Device tier: tokens (all layers) kept in blocks reserved from the KV pool."
    )
    host_tokens: int = Field(0, ge=0, description="Host tier: tokens (all layers) kept in host memory.")
    disk_path: str | None = Field(
        None, description="Directory for the disk tier (a private subdirectory is made); None: the temp dir."
    )
    disk_max_gb: float = Field(8.0, gt=0.0, description="Bound of the disk tier in GiB.")
    top_k_fraction: float = Field(
        0.3, gt=0.0, le=1.0, description="Share of a stored prefix's tokens marked important per layer."
    )
    importance_heads: int = Field(
        3, ge=0, description="KV-heads per layer whose scores pick important tokens (0 = all)."
    )
    check_agreement: bool = Field(
        True, description="Load all tokens of a layer whose sampled heads disagree (Jaccard < j^0.6)."
    )
    repack: bool = Field(True, description="Store important tokens densely in their own chunks.")
    eviction: Literal["importance", "lru"] = Field(
        "importance", description="Memory-tier priority: important tokens x accesses, or LRU."
    )
    load_important_only: bool = Field(
        True, description="Requests under a KV budget load only important chunks (False: all)."
    )


class SchedulerSettings(_Strict):
    max_num_batched_tokens: int = Field(
        2048, ge=1, description="Tokens computed per step (prefill chunk budget)."
    )
    max_num_seqs: int = Field(64, ge=1, description="Sequences running at once.")
    enable_chunked_prefill: bool = Field(True, description="Split long prompts across steps.")


class SpecConfig(_Strict):
    draft: str | None = Field(
        None, description="Draft model for speculative sampling (local HF dir or keyserve draft dir)."
    )
    num_speculative_tokens: int = Field(4, ge=1, le=16, description="Draft tokens per step (K).")
    adaptive_k: bool = Field(
        False, description="Pick K per request from its running acceptance rate (K is the cap)."
    )
    draft_cost_ratio: float | None = Field(
        None, gt=0.0, le=1.0,
        description="Cost of one draft forward / one target forward for adaptive K; "
        "default: the ratio of their weight bytes.",
    )
    speculative_by_default: bool = Field(
        True, description="Requests that do not say use speculation when a draft is loaded."
    )
    draft_kv_policy: KVPolicyName = Field(
        "full", description="KV policy of the draft's own cache (a cheaper draft; output stays exact)."
    )
    draft_kv_budget: float | None = Field(
        None, gt=0.0,
        description="KV budget of the draft: fraction of the prompt if <= 1, else tokens per (layer, head).",
    )
    draft_recent_ratio: float = Field(
        0.3, ge=0.0, le=1.0, description="Share of the draft's KV budget kept for the most recent tokens."
    )


class ParallelConfig(_Strict):
    """Where the engine runs: in this process (``tensor_parallel_size`` 1, no address), or on a
    Ray cluster as a tensor-parallel target group, a draft actor and a KV-block manager actor."""

    tensor_parallel_size: int = Field(
        1, ge=1, le=64, description="Target-model shards (one Ray actor each; 1 = one actor)."
    )
    address: str | None = Field(
        None, description="Ray cluster to join ('auto', 'ray://host:10001', ...); None starts a "
        "local one if none is running."
    )
    placement_strategy: Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"] = Field(
        "STRICT_PACK", description="Placement-group strategy of the target group's shards."
    )
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="torch.distributed backend: auto = NCCL with CUDA, gloo otherwise."
    )
    worker_num_cpus: float = Field(
        0.25, ge=0.0, description="CPUs reserved per target shard (fractional is fine)."
    )
    worker_num_gpus: float | None = Field(
        None, ge=0.0, description="GPUs per target shard; None = 1 when CUDA is available, else 0."
    )
    worker_resources: dict[str, float] = Field(
        default_factory=dict, description="Custom Ray resources each target shard needs."
    )
    worker_threads: int | None = Field(
        None, ge=1, description="torch threads per shard; None = the node's cores / shards."
    )
    draft_num_cpus: float = Field(0.25, ge=0.0, description="CPUs reserved for the draft actor.")
    draft_num_gpus: float | None = Field(
        None, ge=0.0, description="GPUs for the draft actor; None = like the shards."
    )
    draft_resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources of the draft actor (e.g. to put it on another node).",
    )
    kv_manager_num_cpus: float = Field(
        0.0, ge=0.0, description="CPUs reserved for the KV-block manager actor (bookkeeping only)."
    )
    kv_manager_resources: dict[str, float] = Field(
        default_factory=dict, description="Custom Ray resources of the KV-block manager actor."
    )
    max_restarts: int = Field(
        4, ge=-1, description="Ray restarts of the draft and KV-block manager actors (-1 = forever); "
        "a lost target shard is replaced by recreating the whole group."
    )
    max_recoveries: int = Field(
        8, ge=0, description="Consecutive failed steps the engine recovers from before giving up."
    )
    collective_timeout_s: float = Field(
        120.0, gt=0.0, description="torch.distributed timeout (a dead peer fails a step after this)."
    )

    @property
    def uses_ray(self) -> bool:
        return self.tensor_parallel_size > 1 or self.address is not None


class EngineConfig(_Strict):
    model: ModelConfig = Field(default_factory=ModelConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    scheduler: SchedulerSettings = Field(default_factory=SchedulerSettings)
    spec: SpecConfig = Field(default_factory=SpecConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    prefix_store: PrefixStoreConfig = Field(default_factory=PrefixStoreConfig)
    seed: int = Field(0, ge=0, description="Seed of the global RNG (unseeded requests).")

    @model_validator(mode="after")
    def _prefix_store_fits(self) -> "EngineConfig":
        ps = self.prefix_store
        if not ps.enabled:
            return self
        if self.parallel.uses_ray:
            raise ValueError("the prefix store runs with the in-process engine only (no Ray / TP)")
        if self.spec.draft is not None:
            raise ValueError("the prefix store does not support a draft model (its KV is not stored)")
        chunk = ps.chunk_size or self.cache.block_size
        if chunk % self.cache.block_size:
            raise ValueError(f"prefix_store chunk_size {chunk} is not a multiple of block_size")
        return self

    @classmethod
    def from_yaml(cls, path: str | Path) -> "EngineConfig":
        with open(path) as f:
            return cls.model_validate(yaml.safe_load(f) or {})

    @classmethod
    def from_flat(cls, **kwargs: object) -> "EngineConfig":
        """Build from flat keyword arguments (``model=..., block_size=..., max_num_seqs=...``),
        routing each to its section; an unknown name is an error."""
        sections: dict[str, dict[str, object]] = {
            "model": {}, "cache": {}, "scheduler": {}, "spec": {}, "parallel": {}
        }
        top: dict[str, object] = {}
        store: dict[str, object] = {}
        owners = {
            "model": ModelConfig.model_fields,
            "cache": CacheConfig.model_fields,
            "scheduler": SchedulerSettings.model_fields,
            "spec": SpecConfig.model_fields,
            "parallel": ParallelConfig.model_fields,
        }
        for key, value in kwargs.items():
            if value is None:
                continue
            if key == "prefix_store" and isinstance(value, bool):
                store["enabled"] = value
                continue
            if key.startswith("prefix_store_") and key[len("prefix_store_"):] in PrefixStoreConfig.model_fields:
                store[key[len("prefix_store_"):]] = value
                continue
            for section, fields in owners.items():
                if key in fields:
                    sections[section][key] = value
                    break
            else:
                if key in cls.model_fields and key not in owners:
                    top[key] = value
                else:
                    raise ValueError(f"unknown engine option {key!r}")
        if store:
            top["prefix_store"] = store
        return cls.model_validate({**sections, **top})


class ServeConfig(_Strict):
    """One OpenAI-compatible server: the engine it wraps plus the HTTP-side limits.

    The same model validates ``keyserve serve`` flags, ``build_app(args)`` of a Ray Serve /
    KubeRay ``serveConfigV2`` application and the batch job's options.
    """

    model: str | None = Field(None, description="Model to serve; None is the default model.")
    served_model_name: str | None = Field(
        None, description="Name clients put in `model`; default: the model's directory name."
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Weights/KV dtype.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Where the model runs.")
    tp: int = Field(
        1, ge=1, le=64,
        description="Tensor-parallel shards; > 1 runs the Ray engine (shard actors, KV-manager actor).",
    )
    max_model_len: int | None = Field(None, ge=2, description="Context length limit.")
    block_size: int | None = Field(None, ge=1, le=256, description="Token slots per KV block.")
    num_blocks: int | None = Field(None, ge=2, description="KV blocks in the pool.")
    kv_cache_memory_gb: float | None = Field(None, gt=0.0, description="Memory for the KV pool.")
    max_num_seqs: int | None = Field(None, ge=1, description="Sequences running at once.")
    max_num_batched_tokens: int | None = Field(None, ge=1, description="Tokens per step.")
    enable_prefix_caching: bool | None = Field(None, description="Reuse KV of identical prefixes.")
    draft: str | None = Field(None, description="Draft model for speculative sampling.")
    num_speculative_tokens: int | None = Field(None, ge=1, le=16, description="Draft tokens per step.")
    adaptive_k: bool | None = Field(None, description="Pick K from the running acceptance rate.")
    draft_kv_policy: KVPolicyName | None = Field(None, description="KV policy of the draft's own cache.")
    draft_kv_budget: float | None = Field(
        None, gt=0.0, description="KV budget of the draft (fraction of the prompt if <= 1, else tokens)."
    )
    default_kv_policy: KVPolicyName | None = Field(None, description="KV policy when a request names none.")
    default_kv_budget: float | None = Field(None, gt=0.0, description="KV budget when a request gives none.")
    seed: int | None = Field(None, ge=0, description="Seed of the engine's global RNG.")
    prefix_store: bool | None = Field(None, description="Turn on the multi-tier prefix KV store (IMPRESS).")
    prefix_store_device_tokens: int | None = Field(None, ge=0, description="Prefix store: device-tier tokens.")
    prefix_store_host_tokens: int | None = Field(None, ge=0, description="Prefix store: host-tier tokens.")
    prefix_store_disk_path: str | None = Field(None, description="Prefix store: disk-tier directory.")
    prefix_store_disk_max_gb: float | None = Field(None, gt=0.0, description="Prefix store: disk bound (GiB).")
    prefix_store_top_k_fraction: float | None = Field(
        None, gt=0.0, le=1.0, description="Prefix store: share of tokens marked important."
    )
    prefix_store_eviction: Literal["importance", "lru"] | None = Field(
        None, description="Prefix store: memory-tier eviction priority."
    )
    api_key: str | None = Field(
        None,
        description="If set, /v1/* and the API docs (/docs, /redoc, /openapi.json) require "
        "`Authorization: Bearer <api_key>`; it must not be empty.",
    )
    max_request_bytes: int = Field(
        4 * 1024 * 1024, ge=1024, le=2**31 - 1,
        description="Largest request body accepted, in bytes; larger ones get 413.",
    )
    max_queued_requests: int = Field(
        256, ge=0,
        description="Requests allowed to wait beyond the max_num_seqs running ones; more get 503.",
    )
    request_timeout_s: float | None = Field(
        600.0, gt=0.0, description="Server-side limit per request (queueing included); 408 after."
    )
    retry_after_s: int = Field(1, ge=0, description="Retry-After seconds sent with a 503.")

    @field_validator("api_key")
    @classmethod
    def _api_key_not_blank(cls, value: str | None) -> str | None:
        """An empty key would accept an empty bearer token: refuse it at start-up."""
        if value is not None and not value.strip():
            raise ValueError("api_key must not be empty or whitespace (leave it unset for no auth)")
        return value

    def engine_config(self) -> "EngineConfig":
        """The EngineConfig this server runs (unset fields keep the engine's defaults)."""
        names = set(ModelConfig.model_fields) | set(CacheConfig.model_fields)
        names |= set(SchedulerSettings.model_fields) | set(SpecConfig.model_fields) | {"seed"}
        flat = {k: getattr(self, k) for k in type(self).model_fields
                if k in names or k.startswith("prefix_store")}
        return EngineConfig.from_flat(**flat, tensor_parallel_size=self.tp if self.tp > 1 else None)

    def model_name(self) -> str:
        """The name clients use: served_model_name, else the model path's last part."""
        if self.served_model_name:
            return self.served_model_name
        return Path(self.model).name.removesuffix(".gguf") if self.model else DEFAULT_MODEL
