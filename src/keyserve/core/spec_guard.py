"""Whether speculation pays, judged by what it delivered: the tokens per second of the decode
steps that drafted against those of plain steps at the same batch-size bucket.

Why: adaptive K (``core.adaptive_k``) chooses K from a model -- the acceptance a sequence
measures, the expected tokens of K drafts, the measured cost of a step where every sequence
drafts K (``core.step_cost``) -- and the model leaves out what does not fit it: the catch-up step
after a sequence starts drafting (the draft reads everything it skipped), steps where only some
sequences draft (the draft forward's fixed cost shared by fewer rows: at batch 8 on 2 cores, one
drafting sequence added 10 ms to a 61 ms step, all eight 36 ms), a plain baseline measured at
another time than the steps it divides. Where those costs outweigh the model's margin, adaptive
K kept drafting and made 0.74-0.95x plain decoding at batch 8 (docs/BENCHMARKS.md,
speculative_tree), while its promise is never to be slower.

So the promise is checked on outcomes. Every decode step the engine times is reported here
(tokens emitted, seconds, whether any sequence drafted). Once a bucket has ``min_steps`` drafting
steps since its last verdict and a plain baseline, the realised speed-up -- decayed tokens per
second of its drafting steps over its plain steps' -- decides: below 1 - ``margin``, speculation
is off at that bucket for ``interval`` steps (plain decoding, which also refreshes the
baseline), and the next loss doubles the interval (up to ``max_interval``), as the probes of
``AdaptiveK`` back off; a trial that pays resets it. What a loss can cost is thereby bounded
to ``min_steps`` steps per ever longer stretch of plain ones.

Greedy and sampling steps are kept apart, as in ``core.step_cost`` (their plain steps cost
differently). Pure logic.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from keyserve.core.step_cost import StepCostModel


@dataclass
class _Rate:
    """Exponentially decayed tokens and seconds: their ratio is the recent tokens per second."""

    tokens: float = 0.0
    seconds: float = 0.0
    steps: int = 0

    def add(self, tokens: float, seconds: float, decay: float) -> None:
        self.tokens = decay * self.tokens + tokens
        self.seconds = decay * self.seconds + seconds
        self.steps += 1

    @property
    def per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class _Bucket:
    interval: int
    plain: _Rate = field(default_factory=_Rate)
    drafting: _Rate = field(default_factory=_Rate)  # since the last verdict
    blocked: int = 0  # steps left without speculation
    losses: int = 0  # verdicts that turned speculation off (statistics, tests)

    @property
    def speedup(self) -> float:
        """Drafting steps' tokens per second over plain steps' (both seen at least once)."""
        return self.drafting.per_second / self.plain.per_second


class SpeculationGuard:
    """Turns speculation off at a batch-size bucket while it delivers fewer tokens per second
    than plain decoding there (module doc)."""

    def __init__(self, min_steps: int = 16, min_plain: int = 2, min_interval: int = 32,
                 max_interval: int = 1024, decay: float = 0.95, margin: float = 0.0) -> None:
        if not (min_steps >= 1 and min_plain >= 1):
            raise ValueError("need min_steps >= 1 and min_plain >= 1")
        if not 1 <= min_interval <= max_interval:
            raise ValueError("need 1 <= min_interval <= max_interval")
        if not 0.0 < decay <= 1.0 or not 0.0 <= margin < 1.0:
            raise ValueError("need 0 < decay <= 1 and 0 <= margin < 1")
        self.min_steps, self.min_plain = min_steps, min_plain
        self.min_interval, self.max_interval = min_interval, max_interval
        self.decay, self.margin = decay, margin
        self._buckets: dict[tuple[int, bool], _Bucket] = {}

    @staticmethod
    def _key(batch: int, sampled: bool) -> tuple[int, bool]:
        return StepCostModel.bucket_of(batch), sampled

    def _bucket(self, batch: int, sampled: bool) -> _Bucket:
        key = self._key(batch, sampled)
        b = self._buckets.get(key)
        if b is None:
            b = self._buckets[key] = _Bucket(interval=self.min_interval)
        return b

    def record(self, batch: int, seconds: float, tokens: int, drafted: bool, sampled: bool = False) -> None:
        """One decode step of ``batch`` sequences took ``seconds`` and emitted ``tokens``
        (``batch`` for a plain step; plus the accepted drafts for one that verified drafts);
        ``drafted``: whether any sequence drafted in it; ``sampled``: whether any row sampled."""
        if seconds <= 0 or batch < 1 or tokens < 0:
            return
        b = self._bucket(batch, sampled)
        if not drafted:
            b.plain.add(tokens, seconds, self.decay)
            return
        b.drafting.add(tokens, seconds, self.decay)
        if b.drafting.steps < self.min_steps or b.plain.steps < self.min_plain:
            return
        if b.speedup < 1.0 - self.margin:
            b.blocked = b.interval
            b.interval = min(2 * b.interval, self.max_interval)
            b.losses += 1
            b.drafting = _Rate()  # the next trial is judged on its own steps
        else:
            b.interval = self.min_interval

    def blocks(self, batch: int, sampled: bool = False) -> bool:
        """Should the next step at this batch size decode plainly (speculation is off there)?
        Each True counts one of the blocked steps."""
        b = self._buckets.get(self._key(batch, sampled))
        if b is None or b.blocked <= 0:
            return False
        b.blocked -= 1
        return True

    def speedup(self, batch: int, sampled: bool = False) -> float | None:
        """Drafting steps' tokens per second over plain steps' at this bucket, from the current
        trial's steps (None before both kinds were seen)."""
        b = self._buckets.get(self._key(batch, sampled))
        if b is None or not b.drafting.steps or not b.plain.steps:
            return None
        return b.speedup

    def losses(self, batch: int, sampled: bool = False) -> int:
        """How many times speculation was turned off at this bucket."""
        b = self._buckets.get(self._key(batch, sampled))
        return b.losses if b is not None else 0
