"""One builder for every process that holds a part of the engine.

``LLMEngine`` (everything in one process), ``RayEngine`` (the same engine over Ray actors), the
tensor-parallel shard actor, the draft actor and the KV-block manager actor all build through
here, so a dtype, a device, the KV pool's size, a model runner, a drafter or a KV core is made
one way wherever it runs:

- ``resolve_device``, ``resolve_dtype``: config strings -> torch objects (float16 only on CUDA);
- ``weight_bytes``, ``draft_cost_ratio``: parameter bytes, and the draft's cost per target forward;
- ``context_length``, ``kv_pool_blocks``: the context limit; KV blocks per rank for the pool;
- ``load_target``, ``build_runner``: weights and a ``ModelRunner`` for rank ``rank`` of
  ``world_size`` (with the all-reduce and the vocab-parallel LM head when ``world_size > 1``);
- ``draft_target``, ``build_drafter``: the draft model with its own runner, KV pool and blocks;
- ``core_args``, ``build_core``: the KV-block manager side (``KVCore``);
- ``EngineParts``, ``build_local_parts``: everything ``LLMEngine`` drives, built in this process.
  ``RayEngine`` builds the same ``EngineParts`` with actor clients in their place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from keyserve.config import LOOKUP_ONLY_DRAFTS, CacheConfig, EngineConfig, SpeculativeConfig
from keyserve.config import ModelConfig as ModelOptions
from keyserve.core.block_manager import BlockManager
from keyserve.core.scheduler import SchedulerConfig
from keyserve.engine.cuda_graphs import DecodeGraphs
from keyserve.engine.drafter import DraftBudget, Drafter, draft_budget, draft_lookup
from keyserve.engine.lookup_drafter import LookupDrafter
from keyserve.engine.kv_budget import BudgetDefaults
from keyserve.engine.kv_core import KVCore
from keyserve.engine.malloc_tuning import tune_malloc
from keyserve.engine.model_runner import ModelRunner
from keyserve.engine.prefix_store import EnginePrefixStore
from keyserve.engine.speculative import SpeculativeDecoder
from keyserve.kernels import native
from keyserve.model.config import ModelConfig
from keyserve.model.draft_model import load_draft
from keyserve.model.kv_cache import allocate_kv_cache, kv_cache_bytes_per_block
from keyserve.model.llama import LlamaForCausalLM
from keyserve.model.loader import LoadedModel, load_model, load_tokenizer, load_vocab, resolve_model_dir
from keyserve.model.parallel import VocabParallelHead, dist_all_reduce
from keyserve.model.weights import iter_safetensors

GRAPH_ROWS = 256  # decode rows a step may have and still replay a CUDA graph (engine/cuda_graphs.py)


def graph_rows(config: EngineConfig) -> int:
    """Decode rows a step may have and replay a CUDA graph (0: none; only CUDA uses it)."""
    return 0 if config.model.enforce_eager else GRAPH_ROWS

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ------------------------------------------------------------- dtypes, devices, sizes
def resolve_device(name: str) -> torch.device:
    """``"auto"`` is CUDA when this process sees a GPU, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        why = "a CPU build of torch" if torch.version.cuda is None else "no GPU visible to this process"
        raise ValueError(f"device 'cuda' was asked for, but this process has {why}; "
                         "use device 'cpu' or 'auto'")
    return torch.device(name)


def resolve_dtype(name: str, device_type: str) -> torch.dtype:
    """The torch dtype of a config name; ``device_type`` is where it will run ("cpu", "cuda",
    or "auto" when only the remote process will know)."""
    dtype = DTYPES[name]
    if dtype is torch.float16 and device_type == "cpu":
        raise ValueError("dtype float16 is only supported on CUDA; use bfloat16 on the CPU")
    return dtype


def resolve_draft_dtype(name: str, target_dtype: torch.dtype, device_type: str) -> torch.dtype:
    """The draft's dtype (``SpeculativeConfig.draft_dtype``). ``auto``: bfloat16 under a float32
    target on the CPU when the native kernels are built -- a draft forward is bound by the bytes
    it streams, and bf16 halves them (measured at batch 1, K = 1: 1.01x -> 1.08x plain decoding
    at T = 0, the same acceptance) while speculative sampling stays exact whatever the draft
    computes in; without the native kernels torch's bf16 CPU path is slower, so the target's."""
    if name != "auto":
        return resolve_dtype(name, device_type)
    if target_dtype is torch.float32 and device_type == "cpu" and native.library() is not None:
        return torch.bfloat16
    return target_dtype


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def draft_cost_ratio(config: SpeculativeConfig, draft_bytes: int, target_bytes: int) -> float:
    """A draft forward's cost relative to the target's (adaptive K weighs it): the configured
    ratio, else the ratio of their weight bytes (decode is memory-bound)."""
    return config.draft_cost_ratio or min(1.0, draft_bytes / target_bytes)


def context_length(options: ModelOptions, arch: ModelConfig) -> int:
    """The engine's context limit: ``max_model_len``, at most the model's own."""
    if (options.max_model_len or 0) > arch.max_position_embeddings:
        raise ValueError(
            f"max_model_len={options.max_model_len} exceeds the model's "
            f"max_position_embeddings={arch.max_position_embeddings}"
        )
    return options.max_model_len or arch.max_position_embeddings


def num_blocks_for_memory(memory_gb: float, bytes_per_block: int) -> int:
    return max(2, int(math.floor(memory_gb * (1 << 30) / bytes_per_block)))


def kv_pool_blocks(cache: CacheConfig, arch: ModelConfig, dtype: torch.dtype, world_size: int = 1) -> int:
    """KV blocks in the pool: ``num_blocks``, else as many as ``kv_cache_memory_gb`` holds on
    one rank (each of ``world_size`` ranks holds its share of the kv-heads of every block)."""
    if cache.num_blocks:
        return cache.num_blocks
    per_block = kv_cache_bytes_per_block(arch, cache.block_size, dtype, world_size)
    return num_blocks_for_memory(cache.kv_cache_memory_gb, per_block)


def budget_defaults(config: EngineConfig) -> BudgetDefaults:
    """The KV budget of requests that name none (built once per engine, by its front: each
    request's budget is resolved from it once, in ``LLMEngine.add_request``)."""
    return BudgetDefaults(config.cache.default_kv_policy, config.cache.default_kv_budget)


def scheduler_config(config: EngineConfig) -> SchedulerConfig:
    s = config.scheduler
    return SchedulerConfig(s.max_num_batched_tokens, s.max_num_seqs, s.enable_chunked_prefill)


# ------------------------------------------------------------------ model runners
def load_target(
    model_dir: str | Path, dtype: torch.dtype, device: torch.device, rank: int = 0, world_size: int = 1
) -> LlamaForCausalLM:
    """This rank's shard of the target's weights, without the tokenizer (a shard never
    detokenizes, and importing transformers would double its start-up time)."""
    path = Path(model_dir)
    arch = ModelConfig.from_file(path / "config.json")
    all_reduce = dist_all_reduce if world_size > 1 else None
    model = LlamaForCausalLM(arch, dtype, device, rank, world_size, all_reduce)
    model.load_weights(iter_safetensors(path))
    model.eval()
    return model


def build_runner(
    model: LlamaForCausalLM,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    rank: int = 0,
    world_size: int = 1,
    graph_rows: int = 0,
    max_model_len: int | None = None,
) -> ModelRunner:
    """A runner over ``model`` (this rank's shard) with a zeroed KV pool of this rank's
    kv-heads. With ``world_size > 1`` the LM head is vocab-parallel (rank 0 gathers the logits
    and samples) and an untied head keeps only this rank's rows. ``graph_rows`` > 0 on CUDA
    (one rank): decode steps of up to that many rows replay CUDA graphs (engine/cuda_graphs.py),
    whose block tables hold ``max_model_len`` tokens."""
    arch = model.config
    if device.type == "cpu":
        tune_malloc()  # large activations reused, not re-faulted every layer (engine/malloc_tuning.py)
    try:
        kv = allocate_kv_cache(arch, num_blocks, block_size, dtype, device, rank, world_size)
    except (RuntimeError, MemoryError, TypeError) as e:  # allocator: "can't allocate"; sizes past int64: TypeError
        need = num_blocks * kv_cache_bytes_per_block(arch, block_size, dtype, world_size) / 2**30
        raise ValueError(f"cannot allocate the KV cache: {num_blocks} blocks of {block_size} tokens need "
                         f"{need:.1f} GiB on {device} ({str(e).splitlines()[0]}); lower num_blocks or "
                         "kv_cache_memory_gb") from e
    head = None
    if world_size > 1:
        head = VocabParallelHead(model.lm_head_weight, rank, world_size)
        if not arch.tie_word_embeddings:
            model.lm_head_weight = torch.nn.Parameter(head.weight.clone(), requires_grad=False)
            head.weight = model.lm_head_weight
    runner = ModelRunner(
        model, kv, block_size, arch.sliding_window, device,
        num_layers=arch.num_hidden_layers, num_kv_heads=kv[0][0].shape[2],
        logits_fn=head, is_driver=rank == 0,
    )
    if graph_rows > 0 and device.type == "cuda" and world_size == 1:
        context = max_model_len or arch.max_position_embeddings
        runner.graphs = DecodeGraphs(model, runner.logits_fn, kv, -(-context // block_size), graph_rows,
                                     device, arch.sliding_window)
    return runner


def load_target_arch(model: str | None) -> tuple[Path, ModelConfig]:
    """A target's directory and architecture, without its weights or tokenizer (the Ray
    engine's front holds no model; the shards load it)."""
    model_dir = resolve_model_dir(model, progress=False)
    return model_dir, ModelConfig.from_file(model_dir / "config.json")


# ------------------------------------------------------------------------ drafter
def draft_target(target_dir: str | Path, dtype: torch.dtype, device: torch.device) -> Any:
    """What ``load_draft`` reads from the target -- config, tokenizer, input embeddings --
    without loading the whole target (the draft actor may sit on another node)."""
    path = Path(target_dir)
    embed = next(t for name, t in iter_safetensors(path) if name == "model.embed_tokens.weight")
    weight = embed.to(device, dtype)
    return SimpleNamespace(
        model=SimpleNamespace(model=SimpleNamespace(embed_tokens=SimpleNamespace(weight=weight)), dtype=dtype),
        config=ModelConfig.from_file(path / "config.json"),
        tokenizer=load_vocab(path),  # the vocabulary only: the draft actor decodes no text
        path=path,
        generation_config={},
    )


def build_drafter(
    draft: str,
    budget: DraftBudget,
    target: LoadedModel | Any,  # the loaded target, or ``draft_target``'s stand-in
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    graph_rows: int = 0,
    max_model_len: int | None = None,
    lookup: tuple[int, int] | None = None,
    confidence: float = 0.0,
) -> tuple[Drafter | LookupDrafter, int]:
    """The draft model with its own KV pool (as many token slots as the target's) and block
    manager; returns the drafter and the draft's weight bytes. ``graph_rows``/``max_model_len``:
    CUDA graphs of its decode steps, as ``build_runner``'s (its K forwards are decode steps);
    ``lookup``: prompt lookup's n-gram sizes (``drafter.draft_lookup``), None for off;
    ``confidence``: ``SpeculativeConfig.draft_confidence_threshold``.
    ``draft="ngram"``: the ``LookupDrafter`` (prompt lookup alone, no weights)."""
    vocab = target.config.vocab_size
    if draft in LOOKUP_ONLY_DRAFTS:
        if lookup is None:
            raise ValueError("draft='ngram' needs prompt lookup's n-gram sizes")
        return LookupDrafter(vocab, lookup, device), 0
    loaded = load_draft(draft, target, dtype=dtype, device=device)
    if loaded.config.vocab_size != vocab:
        raise ValueError(f"draft vocabulary ({loaded.config.vocab_size}) differs from the target's ({vocab})")
    runner = build_runner(loaded.model, num_blocks, block_size, dtype, device, graph_rows=graph_rows,
                          max_model_len=max_model_len)
    worker = Drafter(runner, BlockManager(num_blocks, block_size, True), vocab, budget, lookup, confidence)
    return worker, weight_bytes(loaded.model)


# ---------------------------------------------------------------------- KV core
@dataclass
class KVCoreArgs:
    """What a ``KVCore`` is built from (sent to the KV-block manager actor as is)."""

    num_blocks: int
    block_size: int
    enable_prefix_caching: bool
    scheduler: SchedulerConfig
    max_model_len: int


def core_args(config: EngineConfig, num_blocks: int, max_model_len: int) -> KVCoreArgs:
    return KVCoreArgs(
        num_blocks, config.cache.block_size, config.cache.enable_prefix_caching, scheduler_config(config),
        max_model_len,
    )


def build_core(args: KVCoreArgs) -> KVCore:
    """The KV-block manager side, in the engine's process or in the KV-block manager actor. It
    holds no speculative policy: the engine's ``SpeculativeDecoder`` sends it how many drafts
    each sequence wants with every ``schedule``."""
    return KVCore(
        args.num_blocks, args.block_size, args.enable_prefix_caching, args.scheduler, args.max_model_len,
    )


# ------------------------------------------------------------------ engine parts
@dataclass
class EngineParts:
    """Everything ``LLMEngine`` drives. ``build_local_parts`` builds them in this process;
    ``RayEngine`` puts Ray actor clients with the same methods in their place."""

    arch: ModelConfig
    tokenizer: Any
    max_model_len: int
    budget_defaults: BudgetDefaults  # the engine resolves every request's budget from it
    runner: Any  # ModelRunner | TargetGroup: apply_ops(ops), execute(step, draft_probs)
    core: Any  # KVCore | RemoteCore: add, schedule, commit, finish, stats
    speculative: SpeculativeDecoder | None  # the engine's one speculative policy; its drafter: Drafter | RemoteDrafter
    device: torch.device  # of this process's model (the CPU when the model is remote)
    loaded: LoadedModel | None = None
    prefix_store: EnginePrefixStore | None = None


def build_local_parts(config: EngineConfig, loaded: LoadedModel | None = None) -> EngineParts:
    """Target, drafter, KV core and prefix store in this process (``loaded``: an already
    loaded target, e.g. shared by tests)."""
    torch.manual_seed(config.seed)
    device = resolve_device(config.model.device)
    dtype = resolve_dtype(config.model.dtype, device.type)
    loaded = loaded or load_model(config.model.model, dtype=dtype, device=device)
    arch = loaded.config
    max_model_len = context_length(config.model, arch)
    block_size = config.cache.block_size
    num_blocks = kv_pool_blocks(config.cache, arch, dtype)
    budget = budget_defaults(config)
    rows = graph_rows(config)
    runner = build_runner(loaded.model, num_blocks, block_size, dtype, device, graph_rows=rows,
                          max_model_len=max_model_len)
    speculative = None
    if config.spec.draft is not None:
        drafter, draft_bytes = build_drafter(
            config.spec.draft, draft_budget(config.spec), loaded, num_blocks, block_size,
            resolve_draft_dtype(config.spec.draft_dtype, dtype, device.type), device,
            graph_rows=rows, max_model_len=max_model_len, lookup=draft_lookup(config.spec),
            confidence=config.spec.draft_confidence_threshold,
        )
        cost = draft_cost_ratio(config.spec, draft_bytes, weight_bytes(loaded.model))
        speculative = SpeculativeDecoder(drafter, config.spec, cost)
    core = build_core(core_args(config, num_blocks, max_model_len))
    store = None
    if config.prefix_store.enabled:  # IMPRESS: hooks itself into the core and the pool
        store = EnginePrefixStore(config.prefix_store, core, runner)
    return EngineParts(arch, loaded.tokenizer, max_model_len, budget, runner, core, speculative, device, loaded, store)
