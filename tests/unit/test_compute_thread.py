"""``ComputeThread``: an actor's torch work runs on one thread whichever thread asks (one
libgomp pool per process, actors/compute_thread.py), with results and exceptions returned."""

from __future__ import annotations

import threading

import pytest

from keyserve.actors.compute_thread import ComputeThread


def test_calls_from_any_thread_run_on_the_same_one() -> None:
    compute = ComputeThread()
    seen = [compute.run(threading.get_ident)]
    callers = [threading.Thread(target=lambda: seen.append(compute.run(threading.get_ident))) for _ in range(3)]
    for t in callers:
        t.start()
    for t in callers:
        t.join()
    assert len(seen) == 4 and len(set(seen)) == 1
    assert seen[0] != threading.get_ident()  # not the caller's


def test_results_and_exceptions_come_back() -> None:
    compute = ComputeThread()
    assert compute.run(lambda a, b: a * b, 6, 7) == 42

    def fail() -> None:
        raise KeyError("no such sequence")

    with pytest.raises(KeyError, match="no such sequence"):
        compute.run(fail)
    assert compute.run(sum, [1, 2]) == 3  # still serving
