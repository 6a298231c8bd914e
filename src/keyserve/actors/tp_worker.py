"""One tensor-parallel shard of the target model: a thin Ray actor around a ``ModelRunner``.

It joins the group's ``torch.distributed`` process group (gloo on CPU, NCCL with CUDA) at a TCP
address rank 0 picked, loads only its shard of the weights (Megatron layers slice the full
tensors as they stream in), allocates the KV cache of its own kv-heads and executes the
``StepInput`` that every rank receives each step. The LM head is vocab-parallel: each rank
projects its slice of the vocabulary and rank 0 gathers the full logits, samples, verifies and
returns; the other ranks return an empty ``StepOutput``.
"""

from __future__ import annotations

import math
import os
import socket
from pathlib import Path
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

from keyserve.engine.model_runner import ModelRunner
from keyserve.engine.step_input import StepInput, StepOutput
from keyserve.model.config import ModelConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class WorkerSpec:
    model_dir: str  # a resolved Hugging Face directory, readable on every node
    dtype: str
    device: str  # "auto", "cpu" or "cuda"
    num_blocks: int
    block_size: int
    backend: str  # "auto", "gloo" or "nccl"
    timeout_s: float
    seed: int
    threads: int | None = None


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


class VocabParallelHead:
    """Logits from this rank's rows of the LM head, gathered onto rank 0 (None elsewhere)."""

    def __init__(self, weight: torch.Tensor, rank: int, size: int) -> None:  # weight [vocab, hidden]
        self.vocab = weight.shape[0]
        self.rank, self.size = rank, size
        self.per_rank = math.ceil(self.vocab / size)
        start = min(self.vocab, rank * self.per_rank)
        self.weight = weight[start : min(self.vocab, start + self.per_rank)]

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor | None:  # [n, hidden] -> [n, vocab]
        local = F.linear(hidden, self.weight).float()
        if local.shape[1] < self.per_rank:  # the last slice of a vocab that does not divide
            local = F.pad(local, (0, self.per_rank - local.shape[1]))
        local = local.contiguous()
        if self.rank != 0:
            dist.gather(local, dst=0)
            return None
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.gather(local, parts, dst=0)
        return torch.cat(parts, dim=1)[:, : self.vocab]


def _all_reduce(x: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(x)
    return x


class TPWorker:
    """Applied ``ray.remote`` by the target group (with its placement-group options)."""

    def __init__(self, rank: int, world_size: int, spec: WorkerSpec) -> None:
        self.rank, self.world_size, self.spec = rank, world_size, spec
        threads = spec.threads or max(1, (os.cpu_count() or 1) // world_size)
        torch.set_num_threads(threads)
        self.runner: ModelRunner | None = None

    def master_address(self) -> tuple[str, int]:
        """Rank 0 picks the process group's TCP store address (a free port on its node)."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def setup(self, host: str, port: int) -> int:
        """Join the group, load this shard, allocate its KV; returns the shard's weight bytes."""
        from keyserve.engine.llm_engine import resolve_device
        from keyserve.model.kv_cache import allocate_kv_cache
        from keyserve.model.llama import LlamaForCausalLM
        from keyserve.model.weights import iter_safetensors

        spec, rank, size = self.spec, self.rank, self.world_size
        torch.manual_seed(spec.seed)  # the global RNG (unseeded sampling, Keyformer's noise)
        device = resolve_device(spec.device)
        backend = spec.backend if spec.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
        if size > 1:
            dist.init_process_group(
                backend, init_method=f"tcp://{host}:{port}", rank=rank, world_size=size,
                timeout=timedelta(seconds=spec.timeout_s),
            )
        dtype = _DTYPES[spec.dtype]
        # The weights only (what load_model does minus the tokenizer: a shard never detokenizes,
        # and importing transformers would double its start-up time).
        arch = ModelConfig.from_file(f"{spec.model_dir}/config.json")
        model = LlamaForCausalLM(arch, dtype, device, rank, size, _all_reduce if size > 1 else None)
        model.load_weights(iter_safetensors(Path(spec.model_dir)))
        model.eval()
        kv = allocate_kv_cache(arch, spec.num_blocks, spec.block_size, dtype, device, rank, size)
        head = None
        if size > 1:
            head = VocabParallelHead(model.lm_head_weight, rank, size)
            if not arch.tie_word_embeddings:  # keep only this rank's rows of an untied head
                model.lm_head_weight = torch.nn.Parameter(head.weight.clone(), requires_grad=False)
                head.weight = model.lm_head_weight
        self.runner = ModelRunner(
            model, kv, spec.block_size, arch.sliding_window, device,
            num_layers=arch.num_hidden_layers, num_kv_heads=kv[0][0].shape[2],
            logits_fn=head, is_driver=rank == 0,
        )
        return sum(p.numel() * p.element_size() for p in model.parameters())

    def execute(
        self,
        step: StepInput,
        draft_probs: torch.Tensor | None = None,  # [num_drafted, max_draft, vocab], rank 0 only
    ) -> StepOutput:
        assert self.runner is not None, "setup() first"
        return self.runner.execute(step, draft_probs)

    def ready(self) -> bool:
        return True

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()
