"""One tensor-parallel shard of the target model: a thin Ray actor around a ``ModelRunner``
(built by ``engine.build`` for this rank of the group).

It joins the group's ``torch.distributed`` process group (gloo on CPU, NCCL with CUDA) at a TCP
address rank 0 picked, loads only its shard of the weights (Megatron layers slice the full
tensors as they stream in), allocates the KV cache of its own kv-heads and executes the
``StepInput`` that every rank receives each step. The LM head is vocab-parallel: each rank
projects its slice of the vocabulary and rank 0 gathers the full logits, samples, verifies and
returns; the other ranks return an empty ``StepOutput``.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta

import ray
import torch
import torch.distributed as dist

from keyserve.actors.compute_thread import ComputeThread
from keyserve.actors.relay import Relay, hand_on
from keyserve.actors.step_channel import ChannelEndpoint
from keyserve.core.cpu_count import threads_per_shard, usable_cpus
from keyserve.engine import build
from keyserve.engine.model_runner import ModelRunner
from keyserve.engine.step_input import StepInput, StepOutput
from keyserve.model.config import ModelConfig


@dataclass
class ShardArgs:
    model_dir: str  # a resolved Hugging Face directory, readable on every node
    dtype: str
    device: str  # "auto", "cpu" or "cuda"
    num_blocks: int
    block_size: int
    backend: str  # "auto", "gloo" or "nccl"
    timeout_s: float
    seed: int
    threads: int | None = None
    graph_rows: int = 0  # CUDA graphs of decode steps (one rank only: build.build_runner)
    max_model_len: int | None = None


def check_tp_fits(config: ModelConfig, tp: int, name: str = "the model") -> None:
    """Raise a ValueError naming the dimension that ``tp`` shards cannot split evenly."""
    heads, kv, inter = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    valid = [n for n in range(1, heads + 1)
             if heads % n == 0 and inter % n == 0 and (kv % n == 0 or n % kv == 0)]
    problems = []
    if heads % tp:
        problems.append(f"{heads} attention heads are not divisible by {tp}")
    if kv % tp and tp % kv:
        problems.append(f"{kv} kv heads neither divide nor are divisible by {tp}")
    if inter % tp:
        problems.append(f"intermediate_size {inter} is not divisible by {tp}")
    if problems:
        raise ValueError(
            f"tensor_parallel_size {tp} does not fit {name}: " + "; ".join(problems)
            + f" (sizes that fit: {', '.join(map(str, valid))})"
        )


class TargetShardActor:
    """Applied ``ray.remote`` by the target group (with its placement-group options)."""

    def __init__(self, rank: int, world_size: int, args: ShardArgs) -> None:
        self.rank, self.world_size, self.args = rank, world_size, args
        threads = threads_per_shard(args.threads, world_size, usable_cpus())
        torch.set_num_threads(threads)
        self.runner: ModelRunner | None = None
        self.compute = ComputeThread()  # every torch call of this shard, on one thread
        self.endpoint = ChannelEndpoint(self.compute)  # the plain path's step channel (step_channel.py)
        self.relay = Relay()  # rank 0's: the relayed step on to the other ranks (relay.py)

    def channel_address(self, token: bytes) -> tuple[str, int]:
        """Open (once per engine client) the socket the plain step path sends steps over (and
        the relayed step graph ``graph_execute``)."""
        return self.endpoint.open(ray.util.get_node_ip_address(), token,
                                  {"execute": self.channel_execute, "graph_execute": self.graph_execute,
                                   "graph_lead": self.graph_lead})

    def relay_to(self, token: bytes, kind: str, addresses: list[tuple[str, int]]) -> None:
        """Rank 0: connect to the other ranks, to hand them each relayed step (``graph_lead``)."""
        with self.endpoint.lock:
            self.relay.connect(token, kind, addresses)

    def master_address(self) -> tuple[str, int]:
        """Rank 0 picks the process group's TCP store address (a free port on its node)."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def setup(self, host: str, port: int) -> int:
        """Join the group, load this shard, allocate its KV; returns the shard's weight bytes."""
        return self.compute.run(self._setup, host, port)

    def _setup(self, host: str, port: int) -> int:
        args, rank, size = self.args, self.rank, self.world_size
        torch.manual_seed(args.seed)  # the global RNG (unseeded sampling, Keyformer's noise)
        device = build.resolve_device(args.device)
        dtype = build.resolve_dtype(args.dtype, device.type)
        backend = args.backend if args.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
        if size > 1:
            dist.init_process_group(
                backend, init_method=f"tcp://{host}:{port}", rank=rank, world_size=size,
                timeout=timedelta(seconds=args.timeout_s),
            )
        model = build.load_target(args.model_dir, dtype, device, rank, size)
        self.runner = build.build_runner(model, args.num_blocks, args.block_size, dtype, device, rank, size,
                                         graph_rows=args.graph_rows, max_model_len=args.max_model_len)
        return build.weight_bytes(self.runner.model)

    def execute(
        self,
        step: StepInput,
        draft_probs: torch.Tensor | None = None,  # [num_drafted, max_draft, vocab], rank 0 only
    ) -> StepOutput:
        assert self.runner is not None, "setup() first"
        return self.compute.run(self.runner.execute, step, draft_probs)  # one at a time, whoever asks

    def channel_execute(
        self,
        step: StepInput,
        draft_probs: torch.Tensor | None = None,  # [num_drafted, max_draft, vocab], rank 0 only
    ) -> StepOutput | None:
        """``execute`` over the step channel: only rank 0 answers with the output."""
        out = self.execute(step, draft_probs)
        return out if self.rank == 0 else None

    def graph_execute(
        self,
        step: StepInput | None,
        draft_probs: torch.Tensor | None = None,  # [num_verify, max_draft, vocab], rank 0 only
    ) -> StepOutput | None:
        """The compiled step's shard node: nothing when the KV-block manager scheduled nothing;
        only rank 0 answers (the others' output is empty)."""
        if step is None:
            return None
        out = self.execute(step, draft_probs)
        return out if self.rank == 0 else None

    def graph_lead(
        self,
        frame: bytes,  # the other ranks' encoded ``graph_execute(step, None)``
        draft_probs: torch.Tensor | None = None,  # [num_verify, max_draft, vocab]
    ) -> StepOutput | None:
        """Rank 0's relayed step: handed on to the other ranks before it runs here, so that
        every rank has it or none does (``relay.py``)."""
        return self.graph_execute(hand_on(self.relay, frame), draft_probs)  # type: ignore[arg-type]

    def ready(self) -> bool:
        return True

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()
