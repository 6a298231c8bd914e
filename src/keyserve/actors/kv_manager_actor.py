"""The KV-block manager as a Ray actor (thin, around ``engine.kv_core.KVCore``), and the
engine-side client with ``KVCore``'s interface.

The actor is the single owner of the target's KV allocation: block tables, ref counts,
copy-on-write, the prefix-cache index, preemption and the block side of KV budgets. The engine
talks to it once per step: everything it has to say since the last step (new requests, aborts,
the previous step's accepted tokens) travels with the request for the next ``StepInput``. The
model-side ops a commit produces (forks, compactions, releases) ride in that ``StepInput``.
"""

from __future__ import annotations

from dataclasses import dataclass

import ray
from ray.exceptions import RayError

from keyserve.actors.common import (
    ACTOR_LOST, CoreLost, actor_runtime_env, alive, kill_actor, new_incarnation, open_channels,
)
from keyserve.actors.relay import DRAFT, Relay
from keyserve.actors.step_channel import ChannelClient, ChannelClosed, ChannelEndpoint, encode, gather
from keyserve.config import ParallelConfig
from keyserve.core.sequence import FinishReason, Sequence
from keyserve.engine.build import KVCoreArgs, build_core
from keyserve.engine.kv_core import CoreReply, SeqStat
from keyserve.engine.stats import CoreStats
from keyserve.engine.step_input import RunnerOp, StepInput, StepOutput

Command = tuple  # ("add", seqs, pending, forced) | ("finish", seq_id, reason) | ("commit", output) | ("reset",)
Batch = tuple[int, list[Command]]  # (number, commands): the engine's commands between two calls


class KVManagerActor:
    """Applied ``ray.remote`` by ``RemoteCore``."""

    def __init__(self, args: KVCoreArgs) -> None:
        self.core = build_core(args)
        self.ops: list[RunnerOp] = []  # for the model side, sent with the next StepInput
        self.incarnation = new_incarnation()
        self.applied = -1  # the last command batch applied (a batch may arrive twice)
        self.endpoint = ChannelEndpoint()  # the plain path's step channel (step_channel.py)
        self.relay = Relay()  # where a relayed step goes next (channel_graph.py)

    def ready(self) -> str:
        return self.incarnation

    def channel_address(self, token: bytes) -> tuple[str, int]:
        """Open (once per engine client) the socket the plain step path calls ``step`` over
        (and the relayed step graph ``relay_step``)."""
        return self.endpoint.open(ray.util.get_node_ip_address(), token,
                                  {"step": self.step, "relay_step": self.relay_step})

    def relay_to(self, token: bytes, kind: str, addresses: list[tuple[str, int]]) -> None:
        """Connect the relayed step's next hop: the draft actor or the target shards."""
        with self.endpoint.lock:
            self.relay.connect(token, kind, addresses)

    def relay_step(
        self, request: "CoreRequest", batch: object | None,
    ) -> tuple[StepInput | None, tuple[CoreReply, CoreStats] | None]:
        """The relayed step's first hop: ``graph_step``, the step handed on (with the engine's
        draft batch, to the draft actor; without one, a step nobody drafts in, to the shards)
        before the engine gets the answer."""
        with self.endpoint.lock:
            step, reply = self._graph_schedule(request)
            if batch is not None and self.relay.has(DRAFT):
                self.relay.to_draft(step, batch)
            else:
                self.relay.to_shards(step)
            return step, self._with_counts(reply)

    def step(
        self, batches: list[Batch], schedule: bool, lookahead: dict[int, int] | None,
        incarnation: str | None, multi_step: bool = False,
    ) -> tuple[CoreReply, CoreStats] | None:
        """Apply the queued command batches (each once: a step that failed after this actor
        read it is sent again), then (``schedule``) the next step with the model-side ops
        accumulated since the last one, and the core's counts. ``lookahead``: the draft tokens
        the engine's speculative policy wants per sequence, or the extra decode steps of a
        multi-step round (``multi_step``, ``KVCore.schedule``). None: this actor restarted and holds none of the engine's requests (``incarnation`` is not its own)."""
        with self.endpoint.lock:  # the channel's thread or Ray's, one at a time
            reply = self._step(batches, schedule, lookahead, incarnation, multi_step)
            return self._with_counts(reply)

    def _step(
        self, batches: list[Batch], schedule: bool, lookahead: dict[int, int] | None,
        incarnation: str | None, multi_step: bool = False,
    ) -> CoreReply | None:
        if incarnation not in (None, self.incarnation):
            return None
        stats: dict[int, SeqStat] = {}
        for number, commands in batches:
            if number <= self.applied:
                continue
            self.applied = number
            for command in commands:
                result = self._run(command)
                self.ops += result.ops
                stats.update(result.seq_stats)
        step = None
        if schedule:
            scheduled = self.core.schedule(lookahead, multi_step)
            stats.update(scheduled.seq_stats)
            step = scheduled.step
            if step is None and self.ops:  # nothing to run, but ops for the model side
                step = StepInput([], 0, step=-1)
        if step is not None:
            step.ops, self.ops = self.ops + step.ops, []
        return CoreReply(step, seq_stats=stats)

    def graph_step(
        self, request: "CoreRequest",
    ) -> tuple[StepInput | None, tuple[CoreReply, CoreStats] | None]:
        """The compiled step's first node: ``step`` with the engine's queued commands, the
        step split off for the model side (the draft actor or the shards read it) from the rest
        for the engine. (None, None): this actor restarted (see ``step``)."""
        with self.endpoint.lock:
            step, reply = self._graph_schedule(request)
            return step, self._with_counts(reply)

    def _with_counts(self, reply: CoreReply | None) -> tuple[CoreReply, CoreStats] | None:
        """A reply as the engine reads it, with the core's counts (None: this actor restarted)."""
        return None if reply is None else (reply, self.core.stats())

    def _graph_schedule(self, request: "CoreRequest") -> tuple[StepInput | None, CoreReply | None]:
        """``graph_step`` without the core's counts (the relay takes them after handing the
        step on)."""
        reply = self._step(request.batches, True, request.lookahead, request.incarnation, request.multi_step)
        if reply is None:
            return None, None
        step, reply.step = reply.step, None
        return step, reply

    def _run(self, command: Command) -> CoreReply:
        kind = command[0]
        if kind == "add":
            self.core.add(*command[1:])
            return CoreReply()
        if kind == "finish":
            return self.core.finish(command[1], command[2])
        if kind == "commit":
            return self.core.commit(command[1])
        if kind == "reset":
            self.ops = []  # meant for model-side state that no longer exists
            return CoreReply(ops=self.core.reset_model_side())
        raise ValueError(f"unknown command {kind!r}")

    def waiting_request_ids(self) -> list[str]:
        with self.endpoint.lock:
            return self.core.waiting_request_ids()

    def check_consistent(self) -> CoreStats:
        with self.endpoint.lock:
            self.core.check_consistent()
            return self.core.stats()


@dataclass
class CoreRequest:
    """What the engine sends the KV-block manager per compiled step (``KVManagerActor.step``'s
    arguments). The model-side ops all come from the actor itself (``RemoteCore``'s replies
    carry none), so nothing else rides along."""

    batches: list[Batch]
    lookahead: dict[int, int] | None
    incarnation: str | None
    multi_step: bool = False  # the lookahead is a multi-step round's extra decode steps


def core_copy(seq: Sequence) -> Sequence:
    """The scheduler side's own copy of a sequence: its tokens and identity (its KV budget
    included), nothing computed."""
    return Sequence(
        seq.request_id, list(seq.prompt_token_ids), seq.params, arrival=seq.arrival,
        sample_index=seq.sample_index, seq_id=seq.seq_id, output_token_ids=list(seq.output_token_ids),
        num_preemptions=seq.num_preemptions, kv_budget=seq.kv_budget,
    )


class RemoteCore:
    """``KVCore``'s interface for the engine, over the actor: ``add``, ``finish`` and ``commit``
    are queued; ``schedule`` sends them with the request for the next step (one round trip, over
    the actor's step channel unless ``ParallelConfig.step_channels`` is off)."""

    def __init__(self, args: KVCoreArgs, parallel: ParallelConfig) -> None:
        self.args, self.parallel = args, parallel
        self.actor = self._create()
        self.incarnation: str | None = ray.get(self.actor.ready.remote())
        self.commands: list[Command] = []
        # Sent but not answered (the call or graph failed): sent again, applied once.
        self.unanswered: list[Batch] = []
        self.num_batches = 0
        self.last_stats = CoreStats(args.num_blocks, args.num_blocks, args.block_size)  # as of the last call
        self.num_losses = 0
        self.channel: ChannelClient | None = None  # opened at the first plain-path call

    def _create(self):
        p = self.parallel
        return ray.remote(KVManagerActor).options(
            num_cpus=p.kv_manager_num_cpus, resources=dict(p.kv_manager_resources),
            max_restarts=p.max_restarts, runtime_env=actor_runtime_env(p.actor_niceness),
        ).remote(self.args)

    # ------------------------------------------------------ KVCore interface
    def add(self, seqs: list[Sequence], pending: list[Sequence] | None = None, forced: list[int] | None = None) -> None:
        self.commands.append(("add", [core_copy(s) for s in seqs], [core_copy(s) for s in pending or []], forced))

    def finish(self, seq_id: int, reason: FinishReason) -> CoreReply:
        self.commands.append(("finish", seq_id, reason))
        return CoreReply()

    def commit(self, output: StepOutput) -> CoreReply:
        self.commands.append(("commit", output))
        return CoreReply()

    def schedule(self, lookahead: dict[int, int] | None = None, multi_step: bool = False) -> CoreReply:
        return self._call(schedule=True, lookahead=lookahead, multi_step=multi_step)

    def stats(self) -> CoreStats:
        """The core's counts as of the last step (they come back with every call)."""
        return self.last_stats

    def waiting_request_ids(self) -> list[str]:
        """As of the last step (queued commands stay queued); none while the actor is lost:
        the next step finds it and recovers."""
        try:
            return ray.get(self.actor.waiting_request_ids.remote())
        except ACTOR_LOST:
            return []

    # ------------------------------------------------------------- plumbing
    def _batches(self) -> list[Batch]:
        """The queued commands as a new batch, after any the actor may not have applied."""
        if self.commands:
            self.unanswered.append((self.num_batches, self.commands))
            self.num_batches += 1
            self.commands = []
        return list(self.unanswered)

    def _call(self, schedule: bool, lookahead: dict[int, int] | None = None, multi_step: bool = False) -> CoreReply:
        args = (self._batches(), schedule, lookahead, self.incarnation, multi_step)
        try:
            if not self.parallel.step_channels:
                return self.answer(ray.get(self.actor.step.remote(*args)))
            channel = self._channel()
            channel.send(encode(("step", args)))
            return self.answer(gather([channel], lambda: alive([self.actor]))[0])
        except (ChannelClosed, *ACTOR_LOST) as e:
            self.close_channel()
            raise self.lost(f"the KV-block manager died: {e}") from e

    def _channel(self) -> ChannelClient:
        """The step channel to the current actor (opened through Ray at first use)."""
        if self.channel is None:
            (self.channel,) = open_channels([self.actor])
        return self.channel

    def close_channel(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None

    def request(self, lookahead: dict[int, int] | None, multi_step: bool = False) -> CoreRequest:
        """The queued commands as a compiled step's input (``KVManagerActor.graph_step``)."""
        return CoreRequest(self._batches(), lookahead, self.incarnation, multi_step)

    def answer(self, answer: tuple[CoreReply, CoreStats] | None) -> CoreReply:
        """The actor's answer to a step (plain call or compiled graph); raises ``CoreLost``
        if the actor restarted and holds none of the engine's requests."""
        if answer is None:
            raise self.lost("the KV-block manager restarted and lost its state")
        self.unanswered = []
        reply, self.last_stats = answer
        return reply

    def lost(self, why: str) -> CoreLost:
        self.num_losses += 1
        return CoreLost(why)

    def restarted(self, timeout_s: float) -> bool:
        """Whether the actor is gone or answers as another incarnation (a fresh, empty core)."""
        try:
            return ray.get(self.actor.ready.remote(), timeout=timeout_s) != self.incarnation
        except RayError:
            return True

    def flush(self) -> dict[int, SeqStat]:
        """Send queued commands now (an idle engine: free finished requests' blocks)."""
        if not self.commands and not self.unanswered:
            return {}
        return self._call(schedule=False).seq_stats

    def recover(self, requests: list[tuple[list[Sequence], list[Sequence], list[int] | None]]) -> None:
        """Wait for the actor (restarted by Ray, or recreated), then give it back the unfinished
        work: every sequence is recomputed from its tokens."""
        self.close_channel()  # bound to the lost process
        try:
            self.incarnation = ray.get(self.actor.ready.remote(), timeout=300)
        except ACTOR_LOST:
            self.actor = self._create()
            self.incarnation = ray.get(self.actor.ready.remote(), timeout=300)
        self.commands, self.unanswered = [], []
        for seqs, pending, forced in requests:
            self.add(seqs, pending, forced)
        self.commands.append(("reset",))

    def reset_model_side(self) -> None:
        self.commands.append(("reset",))

    def check_consistent(self) -> CoreStats:
        self.flush()
        return ray.get(self.actor.check_consistent.remote())

    def shutdown(self) -> None:
        self.close_channel()
        kill_actor(self.actor)
