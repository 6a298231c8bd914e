"""How many threads a barrier-heavy native call should use right now: all of them, or one.

Why: the native decode step meets its OpenMP team at ~180 barriers per step. When another
process wants one of the cores (a second server, a build, a test run, a Kubernetes CPU limit
below the thread count), the thread that loses its core makes every barrier wait out a
scheduler time slice: measured on the 2-core Xeon, batch-1 decode fell from ~47 to ~1.7 tok/s
with two threads beside one busy process, while one thread ran at ~24 tok/s beside it
(docs/engine.md, "Decode under CPU contention"). Nothing in the machine's state says reliably
which will win, so the governor times both: it runs the one whose recent calls' median is
lower and now and then probes the other for a few calls (their median: one unlucky call decides
nothing); a probe that agrees doubles the interval to the next (up to ``max_interval`` calls, so
a quiet machine pays well under 1 % for the probes), one that disagrees switches and starts
probing often again. A neighbour that arrives shows in the running choice's own median within a
few calls.

Estimates are kept per row-count bucket (1, 2-4, 5+ rows): a step's cost depends on how many
rows it carries. Pure logic: the caller measures and reports the seconds.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field


@dataclass
class _Bucket:
    recent: dict[int, deque[float]] = field(default_factory=dict)  # threads -> last calls' seconds
    interval: int = 0  # calls between probes of the other choice
    countdown: int = 0
    probe_threads: int = 0  # the choice being probed (0: none)
    probe_left: int = 0  # its calls still to come
    probe_before: int = 0  # the choice before the probe


class ThreadGovernor:
    """Chooses ``full`` threads or one per call from measured call times (see module doc)."""

    def __init__(self, min_interval: int = 8, max_interval: int = 1024, probe_calls: int = 3,
                 window: int = 8) -> None:
        if not 1 <= min_interval <= max_interval:
            raise ValueError("need 1 <= min_interval <= max_interval")
        if not 1 <= probe_calls <= window:
            raise ValueError("need 1 <= probe_calls <= window")
        self.min_interval, self.max_interval = min_interval, max_interval
        self.probe_calls, self.window = probe_calls, window
        self._buckets: dict[int, _Bucket] = {}

    @staticmethod
    def bucket_of(rows: int) -> int:
        return 0 if rows <= 1 else 1 if rows <= 4 else 2

    def _bucket(self, rows: int) -> _Bucket:
        b = self._buckets.get(self.bucket_of(rows))
        if b is None:
            b = self._buckets[self.bucket_of(rows)] = _Bucket(interval=self.min_interval,
                                                              countdown=self.min_interval)
        return b

    def _best(self, b: _Bucket, full: int) -> int:
        est = {t: statistics.median(q) for t, q in b.recent.items() if q}
        return full if est.get(full, float("inf")) <= est.get(1, float("inf")) else 1

    def _start_probe(self, b: _Bucket, threads: int, before: int) -> int:
        b.probe_threads, b.probe_left, b.probe_before = threads, self.probe_calls, before
        b.recent[threads] = deque(maxlen=self.window)  # older calls are from another regime
        return threads

    def choose(self, full: int, rows: int) -> int:
        """Threads for the next call of ``rows`` rows, ``full`` being the configured count."""
        if full <= 1:
            return max(full, 1)
        b = self._bucket(rows)
        if b.probe_left > 0:
            return b.probe_threads
        if len(b.recent.get(full, ())) < self.probe_calls:  # first calls: the configured count
            b.recent.setdefault(full, deque(maxlen=self.window))
            return full
        if 1 not in b.recent:  # then one thread, as a probe
            return self._start_probe(b, 1, full)
        best = self._best(b, full)
        b.countdown -= 1
        if b.countdown <= 0:
            return self._start_probe(b, 1 if best == full else full, best)
        return best

    def record(self, full: int, rows: int, threads: int, seconds: float) -> None:
        """Report how long the call chosen by ``choose`` took."""
        if full <= 1 or seconds < 0:
            return
        b = self._bucket(rows)
        b.recent.setdefault(threads, deque(maxlen=self.window)).append(seconds)
        if b.probe_left > 0 and threads == b.probe_threads:
            b.probe_left -= 1
            if b.probe_left == 0:
                agreed = self._best(b, full) == b.probe_before
                b.interval = min(2 * b.interval, self.max_interval) if agreed else self.min_interval
                b.countdown = b.interval
                b.probe_threads = 0

    def estimates(self, rows: int) -> dict[int, float]:
        """Median seconds per call by thread count for ``rows`` rows' bucket (benches, tests)."""
        b = self._buckets.get(self.bucket_of(rows))
        return {t: statistics.median(q) for t, q in b.recent.items() if q} if b else {}
