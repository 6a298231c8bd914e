"""The thread governor (core/thread_governor.py) driven by injected call times: it runs the
faster of all threads and one, switches when contention makes the other faster, is not swayed
by one unlucky call, and probes rarely once its choice keeps being confirmed. No clocks: every
time here is made up.

Mutations each test catches (checked by hand): choosing the slower choice
(test_quiet_machine_keeps_all_threads), a probe that keeps the stale samples of its choice
instead of starting afresh (test_contention_ends_and_all_threads_come_back), never doubling the
probe interval (test_probes_become_rare_when_confirmed), one shared bucket for every row count
(test_row_buckets_are_separate), deciding a probe on its last call alone instead of the median
(test_one_unlucky_probe_call_changes_nothing)."""

from __future__ import annotations

import pytest

from keyserve.core.thread_governor import ThreadGovernor

FULL = 2


def drive(gov: ThreadGovernor, cost: dict[int, float], calls: int, rows: int = 1,
          spikes: dict[int, float] | None = None) -> list[int]:
    """``calls`` calls where a call with t threads takes cost[t] seconds (call i: spikes[i] if
    given); the threads chosen."""
    chosen = []
    for i in range(calls):
        t = gov.choose(FULL, rows)
        gov.record(FULL, rows, t, (spikes or {}).get(i, cost[t]))
        chosen.append(t)
    return chosen


def test_quiet_machine_keeps_all_threads() -> None:
    gov = ThreadGovernor(min_interval=8, max_interval=64)
    chosen = drive(gov, {FULL: 0.020, 1: 0.036}, 400)
    assert chosen[:6] == [FULL] * 3 + [1] * 3  # each measured for a probe's worth of calls
    assert chosen[-100:].count(1) <= 6  # only probes
    assert chosen.count(FULL) > 0.93 * len(chosen)


def test_contention_switches_to_one_thread() -> None:
    gov = ThreadGovernor()
    drive(gov, {FULL: 0.020, 1: 0.036}, 50)
    chosen = drive(gov, {FULL: 0.600, 1: 0.040}, 200)  # a busy neighbour: barriers wait out time slices
    switch = chosen.index(1)
    assert switch <= 8  # the running choice's median turns within a window of calls
    assert chosen[switch:].count(FULL) <= 12  # then all threads only as probes, fewer and fewer


def test_contention_ends_and_all_threads_come_back() -> None:
    gov = ThreadGovernor(min_interval=4, max_interval=32)
    drive(gov, {FULL: 0.020, 1: 0.036}, 20)
    drive(gov, {FULL: 0.600, 1: 0.040}, 100)
    chosen = drive(gov, {FULL: 0.020, 1: 0.036}, 100)
    assert chosen[-50:].count(FULL) >= 47  # back at the first probe of all threads; one probe since


def test_probes_become_rare_when_confirmed() -> None:
    gov = ThreadGovernor(min_interval=4, max_interval=256)
    chosen = drive(gov, {FULL: 0.020, 1: 0.036}, 2000)
    starts = [i for i in range(1, len(chosen)) if chosen[i] == 1 and chosen[i - 1] == FULL]
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert gaps[0] <= 12 and gaps[-1] >= 200  # 4, 8, 16, ... up to the maximum


def test_one_unlucky_probe_call_changes_nothing() -> None:
    gov = ThreadGovernor(min_interval=4, max_interval=64)
    drive(gov, {FULL: 0.020, 1: 0.036}, 3)  # the first calls, all threads
    # the one-thread probe's last call happens to be fast: the probe's median still says slower
    chosen = drive(gov, {FULL: 0.020, 1: 0.036}, 40, spikes={2: 0.001})
    assert chosen[:3] == [1, 1, 1] and chosen[3:7] == [FULL] * 4


def test_row_buckets_are_separate() -> None:
    gov = ThreadGovernor()
    drive(gov, {FULL: 0.020, 1: 0.036}, 30, rows=1)
    drive(gov, {FULL: 0.900, 1: 0.300}, 30, rows=16)  # (made up) many rows lose with all threads
    assert gov.estimates(1)[FULL] < gov.estimates(1)[1]
    assert gov.estimates(16)[1] < gov.estimates(16)[FULL]
    assert drive(gov, {FULL: 0.020, 1: 0.036}, 1, rows=1) == [FULL]


def test_one_thread_configured_is_left_alone() -> None:
    gov = ThreadGovernor()
    for _ in range(20):
        assert gov.choose(1, 1) == 1
        gov.record(1, 1, 1, 0.03)
    assert gov.choose(0, 1) == 1 and gov.estimates(1) == {}


@pytest.mark.parametrize("kwargs", [{"min_interval": 0}, {"min_interval": 9, "max_interval": 8},
                                    {"probe_calls": 0}, {"probe_calls": 9, "window": 8}])
def test_bad_settings_are_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        ThreadGovernor(**kwargs)
