"""Adaptive K (``core.adaptive_k``) on injected acceptances and step costs: it maximises
expected tokens per unit time with K = 0 allowed, follows the *measured* relative cost rather
than the weight-byte model, and while at K = 0 probes with exponential back-off. Each test
names the one-line mutation it catches."""

from __future__ import annotations

import pytest

from keyserve.core.adaptive_k import AdaptiveK, expected_tokens
from keyserve.core.step_cost import StepCostModel


def _tokens_per_time(alpha: float, k: int, cost) -> float:
    """The oracle, written out: (1 − α^{K+1}) / (1 − α) tokens for a step of cost(K) plain steps."""
    tokens = (1 - alpha ** (k + 1)) / (1 - alpha) if alpha < 1 else k + 1.0
    return tokens / (cost(k) if k else 1.0)


@pytest.mark.parametrize("alpha", [0.05, 0.3, 0.6, 0.8, 0.95])
@pytest.mark.parametrize("slope", [0.02, 0.2, 0.6, 1.5])
def test_best_maximises_tokens_per_unit_time_with_zero_allowed(alpha: float, slope: float) -> None:
    """Against a brute-force oracle over K = 0..8, for costs that make speculation pay and
    lose. Mutation caught: ``range(self.k_min, ...)`` → ``range(max(self.k_min, 1), ...)`` (K = 0
    never chosen: slower than plain where speculation loses)."""
    ak = AdaptiveK(k_min=0, k_max=8, prior_alpha=alpha, prior_weight=1.0)
    cost = lambda k: 1.0 + slope * k  # noqa: E731
    want = max(range(9), key=lambda k: (_tokens_per_time(alpha, k, cost), -k))
    assert ak.best(cost) == want
    assert (want == 0) == all(_tokens_per_time(alpha, k, cost) <= 1.0 for k in range(1, 9))


def test_measured_cost_overrides_the_weight_byte_model() -> None:
    """The weight-byte model (c = 0.05) says K = 4 pays at α = 0.5; the measured batch-8 step
    costs 2.6× plain at K = 1 (extra target rows are not free), so K = 0; at batch 1 the
    measured 1.1× lets it speculate. Mutation caught: ``cost = relative_cost or ...`` →
    ``cost = lambda k: 1.0 + self.cost_ratio * k`` (the measurement ignored)."""
    costs = StepCostModel(prior_cost_ratio=0.05)
    for _ in range(3):
        costs.record(8, 0, 0.078)
        costs.record(8, 1, 0.200)
        costs.record(1, 0, 0.020)
        costs.record(1, 1, 0.022)
    ak = AdaptiveK(k_min=0, k_max=4, cost_ratio=0.05, prior_alpha=0.5)
    assert ak.best() > 0  # the weight-byte model alone
    assert ak.best(lambda k: costs.relative_cost(k, 8)) == 0
    assert ak.best(lambda k: costs.relative_cost(k, 1)) > 0
    assert expected_tokens(0.5, 1) / costs.relative_cost(1, 8) < 1.0  # why: it really loses


def test_probes_at_zero_with_exponential_back_off() -> None:
    """While K = 0 it drafts ``probe_k`` after 4 steps, then after 8, 16, ... up to the cap.
    Mutations caught: ``min(2 * self._interval, ...)`` → ``self._interval`` (probes at a fixed
    rate forever); ``self._countdown -= 1`` dropped (never probes again: a draft that starts
    agreeing is never noticed)."""
    ak = AdaptiveK(k_min=0, k_max=4, prior_alpha=0.1, prior_weight=1.0, probe_k=1, min_interval=4, max_interval=32)
    cost = lambda k: 1.0 + 0.3 * k  # noqa: E731  a fresh sequence with an accepted probe would draft
    probes = []
    for step in range(1, 120):
        k = ak.choose(cost)
        assert k in (0, 1) and (k == 1) == ak.last_was_probe
        if k:
            probes.append(step)
            ak.observe([1], [0])  # the probe is rejected: α stays low
    gaps = [b - a for a, b in zip([0, *probes], probes)]
    assert gaps == [4, 8, 16, 32, 32, 32][: len(gaps)] and len(gaps) >= 5


def test_no_probe_where_even_an_accepted_one_could_not_pay() -> None:
    """Batch 8 on 2 cores: a K = 1 step costs 1.6 plain steps and the engine's α is 0.34, so
    a probe, even accepted, leaves the choice at 0 -- and its catch-up step costs 2-2.7 plain
    steps. No probe is drafted; where the step gets cheaper (a smaller batch) drafting comes
    back. Mutation caught: the ``_probe_could_pay`` check dropped (probes at 4, 12, 28, ...
    steps)."""
    ak = AdaptiveK(k_min=0, k_max=2, prior_alpha=0.34, prior_weight=8.0, min_interval=4, max_interval=16)
    batch8 = lambda k: 1.0 + 0.6 * k  # noqa: E731
    assert all(ak.choose(batch8) == 0 for _ in range(200))
    batch1 = lambda k: 1.0 + 0.2 * k  # noqa: E731  K = 1 pays at α 0.34 here
    assert any(ak.choose(batch1) for _ in range(17))


def test_a_draft_that_starts_agreeing_is_picked_up_again() -> None:
    """Accepted probes raise α until speculation pays again; then the back-off resets, so the
    next time it turns off it probes soon. Mutation caught: the reset
    ``self._interval = self._countdown = self.min_interval`` dropped (after a long off spell
    the next one would wait the old, long interval)."""
    ak = AdaptiveK(k_min=0, k_max=4, prior_alpha=0.05, prior_weight=1.0, probe_k=1, min_interval=2, max_interval=64)
    cost = lambda k: 1.0 + 0.3 * k  # noqa: E731  pays from α ≈ 0.3
    for _ in range(100):  # a long off spell: the interval grows to the cap
        if ak.choose(cost):
            ak.observe([1], [0])
    on_after = None
    for step in range(1, 400):
        k = ak.choose(cost)
        if k:
            ak.observe([k], [k])  # now the draft agrees on everything
        if k > 1:
            on_after = step
            break
    assert on_after is not None, "never speculated again"
    for _ in range(60):  # it disagrees again: off ...
        k = ak.choose(cost)
        if k:
            ak.observe([k], [0])
        if k == 0 and not ak.last_was_probe:
            break
    first_probe = next(step for step in range(1, 100) if ak.choose(cost))
    assert first_probe <= 2  # ... and probes after min_interval, not after 64 steps


def test_no_probe_when_k_max_is_zero_and_bad_arguments() -> None:
    ak = AdaptiveK(k_min=0, k_max=0, min_interval=1)
    assert all(ak.choose() == 0 for _ in range(10))
    with pytest.raises(ValueError):
        AdaptiveK(min_interval=0)


def test_leaving_k0_needs_a_margin_staying_does_not() -> None:
    """From K = 0 a K must promise ``switch_margin`` more than plain decoding (its first step
    pays a catch-up the cost model does not see); a K already running stays at a smaller gain.
    α pinned at 0.3 and c = 0.262: K = 1 promises 1.30 / 1.262 = 1.03x. Mutation caught: the
    margin check in ``choose`` dropped (it leaves 0 for 1.03x)."""
    ak = AdaptiveK(k_min=0, k_max=4, cost_ratio=0.262, prior_alpha=0.3, prior_weight=1e9, min_interval=64)
    assert ak.choose() == 1  # nothing before: the plain best
    assert ak.choose(lambda k: 1.0 + 5.0 * k) == 0  # speculation expensive for a while
    assert ak.choose() == 0  # 1.03x does not clear the 5 % margin from 0
    assert ak.choose(lambda k: 1.0 + 0.1 * k) > 0  # a clear gain leaves 0
    assert ak.choose() == 1  # and 1.03x keeps a running K


def test_the_prior_keeps_its_weight() -> None:
    """A sequence's α is held toward its prior (the engine's acceptance) by ``prior_weight``
    trials that never decay: a short run of rejections at an engine-wide α of 0.35 does not
    switch it off, a long one does. Mutation caught: the prior folded into the decayed counts
    (the old rule): after 6 rejected steps α falls to ~0.09 and K goes to 0."""
    cost = lambda k: 1.0 + 0.2 * k  # noqa: E731  K = 1 pays from α = 0.2 (1.2 / 1.2)
    ak = AdaptiveK(k_min=0, k_max=2, prior_alpha=0.35, prior_weight=8.0)
    assert ak.choose(cost) > 0
    for _ in range(6):
        ak.observe([1], [0])
    assert ak.alpha == pytest.approx(0.35 * 8 / (8 + sum(0.9**i for i in range(6))))
    assert ak.alpha > 0.2 and ak.choose(cost) > 0
    for _ in range(60):
        ak.observe([2], [0])
    assert ak.alpha < 0.2 and ak.choose(cost) == 0

