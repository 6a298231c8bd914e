"""The engine over Ray actors: ``RayEngine`` (the ``LLMEngine`` step loop with remote sides),
``RayLLM`` (``keyserve.LLM``'s ``generate`` on a cluster) and ``AsyncRayEngine`` (the async
streaming front).

Nothing here decides anything about requests: ``LLMEngine`` runs schedule -> propose -> verify
-> accept -> emit exactly as in one process, against ``RemoteCore`` (the KV-block manager
actor), ``RemoteDrafter`` (the draft actor) and ``TargetGroup`` (the tensor-parallel shards).
What is added is recovery: the engine keeps every request's tokens, so a lost shard, draft or
KV-block manager is replaced and the affected sequences are recomputed from their tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch

from keyserve.actors.common import CoreLost, ShardLost, ensure_ray
from keyserve.actors.draft_worker import DraftSpec, RemoteDrafter
from keyserve.engine.draft_worker import draft_budget
from keyserve.actors.kv_manager import CoreSpec, RemoteCore, views
from keyserve.actors.target_group import TargetGroup, worker_gpus
from keyserve.actors.tp_worker import WorkerSpec, check_tp_fits
from keyserve.config import EngineConfig
from keyserve.core.sampling_params import SamplingParams
from keyserve.engine.kv_budget import BudgetDefaults
from keyserve.engine.llm_engine import LLMEngine, scheduler_config
from keyserve.engine.model_runner import num_blocks_for_memory
from keyserve.engine.outputs import RequestOutput
from keyserve.llm import LLM

log = logging.getLogger(__name__)


class RayEngine(LLMEngine):
    """``LLMEngine`` whose KV-block manager, draft and target shards are Ray actors."""

    def __init__(self, config: EngineConfig | None = None) -> None:  # noqa: D107 — no super().__init__: nothing local
        from transformers import AutoTokenizer

        from keyserve.model.config import ModelConfig
        from keyserve.model.kv_cache import kv_cache_bytes_per_block
        from keyserve.model.loader import resolve_model_dir

        config = config or EngineConfig()
        par = config.parallel
        if config.model.dtype == "float16" and config.model.device == "cpu":
            raise ValueError("dtype float16 is only supported on CUDA; use bfloat16 on the CPU")
        model_dir = str(resolve_model_dir(config.model.model, progress=False))
        arch = ModelConfig.from_file(f"{model_dir}/config.json")
        check_tp_fits(arch, par.tensor_parallel_size, config.model.model)
        ensure_ray(par.address)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        max_model_len = config.model.max_model_len or arch.max_position_embeddings
        block_size = config.cache.block_size
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[config.model.dtype]
        num_blocks = config.cache.num_blocks or num_blocks_for_memory(
            config.cache.kv_cache_memory_gb,
            kv_cache_bytes_per_block(arch, block_size, dtype, par.tensor_parallel_size),
        )
        self.device = torch.device("cpu")  # of this process; the shards pick their own
        self.group: TargetGroup | None = None
        self.drafter_client: RemoteDrafter | None = None
        self.core_client: RemoteCore | None = None
        try:
            worker = WorkerSpec(model_dir, config.model.dtype, config.model.device, num_blocks, block_size,
                                par.backend, par.collective_timeout_s, config.seed, par.worker_threads)
            self.group = TargetGroup(worker, par, arch)
            spec = None
            cost = 1.0
            if config.spec.draft is not None:
                from keyserve.engine.speculative import SpeculativeDecoder

                gpus = par.draft_num_gpus if par.draft_num_gpus is not None else worker_gpus(par, config.model.device)
                self.drafter_client = RemoteDrafter(
                    DraftSpec(config.spec.draft, model_dir, config.model.dtype, config.model.device,
                              num_blocks, block_size, config.seed, draft_budget(config.spec)),
                    par, gpus,
                )
                cost = config.spec.draft_cost_ratio or min(1.0, self.drafter_client.weight_bytes / self.group.weight_bytes)
                spec = SpeculativeDecoder(self.drafter_client, config.spec, cost)
            budget = BudgetDefaults(config.cache.default_kv_policy, config.cache.default_kv_budget)
            self.core_client = RemoteCore(
                CoreSpec(num_blocks, block_size, config.cache.enable_prefix_caching, scheduler_config(config),
                         budget, max_model_len, config.spec if spec is not None else None, cost),
                par,
            )
        except BaseException:
            self.shutdown()
            raise
        self.runner = self.group
        self._init_front(config, arch, tokenizer, max_model_len, self.core_client, spec)
        self.scheduler, self.block_manager = views(self.core_client)
        self.num_recoveries = 0
        self._failures = 0

    # ------------------------------------------------------------------ steps
    def step(self) -> list[RequestOutput]:
        try:
            outputs = super().step()
        except ShardLost as e:
            self._recovered(e)
            assert self.group is not None and self.core_client is not None
            self.core_client.reset_model_side()  # recompute everything on the new shards
            try:
                self.group.restart()
            except Exception:  # noqa: BLE001 — e.g. no room yet: the next step finds it dead again
                log.exception("replacing the target group failed; retrying at the next step")
            return []
        except CoreLost as e:
            self._recovered(e)
            assert self.core_client is not None
            self.core_client.recover(self._unfinished())
            return []
        self._failures = 0
        if not self.requests:
            self.flush()
        return outputs

    def _recovered(self, error: Exception) -> None:
        self._failures += 1
        self.num_recoveries += 1
        log.warning("recovering from %s (attempt %d)", error, self._failures)
        if self._failures > self.config.parallel.max_recoveries:
            raise RuntimeError(f"giving up after {self._failures - 1} recoveries in a row") from error
        self.last_step_empty = False

    def _unfinished(self) -> list[tuple[list, list, list[int] | None]]:
        """Every unfinished request as the core needs it back: its tokens so far."""
        out = []
        for req in self.requests.values():
            live = [s for s in req.seqs if not s.is_finished]
            if live or req.pending_forks:
                pending = req.pending_forks if req.seqs and req.seqs[0] in live else []
                forced = req.forced_token_ids
                out.append((live, pending, forced))
        return out

    def flush(self) -> None:
        """Deliver what is queued for the actors (frees finished requests' blocks)."""
        if self.core_client is not None:
            try:
                self.core_client.flush()
            except CoreLost:
                self.core_client.recover(self._unfinished())
        if self.drafter_client is not None:
            self.drafter_client.flush()

    def check_consistent(self) -> Any:
        """Block accounting of the KV-block manager (raises if a reference leaked)."""
        assert self.core_client is not None
        return self.core_client.check_consistent()

    def shutdown(self) -> None:
        for part in (self.group, self.drafter_client, self.core_client):
            if part is not None:
                part.shutdown()
        self.group = self.drafter_client = self.core_client = None


class RayLLM(LLM):
    """``keyserve.LLM`` on a Ray cluster (a local one is started if none is running).

    >>> llm = RayLLM("/path/to/model", tensor_parallel_size=2, draft="/path/to/draft")
    >>> [out] = llm.generate("Once upon a time", SamplingParams(max_tokens=32))
    """

    def __init__(self, model: str | None = None, *, config: EngineConfig | None = None, **options: Any) -> None:
        if config is None:
            config = EngineConfig.from_flat(model=model, **options)
        elif model is not None or options:
            raise ValueError("pass either config= or model/options, not both")
        self.engine = RayEngine(config)

    def stream(
        self, prompts: list[str] | list[list[int]], sampling_params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        """Every request's snapshot as soon as a step accepted tokens for it (last one finished)."""
        engine = self.engine
        ids = [engine.add_request(p, sampling_params, prompt_token_ids=p if isinstance(p, list) else None)
               for p in prompts]
        try:
            while engine.has_unfinished_requests():
                yield from engine.step()
        finally:
            for rid in ids:
                engine.abort(rid)

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> "RayLLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def AsyncRayEngine(config: EngineConfig, **kwargs: Any) -> Any:  # noqa: N802 — a factory
    """The serving layer's ``AsyncLLMEngine`` (asyncio streaming, aborts, queue limits) driving a
    ``RayEngine`` on its engine thread."""
    from keyserve.engine.async_engine import AsyncLLMEngine

    return AsyncLLMEngine(lambda: RayEngine(config), **kwargs)
