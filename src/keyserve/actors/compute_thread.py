"""One thread for all of an actor's torch work, whichever thread asks for it.

Why: libgomp keeps a pool of OpenMP threads per thread that starts a parallel region, and once
the threads of all pools outnumber the CPUs it stops spinning at barriers and sleeps on a futex
at each one (its "throttled" spin count). A shard loads its model on the actor's main thread
(a Ray call) and then runs its steps on another: a step channel's thread, or the compiled
graph's loop thread. That made two pools, four OpenMP threads on two cores, and every step of
the barrier-heavy native decode paid ~160 context switches: measured on the 2-core EPYC (the
same decode step, SmolLM2 float32, 2 threads, in one process), 1 context switch and 18.5-21.3 ms
per step with one pool, 154-165 and 22.4-23.9 ms once a second thread had run a parallel
region. With every torch call on this one thread there is one pool, whichever path the step
came by.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class ComputeThread:
    """Runs callables on one persistent thread and waits for their result (or exception)."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="keyserve-compute")

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        return self._executor.submit(fn, *args).result()
