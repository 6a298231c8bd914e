"""The tensor-parallel target group: a placement group and one ``TargetShardActor`` actor per shard.

``execute`` is the model runner's interface over Ray: the step's one ``StepInput`` goes to every
rank (encoded once and sent over each shard's step channel, or put once in the object store
for Ray calls), the draft probabilities (an object ref straight from the draft actor, by Ray
call) to rank 0 only, and one wait collects the step -- no per-token or per-layer round trips. A failed shard poisons the group's collectives, so the group is replaced as a whole.
"""

from __future__ import annotations

import ray
import torch
from ray.exceptions import GetTimeoutError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from keyserve.actors.common import ACTOR_LOST, ShardLost, actor_runtime_env, alive, kill_actor, open_channels
from keyserve.actors.relay import send_to_shards
from keyserve.actors.step_channel import ChannelClient, ChannelClosed, gather
from keyserve.actors.target_shard_actor import TargetShardActor, ShardArgs, check_tp_fits
from keyserve.config import ParallelConfig
from keyserve.engine.step_input import RunnerOp, StepInput, StepOutput
from keyserve.model.config import ModelConfig

PLACEMENT_TIMEOUT_S = 120.0


def worker_gpus(parallel: ParallelConfig, device: str) -> float:
    if parallel.worker_num_gpus is not None:
        return parallel.worker_num_gpus
    has_gpu = ray.cluster_resources().get("GPU", 0) > 0
    return 1.0 if device != "cpu" and has_gpu else 0.0


class TargetGroup:
    def __init__(self, args: ShardArgs, parallel: ParallelConfig, arch: ModelConfig, start: bool = True) -> None:
        """Reserves the shards' placement group; ``start=False`` leaves starting the shards to
        ``start()`` (the engine starts them beside the draft and KV-manager actors)."""
        self.tp = parallel.tensor_parallel_size
        check_tp_fits(arch, self.tp, args.model_dir)
        self.args, self.parallel = args, parallel
        self.num_gpus = worker_gpus(parallel, args.device)
        bundle = {"CPU": parallel.worker_num_cpus, **parallel.worker_resources}
        if self.num_gpus:
            bundle["GPU"] = self.num_gpus
        self.pg = placement_group([dict(bundle) for _ in range(self.tp)], strategy=parallel.placement_strategy)
        try:
            ray.get(self.pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except GetTimeoutError:
            remove_placement_group(self.pg)
            raise RuntimeError(
                f"cannot place {self.tp} target shards of {bundle} with {parallel.placement_strategy}; "
                f"the cluster has {ray.available_resources()} available"
            ) from None
        self.workers: list = []
        self.channels: list[ChannelClient] = []  # one per shard (ParallelConfig.step_channels)
        # The driver's own calls to the shards (``execute``); a graph path sends every step its
        # own way and turns them off (``drop_channels``), so no shard keeps an idle socket.
        self.wants_channels = parallel.step_channels
        self.weight_bytes = 0
        self._ops: list[RunnerOp] = []
        self.num_restarts = 0
        if start:
            self._start()

    def start(self) -> None:
        """Start the shards and wait until they are set up (after ``start=False``)."""
        self._start()

    def _start(self) -> None:
        cls = ray.remote(TargetShardActor)
        p = self.parallel
        self.workers = [
            cls.options(
                num_cpus=p.worker_num_cpus,
                num_gpus=self.num_gpus,
                resources=dict(p.worker_resources),
                max_restarts=0,  # a lone restarted shard cannot rejoin the process group
                runtime_env=actor_runtime_env(p.actor_niceness),
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i),
                name=None,
            ).remote(i, self.tp, self.args)
            for i in range(self.tp)
        ]
        try:
            host, port = ray.get(self.workers[0].master_address.remote())
            self.weight_bytes = sum(ray.get([w.setup.remote(host, port) for w in self.workers]))
            if self.wants_channels:
                self.channels = open_channels(self.workers)
        except BaseException:
            self._kill()
            raise

    # ------------------------------------------------------- runner interface
    def apply_ops(self, ops: list[RunnerOp]) -> dict[int, tuple[int, int]]:
        """Ops ride along with the next step (the shards apply them before anything else)."""
        self._ops += ops
        return {}

    def execute(
        self,
        step: StepInput,
        draft_probs: torch.Tensor | ray.ObjectRef | None = None,  # [num_drafted, max_draft, vocab]
    ) -> StepOutput:
        if not self.workers:
            raise ShardLost("the target group is being replaced")
        if self._ops:
            step.ops, self._ops = self._ops + step.ops, []
        if self.channels and not isinstance(draft_probs, ray.ObjectRef):
            return self._execute_over_channels(step, draft_probs)
        arg = ray.put(step) if self.tp > 1 else step
        refs = [w.execute.remote(arg, draft_probs if i == 0 else None) for i, w in enumerate(self.workers)]
        try:
            if self.tp == 1:
                return ray.get(refs[0])
            pending = refs
            while pending:  # stop at the first failure: a dead peer may hang the others
                ready, pending = ray.wait(pending, num_returns=1)
                ray.get(ready)
            return ray.get(refs[0])
        except Exception as e:
            lost = self._lost(e)
            if lost is None:
                raise  # a real error in the step, not a lost shard
            raise lost from e

    def _execute_over_channels(
        self,
        step: StepInput,
        draft_probs: torch.Tensor | None,  # [num_drafted, max_draft, vocab]
    ) -> StepOutput:
        """The step to every shard over its channel (encoded once), each reply read as it
        comes; the first failure decides, as in ``execute``."""
        try:
            send_to_shards(self.channels, "execute", step, draft_probs)
            return gather(self.channels, lambda: alive(self.workers))[0]
        except Exception as e:
            lost = self._lost(e)
            if lost is None:
                raise  # a real error in the step, not a lost shard
            raise lost from e

    def _lost(self, error: Exception) -> ShardLost | None:
        """A failed step's ``ShardLost`` when a shard died (an actor error, a closed channel, or
        a peer that no longer answers); None when it is the step's own error."""
        if isinstance(error, (ChannelClosed, *ACTOR_LOST)) or not alive(self.workers):
            return ShardLost(f"a target shard died: {error}")
        return None

    def drop_channels(self) -> None:
        """Close the driver's step channels to the shards, now and after any restart (the
        engine runs every step through a graph; ``execute`` then goes by Ray call)."""
        self.wants_channels = False
        for channel in self.channels:
            channel.close()
        self.channels = []

    # ------------------------------------------------------------- lifecycle
    def restart(self) -> None:
        """Replace every shard (the KV is lost; the engine recomputes from tokens)."""
        self._kill()
        self._ops = []
        self.num_restarts += 1
        self._start()

    def _kill(self) -> None:
        for channel in self.channels:
            channel.close()
        self.channels = []
        for w in self.workers:
            kill_actor(w)
        self.workers = []

    def shutdown(self) -> None:
        self._kill()
        try:
            remove_placement_group(self.pg)
        except Exception:  # noqa: BLE001
            pass
