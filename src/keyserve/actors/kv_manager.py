"""The KV-block manager as a Ray actor (thin, around ``engine.kv_core.KVCore``), and the
engine-side client with ``KVCore``'s interface.

The actor is the single owner of the target's KV allocation: block tables, ref counts,
copy-on-write, the prefix-cache index, preemption and the block side of KV budgets. The engine
talks to it once per step: everything it has to say since the last step (new requests, aborts,
the previous step's accepted tokens) travels with the request for the next ``StepInput``. The
model-side ops a commit produces (forks, compactions, releases) ride in that ``StepInput``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import ray

from keyserve.actors.common import ACTOR_LOST, CoreLost, new_incarnation
from keyserve.config import ParallelConfig
from keyserve.core.sequence import FinishReason, Sequence
from keyserve.engine.build import KVCoreArgs, build_core
from keyserve.engine.kv_core import CommitResult, ScheduleResult, SeqStat, SeqUpdate
from keyserve.engine.step_input import RunnerOp, StepInput


@dataclass
class SeqView:
    request_id: str
    seq_id: int


@dataclass
class CoreView:
    """What the engine's statistics read from the scheduler and the block manager."""

    running: list[SeqView] = field(default_factory=list)
    waiting: list[SeqView] = field(default_factory=list)
    num_preemptions: int = 0
    num_blocks: int = 0
    num_free_blocks: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)


@dataclass
class StepReply:
    step: StepInput | None
    seq_stats: dict[int, SeqStat]
    view: CoreView
    incarnation: str
    resync: bool = False  # the actor restarted: it holds none of the engine's requests


Command = tuple  # ("add", seqs, pending, forced) | ("finish", seq_id, reason) | ("commit", updates) | ("reset",)


class KVManagerActor:
    """Applied ``ray.remote`` by ``RemoteCore``."""

    def __init__(self, args: KVCoreArgs) -> None:
        self.core = build_core(args)
        self.ops: list[RunnerOp] = []  # for the model side, sent with the next StepInput
        self.incarnation = new_incarnation()

    def ready(self) -> str:
        return self.incarnation

    def step(self, commands: list[Command], schedule: bool, speculate: bool, incarnation: str | None) -> StepReply:
        if incarnation not in (None, self.incarnation):
            return StepReply(None, {}, self.view(), self.incarnation, resync=True)
        stats: dict[int, SeqStat] = {}
        for command in commands:
            result = self._run(command)
            self.ops += result.ops
            stats.update(result.seq_stats)
        step = None
        if schedule:
            scheduled = self.core.schedule(speculate)
            stats.update(scheduled.seq_stats)
            step = scheduled.step
            if step is None and self.ops:  # nothing to run, but ops for the model side
                step = StepInput([], 0, step=-1)
        if step is not None:
            step.ops, self.ops = self.ops + step.ops, []
        return StepReply(step, stats, self.view(), self.incarnation)

    def _run(self, command: Command) -> CommitResult:
        kind = command[0]
        if kind == "add":
            self.core.add(*command[1:])
            return CommitResult()
        if kind == "finish":
            return self.core.finish(command[1], command[2])
        if kind == "commit":
            return self.core.commit(command[1])
        if kind == "reset":
            self.ops = []  # meant for model-side state that no longer exists
            return CommitResult(self.core.reset_model_side())
        raise ValueError(f"unknown command {kind!r}")

    def view(self) -> CoreView:
        s, bm = self.core.scheduler, self.core.block_manager
        return CoreView(
            [SeqView(q.request_id, q.seq_id) for q in s.running],
            [SeqView(q.request_id, q.seq_id) for q in s.waiting],
            s.num_preemptions, bm.num_blocks, bm.num_free_blocks, bm.prefix_queries, bm.prefix_hits,
        )

    def check_consistent(self) -> CoreView:
        self.core.check_consistent()
        return self.view()


def core_copy(seq: Sequence) -> Sequence:
    """The scheduler side's own copy of a sequence: its tokens and identity, nothing computed."""
    return Sequence(
        seq.request_id, list(seq.prompt_token_ids), seq.params, arrival=seq.arrival,
        sample_index=seq.sample_index, seq_id=seq.seq_id, output_token_ids=list(seq.output_token_ids),
        num_preemptions=seq.num_preemptions, kv_budgeted=seq.kv_budgeted,
    )


class RemoteCore:
    """``KVCore``'s interface for the engine, over the actor: ``add``, ``finish`` and ``commit``
    are queued; ``schedule`` sends them with the request for the next step (one round trip)."""

    def __init__(self, args: KVCoreArgs, parallel: ParallelConfig) -> None:
        self.args, self.parallel = args, parallel
        self.actor = self._create()
        self.incarnation: str | None = ray.get(self.actor.ready.remote())
        self.commands: list[Command] = []
        self.view = CoreView(num_blocks=args.num_blocks, num_free_blocks=args.num_blocks)
        self.num_losses = 0

    def _create(self):
        p = self.parallel
        return ray.remote(KVManagerActor).options(
            num_cpus=p.kv_manager_num_cpus, resources=dict(p.kv_manager_resources),
            max_restarts=p.max_restarts,
        ).remote(self.args)

    # ------------------------------------------------------ KVCore interface
    def add(self, seqs: list[Sequence], pending: list[Sequence] | None = None, forced: list[int] | None = None) -> None:
        self.commands.append(("add", [core_copy(s) for s in seqs], [core_copy(s) for s in pending or []], forced))

    def finish(self, seq_id: int, reason: FinishReason) -> CommitResult:
        self.commands.append(("finish", seq_id, reason))
        return CommitResult()

    def commit(self, updates: dict[int, SeqUpdate]) -> CommitResult:
        self.commands.append(("commit", updates))
        return CommitResult()

    def schedule(self, speculate: bool = True) -> ScheduleResult:
        reply = self._call(schedule=True, speculate=speculate)
        return ScheduleResult(reply.step, reply.seq_stats)

    @property
    def has_work(self) -> bool:
        return self.view.has_work or any(c[0] == "add" for c in self.commands)

    # ------------------------------------------------------------- plumbing
    def _call(self, schedule: bool, speculate: bool = False) -> StepReply:
        commands, self.commands = self.commands, []
        try:
            reply: StepReply = ray.get(self.actor.step.remote(commands, schedule, speculate, self.incarnation))
        except ACTOR_LOST as e:
            self.num_losses += 1
            raise CoreLost(f"the KV-block manager died: {e}") from e
        if reply.resync:
            self.num_losses += 1
            raise CoreLost("the KV-block manager restarted and lost its state")
        self.view = reply.view
        return reply

    def flush(self) -> dict[int, SeqStat]:
        """Send queued commands now (an idle engine: free finished requests' blocks)."""
        if not self.commands:
            return {}
        return self._call(schedule=False).seq_stats

    def recover(self, requests: list[tuple[list[Sequence], list[Sequence], list[int] | None]]) -> None:
        """Wait for the actor (restarted by Ray, or recreated), then give it back the unfinished
        work: every sequence is recomputed from its tokens."""
        try:
            self.incarnation = ray.get(self.actor.ready.remote(), timeout=300)
        except ACTOR_LOST:
            self.actor = self._create()
            self.incarnation = ray.get(self.actor.ready.remote(), timeout=300)
        self.commands = []
        for seqs, pending, forced in requests:
            self.add(seqs, pending, forced)
        self.commands.append(("reset",))

    def reset_model_side(self) -> None:
        self.commands.append(("reset",))

    def check_consistent(self) -> CoreView:
        self.flush()
        return ray.get(self.actor.check_consistent.remote())

    def shutdown(self) -> None:
        try:
            ray.kill(self.actor, no_restart=True)
        except Exception:  # noqa: BLE001
            pass


class _SchedulerView:
    """``engine.scheduler`` for statistics readers (e.g. the async engine)."""

    def __init__(self, core: RemoteCore) -> None:
        self._core = core
        self.config = core.args.scheduler

    @property
    def running(self) -> list[SeqView]:
        return self._core.view.running

    @property
    def waiting(self) -> list[SeqView]:
        return self._core.view.waiting

    @property
    def num_preemptions(self) -> int:
        return self._core.view.num_preemptions

    @property
    def has_work(self) -> bool:
        return self._core.has_work


class _BlockManagerView:
    """``engine.block_manager`` for statistics readers: counts as of the last step."""

    def __init__(self, core: RemoteCore) -> None:
        self._core = core
        self.block_size = core.args.block_size

    def __getattr__(self, name: str) -> Any:
        if name in ("num_blocks", "num_free_blocks", "prefix_queries", "prefix_hits"):
            return getattr(self._core.view, name)
        raise AttributeError(name)


def views(core: RemoteCore) -> tuple[_SchedulerView, _BlockManagerView]:
    return _SchedulerView(core), _BlockManagerView(core)
