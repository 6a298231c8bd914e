"""One engine step as one Ray Compiled Graph, compiled once and re-executed every step.

    driver --request--> KV-block manager (apply commands: new requests, aborts, the previous
      step's commit; schedule) --StepInput--> draft actor (draft for the items with lookahead,
      write the drafts into the step) --StepInput, draft probs--> target shards (forward,
      all-reduce, rank 0 samples and verifies) --StepOutput--> driver

Every edge is a compiled-graph channel (shared memory on one node; Ray moves it between
nodes), so a step costs the driver one ``execute`` and one read, and each actor reads its
input as soon as the one before it wrote it: no task submission, no object-store round trip.
The driver also reads the step and the KV-block manager's answer (block counts, core stats)
and the draft tokens, for its stop checks; the commit of step n (the tokens the stop checks
kept) is the first command the KV-block manager applies in step n + 1.

A graph is bound to the actors it was compiled with: when one is lost (an actor error, or no
answer within the timeout) the engine tears it down, replaces the actor, and compiles again.
Without a draft (none configured, or the draft actor away) the graph has no draft node.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import ray
from ray.dag import InputNode, MultiOutputNode

from keyserve.actors.draft_actor import DraftBatch, DraftTokens
from keyserve.actors.kv_manager_actor import CoreRequest
from keyserve.core.cpu_count import threads_per_shard
from keyserve.engine.kv_core import CoreReply
from keyserve.engine.stats import CoreStats
from keyserve.engine.step_input import StepInput, StepOutput

log = logging.getLogger(__name__)


@dataclass
class GraphResult:
    step: StepInput | None  # as the shards ran it (drafts included); None: nothing scheduled
    answer: tuple[CoreReply, CoreStats] | None  # None: the KV-block manager restarted
    drafts: DraftTokens | None  # None: no draft node
    output: StepOutput | None  # rank 0's; None when nothing ran


def actor_key(handle: object) -> str:
    return handle._actor_id.hex()  # type: ignore[attr-defined]


class StepGraph:
    """The compiled step over one set of actors (``key`` names them)."""

    def __init__(self, core: object, workers: list, draft: object | None, timeout_s: float) -> None:
        self.key = graph_key(core, workers, draft)
        self.has_draft = draft is not None
        self.timeout_s = timeout_s
        with InputNode() as request:
            step, answer = core.graph_step.options(num_returns=2).bind(request[0])  # type: ignore[attr-defined]
            outputs = [answer]
            probs = None
            if draft is not None:
                step, probs, drafts = draft.graph_propose.options(num_returns=3).bind(  # type: ignore[attr-defined]
                    step, request[1])
                outputs.append(drafts)
            shards = [w.graph_execute.bind(step, probs if i == 0 else None) for i, w in enumerate(workers)]
            dag = MultiOutputNode([step, *outputs, *shards])
        self.dag = dag.experimental_compile()
        self._ref = None

    def run(self, request: CoreRequest, batch: DraftBatch | None) -> GraphResult:
        self.submit(request, batch)
        return self.read()

    def submit(self, request: CoreRequest, batch: DraftBatch | None) -> None:
        """Start one step (the engine reads it with ``read``)."""
        self._ref = self.dag.execute(request, batch) if self.has_draft else self.dag.execute(request)

    def read(self) -> GraphResult:
        """The submitted step's outputs (an actor error or a timeout raises)."""
        ref, self._ref = self._ref, None
        values = ray.get(ref, timeout=self.timeout_s)
        if self.has_draft:
            step, answer, drafts, output = values[:4]
        else:
            (step, answer, output), drafts = values[:3], None
        return GraphResult(step, answer, drafts, output)

    def teardown(self) -> None:
        try:
            self.dag.teardown()
        except Exception:  # noqa: BLE001 — an actor already gone; the graph is dropped anyway
            log.debug("tearing down the step graph", exc_info=True)


def use_compiled_graph(
    setting: bool | None, on_gpu: bool, cpu_count: int, tensor_parallel_size: int,
    worker_threads: int | None, has_draft: bool,
) -> bool:
    """Resolve ``ParallelConfig.compiled_graph`` (None: auto). The graph's readers busy-wait
    on their channels for the whole step: the driver, the KV-block manager and the draft actor.
    On a GPU that costs host cores nobody computes on; on a CPU whose cores the shards' threads
    take, the spinners take them back (2-core EPYC, SmolLM2, TP 1, 2 threads: the graph lost
    44 % of in-process throughput at batch 16 where plain actor calls lost 13 %, docs/ray.md).
    So on a CPU the graph is used only where the cores leave one per reader."""
    if setting is not None:
        return setting
    if on_gpu:
        return True
    threads = threads_per_shard(worker_threads, tensor_parallel_size, cpu_count)
    readers = 3 if has_draft else 2
    return cpu_count - tensor_parallel_size * threads >= readers


def lost_actor(error: BaseException) -> str | None:
    """The actor an actor error names (hex id), if it names one."""
    actor_id = getattr(error, "actor_id", None)
    return actor_id if isinstance(actor_id, str) else getattr(actor_id, "hex", lambda: None)()


def graph_key(core: object, workers: list, draft: object | None) -> tuple:
    """Which actors a graph runs on: a new actor (recreated shard group, KV-block manager or
    draft actor) needs a new graph; a restarted one keeps its handle and its key."""
    return (actor_key(core), tuple(actor_key(w) for w in workers), draft and actor_key(draft))
