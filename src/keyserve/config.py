"""keyserve's configuration: pydantic models with a description on every field.

The same models validate CLI flags, Python keyword arguments, YAML files and the ``args`` of a
Ray Serve / KubeRay deployment, so a bad value fails the same way everywhere.

Each engine option is defined once, in a section of ``EngineConfig``. ``FlatEngineConfig`` is
the flat view of those fields (``max_num_seqs=32`` for ``scheduler.max_num_seqs``) made from
their definitions, with their descriptions, defaults and ranges: ``LLM(**options)``,
``EngineConfig.from_flat``, ``ServeConfig`` (the server = the flat engine fields + its own)
and every command's flags are built from it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo

from keyserve.types import KVPolicyName

DEFAULT_MODEL = "SmolLM2-135M-Instruct"


class _Strict(BaseModel):
    # allow_inf_nan=False: no size, timeout or budget is infinite (inf used to pass, and failed
    # later as an OverflowError from deep inside)
    model_config = ConfigDict(extra="forbid", protected_namespaces=(), allow_inf_nan=False)


class ModelConfig(_Strict):
    model: str = Field(
        DEFAULT_MODEL,
        description="A local Hugging Face directory, a GGUF file, or the default model's name.",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Weights and KV-cache dtype (float16 only on CUDA)."
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Where the model runs.")
    enforce_eager: bool = Field(
        False, description="On CUDA, run decode steps eagerly instead of replaying CUDA graphs."
    )
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
        None, description="Directory for the disk tier (a private subdirectory is made); default: the temp dir."
    )
    disk_max_gb: float = Field(8.0, gt=0.0, description="Bound of the disk tier in GiB.")
    disk_cold_reads: bool = Field(
        False, description="Read the disk tier past the page cache (sync on write, drop before each "
        "read): what a store larger than memory pays; for benchmarks.",
    )
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
    disk_unimportant_dtype: Literal["same", "float16", "bfloat16"] = Field(
        "same", description="Disk tier: store chunks without an important token in this dtype "
        "(half the bytes of a float32 cache; read back cast to the cache dtype). 'same': as cached.",
    )


class SchedulerSettings(_Strict):
    max_num_batched_tokens: int = Field(
        2048, ge=1, description="Tokens computed per step (prefill chunk budget)."
    )
    max_num_seqs: int = Field(64, ge=1, description="Sequences running at once.")
    enable_chunked_prefill: bool = Field(True, description="Split long prompts across steps.")
    num_scheduler_steps: int = Field(
        1, ge=1, le=64,
        description="Decode steps the model side runs per scheduling round once every request is "
        "past its prompt (vLLM's multi-step scheduling): the orchestration of a step (scheduling, "
        "KV bookkeeping, on Ray the actor hops) is paid once per N tokens, and tokens stream in "
        "bursts of up to N. 1: every token is its own round.",
    )


LOOKUP_ONLY_DRAFTS = ("ngram", "[ngram]")  # ``draft`` values that mean prompt lookup alone
NGRAM_DEFAULT_MAX = 4  # prompt_lookup_max of draft="ngram" when it is left at 0


class SpeculativeConfig(_Strict):
    draft: str | None = Field(
        None, description="Draft model for speculative sampling (local HF dir or keyserve draft dir, "
        "'default' for the default model's committed draft), or 'ngram': prompt lookup alone, no "
        "draft model (vLLM's ngram method; n-grams prompt_lookup_min..prompt_lookup_max, max 4 if unset).",
    )
    num_speculative_tokens: int = Field(4, ge=1, le=16, description="Draft tokens per step (K).")
    adaptive_k: bool = Field(
        False, description="Pick K per request (0 = no drafts) from its running acceptance and the "
        "step cost the engine measures at the current batch size (K is the cap).",
    )
    draft_cost_ratio: float | None = Field(
        None, gt=0.0, le=1.0,
        description="Cost of one draft forward / one target forward: adaptive K's prior until it "
        "has measured steps; default: the ratio of their weight bytes.",
    )
    draft_confidence_threshold: float = Field(
        0.0, ge=0.0, lt=1.0,
        description="A sequence's chain of drafts ends where the draft's own distribution gives its "
        "likeliest token less than this probability (transformers' assistant_confidence_threshold): "
        "the target verifies only the drafts before it, so a step spends no draft forwards and target "
        "rows on tokens the draft itself doubts. Output stays the target's. 0: every sequence drafts K. "
        "Chains only (not trees, not prompt lookup's copies).",
    )
    speculative_by_default: bool = Field(
        True, description="Requests that do not say use speculation when a draft is loaded."
    )
    draft_dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="The draft's weights and KV cache. auto: bfloat16 for a float32 target on "
        "the CPU where the native kernels are built (a draft forward streams half the bytes; the "
        "output stays the target's), else the target's dtype.",
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
    speculative_tree: str | None = Field(
        None, description="Verify a tree of drafts instead of a chain: children per node at each depth, "
        "e.g. '3x2' (the draft's 3 likeliest tokens, then its 2 likeliest after each; 9 drafts, up to "
        "3 tokens a step). Output stays the target's. With adaptive_k each request verifies the tree "
        "or decodes plainly, whichever the measured acceptance and step cost favour. Not with a "
        "draft KV policy or tensor parallelism (those sequences verify chains).",
    )

    prompt_lookup_max: int = Field(
        0, ge=0, le=16,
        description="Prompt lookup: where the sequence's last n tokens (n from this down to "
        "prompt_lookup_min) occurred earlier in it, draft the tokens that followed them then, "
        "with no draft forward; the draft model drafts where nothing matches. Output stays the "
        "target's. 0: off. Chains only (not with speculative_tree).",
    )
    prompt_lookup_min: int = Field(
        2, ge=1, le=16, description="Prompt lookup: the shortest n-gram matched (see prompt_lookup_max)."
    )

    @property
    def lookup_only(self) -> bool:
        """Speculation by prompt lookup alone (``draft="ngram"``): no draft model."""
        return self.draft in LOOKUP_ONLY_DRAFTS

    @model_validator(mode="after")
    def _lookup_sizes(self) -> "SpeculativeConfig":
        top = self.prompt_lookup_max or (NGRAM_DEFAULT_MAX if self.lookup_only else 0)
        if top and self.prompt_lookup_min > top:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) is above prompt_lookup_max "
                             f"({top}{'' if self.prompt_lookup_max else ', the ngram default'})")
        return self

    @field_validator("speculative_tree")
    @classmethod
    def _tree_shape(cls, value: str | None) -> str | None:
        """Widths per depth, 'WxVx...', at most 62 nodes (core/spec_tree.py's TreeShape, which
        the config may not import: it is the layer below core)."""
        if value is None:
            return None
        parts = value.strip().lower().split("x")
        if not all(p.strip().isdigit() and int(p) >= 1 for p in parts):
            raise ValueError(f"speculative_tree {value!r}: widths per depth like '3x2', each at least 1")
        nodes, level = 0, 1
        for width in map(int, parts):
            level *= width
            nodes += level
        if nodes > 62:
            raise ValueError(f"speculative_tree {value!r} has {nodes} nodes; at most 62")
        return value


class ParallelConfig(_Strict):
    """Where the engine runs: in this process (``tensor_parallel_size`` 1, no address), or on a
    Ray cluster as a tensor-parallel target group, a draft actor and a KV-block manager actor."""

    tensor_parallel_size: int = Field(
        1, ge=1, le=64,
        description="Tensor-parallel shards of the target model, one Ray actor each. The Ray engine "
        "(shard actors, a KV-block manager actor) runs at every size wherever Ray runs (Ray Serve, "
        "a Ray job); > 1 starts it anywhere.",
    )
    address: str | None = Field(
        None, description="Ray cluster to run the engine on ('auto', 'ray://host:10001', ...), at "
        "any tensor_parallel_size; default: in this process at size 1, else the running local Ray "
        "or a new one."
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
        None, ge=0.0, description="GPUs per target shard; default: 1 when CUDA is available, else 0."
    )
    worker_resources: dict[str, Annotated[float, Field(ge=0.0)]] = Field(
        default_factory=dict, description="Custom Ray resources each target shard needs."
    )
    worker_threads: int | None = Field(
        None, ge=1, description="torch threads per shard; default: the cores the shard may use (its CPU "
        "affinity, capped by a cgroup CPU quota such as a Kubernetes limit) / shards."
    )
    draft_num_cpus: float = Field(0.25, ge=0.0, description="CPUs reserved for the draft actor.")
    draft_threads: int | None = Field(
        None, ge=1, description="torch threads of the draft actor; default: as Ray starts it (one thread "
        "for a fractional actor). Within a step it drafts while the shards wait, yet on a 2-core node two "
        "threads beside a 2-thread shard drafted slower (0.76x the tokens/s of one: the shard's idle "
        "threads still spin on those cores); more may pay where cores are left over.",
    )
    draft_num_gpus: float | None = Field(
        None, ge=0.0, description="GPUs for the draft actor; default: like the shards."
    )
    draft_resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources of the draft actor (e.g. to put it on another node).",
    )
    actor_niceness: int | None = Field(
        None, ge=0, le=19, description="Niceness the engine's actor processes (target shards, draft, "
        "KV-block manager) start at; None: Ray's (pooled workers start at 15, below a driver at 0). "
        "0 runs them at a script driver's niceness, each in a process started for it (~1 s more)."
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
    compiled_graph: bool | None = Field(
        None, description="Run each step as one Ray Compiled Graph (KV-block manager -> draft -> "
        "target shards, shared-memory channels, compiled once); false: plain actor calls from the driver. "
        "None (auto): the graph on a GPU, or where the node's cores leave one for each of the graph's "
        "busy-waiting readers (the driver, the KV-block manager, the draft) beside the shards' threads; "
        "else plain calls (on a CPU whose cores the shards use, spinning readers slow them down)."
    )
    step_channels: bool = Field(
        True, description="Without the compiled graph, send each step to the KV-block manager and the "
        "target shards over a direct socket per actor (blocking reads: no core spins; ~40 us a round "
        "trip where a Ray actor call costs ~1 ms on a small node), the draft actor's proposals and their "
        "probabilities included; false: Ray actor calls (the probabilities pass actor to actor by reference)."
    )
    step_relay: bool = Field(
        True, description="With step channels, relay each step actor to actor as the compiled graph does "
        "(the KV-block manager hands the step to the draft actor or the shards, the shards answer the "
        "driver): three socket hops on the step's critical path instead of four, and the driver's "
        "bookkeeping overlaps the shards' forward; false: the driver calls each actor in turn."
    )
    graph_idle_release_s: float = Field(
        2.0, gt=0.0, description="Tear the compiled step graph down after this many seconds without "
        "requests: its actors busy-wait on their channels (a core each) while it exists. The next "
        "step compiles it again (~0.2-0.5 s)."
    )

    @property
    def uses_ray(self) -> bool:
        return self.tensor_parallel_size > 1 or self.address is not None


class EngineConfig(_Strict):
    model: ModelConfig = Field(default_factory=ModelConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    scheduler: SchedulerSettings = Field(default_factory=SchedulerSettings)
    spec: SpeculativeConfig = Field(default_factory=SpeculativeConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    prefix_store: PrefixStoreConfig = Field(default_factory=PrefixStoreConfig)
    seed: int = Field(0, ge=0, le=2**63 - 1, description="Seed of the global RNG (unseeded requests).")

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
        """Build from flat keyword arguments (``model=..., block_size=..., max_num_seqs=...``,
        the names of ``FlatEngineConfig``); None leaves a field at its default, an unknown name
        is an error."""
        for key in kwargs:
            if key not in FLAT_NAMES:
                raise ValueError(f"unknown engine option {key!r}")
        return FlatEngineConfig.model_validate(kwargs).engine_config()


# --------------------------------------------------------------------------- the flat view
_SECTIONS: dict[str, type[_Strict]] = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerSettings,
    "spec": SpeculativeConfig,
    "parallel": ParallelConfig,
    "prefix_store": PrefixStoreConfig,
}
# Flat names that are not the field's own: the chart, Serve args and the CLI say ``tp``.
_RENAMED: dict[tuple[str, ...], str] = {("parallel", "tensor_parallel_size"): "tp"}


def _flat_name(path: tuple[str, ...]) -> str:
    """``("scheduler", "max_num_seqs")`` -> ``max_num_seqs``; the prefix store's fields keep
    their section as a prefix (``prefix_store_host_tokens``), its ``enabled`` is ``prefix_store``."""
    if path in _RENAMED:
        return _RENAMED[path]
    if path[0] == "prefix_store":
        return "prefix_store" if path[1] == "enabled" else f"prefix_store_{path[1]}"
    return path[-1]


def _engine_field_paths() -> dict[str, tuple[str, ...]]:
    paths: dict[str, tuple[str, ...]] = {}
    for name in EngineConfig.model_fields:
        if name in _SECTIONS:
            candidates = [(name, field) for field in _SECTIONS[name].model_fields]
        else:
            candidates = [(name,)]
        for path in candidates:
            flat = _flat_name(path)
            if flat in paths:  # a new field must not shadow another one's flat name
                raise TypeError(f"EngineConfig fields {paths[flat]} and {path} share the flat name {flat!r}")
            paths[flat] = path
    return paths


# Flat name -> where the field lives in EngineConfig (``("scheduler", "max_num_seqs")``).
ENGINE_FIELD_PATHS: dict[str, tuple[str, ...]] = _engine_field_paths()


def engine_field_info(path: tuple[str, ...]) -> FieldInfo:
    """The definition of the EngineConfig field at ``path``."""
    owner: type[BaseModel] = EngineConfig if len(path) == 1 else _SECTIONS[path[0]]
    return owner.model_fields[path[-1]]


def _flat_field(flat: str, path: tuple[str, ...]) -> tuple[Any, FieldInfo]:
    info = engine_field_info(path)
    extra: dict[str, Any] = {}
    if path in _RENAMED:  # tp: the field's own name (tensor_parallel_size) is accepted too
        extra["validation_alias"] = AliasChoices(flat, path[-1])
    return info.annotation, FieldInfo.merge_field_infos(info, **extra)


# Every name a flat option may be given by (``tensor_parallel_size`` as well as ``tp``).
FLAT_NAMES: frozenset[str] = frozenset(ENGINE_FIELD_PATHS) | {path[-1] for path in _RENAMED}


class _EngineOptions(_Strict):
    """Base of ``FlatEngineConfig``: nests the flat fields into an ``EngineConfig``."""

    @model_validator(mode="before")
    @classmethod
    def _none_is_the_default(cls, data: Any) -> Any:
        """An engine option given as None (``model=None``, ``max_num_seqs: null``) keeps its
        default, as ``EngineConfig.from_flat`` and ``LLM(model=None)`` do; an option given by
        both its names (``tp`` and ``tensor_parallel_size``) is refused as such."""
        if isinstance(data, dict):
            for path, flat in _RENAMED.items():
                given = [name for name in (flat, path[-1]) if data.get(name) is not None]
                if len(given) == 2:  # else pydantic would call the second an extra input
                    raise ValueError(f"{flat} and {path[-1]} name the same option: give one of them")
            return {k: v for k, v in data.items() if v is not None or k not in FLAT_NAMES}
        return data

    def engine_config(self) -> EngineConfig:
        """The EngineConfig these flat options describe."""
        nested: dict[str, Any] = {}
        for flat, path in ENGINE_FIELD_PATHS.items():
            section = nested.setdefault(path[0], {}) if len(path) > 1 else nested
            section[path[-1]] = getattr(self, flat)
        return EngineConfig.model_validate(nested)

    @model_validator(mode="after")
    def _engine_consistent(self) -> "_EngineOptions":
        """EngineConfig's checks across fields (the prefix store vs. Ray, ...) fail here too."""
        try:
            self.engine_config()
        except ValidationError as e:
            raise ValueError("; ".join(err["msg"].removeprefix("Value error, ") for err in e.errors())) from None
        return self


FlatEngineConfig: type[_EngineOptions] = create_model(  # type: ignore[call-overload]
    "FlatEngineConfig",
    __base__=_EngineOptions,
    __module__=__name__,
    __doc__="Every EngineConfig field under its flat name (see ENGINE_FIELD_PATHS), with the "
    "field's own description, default and range.",
    **{flat: _flat_field(flat, path) for flat, path in ENGINE_FIELD_PATHS.items()},
)


class ServeConfig(FlatEngineConfig):  # type: ignore[misc, valid-type]
    """One OpenAI-compatible server: the engine it wraps (the fields of ``FlatEngineConfig``,
    flat: ``max_num_seqs``, ``tp``, ``default_kv_policy``, ...) plus the HTTP-side limits.

    The same model validates ``keyserve serve`` flags, ``build_app(args)`` of a Ray Serve /
    KubeRay ``serveConfigV2`` application and the batch job's options.
    """

    served_model_name: str | None = Field(
        None, description="Name clients put in `model`; default: the model's directory name."
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
        """An empty key would accept an empty bearer token: refuse it at start-up. Whitespace
        around it (a key file's trailing newline, a Secret made with ``--from-file``) is not
        part of it: clients send the key without it (and the server strips theirs), so a key
        kept with it would lock every client out."""
        if value is not None and not value.strip():
            raise ValueError("api_key must not be empty or whitespace (leave it unset for no auth)")
        if value is not None and any(c.isspace() for c in value.strip()):
            raise ValueError("api_key must not contain whitespace inside it")
        return value.strip() if value is not None else None

    def model_name(self) -> str:
        """The name clients use: served_model_name, else the model path's last part."""
        if self.served_model_name:
            return self.served_model_name
        return Path(self.model).name.removesuffix(".gguf")
