"""How many threads a barrier-heavy native call should use right now: all of them, or one.

Why: the native decode step meets its OpenMP team at ~180 barriers per step. When another
process wants one of the cores (a second server, a build, a test run, a Kubernetes CPU limit
below the thread count), the thread that loses its core makes every barrier wait out a
scheduler time slice: measured on the 2-core Xeon, batch-1 decode fell from ~45 to ~1.7 tok/s
with two threads beside one busy process, while one thread ran at ~24 tok/s beside it
(docs/engine.md, "Decode under CPU contention").

On evidence, not on a schedule: a quiet machine must pay nothing. The governor runs all threads
and remembers their usual time (the lowest median of its recent calls). Only when that median
rises past ``slack`` x the usual does it try one thread for a few calls (their median: one
unlucky call decides nothing). If one thread is faster it switches, and from then on tries all
threads again every ``interval`` calls -- 8 at first, doubling each time all threads still
lose, up to ``max_interval`` -- and goes back as soon as they win. A try that finds all threads
still best takes their current median as the new usual (contexts grow; steps get slower
without any contention).

Times are kept per row-count bucket (1, 2-4, 5+ rows): a step's cost depends on how many rows
it carries. Pure logic: the caller measures and reports the seconds.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field


@dataclass
class _Bucket:
    recent: dict[int, deque[float]] = field(default_factory=dict)  # threads -> last calls' seconds
    usual: float = float("inf")  # all threads' uncontended median (the lowest seen, re-based)
    current: int = 0  # the choice being run (0: not decided yet: all threads)
    interval: int = 0  # calls at one thread between tries of all threads
    countdown: int = 0
    probe_threads: int = 0  # the choice being tried (0: none)
    probe_left: int = 0  # its calls still to come


class ThreadGovernor:
    """Chooses ``full`` threads or one per call from measured call times (see module doc)."""

    def __init__(self, slack: float = 1.5, min_interval: int = 8, max_interval: int = 1024,
                 probe_calls: int = 3, window: int = 8) -> None:
        if not slack > 1.0:
            raise ValueError("slack must be > 1")
        if not 1 <= min_interval <= max_interval:
            raise ValueError("need 1 <= min_interval <= max_interval")
        if not 1 <= probe_calls <= window:
            raise ValueError("need 1 <= probe_calls <= window")
        self.slack, self.min_interval, self.max_interval = slack, min_interval, max_interval
        self.probe_calls, self.window = probe_calls, window
        self._buckets: dict[int, _Bucket] = {}

    @staticmethod
    def bucket_of(rows: int) -> int:
        return 0 if rows <= 1 else 1 if rows <= 4 else 2

    def _bucket(self, rows: int, full: int) -> _Bucket:
        b = self._buckets.get(self.bucket_of(rows))
        if b is None:
            b = self._buckets[self.bucket_of(rows)] = _Bucket(current=full, interval=self.min_interval)
        return b

    def _median(self, b: _Bucket, threads: int) -> float:
        q = b.recent.get(threads)
        return statistics.median(q) if q else float("inf")

    def _try(self, b: _Bucket, threads: int) -> int:
        b.probe_threads, b.probe_left = threads, self.probe_calls
        b.recent[threads] = deque(maxlen=self.window)  # older calls are from another regime
        return threads

    def choose(self, full: int, rows: int) -> int:
        """Threads for the next call of ``rows`` rows, ``full`` being the configured count."""
        if full <= 1:
            return max(full, 1)
        b = self._bucket(rows, full)
        if b.probe_left > 0:
            return b.probe_threads
        if b.current == full:
            q = b.recent.get(full)
            if q is not None and len(q) >= self.probe_calls and self._median(b, full) > self.slack * b.usual:
                return self._try(b, 1)  # all threads got slower: is one thread faster now?
            return full
        b.countdown -= 1
        if b.countdown <= 0:
            return self._try(b, full)
        return 1

    def record(self, full: int, rows: int, threads: int, seconds: float) -> None:
        """Report how long the call chosen by ``choose`` took."""
        if full <= 1 or seconds < 0:
            return
        b = self._bucket(rows, full)
        b.recent.setdefault(threads, deque(maxlen=self.window)).append(seconds)
        if threads == full and b.current == full and b.probe_left == 0 and len(b.recent[full]) >= self.probe_calls:
            b.usual = min(b.usual, self._median(b, full))
        if b.probe_left == 0 or threads != b.probe_threads:
            return
        b.probe_left -= 1
        if b.probe_left > 0:
            return
        b.probe_threads = 0
        one, all_ = self._median(b, 1), self._median(b, full)
        if b.current == full:
            if one < all_:  # contention: switch to one thread
                b.current, b.interval = 1, self.min_interval
            else:  # no better: all threads' present speed is the new usual
                b.usual = all_
        elif all_ < one:  # the neighbour left: back to all threads
            b.current, b.usual = full, all_
        else:
            b.interval = min(2 * b.interval, self.max_interval)
        b.countdown = b.interval

    def estimates(self, rows: int) -> dict[int, float]:
        """Median seconds per call by thread count for ``rows`` rows' bucket (benches, tests)."""
        b = self._buckets.get(self.bucket_of(rows))
        return {t: statistics.median(q) for t, q in b.recent.items() if q} if b else {}

    def current(self, rows: int) -> int | None:
        """The choice being run for ``rows`` rows (None before the first call)."""
        b = self._buckets.get(self.bucket_of(rows))
        return b.current if b else None
