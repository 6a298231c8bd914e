"""Which batch failures are worth another try, and how long to wait before it.

A transient failure (the server was busy, a step failed, the request ran out of time) says
nothing about the line itself: it is retried with exponential backoff, and a line that still
fails after the last attempt gets no record at all, so the next run of the job tries it again.
A permanent failure (4xx: a bad line, a bad body, a prompt too long) is the line's answer and
is recorded as its final result.
"""

from __future__ import annotations

import math

import random
from dataclasses import dataclass

# HTTP statuses that are about the server's state, not about the request.
TRANSIENT_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


def is_transient(record: dict) -> bool:
    """Whether an output record reports a failure that another attempt may not have."""
    response = record.get("response")
    return record.get("error") is None and response is not None and response["status_code"] in TRANSIENT_STATUSES


@dataclass(frozen=True)
class RetryPolicy:
    """``max_attempts`` tries per line per run; the wait before try ``k + 1`` is
    ``backoff_s * 2**(k - 1)``, capped at ``max_backoff_s``, times a jitter in [0.5, 1]."""

    max_attempts: int = 5
    backoff_s: float = 1.0
    max_backoff_s: float = 60.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if not (math.isfinite(self.backoff_s) and math.isfinite(self.max_backoff_s)):
            raise ValueError(f"backoff_s and max_backoff_s must be finite, got {self.backoff_s}, {self.max_backoff_s}")
        if not (0 <= self.backoff_s <= self.max_backoff_s):
            raise ValueError(f"need 0 <= backoff_s <= max_backoff_s, got {self.backoff_s}, {self.max_backoff_s}")

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """Seconds to wait after failed attempt number ``attempt`` (1-based)."""
        base = min(self.max_backoff_s, self.backoff_s * 2 ** min(attempt - 1, 32))
        return base * (0.5 + 0.5 * (rng or random).random())
