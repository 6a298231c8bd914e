"""How many drafts a sequence should get next step: K from its running acceptance and the cost
of a speculative step, K = 0 (no speculation) included.

Why: speculation must never be slower than plain decoding. A step with K drafts yields
E[tokens | α, K] = 1 + α + … + α^K per sequence and costs ``relative_cost(K)`` plain steps
(measured: ``core.step_cost.StepCostModel``; by default the weight-byte model 1 + c·K). The
chooser maximises tokens per unit time, E[tokens | α, K] / relative_cost(K); K = 0 scores 1,
so when no K beats plain decoding it picks 0.

While K = 0 the sequence drafts nothing, so α would never move again and a draft that starts
agreeing (another part of the answer, a quoted passage) would be missed. So it probes: after
``min_interval`` steps at K = 0 it drafts ``probe_k`` tokens once, and each probe that still
leaves the choice at 0 doubles the wait (up to ``max_interval``), as the thread governor
(``core.thread_governor``) backs off its tries; a choice above 0 resets it. A probe that could
not change the choice even if every draft in it were accepted is skipped (its wait doubles
all the same): where a K = 1 step costs 1.6 plain steps, no single probe moves α from 0.34 to
the 0.65 K = 1 would need, and the probes' catch-up steps were all speculation cost there.

Pure logic: the caller reports acceptances and supplies the relative cost.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


def expected_tokens(alpha: float, k: int) -> float:
    """E[tokens per target forward] with K drafts each accepted w.p. α independently:
    1 + α + … + α^K = (1 − α^{K+1}) / (1 − α)."""
    return sum(alpha**i for i in range(k + 1))


def expected_speedup(alpha: float, k: int, cost_ratio: float) -> float:
    """Tokens per unit time relative to plain decoding under the weight-byte model: a step
    costs K draft forwards (c each) plus one target forward (1)."""
    return expected_tokens(alpha, k) / (cost_ratio * k + 1.0)


def draft_counts(
    num_draft: torch.Tensor | int | list[int],  # [num_seqs], [1] or a scalar
    num_accepted: torch.Tensor | list[int],  # [num_seqs]
) -> tuple[list[int], list[int]]:
    """(drafted, accepted) per sequence as Python ints, ``num_draft`` broadcast to every
    sequence. The engine records one sequence at a time with ints: no tensor is built for
    them (four small tensors and five ``.item()`` a sequence were ~70 us of the step's
    Python per sequence)."""
    acc = num_accepted.tolist() if isinstance(num_accepted, torch.Tensor) else [int(a) for a in num_accepted]
    if isinstance(num_draft, torch.Tensor):
        num_draft = num_draft.tolist()
    drafted = [int(num_draft)] if isinstance(num_draft, int) else [int(d) for d in num_draft]
    if len(drafted) == 1 and len(acc) != 1:
        drafted = drafted * len(acc)
    if len(drafted) != len(acc):
        raise ValueError(f"{len(drafted)} draft counts for {len(acc)} sequences")
    return drafted, acc


def _as_counts(
    num_draft: torch.Tensor | int | list[int],  # [num_seqs] or a scalar
    num_accepted: torch.Tensor | list[int],  # [num_seqs]
) -> tuple[int, int]:
    """(accepted, rejections): drafts accepted, and steps that ended in a rejected draft."""
    drafted, acc = draft_counts(num_draft, num_accepted)
    return sum(acc), sum(a < d for a, d in zip(acc, drafted))


@dataclass
class AdaptiveK:
    """Per-sequence K in [k_min, k_max] (see the module doc). Call ``choose`` once per step.

    α is estimated as (accepted + prior_alpha·prior_weight) / (tested + prior_weight) over
    exponentially decayed counts (tokens after a rejection are never tested). The prior -- the
    engine's recent acceptance, for a sequence the engine starts -- keeps its weight instead of
    decaying away: with ~10 effective trials of its own, a sequence's estimate swings by ±0.15
    at α ≈ 0.35, and near break-even (batch 1, float32) such dips switched sequences to K = 0,
    where probes back off: adaptive K made 0.99x plain decoding while fixed K = 1 made 1.08x.
    Held toward the engine's α, a sequence leaves K = 0 only when its own drafts keep failing.
    """

    k_min: int = 1
    k_max: int = 8
    cost_ratio: float = 0.1  # c = one draft forward / one target forward (the default cost model)
    decay: float = 0.9  # weight of the past per observe() call
    prior_alpha: float = 0.7
    prior_weight: float = 8.0  # trials the prior is worth, always (see the class doc)
    probe_k: int = 1  # drafts of a probe while K = 0
    min_interval: int = 4  # steps at K = 0 before the first probe
    max_interval: int = 256
    # Leaving K = 0 costs a catch-up step the cost model does not see (the draft first reads
    # what it skipped), so from 0 a K must promise this much more than plain decoding. Near the
    # break-even (batch 1, float32, a draft accepted ~0.3 of the time) K flipped between 0 and
    # 1-2 and lost 3-4 % to catch-ups while fixed K = 1 was even.
    switch_margin: float = 0.05
    last_was_probe: bool = field(init=False, default=False)
    _last: int = field(init=False, default=-1)  # the previous choice (-1: none yet)
    _accepted: float = field(init=False)
    _tested: float = field(init=False)
    _interval: int = field(init=False)
    _countdown: int = field(init=False)

    def __post_init__(self) -> None:
        if not 0 <= self.k_min <= self.k_max:
            raise ValueError("need 0 <= k_min <= k_max")
        if not 1 <= self.min_interval <= self.max_interval:
            raise ValueError("need 1 <= min_interval <= max_interval")
        self._accepted = 0.0  # decayed observations only; the prior is added in ``alpha``
        self._tested = 0.0
        self._interval = self._countdown = self.min_interval

    def observe(
        self,
        num_draft: torch.Tensor | int | list[int],  # [num_seqs] or scalar
        num_accepted: torch.Tensor | list[int],  # [num_seqs]
    ) -> None:
        accepted, rejections = _as_counts(num_draft, num_accepted)
        self._accepted = self.decay * self._accepted + accepted
        self._tested = self.decay * self._tested + accepted + rejections

    @property
    def tested(self) -> float:
        """Decayed drafts tested so far, the prior's weight included."""
        return self._tested + self.prior_weight

    @property
    def alpha(self) -> float:
        total = self._tested + self.prior_weight
        return (self._accepted + self.prior_alpha * self.prior_weight) / total if total > 0 else self.prior_alpha

    def _rate(self, relative_cost: Callable[[int], float] | None,
              alpha: float | None = None) -> Callable[[int], float]:
        """K -> expected tokens per unit time, relative to plain decoding (K = 0 scores 1), at
        acceptance ``alpha`` (default: this sequence's estimate)."""
        cost = relative_cost or (lambda k: 1.0 + self.cost_ratio * k)
        alpha = min(max(self.alpha if alpha is None else alpha, 0.0), 1.0)
        return lambda k: expected_tokens(alpha, k) / (cost(k) if k else 1.0)

    def best(self, relative_cost: Callable[[int], float] | None = None) -> int:
        """The K in [k_min, k_max] with the most expected tokens per unit time (smallest on
        ties); ``relative_cost(K)``: a K-draft step over a plain one (default 1 + c·K)."""
        rate = self._rate(relative_cost)
        ks = range(self.k_min, self.k_max + 1)
        return max(ks, key=lambda k: (rate(k), -k))

    def choose(self, relative_cost: Callable[[int], float] | None = None) -> int:
        """``best``, except that from K = 0 it moves only for a gain above ``switch_margin``,
        and at K = 0 it drafts ``probe_k`` now and then (module doc); ``last_was_probe`` says
        whether this choice was such a probe."""
        k = self.best(relative_cost)
        if k > 0 and self._last == 0 and self._rate(relative_cost)(k) < 1.0 + self.switch_margin:
            k = 0
        self._last = k
        self.last_was_probe = False
        if k > 0:
            self._interval = self._countdown = self.min_interval
            return k
        self._countdown -= 1
        if self._countdown > 0 or self.k_max == 0:
            return 0
        self._interval = min(2 * self._interval, self.max_interval)
        self._countdown = self._interval
        if not self._probe_could_pay(relative_cost):
            return 0  # a hopeless probe is skipped; the wait still doubles
        self.last_was_probe = True
        return min(max(self.probe_k, 1), self.k_max)

    def _probe_could_pay(self, relative_cost: Callable[[int], float] | None) -> bool:
        """Whether a probe could take a sequence off K = 0: a fresh sequence (the prior alone,
        none of this one's own failures) whose probe drafts were all accepted would then pick
        a K > 0.

        If not, the probe can only cost: its step makes the draft catch up on everything it
        skipped, for every sequence whose wait ran out. Measured at batch 8 on 2 cores (a K = 1
        step 1.6x a plain one, so K = 1 needs α above ~0.65 against the engine's 0.34): the
        sequences' probes came due together, each such step cost 2-2.7 plain steps, and
        adaptive K made 0.91x plain decoding while never drafting otherwise. The sequence's own
        failures are left out on purpose: they would also veto the probes that notice a draft
        which starts agreeing again."""
        n = min(max(self.probe_k, 1), self.k_max)
        rate = self._rate(relative_cost, (n + self.prior_alpha * self.prior_weight) / (n + self.prior_weight))
        return max(rate(k) for k in range(max(self.k_min, 1), self.k_max + 1)) >= 1.0 + self.switch_margin
