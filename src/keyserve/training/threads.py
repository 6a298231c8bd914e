"""Choosing the CPU thread count by measurement.

On a small shared CPU, two OpenMP threads can be several times *slower* than one: when other
processes hold the cores, every parallel matmul waits at its barrier for the descheduled
thread. Timing a representative matmul both ways every few minutes picks what is fast now.
"""

from __future__ import annotations

import time

import torch


def _time_matmul(threads: int, reps: int = 6) -> float:
    torch.set_num_threads(threads)
    a = torch.randn(48, 576)
    w = torch.randn(3072, 576)
    torch.nn.functional.linear(a, w)
    start = time.perf_counter()
    for _ in range(reps):
        torch.nn.functional.linear(a, w)
    return time.perf_counter() - start


def pick_threads(max_threads: int) -> int:
    """Set and return the fastest of 1..``max_threads`` threads (``max_threads`` <= 1: 1)."""
    if max_threads <= 1:
        torch.set_num_threads(1)
        return 1
    timings = {n: min(_time_matmul(n), _time_matmul(n)) for n in range(1, max_threads + 1)}
    best = min(timings, key=timings.__getitem__)
    torch.set_num_threads(best)
    return best


class ThreadTuner:
    """Re-runs ``pick_threads`` every ``every_s`` seconds from inside a long loop."""

    def __init__(self, max_threads: int, every_s: float = 180.0) -> None:
        self.max_threads = max_threads
        self.every_s = every_s
        self.threads = pick_threads(max_threads)
        self.last = time.monotonic()

    def maybe_retune(self) -> int:
        if time.monotonic() - self.last > self.every_s:
            self.threads = pick_threads(self.max_threads)
            self.last = time.monotonic()
        return self.threads
