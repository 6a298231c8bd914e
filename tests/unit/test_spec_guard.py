"""The speculation guard (``core.spec_guard``) on injected step outcomes: speculation turned off
at a bucket once its drafting steps delivered fewer tokens per second than plain steps there,
for an interval that doubles on each loss and resets on a win. Each test names the one-line
mutation it catches."""

from __future__ import annotations

import pytest

from keyserve.core.spec_guard import SpeculationGuard


def _plain(guard: SpeculationGuard, batch: int, seconds: float, times: int = 4, sampled: bool = False) -> None:
    for _ in range(times):
        guard.record(batch, seconds, batch, drafted=False, sampled=sampled)


def _drafting(guard: SpeculationGuard, batch: int, seconds: float, tokens: int, times: int,
              sampled: bool = False) -> None:
    for _ in range(times):
        guard.record(batch, seconds, tokens, drafted=True, sampled=sampled)


def _blocked_steps(guard: SpeculationGuard, batch: int, sampled: bool = False) -> int:
    n = 0
    while guard.blocks(batch, sampled):
        n += 1
    return n


def test_a_loss_turns_speculation_off_for_the_interval() -> None:
    """Plain: 8 tokens per 1.0 s; drafting: 10 tokens per 1.5 s (0.83x). After min_steps
    drafting steps the bucket is blocked for min_interval steps, then open again. Mutation
    caught: ``speedup < 1.0 - self.margin`` → ``>`` (a loss would never block, a win would)."""
    guard = SpeculationGuard(min_steps=4, min_interval=8)
    _plain(guard, 8, 1.0)
    _drafting(guard, 8, 1.5, 10, times=3)
    assert not guard.blocks(8)  # 3 < min_steps: no verdict yet
    assert guard.speedup(8) == pytest.approx(10 / 1.5 / 8)
    _drafting(guard, 8, 1.5, 10, times=1)
    assert guard.losses(8) == 1
    assert _blocked_steps(guard, 8) == 8
    assert not guard.blocks(8)


def test_a_win_never_blocks() -> None:
    """Drafting steps at 12 tokens per 1.2 s against 8 per 1.0 s (1.25x): never blocked, over
    any number of steps. Mutation caught: the ``else`` branch blocking as well."""
    guard = SpeculationGuard(min_steps=4, min_interval=8)
    _plain(guard, 8, 1.0)
    _drafting(guard, 8, 1.2, 12, times=100)
    assert guard.losses(8) == 0 and not guard.blocks(8)


def test_losses_double_the_interval_and_a_win_resets_it() -> None:
    """Each loss blocks twice as long as the last (8, 16, 32, capped at 32); a trial that pays
    resets it to 8. Mutation caught: ``b.interval = min(2 * b.interval, ...)`` → ``b.interval``
    kept (a hopeless draft would cost min_steps in every 8 steps forever)."""
    guard = SpeculationGuard(min_steps=2, min_interval=8, max_interval=32)
    _plain(guard, 1, 1.0)
    blocked = []
    for _ in range(4):
        _drafting(guard, 1, 2.0, 1, times=2)
        blocked.append(_blocked_steps(guard, 1))
    assert blocked == [8, 16, 32, 32]
    _drafting(guard, 1, 0.5, 2, times=2)  # a trial that pays
    while guard.losses(1) == 4:  # then losing steps until the decayed rate turns below 1
        _drafting(guard, 1, 2.0, 1, times=1)
    assert _blocked_steps(guard, 1) == 8


def test_no_verdict_without_a_plain_baseline() -> None:
    """Before the bucket saw min_plain plain steps there is nothing to compare with: no block.
    Mutation caught: ``or b.plain.steps < self.min_plain`` dropped (a division by zero rate:
    every bucket blocked, or a crash)."""
    guard = SpeculationGuard(min_steps=2, min_plain=2)
    _plain(guard, 4, 1.0, times=1)
    _drafting(guard, 4, 5.0, 4, times=10)
    assert guard.losses(4) == 0 and not guard.blocks(4)


def test_buckets_and_greedy_or_sampled_steps_are_judged_apart() -> None:
    """A loss at batch 8 leaves batch 1 open, and a loss of greedy steps leaves sampling steps
    open (their plain steps cost differently). Mutation caught: the guard keyed by bucket only
    (``_key`` returning ``sampled`` as False: the sampling steps' win would mix with the
    greedy steps' loss)."""
    guard = SpeculationGuard(min_steps=2, min_interval=8)
    for sampled in (False, True):
        _plain(guard, 8, 1.0, sampled=sampled)
        _plain(guard, 1, 0.2, sampled=sampled)
    _drafting(guard, 8, 0.5, 12, times=2, sampled=True)  # 3x: sampling steps stay open
    _drafting(guard, 8, 2.0, 9, times=2)  # 0.56x: greedy steps at batch 8 are turned off
    assert guard.blocks(8)
    assert not guard.blocks(1) and not guard.blocks(8, sampled=True)
    assert guard.losses(8) == 1 and guard.losses(8, sampled=True) == 0


def test_bad_arguments() -> None:
    for kwargs in ({"min_steps": 0}, {"min_interval": 0}, {"min_interval": 9, "max_interval": 8},
                   {"decay": 0.0}, {"margin": 1.0}):
        with pytest.raises(ValueError):
            SpeculationGuard(**kwargs)
    guard = SpeculationGuard()
    guard.record(4, 0.0, 4, drafted=True)  # nothing measured: ignored
    guard.record(0, 1.0, 1, drafted=True)
    assert guard.speedup(4) is None and guard.speedup(1) is None
