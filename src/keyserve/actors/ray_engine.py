"""The engine over Ray actors: ``RayEngine`` (the ``LLMEngine`` step loop with remote sides)
and ``AsyncRayEngine`` (the async streaming front). ``keyserve.llm.RayLLM`` is
``keyserve.LLM``'s ``generate`` over a ``RayEngine``.

Nothing here decides anything about requests: ``LLMEngine`` runs schedule -> propose -> verify
-> accept -> emit exactly as in one process, against ``RemoteCore`` (the KV-block manager
actor), ``RemoteDrafter`` (the draft actor) and ``TargetGroup`` (the tensor-parallel shards),
which ``RayEngine`` builds with ``engine.build`` in place of the local parts.
What is added is recovery: the engine keeps every request's tokens, so a lost shard, draft or
KV-block manager is replaced and the affected sequences are recomputed from their tokens.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from keyserve.actors.channel_graph import ChannelGraph
from keyserve.actors.common import CoreLost, DraftLost, ShardLost, alive, ensure_ray
from keyserve.actors.draft_actor import DraftActorArgs, DraftBatch, RemoteDrafter
from keyserve.actors.kv_manager_actor import RemoteCore
from keyserve.actors.step_graph import StepGraph, actor_key, graph_key, lost_actor, use_compiled_graph
from keyserve.actors.target_group import TargetGroup, worker_gpus
from keyserve.actors.target_shard_actor import ShardArgs, check_tp_fits
from keyserve.config import EngineConfig
from keyserve.core.cpu_count import usable_cpus
from keyserve.core.sequence import Sequence
from keyserve.engine import build
from keyserve.engine.async_engine import AsyncLLMEngine
from keyserve.engine.drafter import draft_budget, draft_lookup
from keyserve.engine.llm_engine import LLMEngine
from keyserve.engine.outputs import RequestOutput
from keyserve.engine.speculative import SpeculativeDecoder
from keyserve.engine.stats import CoreStats

log = logging.getLogger(__name__)


@dataclass
class _Flight:
    """A submitted step: what the driver needs to read and accept it."""

    batch: DraftBatch | None  # the draft actor's input, if drafting
    targets: list[Sequence]  # the sequences drafted for
    graph: StepGraph | ChannelGraph | None = None
    error: BaseException | None = None  # the submission failed: raised where the step is read


class RayEngine(LLMEngine):
    """``LLMEngine`` whose KV-block manager, draft and target shards are Ray actors."""

    # A lost shard or KV-block manager is recovered in ``step`` below (every request is
    # recomputed from its tokens); any other failure is isolated by ``LLMEngine.step``.
    engine_faults = (ShardLost, CoreLost, DraftLost)

    def __init__(self, config: EngineConfig | None = None) -> None:
        config = config or EngineConfig()
        self.group: TargetGroup | None = None
        self.drafter_client: RemoteDrafter | None = None
        self.core_client: RemoteCore | None = None
        self._graph: StepGraph | ChannelGraph | None = None
        self._inflight: _Flight | None = None  # a relayed step submitted, not read yet
        self._drained: list[RequestOutput] | None = None  # outputs of a step read early
        self._draining = False
        self.num_graph_compiles = 0
        self.num_graph_releases = 0
        # The step and the idle release both touch the graph: one at a time.
        self._graph_lock = threading.Lock()
        self._last_active = time.monotonic()
        self._closed = threading.Event()
        self._idle_reaper: threading.Thread | None = None
        try:
            parts = self._remote_parts(config)
        except BaseException:
            self.shutdown()
            raise
        super().__init__(config, parts=parts)
        self.num_recoveries = 0
        self._failures = 0
        par = config.parallel
        self.compiled_graph = use_compiled_graph(
            par.compiled_graph, bool(self.group is not None and self.group.num_gpus), usable_cpus(),
            par.tensor_parallel_size, par.worker_threads, self.drafter_client is not None)
        # Without the compiled graph, the step channels relay the step the graph's way.
        self.relayed = not self.compiled_graph and par.step_channels and par.step_relay
        if (self.compiled_graph or self.relayed) and self.group is not None:
            self.group.drop_channels()  # every step goes through the graph
        if self.compiled_graph:
            self._idle_reaper = threading.Thread(target=self._release_when_idle, daemon=True,
                                                 name="keyserve-graph-idle")
            self._idle_reaper.start()

    def _remote_parts(self, config: EngineConfig) -> build.EngineParts:
        """The builder's parts with actors in place of the local ones: the tensor-parallel
        target group, the draft actor and the KV-block manager actor (this process holds
        only the tokenizer)."""
        par = config.parallel
        dtype = build.resolve_dtype(config.model.dtype, config.model.device)
        model_dir, arch = build.load_target_arch(config.model.model)
        check_tp_fits(arch, par.tensor_parallel_size, config.model.model)
        ensure_ray(par.address)
        max_model_len = build.context_length(config.model, arch)
        block_size = config.cache.block_size
        num_blocks = build.kv_pool_blocks(config.cache, arch, dtype, par.tensor_parallel_size)
        budget = build.budget_defaults(config)
        rows = build.graph_rows(config)
        worker = ShardArgs(str(model_dir), config.model.dtype, config.model.device, num_blocks, block_size,
                            par.backend, par.collective_timeout_s, config.seed, par.worker_threads,
                            graph_rows=rows, max_model_len=max_model_len)
        # The shards' placement group first (as before the parallel start: the draft and
        # KV-manager actors must not take the bundles' resources), then every actor at once.
        self.group = TargetGroup(worker, par, arch, start=False)
        draft_args = None
        if config.spec.draft is not None:
            gpus = par.draft_num_gpus if par.draft_num_gpus is not None else worker_gpus(par, config.model.device)
            draft_args = DraftActorArgs(config.spec.draft, str(model_dir), config.model.dtype, config.model.device,
                                        num_blocks, block_size, config.seed, draft_budget(config.spec),
                                        graph_rows=rows, max_model_len=max_model_len,
                                        draft_dtype=config.spec.draft_dtype,
                                        lookup=draft_lookup(config.spec),
                                        confidence=config.spec.draft_confidence_threshold,
                                        threads=par.draft_threads)
        tokenizer = self._start_actors(config, num_blocks, max_model_len, model_dir, draft_args,
                                       gpus if draft_args else 0.0)
        speculative = None
        if self.drafter_client is not None:
            cost = build.draft_cost_ratio(config.spec, self.drafter_client.weight_bytes, self.group.weight_bytes)
            speculative = SpeculativeDecoder(self.drafter_client, config.spec, cost)
        return build.EngineParts(
            arch, tokenizer, max_model_len, budget, self.group, self.core_client, speculative,
            torch.device("cpu"),  # the shards pick their own devices
        )

    def _start_actors(self, config: EngineConfig, num_blocks: int, max_model_len: int, model_dir: Any,
                      draft_args: DraftActorArgs | None, draft_gpus: float) -> Any:
        """Start the shards, the draft actor and the KV-manager actor side by side and load
        the tokenizer meanwhile; returns the tokenizer. Each actor's start is mostly its
        process importing torch and loading weights, seconds apiece: one after the other they
        took 13-17 s on 2 cores for stories260K, most of the engine's start-up. Every part that
        started is kept on ``self`` (so ``shutdown`` stops it) before the first error is raised."""
        par = config.parallel
        assert self.group is not None
        with ThreadPoolExecutor(max_workers=4, thread_name_prefix="keyserve-start") as pool:
            group = pool.submit(self.group.start)
            drafter = pool.submit(RemoteDrafter, draft_args, par, draft_gpus) if draft_args else None
            core = pool.submit(RemoteCore, build.core_args(config, num_blocks, max_model_len), par)
            tokenizer = pool.submit(build.load_tokenizer, model_dir)
            errors = [f.exception() for f in (group, drafter, core, tokenizer) if f is not None]
        if drafter is not None and drafter.exception() is None:
            self.drafter_client = drafter.result()
        if core.exception() is None:
            self.core_client = core.result()
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first
        return tokenizer.result()

    # ------------------------------------------------------------------ steps
    def step(self) -> list[RequestOutput]:
        try:
            outputs = super().step()
        except self.engine_faults as e:
            return self._recover(e)
        self._failures = 0
        if not self.requests:
            self.flush()
        return outputs

    def _recover(self, error: BaseException) -> list[RequestOutput]:
        """A lost actor: replace it and recompute what it held from the engine's tokens."""
        self._inflight = None  # a fault is raised where a step is read: nothing is in flight
        if self.relayed:
            with self._graph_lock:
                self._drop_graph()  # a replaced actor needs a new graph
        self._recovered(error)
        assert self.group is not None and self.core_client is not None
        if isinstance(error, CoreLost):
            self.core_client.recover(self._unfinished())
            return []
        self.core_client.reset_model_side()  # recompute everything on the new shards
        if isinstance(error, ShardLost):
            try:
                self.group.restart()
            except Exception:  # noqa: BLE001 — e.g. no room yet: the next step finds it dead again
                log.exception("replacing the target group failed; retrying at the next step")
        # DraftLost: the step it was part of never ran; it is recomputed, without drafts
        return []

    def _step(self) -> list[RequestOutput]:
        if not (self.compiled_graph or self.relayed):
            return super()._step()
        with self._graph_lock:
            try:
                return self._graph_step()
            finally:
                self._last_active = time.monotonic()

    def _release_when_idle(self) -> None:
        """While the compiled graph exists its actors spin on their input channels (Ray's
        shared-memory reads busy-wait): an idle server would hold a core per actor. After
        ``graph_idle_release_s`` without requests the graph is torn down; the next step
        compiles it again."""
        idle_s = self.config.parallel.graph_idle_release_s
        while not self._closed.wait(min(0.25, idle_s / 2)):
            with self._graph_lock:  # waits out a running step
                if self._graph is not None and not self.requests and \
                        time.monotonic() - self._last_active >= idle_s:
                    self._drop_graph()
                    self.num_graph_releases += 1

    def _graph_step(self) -> list[RequestOutput]:
        """``LLMEngine._step`` as one execution of the step graph (compiled, or relayed over the
        step channels): schedule, propose and verify run actor to actor; the driver submits,
        reads, and runs its stop checks. A relayed step may have been submitted already, as
        soon as the previous one was committed (``_after_commit``)."""
        if self._drained is not None:  # a step read early (``_drain``): its outputs now
            outputs, self._drained = self._drained, None
            return outputs
        flight, self._inflight = self._inflight or self._submit(), None
        return self._complete(flight)

    def _submit(self) -> _Flight:
        """Send the next step's request; an error is kept for ``_complete`` to raise."""
        assert self.group is not None and self.core_client is not None
        drafter = self.drafter_client
        speculate = drafter is not None and drafter.available
        lookahead, multi_step = self._step_lookahead(speculate)
        targets = [self._seqs[seq_id] for seq_id in lookahead] if speculate and lookahead and not multi_step else []
        trees = self.speculative.trees if self.speculative is not None else None
        # Relayed, a step nobody drafts in skips the draft actor (``ChannelGraph.submit``),
        # unless finished sequences' releases wait for it; the compiled graph always has the node.
        by_draft = speculate and (bool(targets) or drafter.has_releases or not self.relayed)
        batch = drafter.graph_batch(targets, trees) if by_draft else None
        request = self.core_client.request(lookahead, multi_step)
        flight = _Flight(batch, targets)
        try:
            flight.graph = self._graph_for(speculate)
            flight.graph.submit(request, batch)
        except Exception as e:  # noqa: BLE001 — raised where the step is read
            flight.error = e
        return flight

    def _complete(self, flight: _Flight) -> list[RequestOutput]:
        """Read a submitted step, then accept it (stop checks, commit, outputs)."""
        assert self.core_client is not None
        drafter = self.drafter_client
        try:
            if flight.error is not None:
                raise flight.error
            assert flight.graph is not None
            result = flight.graph.read()
        except Exception as e:  # noqa: BLE001 — which actor, if any, is lost decides
            if flight.batch is not None:
                drafter.graph_failed(flight.batch)
            raise self._diagnose(e) from e
        if result.drafts is not None:
            drafter.graph_done(result.drafts, flight.targets)
        reply = self.core_client.answer(result.answer)
        self._apply_seq_stats(reply.seq_stats)
        step = self._running_step = result.step
        self.last_step_empty = step is None or step.is_empty
        if step is None or step.is_empty or result.output is None:
            return []
        self.num_steps += 1
        return self._accept(step, result.output)

    def _after_commit(self) -> None:
        """Relayed: submit the next step as soon as this one is committed, so the KV-block
        manager and the shards start it while the driver builds this step's outputs and the
        caller handles them (the driver's work leaves the step's critical path). Requests added
        meanwhile join the step after it; an abort reads the step in flight first (``_drain``)."""
        if self.relayed and not self._draining and any(not r.finished for r in self.requests.values()):
            self._inflight = self._submit()

    def _drain(self) -> None:
        """Read and accept the step in flight now (its outputs go out with the next ``step``),
        so that what comes next (an abort, a flush, a check) meets a committed core. An error
        is kept for the next ``step`` to raise and recover from."""
        flight, self._inflight = self._inflight, None
        if flight is None:
            return
        self._draining = True
        try:
            outputs = self._complete(flight)
        except Exception as e:  # noqa: BLE001 — raised by the next step
            outputs = []
            self._inflight = _Flight(None, [], error=e)  # already diagnosed
        finally:
            self._draining = False
        self._drained = (self._drained or []) + outputs

    def has_unfinished_requests(self) -> bool:
        return super().has_unfinished_requests() or bool(self._drained) or self._inflight is not None

    def abort(self, request_id: str) -> RequestOutput | None:
        self._drain()
        if self._drained and request_id in self.requests:  # its progress, superseded by its end
            self._drained = [out for out in self._drained if out.request_id != request_id]
        return super().abort(request_id)

    def _graph_for(self, speculate: bool) -> StepGraph | ChannelGraph:
        """The graph over the current actors (built again only when one was replaced, or the
        draft left or came back, or a step failed)."""
        assert self.group is not None and self.core_client is not None
        if not self.group.workers:
            raise ShardLost("the target group is being replaced")
        draft = self.drafter_client.actor if speculate and self.drafter_client is not None else None
        key = graph_key(self.core_client.actor, self.group.workers, draft)
        if self._graph is None or self._graph.key != key:
            self._drop_graph()
            if self.relayed:
                self._graph = ChannelGraph(self.core_client.actor, self.group.workers, draft)
                return self._graph
            timeout = self.config.parallel.collective_timeout_s + 60.0
            self._graph = StepGraph(self.core_client.actor, self.group.workers, draft, timeout)
            self.num_graph_compiles += 1
        return self._graph

    def _drop_graph(self) -> None:
        if self._graph is not None:
            self._graph.teardown()
            self._graph = None

    def _diagnose(self, error: Exception) -> Exception:
        """A compiled step failed: tear the graph down and name the lost actor (``ShardLost``,
        ``CoreLost``, ``DraftLost``), or return ``error`` itself if every actor is there."""
        in_graph = self._graph is not None and self._graph.has_draft
        self._drop_graph()
        if isinstance(error, self.engine_faults):
            return error
        assert self.group is not None and self.core_client is not None
        if not alive(self.group.workers):
            return ShardLost(f"a target shard died: {error}")
        if self.core_client.restarted(timeout_s=60.0):
            return self.core_client.lost(f"the KV-block manager was lost: {error}")
        drafter = self.drafter_client
        if drafter is not None and in_graph and (
            lost_actor(error) == actor_key(drafter.actor) or drafter.restarted(timeout_s=5.0)
        ):
            drafter.lost()
            return DraftLost(f"the draft actor was lost: {error}")
        return error

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
        self._drain()
        if self.core_client is not None:
            try:
                self.core_client.flush()
            except CoreLost:
                self.core_client.recover(self._unfinished())
        if self.drafter_client is not None:
            self.drafter_client.flush()

    def check_consistent(self) -> CoreStats:
        """Block accounting of the KV-block manager (raises if a reference leaked); its
        counts after the check."""
        assert self.core_client is not None
        self._drain()
        return self.core_client.check_consistent()

    def shutdown(self) -> None:
        self._closed.set()
        if self._idle_reaper is not None and self._idle_reaper is not threading.current_thread():
            self._idle_reaper.join()
        with self._graph_lock:
            self._inflight = None
            self._drop_graph()
        for part in (self.group, self.drafter_client, self.core_client):
            if part is not None:
                part.shutdown()
        self.group = self.drafter_client = self.core_client = None


def AsyncRayEngine(config: EngineConfig, **kwargs: Any) -> Any:  # noqa: N802 — a factory
    """The serving layer's ``AsyncLLMEngine`` (asyncio streaming, aborts, queue limits) driving a
    ``RayEngine`` on its engine thread."""
    return AsyncLLMEngine(lambda: RayEngine(config), **kwargs)
