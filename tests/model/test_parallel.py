"""Megatron sharding: shards' partial outputs sum to the full layer; N ranks equal 1 rank."""

from __future__ import annotations

import threading

import pytest
import torch
from hf_refs import ours_from_hf, tiny_hf
from helpers.paged_runner import PagedRunner

from keyserve.model.llama import LlamaForCausalLM
from keyserve.model.parallel import AllReduce, TPContext, kv_head_range


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def test_kv_head_partition() -> None:
    assert kv_head_range(4, TPContext(1, 2)) == (2, 2)
    assert kv_head_range(2, TPContext(3, 4)) == (1, 1)  # replicated: ranks 2, 3 hold head 1
    with pytest.raises(ValueError, match="not divisible"):
        kv_head_range(3, TPContext(0, 2))
    with pytest.raises(ValueError, match="outside"):
        TPContext(2, 2)


def test_mlp_shards_sum_to_full() -> None:
    hf = tiny_hf("llama", seed=3)
    full = ours_from_hf(hf).model.layers[1].mlp
    shards = [
        ours_from_hf(hf, tp_rank=r, tp_size=2, all_reduce=_identity).model.layers[1].mlp
        for r in range(2)
    ]
    x = torch.randn(5, 64)
    with torch.inference_mode():
        torch.testing.assert_close(sum(s(x) for s in shards), full(x), atol=1e-5, rtol=1e-5)


def test_attention_shards_sum_to_full() -> None:
    """o_proj partials of the two head halves, each over its own KV cache shard."""
    hf = tiny_hf("llama", seed=4)
    toks = torch.randint(0, 300, (13,)).tolist()

    def attn_out(model: LlamaForCausalLM) -> torch.Tensor:
        runner = PagedRunner(model, num_blocks=16, block_size=4)
        ids, pos, meta = runner.build(prefill=[(0, toks)])
        layer = model.model.layers[0]
        h = model.model.embed_tokens(ids)
        cos, sin = model.model.rotary(pos, h.dtype)
        with torch.inference_mode():  # as PagedRunner.step and the engine run
            out, _ = layer.self_attn(layer.input_layernorm(h), cos, sin, runner.kv_caches[0], meta)
            return out

    full = attn_out(ours_from_hf(hf))
    parts = [attn_out(ours_from_hf(hf, tp_rank=r, tp_size=2, all_reduce=_identity)) for r in range(2)]
    torch.testing.assert_close(parts[0] + parts[1], full, atol=1e-5, rtol=1e-5)


class ThreadAllReduce:
    """An all-reduce among threads of one process (each thread plays one rank)."""

    def __init__(self, size: int) -> None:
        self.barrier = threading.Barrier(size)
        self.slots: list[torch.Tensor | None] = [None] * size

    def hook(self, rank: int) -> AllReduce:
        def all_reduce(x: torch.Tensor) -> torch.Tensor:
            self.slots[rank] = x
            self.barrier.wait()
            total = torch.stack(self.slots).sum(0)  # same order on every rank
            self.barrier.wait()  # nobody overwrites a slot before all have read
            return total

        return all_reduce


@pytest.mark.parametrize("tp_size", [2, 4])
def test_whole_model_tp_equals_single_rank(tp_size: int) -> None:
    """Full model (prefill then decode) on tp_size threads equals tp_size 1; tp 4 replicates
    the 2 kv heads."""
    hf = tiny_hf("llama", seed=5)
    toks = torch.randint(0, 300, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    lens = {0: 14}
    reference = PagedRunner(ours_from_hf(hf)).teacher_forced({0: toks}, lens)[0]
    group = ThreadAllReduce(tp_size)
    results: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            model = ours_from_hf(hf, tp_rank=rank, tp_size=tp_size, all_reduce=group.hook(rank))
            results[rank] = PagedRunner(model, seed=rank).teacher_forced({0: toks}, lens)[0]
        except BaseException as e:  # surfaced below; a dead rank would hang the others
            errors.append(e)
            group.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(tp_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    for rank in range(tp_size):
        torch.testing.assert_close(results[rank], reference, atol=1e-5, rtol=1e-5)
    shard = ours_from_hf(hf, tp_rank=0, tp_size=tp_size, all_reduce=_identity)
    assert shard.num_kv_heads == max(1, 2 // tp_size)
