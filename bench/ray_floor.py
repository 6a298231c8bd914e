"""What a Ray Compiled Graph costs per step on this machine when its actors do no engine work.

The engine's step graph is driver -> KV-block manager (two outputs: the step, the answer) ->
target shard -> driver. ``graph_floor`` compiles a graph of that shape over two stand-in actors:
the first returns its input twice, the second streams ``weight_bytes`` through matrix-vector
products, as a decode step reads the model's weights (so the caches and cores are as busy as in
a real step), and reports how long that took. Whatever the step graph's actors do on top, a step
cannot cost less than the time this graph adds beyond the stand-in's own work: that is the floor
the issue-20 target (<= 1 ms orchestration per step) is measured against. The one-actor graph
(driver -> stand-in shard -> driver) is what is left with a single hop each way.
"""

from __future__ import annotations

import statistics
import time

import ray
import torch
from ray.dag import InputNode, MultiOutputNode

ROWS = 4096  # each weight tile is [ROWS, ROWS] float32


@ray.remote(num_cpus=0.1)
class StandInManager:
    """Returns its input as two outputs, like the KV-block manager's (step, answer)."""

    def step(self, x: int) -> tuple[int, int]:
        return x, x


@ray.remote(num_cpus=0.1)
class StandInShard:
    """Streams the weights once per step; returns the seconds that took (its own work)."""

    def __init__(self, weight_bytes: int, threads: int) -> None:
        torch.set_num_threads(threads)
        tiles = max(1, weight_bytes // (ROWS * ROWS * 4))
        self.weights = [torch.randn(ROWS, ROWS) for _ in range(tiles)]  # [ROWS, ROWS] each
        self.x = torch.randn(ROWS)  # [ROWS]

    def run(self, x: int) -> float:
        """x < 0: no work (the graph alone, back to back)."""
        start = time.perf_counter()
        for w in self.weights if x >= 0 else ():
            torch.mv(w, self.x)
        return time.perf_counter() - start


def _overhead_ms(dag, steps: int, shard_index: int, idle: bool = False) -> dict[str, float]:
    for i in range(5):  # warm-up
        ray.get(dag.execute(-1 if idle else i))
    extra = []
    for i in range(steps):
        start = time.perf_counter()
        out = ray.get(dag.execute(-1 if idle else i))
        work = out[shard_index] if isinstance(out, list) else out
        extra.append(1e3 * (time.perf_counter() - start - work))
    extra.sort()
    return {"median": statistics.median(extra), "p10": extra[len(extra) // 10], "p90": extra[9 * len(extra) // 10]}


def read_after_wait_ms(dag, wait_s: float, reads: int = 30) -> dict[str, float]:
    """The driver's read of a result that is already there (the stand-in idle), after a short
    sleep and after ``wait_s`` asleep (as the driver waits through a step): what a process's
    first steps cost after it waited, on their own."""
    out = {}
    for label, sleep_s in (("after 0.5 ms", 0.0005), (f"after {1e3 * wait_s:.0f} ms", wait_s)):
        times = []
        for _ in range(reads):
            ref = dag.execute(-1)
            time.sleep(sleep_s)
            start = time.perf_counter()
            ray.get(ref)
            times.append(1e3 * (time.perf_counter() - start))
        out[label] = statistics.median(times)
    return out


def graph_floor(weight_bytes: int, threads: int, steps: int = 60) -> dict[str, dict[str, float]]:
    """ms per step each graph adds beyond the stand-in shard's work: 'step-shaped' (driver ->
    manager -> shard -> driver, reading all three outputs), the same with the stand-in idle
    (back to back), and 'one actor' (driver -> shard -> driver); 'read' times the driver's read
    of a result that is already there, back to back and after a 20 ms wait. Needs ``ray.init``."""
    manager = StandInManager.remote()
    shard = StandInShard.remote(weight_bytes, threads)
    out: dict[str, dict[str, float]] = {}
    try:
        with InputNode() as request:
            step, answer = manager.step.options(num_returns=2).bind(request)
            dag = MultiOutputNode([step, answer, shard.run.bind(step)]).experimental_compile()
        try:
            out["step-shaped"] = _overhead_ms(dag, steps, shard_index=2)
            out["step-shaped, idle"] = _overhead_ms(dag, steps, shard_index=2, idle=True)
        finally:
            dag.teardown()
        with InputNode() as request:
            dag = shard.run.bind(request).experimental_compile()
        try:
            out["one actor"] = _overhead_ms(dag, steps, shard_index=0)
            out["read"] = read_after_wait_ms(dag, 0.020)
        finally:
            dag.teardown()
    finally:
        for actor in (manager, shard):
            ray.kill(actor)
    return out
