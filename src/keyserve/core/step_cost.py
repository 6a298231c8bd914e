"""What a speculative decode step costs relative to a plain one, as measured on this engine.

Why: adaptive K weighs expected tokens against cost, and the weight-byte model (1 + c·K) is
wrong where it matters: at batch 8 the target's K extra rows per sequence are not free, and a
speculative step has costs of its own (draft step overhead, verification, rollback). So the
engine times its decode steps and reports (batch, K, seconds) here; this model keeps an
exponentially decayed mean step time per batch-size bucket (1, 2, 3-4, 5-8, ...) and per K, and
answers ``relative_cost(K, batch)`` = cost(K) / cost(0) at that bucket. Greedy steps and steps
that sample (any row at T > 0) are kept apart (``sampled``): a sampled step pays softmax and
top-k/top-p over the vocabulary per row, so at batch 8 its plain steps cost ~35 ms against
~24 ms greedy, and a baseline mixed from both, as a server with mixed traffic (or a bench
alternating temperatures) would feed it, read greedy speculation at 1.25x plain where it
costs ~1.9x, and adaptive K kept drafting at 0.72x plain decoding.

Where a K has no measurement yet, a line through the measured Ks of the same bucket
(``1 + slope·K``, least squares through (0, 1)) stands in; where the bucket has no plain or no
speculative measurement, the prior ``1 + c·K`` does (c: the configured draft/target cost).

A plain baseline needs plain steps, which an engine that always speculates never runs: the
model asks for one (``wants_plain``) while its bucket has fewer than ``min_samples`` of them,
and then once every ``interval`` speculative steps -- 16 at first, doubling after each refresh
up to ``max_interval`` (contexts grow and the machine's load moves; a stale baseline would
drift, but a settled one needs refreshing only rarely).

Pure logic: the caller measures and reports the seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class _Mean:
    """An exponentially decayed mean: each new sample weighs 1, the past is multiplied by decay."""

    total: float = 0.0
    weight: float = 0.0
    count: int = 0

    def add(self, x: float, decay: float, weight: float = 1.0) -> None:
        """A sample worth ``weight`` of a full one also displaces only that much of the past
        (``decay ** weight``): else a run of 1-of-8 steps, each 8x as noisy once scaled,
        made the mean the last few of them."""
        d = decay**weight
        self.total = d * self.total + weight * x
        self.weight = d * self.weight + weight
        self.count += 1

    @property
    def value(self) -> float:
        return self.total / self.weight


@dataclass
class _Bucket:
    means: dict[int, _Mean] = field(default_factory=dict)  # K -> decayed mean step seconds
    since_plain: int = 0  # speculative steps recorded since the last plain one
    interval: int = 0  # speculative steps between plain refreshes


class StepCostModel:
    """Online cost(K, batch) / cost(0, batch) from the engine's own step times (module doc)."""

    def __init__(self, prior_cost_ratio: float, decay: float = 0.8, min_samples: int = 2,
                 min_interval: int = 16, max_interval: int = 1024, max_jump: float = 1.25) -> None:
        if not prior_cost_ratio >= 0:
            raise ValueError("prior_cost_ratio must be >= 0")
        if not 0.0 <= decay < 1.0:
            raise ValueError("need 0 <= decay < 1")
        if not 1 <= min_interval <= max_interval:
            raise ValueError("need 1 <= min_interval <= max_interval")
        self.prior_cost_ratio, self.decay, self.min_samples = prior_cost_ratio, decay, max(1, min_samples)
        self.min_interval, self.max_interval = min_interval, max_interval
        # A step slower than max_jump x its mean counts as max_jump x: unclipped, at decay 0.8
        # one 3x stall of a speculative step raised its relative cost from 1.25 to ~2.0 and sent
        # sequences to K = 0 for dozens of steps (batch 1, 2 cores; probes back off); clipped,
        # to ~1.34, while a lasting change still moves the mean within a few steps.
        self.max_jump = max_jump
        self._buckets: dict[tuple[int, bool], _Bucket] = {}  # (batch bucket, sampled) -> means

    @staticmethod
    def bucket_of(batch: int) -> int:
        """1 -> 0, 2 -> 1, 3-4 -> 2, 5-8 -> 3, ...: the step cost grows with the rows it carries."""
        return max(batch - 1, 0).bit_length()

    def _bucket(self, batch: int, sampled: bool) -> _Bucket:
        key = (self.bucket_of(batch), sampled)
        b = self._buckets.get(key)
        if b is None:
            b = self._buckets[key] = _Bucket(interval=self.min_interval)
        return b

    def record(self, batch: int, k: int, seconds: float, sampled: bool = False,
               drafting: int | None = None) -> None:
        """One decode step of ``batch`` sequences drafting up to ``k`` each (0: plain) took
        ``seconds``, all of it: draft, target, verification and bookkeeping; ``sampled``: some
        row of it sampled (T > 0); ``drafting``: how many of the sequences drafted (default:
        all of them).

        A speculative K's mean is what a step costs when *every* sequence drafts K, because
        that is what each sequence's choice is weighed against (a sequence gains its own extra
        tokens and pays its share of the step). A step in which only some drafted is scaled up
        to it -- plain + (seconds - plain) x batch / drafting -- and weighs drafting / batch of
        a sample (a step where 1 of 8 drafted says little about 8 drafting). Unscaled, steps where
        3 of 8 sequences drafted read K = 1 at 1.29x plain where all 8 drafting cost 1.50x: each
        sequence judged K = 1 worth it, and adaptive K made 0.75x plain decoding at batch 8."""
        if seconds <= 0 or batch < 1 or k < 0:
            return
        b = self._bucket(batch, sampled)
        weight = 1.0
        if k > 0 and drafting is not None and 0 < drafting < batch:
            weight = drafting / batch
            plain = self._measured(b, 0)
            if plain is not None:
                seconds = plain + (seconds - plain) / weight
        mean = b.means.setdefault(k, _Mean())
        if mean.count >= self.min_samples:  # a one-off stall (GC, another process) counts as max_jump x
            seconds = min(seconds, self.max_jump * mean.value)
            if weight < 1.0:
                # Scaled up, a partly drafting step's noise is batch / drafting x a step's, both
                # ways: clipped only above, the low ones dragged the mean down (ngram at batch 8,
                # 1-3 of 8 sequences copying: K = 1 read at 31.8 ms against 72.7 ms plain, free,
                # where it costs ~1.9x; the copies drafted at 0.89x plain decoding).
                seconds = max(seconds, mean.value / self.max_jump)
        mean.add(seconds, self.decay, weight)
        if k == 0:
            if b.since_plain >= b.interval:  # a refresh was due: space the next one out further
                b.interval = min(2 * b.interval, self.max_interval)
            b.since_plain = 0
        else:
            b.since_plain += 1

    def _measured(self, b: _Bucket, k: int) -> float | None:
        m = b.means.get(k)
        return m.value if m is not None and m.count >= self.min_samples else None

    def relative_cost(self, k: int, batch: int, sampled: bool = False) -> float:
        """cost(K) / cost(0) for a step of ``batch`` sequences; at least 1 (speculation never
        makes a step cheaper; a lower measurement is noise)."""
        if k <= 0:
            return 1.0
        prior = 1.0 + self.prior_cost_ratio * k
        b = self._buckets.get((self.bucket_of(batch), sampled))
        plain = self._measured(b, 0) if b is not None else None
        if b is None or plain is None:
            return prior
        own = self._measured(b, k)
        if own is not None:
            return max(1.0, own / plain)
        num = den = 0.0
        for kk, m in b.means.items():
            cost = self._measured(b, kk)
            if kk > 0 and cost is not None:
                num += m.weight * (cost / plain - 1.0) * kk
                den += m.weight * kk * kk
        return max(1.0, 1.0 + num / den * k) if den else prior

    def wants_plain(self, batch: int, sampled: bool = False) -> bool:
        """Should the next step at this batch size (greedy or ``sampled``) run plain, to measure
        (or refresh) the baseline every relative cost divides by?"""
        b = self._bucket(batch, sampled)
        m = b.means.get(0)
        return m is None or m.count < self.min_samples or b.since_plain >= b.interval

    def estimates(self, batch: int, sampled: bool = False) -> dict[int, float]:
        """K -> decayed mean seconds per step at this batch's bucket (benches, tests)."""
        b = self._buckets.get((self.bucket_of(batch), sampled))
        return {k: m.value for k, m in sorted(b.means.items())} if b else {}
