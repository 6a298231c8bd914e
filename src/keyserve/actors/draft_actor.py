"""The draft model as a Ray actor (thin, around ``engine.drafter.Drafter``), and the
engine-side client that keeps its per-step message small.

The actor holds the draft weights, its paged KV and block manager, and a shadow of every target
sequence's tokens, so each ``propose`` call carries per sequence only the tokens that are new
since the last call. It returns the draft tokens (small, read by the engine) and the draft
probabilities: over the step channel both come to the engine, which sends the probabilities
on to rank 0 over its channel; by Ray call they are two objects, the probabilities passed by
reference straight to the target's rank 0. It may be
placed on another node than the target group (``ParallelConfig.draft_resources``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import ray
import torch
from ray.exceptions import RayError

from keyserve.actors.common import ACTOR_LOST, actor_runtime_env, alive, kill_actor, new_incarnation, open_channels
from keyserve.actors.compute_thread import ComputeThread
from keyserve.actors.relay import Relay
from keyserve.actors.step_channel import ChannelClient, ChannelClosed, ChannelEndpoint, encode, gather
from keyserve.config import LOOKUP_ONLY_DRAFTS, ParallelConfig
from keyserve.core.sampling_params import SamplingParams
from keyserve.core.sequence import Sequence
from keyserve.engine import build
from keyserve.engine.drafter import DraftBudget, Proposal
from keyserve.engine.step_input import StepInput, attach_drafts

log = logging.getLogger(__name__)


@dataclass
class DraftActorArgs:
    draft: str  # what SpeculativeConfig.draft names
    target_dir: str  # the target's resolved directory (tokenizer, embeddings, vocab)
    dtype: str
    device: str
    num_blocks: int
    block_size: int
    seed: int
    budget: DraftBudget = field(default_factory=DraftBudget)  # the draft's own KV budget
    graph_rows: int = 0  # CUDA graphs of its decode steps (build.build_drafter)
    max_model_len: int | None = None
    draft_dtype: str = "auto"  # SpeculativeConfig.draft_dtype (build.resolve_draft_dtype)
    lookup: tuple[int, int] | None = None  # prompt lookup's n-gram sizes (drafter.draft_lookup)
    confidence: float = 0.0  # SpeculativeConfig.draft_confidence_threshold
    threads: int | None = None  # torch threads (ParallelConfig.draft_threads); None: as Ray starts it


@dataclass
class DraftEntry:
    seq_id: int
    base: int  # tokens of the target the actor already has (it keeps the first `base`)
    tail: list[int]  # the target's tokens after those
    num_draft: int


@dataclass
class DraftBatch:
    entries: list[DraftEntry]
    # new seq_id -> (request, params, sample, arrival, prompt tokens)
    infos: dict[int, tuple[str, SamplingParams, int, float, int]]
    released: list[int] = field(default_factory=list)
    incarnation: str | None = None  # the actor the client believes it talks to
    # seq_id -> the tree of drafts it verifies this step (its parents, core/spec_tree.py); the
    # others draft chains
    trees: dict[int, list[int]] = field(default_factory=dict)


@dataclass
class DraftTokens:
    token_ids: torch.Tensor  # [num_seqs, max_k] int64
    num_draft: torch.Tensor  # [num_seqs] int64
    incarnation: str
    resync: bool = False  # the actor restarted: nothing proposed, send full tokens again
    failed: bool = False  # drafting raised: nothing proposed, the shadows were dropped
    parents: torch.Tensor | None = None  # [num_seqs, max_k + 1] int64 trees' parents, or None: chains
    copied: torch.Tensor | None = None  # [num_seqs] bool: rows prompt lookup drafted, or None: none


class DraftActor:
    """Applied ``ray.remote`` by ``RemoteDrafter``."""

    def __init__(self, args: DraftActorArgs) -> None:
        if args.threads:
            torch.set_num_threads(args.threads)
        self.compute = ComputeThread()  # every torch call of this actor, on one thread
        self.worker, self.weight_bytes = self.compute.run(self._build, args)
        self.targets: dict[int, Sequence] = {}
        self.incarnation = new_incarnation()
        self.endpoint = ChannelEndpoint(self.compute)  # the plain path's step channel (step_channel.py)
        self.relay = Relay()  # the relayed step's next hop: the shards (channel_graph.py)
        self.num_relayed = 0  # relayed steps that went by this actor (a step nobody drafts in skips it)

    @staticmethod
    def _build(args: DraftActorArgs) -> tuple:
        torch.manual_seed(args.seed)
        device = build.resolve_device(args.device)
        dtype = build.resolve_draft_dtype(args.draft_dtype, build.resolve_dtype(args.dtype, device.type), device.type)
        target = build.draft_target(args.target_dir, dtype, device)
        return build.build_drafter(
            args.draft, args.budget, target, args.num_blocks, args.block_size, dtype, device,
            graph_rows=args.graph_rows, max_model_len=args.max_model_len, lookup=args.lookup,
            confidence=args.confidence,
        )

    def ready(self) -> tuple[str, int]:
        return self.incarnation, self.weight_bytes

    def channel_address(self, token: bytes) -> tuple[str, int]:
        """Open (once per engine client) the socket the plain step path proposes over."""
        return self.endpoint.open(ray.util.get_node_ip_address(), token,
                                  {"propose": self.propose, "relay_propose": self.relay_propose})

    def relay_to(self, token: bytes, kind: str, addresses: list[tuple[str, int]]) -> None:
        """Connect the relayed step's next hop (the target shards)."""
        with self.endpoint.lock:
            self.relay.connect(token, kind, addresses)

    def relay_propose(self, step: StepInput | None, batch: DraftBatch) -> tuple[StepInput | None, DraftTokens]:
        """The relayed step's draft hop: ``graph_propose``, the step and the probabilities
        handed to the shards before the engine gets the drafts and the step."""
        step, probs, drafts = self.graph_propose(step, batch)
        self.relay.to_shards(step, probs)
        self.num_relayed += 1
        return step, drafts

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def propose(self, batch: DraftBatch) -> tuple[DraftTokens, torch.Tensor | None]:
        return self.compute.run(self._propose, batch)  # one at a time, whoever asks

    def _propose(self, batch: DraftBatch) -> tuple[DraftTokens, torch.Tensor | None]:
        self._release(batch.released)
        if batch.incarnation not in (None, self.incarnation):
            return self._nothing(resync=True), None
        targets = self._sync(batch)
        if batch.trees:  # the engine asks for trees and chains in separate calls
            proposal = self.worker.propose_tree(targets, [list(batch.trees[t.seq_id]) for t in targets])
        else:
            proposal = self.worker.propose(targets, [e.num_draft for e in batch.entries])
        return (DraftTokens(proposal.token_ids, proposal.num_draft, self.incarnation, parents=proposal.parents,
                            copied=proposal.copied), proposal.probs)

    def graph_propose(
        self, step: StepInput | None, batch: DraftBatch,
    ) -> tuple[StepInput | None, torch.Tensor | None, DraftTokens]:
        """The compiled step's draft node: bring the shadows of ``batch`` up to date, draft for
        the items the KV-block manager reserved lookahead for, and write the drafts into the
        step the shards read. Returns the step, the draft probabilities (rank 0 reads them;
        [num_verify, max_draft, vocab]) and the tokens (the engine reads them)."""
        return self.compute.run(self._graph_propose, step, batch)

    def _graph_propose(
        self, step: StepInput | None, batch: DraftBatch,
    ) -> tuple[StepInput | None, torch.Tensor | None, DraftTokens]:
        self._release(batch.released)
        if batch.incarnation not in (None, self.incarnation):
            return step, None, self._nothing(resync=True)
        # a multi-step round's lookahead is the shards' own extra steps, not slots for drafts
        verify = [it for it in step.items if it.num_lookahead] if step is not None and not step.multi_step else []
        trees = [it for it in verify if it.seq_id in batch.trees]
        chains = [it for it in verify if it.seq_id not in batch.trees] if trees else verify
        try:
            targets = {t.seq_id: t for t in self._sync(batch)}
            if not verify:
                return step, None, self._nothing()
            grown = None
            if trees:  # trees of drafts (core/spec_tree.py), as LLMEngine._propose asks for them
                grown = self.worker.propose_tree([targets[it.seq_id] for it in trees],
                                                 [list(batch.trees[it.seq_id]) for it in trees])
            proposal = self.worker.propose([targets[it.seq_id] for it in chains],
                                           [it.num_lookahead for it in chains]) if chains else None
        except Exception:  # noqa: BLE001 — the step decodes without drafts (as in LLMEngine._propose)
            log.warning("drafting failed; this step decodes without drafts", exc_info=True)
            self._release([e.seq_id for e in batch.entries])
            return step, None, self._nothing(failed=True)
        if grown is not None:
            attach_drafts(trees, grown.token_ids, grown.num_draft, grown.parents)
        if proposal is None:
            return step, None, DraftTokens(grown.token_ids, grown.num_draft, self.incarnation, parents=grown.parents)
        attach_drafts(chains, proposal.token_ids, proposal.num_draft, copied=proposal.copied)
        return step, proposal.probs, DraftTokens(proposal.token_ids, proposal.num_draft, self.incarnation,
                                                 copied=proposal.copied)

    def _nothing(self, resync: bool = False, failed: bool = False) -> DraftTokens:
        return DraftTokens(torch.zeros(0, 0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64),
                           self.incarnation, resync=resync, failed=failed)

    def _sync(self, batch: DraftBatch) -> list[Sequence]:
        """The actor's shadow of each entry's target sequence, brought up to the engine's tokens."""
        targets = []
        for entry in batch.entries:
            target = self.targets.get(entry.seq_id)
            if target is None:
                request_id, params, sample_index, arrival, num_prompt = batch.infos[entry.seq_id]
                target = Sequence(request_id, entry.tail[:num_prompt], params, arrival=arrival,
                                  sample_index=sample_index, seq_id=entry.seq_id)
                target.output_token_ids = entry.tail[num_prompt:]
                self.targets[entry.seq_id] = target
            else:  # the prompt never changes; keep the engine's prompt/output split
                n = target.num_prompt_tokens
                del target.output_token_ids[max(0, entry.base - n) :]
                target.output_token_ids.extend(entry.tail[max(0, n - entry.base) :])
            targets.append(target)
        return targets

    def release(self, seq_ids: list[int]) -> None:
        self.compute.run(self._release, seq_ids)

    def _release(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            target = self.targets.pop(seq_id, None)
            if target is not None:
                self.worker.release(target)

    def stats(self) -> dict[str, int]:
        with self.endpoint.lock:
            bm = getattr(self.worker, "block_manager", None)  # none with draft="ngram"
            return {"num_blocks": bm.num_blocks if bm else 0, "num_free_blocks": bm.num_free_blocks if bm else 0,
                    "num_mirrors": len(self.worker.mirrors), "num_relayed": self.num_relayed,
                    "torch_threads": torch.get_num_threads()}


class RemoteDrafter:
    """The engine's drafter when the draft is an actor: same ``propose``/``release`` as
    ``Drafter``. If the actor is lost, it proposes nothing (the engine decodes without
    speculation) until the actor is back -- restarted by Ray, or recreated here."""

    def __init__(self, args: DraftActorArgs, parallel: ParallelConfig, num_gpus: float) -> None:
        self.args, self.parallel, self.num_gpus = args, parallel, num_gpus
        self.actor = self._create()
        self.incarnation, self.weight_bytes = ray.get(self.actor.ready.remote())
        self._seen: dict[int, int] = {}  # seq_id -> tokens the actor has for it
        self._released: list[int] = []
        self._ready_ref: ray.ObjectRef | None = None
        self.num_losses = 0
        self.channel: ChannelClient | None = None  # opened at the first plain-path proposal

    def _create(self):
        p = self.parallel
        return ray.remote(DraftActor).options(
            num_cpus=p.draft_num_cpus, num_gpus=self.num_gpus, resources=dict(p.draft_resources),
            max_restarts=p.max_restarts, runtime_env=actor_runtime_env(p.actor_niceness),
        ).remote(self.args)

    @property
    def available(self) -> bool:
        if self._ready_ref is None:
            return True
        ready, _ = ray.wait([self._ready_ref], timeout=0)
        if not ready:
            return False
        try:
            self.incarnation, _ = ray.get(self._ready_ref)
        except ACTOR_LOST:  # out of restarts: a new actor
            self.actor = self._create()
            self._ready_ref = self.actor.ready.remote()
            return False
        self._ready_ref = None
        self._seen.clear()
        self._released.clear()
        return True

    def lost(self) -> None:
        """Propose nothing until the actor answers ``ready`` again (restarted or recreated)."""
        self.num_losses += 1
        self.close_channel()  # bound to the lost process
        self._ready_ref = self.actor.ready.remote()

    def restarted(self, timeout_s: float) -> bool:
        """Whether the actor is gone, silent for ``timeout_s``, or another incarnation."""
        try:
            incarnation, _ = ray.get(self.actor.ready.remote(), timeout=timeout_s)
        except RayError:
            return True
        return incarnation != self.incarnation

    @property
    def supports_trees(self) -> bool:
        """Trees of drafts (``Drafter.supports_trees``) on one target shard: only the driver
        rank verifies, and only it could move an accepted path's KV."""
        return (self.parallel.tensor_parallel_size == 1 and self.args.budget.policy == "full"
                and self.args.draft not in LOOKUP_ONLY_DRAFTS)

    def propose(self, targets: list[Sequence], num_draft: list[int],
                trees: dict[int, list[int]] | None = None) -> Proposal:
        for _ in range(2):  # a second time only after the actor was found restarted
            batch = self._batch(targets, num_draft, trees)
            try:
                tokens, probs = self._call(batch)
            except (ChannelClosed, *ACTOR_LOST):
                self.lost()
                break
            if not tokens.resync:
                for seq in targets:
                    self._seen[seq.seq_id] = seq.num_tokens
                return Proposal(tokens.token_ids, probs, tokens.num_draft, tokens.parents,  # type: ignore[arg-type]
                                tokens.copied)
            self.incarnation = tokens.incarnation
            self._seen.clear()
        k = max(num_draft, default=0)
        return Proposal(torch.zeros(len(targets), k, dtype=torch.int64), None,  # type: ignore[arg-type]
                        torch.zeros(len(targets), dtype=torch.int64),
                        torch.full((len(targets), k + 1), -1, dtype=torch.int64) if trees else None)

    def propose_tree(self, targets: list[Sequence], trees: list[list[int]]) -> Proposal:
        """``Drafter.propose_tree`` in the actor."""
        return self.propose(targets, [len(t) - 1 for t in trees],
                            {seq.seq_id: tree for seq, tree in zip(targets, trees)})

    def _call(self, batch: DraftBatch) -> tuple[DraftTokens, torch.Tensor | ray.ObjectRef | None]:
        """One proposal: over the step channel, the probabilities come back as a tensor (rank 0
        gets them over its own); by Ray call they stay an object reference, passed actor to
        actor."""
        if not self.parallel.step_channels:
            tokens_ref, probs_ref = self.actor.propose.options(num_returns=2).remote(batch)
            return ray.get(tokens_ref), probs_ref
        if self.channel is None:
            (self.channel,) = open_channels([self.actor])
        self.channel.send(encode(("propose", (batch,))))
        return gather([self.channel], lambda: alive([self.actor]))[0]

    def close_channel(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None

    def _batch(self, targets: list[Sequence], num_draft: list[int],
               trees: dict[int, list[int]] | None = None) -> DraftBatch:
        entries, infos = [], {}
        for seq, n in zip(targets, num_draft):
            base = self._seen.get(seq.seq_id)
            if base is None:
                infos[seq.seq_id] = (seq.request_id, seq.params, seq.sample_index, seq.arrival,
                                     seq.num_prompt_tokens)
                base = 0
            entries.append(DraftEntry(seq.seq_id, base, seq.token_ids[base:], n))
        released, self._released = self._released, []
        return DraftBatch(entries, infos, released, self.incarnation, dict(trees or {}))

    def graph_batch(self, targets: list[Sequence], trees: dict[int, list[int]] | None = None) -> DraftBatch:
        """A compiled step's draft input: the new tokens of every sequence that may draft
        (the KV-block manager picks which do, in the same step), and the trees of those the
        engine wants to verify one (``SpeculativeDecoder.trees``)."""
        return self._batch(targets, [0] * len(targets), trees)

    def graph_failed(self, batch: DraftBatch) -> None:
        """The step of ``batch`` failed, maybe before the actor read it: its releases go again
        (releasing twice is harmless)."""
        self._released = batch.released + self._released

    def graph_done(self, tokens: DraftTokens, targets: list[Sequence]) -> None:
        """What the draft node answered for ``graph_batch(targets)``: the shadows it now holds."""
        if tokens.resync:
            self.incarnation = tokens.incarnation
            self._seen.clear()
        elif tokens.failed:
            for seq in targets:
                self._seen.pop(seq.seq_id, None)
        else:
            for seq in targets:
                self._seen[seq.seq_id] = seq.num_tokens

    @property
    def has_releases(self) -> bool:
        """Finished sequences whose shadows and KV the actor still holds (sent with the next
        proposal, or by ``flush``)."""
        return bool(self._released)

    def release(self, seq: Sequence) -> None:
        """Sent with the next proposal (no round trip of its own)."""
        if self._seen.pop(seq.seq_id, None) is not None:
            self._released.append(seq.seq_id)

    def flush(self) -> None:
        if self._released and self._ready_ref is None:
            self.actor.release.remote(self._released)
            self._released = []

    def stats(self) -> dict[str, int]:
        return ray.get(self.actor.stats.remote())

    def shutdown(self) -> None:
        self.close_channel()
        kill_actor(self.actor)
