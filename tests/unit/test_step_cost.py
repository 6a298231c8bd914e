"""The step cost model (``core.step_cost``) on injected step times: measured ratios per batch
bucket, exponential decay, a line for unmeasured K, the prior without a baseline, and the
plain-baseline refresh with back-off. Each test names the one-line mutation it catches."""

from __future__ import annotations

import pytest

from keyserve.core.step_cost import StepCostModel


def _feed(model: StepCostModel, batch: int, k: int, seconds: float, times: int = 3) -> None:
    for _ in range(times):
        model.record(batch, k, seconds)


def test_relative_cost_is_the_measured_ratio_per_batch_bucket() -> None:
    """Mutations caught: ``bucket_of`` returning one bucket for every batch (batch 8's cost
    would mix with batch 1's); ``own / plain`` replaced by the prior (1 + c·K)."""
    m = StepCostModel(prior_cost_ratio=0.05)
    _feed(m, 1, 0, 0.010)
    _feed(m, 1, 4, 0.015)
    _feed(m, 8, 0, 0.020)
    _feed(m, 8, 4, 0.060)
    assert m.relative_cost(4, 1) == pytest.approx(1.5)
    assert m.relative_cost(4, 8) == pytest.approx(3.0)
    assert m.relative_cost(4, 6) == pytest.approx(3.0)  # 5..8 share a bucket
    assert m.relative_cost(0, 8) == 1.0
    assert [StepCostModel.bucket_of(b) for b in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [0, 1, 2, 2, 3, 3, 4, 4, 5]


def test_decayed_mean_matches_weighted_oracle() -> None:
    """The estimate is Σ decayᵃᵍᵉ·x / Σ decayᵃᵍᵉ, so a shift in step time is followed.
    Mutation caught: ``self.total = decay * self.total + x`` → ``self.total += x`` (with the
    weight still decayed the mean is wrong; with both undecayed it would be the plain mean,
    16.7 ms here, far from the oracle's)."""
    decay = 0.8
    m = StepCostModel(prior_cost_ratio=0.1, decay=decay, max_jump=float("inf"))  # no clip: the mean alone
    xs = [0.010] * 5 + [0.020] * 10
    for x in xs:
        m.record(1, 0, x)
    n = len(xs)
    weights = [decay ** (n - 1 - i) for i in range(n)]
    oracle = sum(w * x for w, x in zip(weights, xs)) / sum(weights)
    assert m.estimates(1)[0] == pytest.approx(oracle)
    assert oracle > 0.019  # the old regime has nearly faded


def test_unmeasured_k_comes_from_the_line_through_measured_ones() -> None:
    """K = 2 measured at 1.4× plain: K = 4 is estimated at 1.8×, K = 1 at 1.2×. Mutation caught:
    ``return ... if den else prior`` → ``return prior`` (the weight-byte prior would say 1.2×
    at K = 4, hiding what extra rows cost)."""
    m = StepCostModel(prior_cost_ratio=0.05)
    _feed(m, 8, 0, 0.010)
    _feed(m, 8, 2, 0.014)
    assert m.relative_cost(4, 8) == pytest.approx(1.8)
    assert m.relative_cost(1, 8) == pytest.approx(1.2)
    assert m.relative_cost(2, 8) == pytest.approx(1.4)


def test_prior_until_a_baseline_and_enough_samples() -> None:
    """No plain step at this bucket, or fewer than ``min_samples`` of a K: the prior 1 + c·K.
    Mutation caught: ``m.count >= self.min_samples`` → ``m.count >= 1`` (one noisy step would
    decide)."""
    m = StepCostModel(prior_cost_ratio=0.1, min_samples=2)
    _feed(m, 1, 3, 0.050)
    assert m.relative_cost(3, 1) == pytest.approx(1.3)  # no baseline
    m.record(1, 0, 0.010)
    assert m.relative_cost(3, 1) == pytest.approx(1.3)  # one plain step is not enough
    m.record(1, 0, 0.010)
    assert m.relative_cost(3, 1) == pytest.approx(5.0)


def test_relative_cost_is_at_least_one() -> None:
    """A speculative step measured cheaper than a plain one is noise. Mutation caught:
    ``max(1.0, own / plain)`` → ``own / plain``."""
    m = StepCostModel(prior_cost_ratio=0.1)
    _feed(m, 1, 0, 0.010)
    _feed(m, 1, 1, 0.009)
    assert m.relative_cost(1, 1) == 1.0


def test_wants_plain_for_a_baseline_then_refreshes_with_back_off() -> None:
    """Plain steps until the bucket has ``min_samples``; then one after every ``interval``
    speculative steps, the interval doubling per refresh. Mutations caught: the doubling
    ``min(2 * b.interval, ...)`` → ``b.interval``; ``b.since_plain = 0`` dropped."""
    m = StepCostModel(prior_cost_ratio=0.1, min_samples=2, min_interval=4, max_interval=16)
    assert m.wants_plain(1)
    m.record(1, 0, 0.01)
    assert m.wants_plain(1)
    m.record(1, 0, 0.01)
    assert not m.wants_plain(1)
    asked = []
    for step in range(60):
        if m.wants_plain(1):
            asked.append(step)
            m.record(1, 0, 0.01)
        else:
            m.record(1, 2, 0.02)
    # 4 speculative steps, a refresh, 8, a refresh, 16, a refresh, 16 (the cap) ...
    assert asked == [4, 13, 30, 47]
    assert m.wants_plain(8)  # another bucket has its own baseline to measure


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        StepCostModel(prior_cost_ratio=0.1, decay=1.0)
    with pytest.raises(ValueError):
        StepCostModel(prior_cost_ratio=0.1, min_interval=8, max_interval=4)
    m = StepCostModel(prior_cost_ratio=0.1)
    m.record(1, 0, -1.0)  # a clock that went backwards is ignored
    assert m.estimates(1) == {}


def test_a_one_off_stall_is_clipped() -> None:
    """Once a K has its samples, a step slower than 1.25x its mean counts as 1.25x: one 3x
    stall moves cost(1)/cost(0) from 1.25 to ~1.34, not to ~2.0, while a lasting change still
    moves it within a few steps. Mutation caught: the clip dropped (~2.0 after the stall)."""
    m = StepCostModel(prior_cost_ratio=0.1, decay=0.8)
    for _ in range(4):
        m.record(1, 0, 0.020)
        m.record(1, 1, 0.025)
    assert m.relative_cost(1, 1) == pytest.approx(1.25)
    m.record(1, 1, 0.075)  # a stall
    assert m.relative_cost(1, 1) < 1.36
    for _ in range(12):  # the step really got dearer
        m.record(1, 1, 0.040)
    assert m.relative_cost(1, 1) > 1.9


def test_greedy_and_sampled_steps_keep_their_own_baselines() -> None:
    """A sampled plain step (softmax, top-p over the vocabulary per row) costs more than a
    greedy one; each kind divides by its own baseline, so a sampled baseline never makes greedy
    speculation look cheap. Mutation caught: the ``sampled`` part of the bucket key dropped
    (greedy K = 2 reads 38/30.7 = 1.24x instead of 38/24 = 1.58x)."""
    m = StepCostModel(prior_cost_ratio=0.1)
    for _ in range(3):
        m.record(8, 0, 0.024)
        m.record(8, 2, 0.038)
        m.record(8, 0, 0.035, sampled=True)
        m.record(8, 2, 0.050, sampled=True)
    assert m.relative_cost(2, 8) == pytest.approx(0.038 / 0.024)
    assert m.relative_cost(2, 8, sampled=True) == pytest.approx(0.050 / 0.035)
    assert m.estimates(8) == {0: pytest.approx(0.024), 2: pytest.approx(0.038)}
    assert not m.wants_plain(8) and m.wants_plain(4, sampled=True)


def test_a_step_where_some_sequences_drafted_is_scaled_to_all_of_them() -> None:
    """K's cost is what a step costs when every sequence drafts K (each sequence's choice is
    weighed against it): 2 of 8 drafting at +12.5 % means all 8 at +50 %. Mutation caught:
    the ``(seconds - plain) / weight`` scaling dropped (the ratio reads 1.125, and at batch 8
    adaptive K kept drafting at 0.75x plain decoding)."""
    m = StepCostModel(prior_cost_ratio=0.05, max_jump=float("inf"))
    _feed(m, 8, 0, 1.0)
    for _ in range(3):
        m.record(8, 1, 1.125, drafting=2)
    assert m.relative_cost(1, 8) == pytest.approx(1.5)
    for _ in range(3):  # all drafting (drafting == batch, or not given): taken as measured
        m.record(8, 2, 1.6, drafting=8)
    assert m.relative_cost(2, 8) == pytest.approx(1.6)


def test_a_step_where_few_drafted_weighs_as_little() -> None:
    """A step in which 1 of 8 sequences drafted weighs 1/8 of a sample: its scaled-up time is
    8x as noisy. Mutation caught: ``mean.add(seconds, self.decay, weight)`` back to a full
    sample (one such step pulls the mean from 1.5 to 1.36 instead of 1.48)."""
    decay = 0.8
    m = StepCostModel(prior_cost_ratio=0.05, decay=decay, max_jump=float("inf"))
    _feed(m, 8, 0, 1.0)
    _feed(m, 8, 1, 1.5, times=5)
    m.record(8, 1, 1.0, drafting=1)  # no visible extra cost: scaled, still 1.0 (no clip here)
    w = sum(decay**i for i in range(5))
    d = decay**0.125  # it displaces an eighth of what a full sample would
    oracle = (d * w * 1.5 + 0.125 * 1.0) / (d * w + 0.125)
    assert m.relative_cost(1, 8) == pytest.approx(oracle)
    assert m.relative_cost(1, 8) > 1.48


def test_partly_drafting_steps_noisy_both_ways_average_to_their_cost() -> None:
    """1 of 8 sequences drafting at a true +6.25 % (all 8: 1.5x), each step ±10 % of noise:
    scaled up, samples of 2.3x and 0.7x. Their mean must stay near 1.5, over many of them (each
    is an eighth of the evidence). Mutations caught: ``decay ** weight`` back to ``decay`` (the
    last few samples rule: 1.25 after a low one); the low clip of scaled samples dropped (only
    the high ones clipped: the mean sinks to ~1.0, where the copies at batch 8 read as free)."""
    m = StepCostModel(prior_cost_ratio=0.0, decay=0.8)
    _feed(m, 8, 0, 1.0)
    for i in range(80):
        m.record(8, 1, 1.0625 + (0.1 if i % 2 else -0.1), drafting=1)
    assert 1.4 < m.relative_cost(1, 8) < 1.65


def test_fit_splits_a_drafting_step_into_a_fixed_part_and_a_part_per_row() -> None:
    """A drafting step costs plain + 10 ms once + 1 ms per drafted row (the shape measured at
    batch 8: a lone copier paid ~8.6 ms). Steps of 8, 16 and 24 rows with ±0.5 ms of noise; the
    fit must give back ~10 ms and ~1 ms/row, and so a lone drafter's step at 3 rows ~13 ms,
    where the per-K means (scaled to all 8 drafting) say nothing about it. None before
    ``min_fit`` drafting steps. Mutations caught: ``extra_seconds`` through the origin (slope
    only: 3 rows read as ~4.4 ms); the fit fed the scaled seconds instead of the step's own (the
    fixed part read ~8x)."""
    m = StepCostModel(prior_cost_ratio=0.0, min_fit=8)
    _feed(m, 8, 0, 0.080)
    assert m.extra_seconds(3, 8) is None
    for i in range(30):
        k = 1 + i % 3
        m.record(8, k, 0.080 + 0.010 + 0.001 * 8 * k + (0.0005 if i % 2 else -0.0005), rows=8 * k)
    fixed, per_row = m.fit_line(8)
    assert fixed == pytest.approx(0.010, abs=0.001) and per_row == pytest.approx(0.001, abs=0.0001)
    assert m.extra_seconds(3, 8) == pytest.approx(0.013, abs=0.001)
    assert m.extra_seconds(3, 2) is None  # another bucket: nothing measured there
    assert m.plain_seconds(8) == pytest.approx(0.080)


def test_fit_of_one_row_count_reads_the_whole_cost_as_fixed() -> None:
    """Every drafting step had 3 rows: fixed and per-row cannot be told apart, and the cost at
    3 rows must come back whole (all of it fixed: the drafters of a step pay it together), and
    a stall is clipped. Mutation caught: the degenerate branch of ``_Fit.line`` dropped (a
    division by ~0: the prediction is nan or wild)."""
    m = StepCostModel(prior_cost_ratio=0.0, min_fit=4, max_jump=1.25)
    _feed(m, 8, 0, 0.080)
    for _ in range(10):
        m.record(8, 3, 0.093, drafting=1, rows=3)
    assert m.fit_line(8) == pytest.approx((0.013, 0.0), abs=1e-9)
    m.record(8, 3, 10.0, drafting=1, rows=3)  # a 10 s stall counts as 1.25 x 93 ms
    assert m.extra_seconds(3, 8) < 0.020
