"""``sum_over_replicas`` across simulated ranks: four threads joined by a real barrier-based
all-reduce (each returns the sum of every rank's buffer), two kv heads, each replicated on two
consecutive ranks. Each rank must end with the sum of its own kv head's replicas' scores, in the
same per-layer (decode, prefill) structure; with no replication the scores pass through.

Mutations caught: choosing the kv head as ``rank % kv_heads`` (the replicas of kv head 0 are
ranks 0 and 1, not 0 and 2), and summing over all ranks instead of per kv head."""

from __future__ import annotations

import threading

import torch

from keyserve.engine.kv_budget.replicas import sum_over_replicas
from keyserve.model.parallel import TPContext


def _world(size: int):
    """An all-reduce for ``size`` threads: every caller gets the sum of all callers' tensors."""
    barrier = threading.Barrier(size)
    bufs: dict[int, torch.Tensor] = {}

    def make(rank: int):
        def all_reduce(x: torch.Tensor) -> torch.Tensor:
            bufs[rank] = x.clone()
            barrier.wait()
            total = sum(bufs[r] for r in range(size))
            barrier.wait()
            return total

        return all_reduce

    return make


def _scores(gen: torch.Generator) -> list:  # 2 layers: (decode [2, 1, 5], prefill [1, 1, 5]), (decode, None)
    return [(torch.rand(2, 1, 5, generator=gen), torch.rand(1, 1, 5, generator=gen)),
            (torch.rand(2, 1, 5, generator=gen), None)]


def test_each_replica_gets_its_kv_heads_sum() -> None:
    size, kv_heads = 4, 2
    gen = torch.Generator().manual_seed(0)
    mine = [_scores(gen) for _ in range(size)]
    make = _world(size)
    got: dict[int, list] = {}

    def run(rank: int) -> None:
        got[rank] = sum_over_replicas(mine[rank], TPContext(rank, size, make(rank)), kv_heads)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    for rank in range(size):
        group = [rank // 2 * 2, rank // 2 * 2 + 1]  # the ranks that hold this rank's kv head
        for layer in range(2):
            for part in range(2):
                mine_part = mine[rank][layer][part]
                if mine_part is None:
                    assert got[rank][layer][part] is None
                    continue
                want = sum(mine[r][layer][part] for r in group)
                torch.testing.assert_close(got[rank][layer][part], want)


def test_no_replication_passes_through() -> None:
    scores = _scores(torch.Generator().manual_seed(1))
    assert sum_over_replicas(scores, TPContext(1, 2, lambda x: 0 * x), 2) is scores
    assert sum_over_replicas(None, TPContext(0, 4, lambda x: x), 2) is None
