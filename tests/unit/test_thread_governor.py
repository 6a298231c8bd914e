"""The thread governor (core/thread_governor.py) driven by injected call times: all threads on a
quiet machine at no cost, one thread once contention makes it faster, back to all threads when
the contention ends, not swayed by one unlucky call, and not fooled by steps that get slower on
their own. No clocks: every time here is made up.

Mutations each test catches (checked by hand): trying one thread whenever all threads are
slower than usual at all, without the slack (test_quiet_machine_pays_nothing); never trying one
thread (test_contention_switches_to_one_thread); never trying all threads again
(test_contention_ends_and_all_threads_come_back); not doubling the interval between tries
(test_tries_become_rare_under_lasting_contention); deciding a try on its last call instead of
the median (test_one_unlucky_call_changes_nothing); not re-basing the usual time after a try
that finds all threads still best (test_steps_that_slow_on_their_own_are_not_contention); one
shared bucket for every row count (test_row_buckets_are_separate)."""

from __future__ import annotations

import pytest

from keyserve.core.thread_governor import ThreadGovernor

FULL = 2
QUIET = {FULL: 0.020, 1: 0.036}
BUSY = {FULL: 0.600, 1: 0.040}  # a busy neighbour: all threads' barriers wait out time slices


def drive(gov: ThreadGovernor, cost, calls: int, rows: int = 1, spikes: dict[int, float] | None = None) -> list[int]:
    """``calls`` calls where a call with t threads takes cost[t] seconds (cost may also be a
    function of the call index; call i takes spikes[i] if given); the threads chosen."""
    chosen = []
    for i in range(calls):
        t = gov.choose(FULL, rows)
        c = cost(i) if callable(cost) else cost
        gov.record(FULL, rows, t, (spikes or {}).get(i, c[t]))
        chosen.append(t)
    return chosen


def test_quiet_machine_pays_nothing() -> None:
    gov = ThreadGovernor()
    jitter = {i: 0.020 * (1.0 + (i % 7) / 10) for i in range(0, 500, 3)}  # up to 1.6x, a third of calls
    jitter.update({100: 0.5, 250: 0.4})  # and two calls that lost their core once
    assert drive(gov, QUIET, 500, spikes=jitter) == [FULL] * 500


def test_contention_switches_to_one_thread() -> None:
    gov = ThreadGovernor()
    drive(gov, QUIET, 50)
    chosen = drive(gov, BUSY, 300)
    switch = chosen.index(1)
    assert switch <= 6  # the median of the last calls turns, then three calls try one thread
    assert chosen[switch:].count(FULL) <= 20  # then all threads only as tries, fewer and fewer
    assert gov.current(1) == 1


def test_contention_ends_and_all_threads_come_back() -> None:
    gov = ThreadGovernor(min_interval=4, max_interval=32)
    drive(gov, QUIET, 20)
    drive(gov, BUSY, 100)
    chosen = drive(gov, QUIET, 100)
    assert chosen[-50:] == [FULL] * 50 and gov.current(1) == FULL


def test_tries_become_rare_under_lasting_contention() -> None:
    gov = ThreadGovernor(min_interval=4, max_interval=256)
    drive(gov, QUIET, 10)
    chosen = drive(gov, BUSY, 2000)
    starts = [i for i in range(1, len(chosen)) if chosen[i] == FULL and chosen[i - 1] == 1]
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert gaps[0] <= 12 and gaps[-1] >= 200  # 4, 8, 16, ... up to the maximum


def test_one_unlucky_call_changes_nothing() -> None:
    gov = ThreadGovernor()
    drive(gov, QUIET, 10)
    mild = {FULL: 0.040, 1: 0.050}  # all threads twice as slow: worth a try, but still the faster
    chosen = drive(gov, mild, 60, spikes={7: 0.001})  # the try's last call happens to be fast
    tried = [i for i, t in enumerate(chosen) if t == 1]
    assert tried == [5, 6, 7]  # the window's median (3 quiet + 5 slower calls) passed 1.5x the usual
    assert gov.current(1) == FULL and chosen[8:] == [FULL] * 52


def test_steps_that_slow_on_their_own_are_not_contention() -> None:
    gov = ThreadGovernor()
    growing = lambda i: {FULL: 0.020 * (1 + i / 100), 1: 0.036 * (1 + i / 100)}  # noqa: E731 (longer contexts)
    chosen = drive(gov, growing, 400)  # 4x slower by the end, one thread always 1.8x slower
    assert chosen.count(1) <= 12  # a few tries as the usual time moves up, never a switch
    assert gov.current(1) == FULL


def test_row_buckets_are_separate() -> None:
    gov = ThreadGovernor()
    drive(gov, QUIET, 30, rows=1)
    drive(gov, QUIET, 30, rows=16)
    drive(gov, {FULL: 0.900, 1: 0.300}, 30, rows=16)  # (made up) many rows alone lose with all threads
    assert gov.current(16) == 1 and gov.current(1) == FULL
    assert drive(gov, QUIET, 1, rows=1) == [FULL]


def test_one_thread_configured_is_left_alone() -> None:
    gov = ThreadGovernor()
    for _ in range(20):
        assert gov.choose(1, 1) == 1
        gov.record(1, 1, 1, 0.03)
    assert gov.choose(0, 1) == 1 and gov.estimates(1) == {}


@pytest.mark.parametrize("kwargs", [{"slack": 1.0}, {"min_interval": 0}, {"min_interval": 9, "max_interval": 8},
                                    {"probe_calls": 0}, {"probe_calls": 9, "window": 8}])
def test_bad_settings_are_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        ThreadGovernor(**kwargs)
