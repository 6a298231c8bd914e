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

Beside the per-K means, each bucket fits what a drafting step adds to a plain one as
``fixed + per_row x rows`` (``extra_seconds``; rows: the step's drafted tokens, all sequences
together), by decayed least squares over the same steps, unscaled. Why: the per-K means answer
"what if every sequence drafted", but a step's cost is not linear in its drafters. At batch 8 on
2 cores a lone sequence copying one token added +8.6 ms to a 71.9 ms plain step, worth more than
the 0.72 tokens it gained, while the scaled means read K = 1 at ~4-7 ms per drafter: a drafting
step pays a fixed part (the verification path, the draft forward's own overhead) once, whoever
drafts in it. The engine weighs a partly drafting step as a whole against that fit
(``engine.speculative``).

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
class _Fit:
    """Decayed least squares of y = fixed + slope·x (x: a drafting step's drafted rows, y: the
    seconds it took beyond a plain step's mean)."""

    s0: float = 0.0  # decayed sums of 1, x, x², y, x·y
    sx: float = 0.0
    sxx: float = 0.0
    sy: float = 0.0
    sxy: float = 0.0
    count: int = 0

    def add(self, x: float, y: float, decay: float) -> None:
        self.s0 = decay * self.s0 + 1.0
        self.sx = decay * self.sx + x
        self.sxx = decay * self.sxx + x * x
        self.sy = decay * self.sy + y
        self.sxy = decay * self.sxy + x * y
        self.count += 1

    def line(self) -> tuple[float, float]:
        """(fixed, slope). Where the rows seen barely vary the two cannot be told apart, and
        the whole cost at the mean rows is read as fixed (a step's drafters then pay it
        together, which is what was measured)."""
        det = self.s0 * self.sxx - self.sx * self.sx
        if det <= 1e-9 * max(self.s0 * self.sxx, 1e-12):
            return self.sy / self.s0, 0.0
        slope = max(0.0, (self.s0 * self.sxy - self.sx * self.sy) / det)
        return (self.sy - slope * self.sx) / self.s0, slope

    def predict(self, x: float) -> float:
        fixed, slope = self.line()
        return max(0.0, fixed + slope * x)


@dataclass
class _Bucket:
    means: dict[int, _Mean] = field(default_factory=dict)  # K -> decayed mean step seconds
    fit: _Fit = field(default_factory=_Fit)  # a drafting step's seconds beyond plain, by its rows
    since_plain: int = 0  # speculative steps recorded since the last plain one
    interval: int = 0  # speculative steps between plain refreshes


class StepCostModel:
    """Online cost(K, batch) / cost(0, batch) from the engine's own step times (module doc)."""

    def __init__(self, prior_cost_ratio: float, decay: float = 0.8, min_samples: int = 2,
                 min_interval: int = 16, max_interval: int = 1024, max_jump: float = 1.25,
                 fit_decay: float = 0.95, min_fit: int = 8) -> None:
        if not prior_cost_ratio >= 0:
            raise ValueError("prior_cost_ratio must be >= 0")
        if not 0.0 <= decay < 1.0:
            raise ValueError("need 0 <= decay < 1")
        if not 1 <= min_interval <= max_interval:
            raise ValueError("need 1 <= min_interval <= max_interval")
        if not 0.0 < fit_decay <= 1.0:
            raise ValueError("need 0 < fit_decay <= 1")
        self.prior_cost_ratio, self.decay, self.min_samples = prior_cost_ratio, decay, max(1, min_samples)
        self.min_interval, self.max_interval = min_interval, max_interval
        # A step slower than max_jump x its mean counts as max_jump x: unclipped, at decay 0.8
        # one 3x stall of a speculative step raised its relative cost from 1.25 to ~2.0 and sent
        # sequences to K = 0 for dozens of steps (batch 1, 2 cores; probes back off); clipped,
        # to ~1.34, while a lasting change still moves the mean within a few steps.
        self.max_jump = max_jump
        # The fixed + per-row fit (``extra_seconds``) remembers longer than the means: it needs
        # steps of several row counts to tell its two parts apart.
        self.fit_decay, self.min_fit = fit_decay, max(1, min_fit)
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
               drafting: int | None = None, rows: int | None = None) -> None:
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
        sequence judged K = 1 worth it, and adaptive K made 0.75x plain decoding at batch 8.

        ``rows``: the step's drafted tokens, all sequences together (default: ``k`` x the
        drafting sequences); with them, unscaled, the step also feeds the fixed + per-row fit
        (``extra_seconds``)."""
        if seconds <= 0 or batch < 1 or k < 0:
            return
        b = self._bucket(batch, sampled)
        if k > 0:
            self._fit_step(b, k * (batch if drafting is None else drafting) if rows is None else rows, seconds)
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

    def _fit_step(self, b: _Bucket, rows: int, seconds: float) -> None:
        plain = self._measured(b, 0)
        if plain is None or rows <= 0:
            return
        if b.fit.count >= self.min_fit:  # a stall (or a lucky step) counts as max_jump x off, no more
            expected = plain + b.fit.predict(rows)
            seconds = min(max(seconds, expected / self.max_jump), self.max_jump * expected)
        b.fit.add(float(rows), seconds - plain, self.fit_decay)

    def extra_seconds(self, rows: int, batch: int, sampled: bool = False) -> float | None:
        """What a decode step of ``batch`` sequences drafting ``rows`` tokens in all costs beyond a
        plain one (fixed + per-row fit), or None before ``min_fit`` drafting steps and a plain
        baseline were measured at that bucket."""
        b = self._buckets.get((self.bucket_of(batch), sampled))
        if b is None or b.fit.count < self.min_fit or self._measured(b, 0) is None:
            return None
        return b.fit.predict(rows)

    def plain_seconds(self, batch: int, sampled: bool = False) -> float | None:
        """The measured plain step at this batch's bucket (None before ``min_samples``)."""
        b = self._buckets.get((self.bucket_of(batch), sampled))
        return self._measured(b, 0) if b is not None else None

    def fit_line(self, batch: int, sampled: bool = False) -> tuple[float, float] | None:
        """(fixed seconds, seconds per drafted row) of the fit at this bucket (benches, tests)."""
        b = self._buckets.get((self.bucket_of(batch), sampled))
        return b.fit.line() if b is not None and b.fit.count else None

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
