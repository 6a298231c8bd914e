"""Adaptive K in the engine (stories260K target, its perturbed copy as the draft): with K = 0
allowed, greedy output stays the target's token for token while speculation switches off and
on; when the measured step cost says speculation loses the engine stops drafting (probes
aside), and when it pays it keeps drafting.

Step times are injected, never measured: the engine's real ``observe_step`` call is kept and
only its ``seconds`` replaced by a cost model's, so what the engine would do on a machine where
a speculative step costs that much is deterministic."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from keyserve import LLM, SamplingParams

WORDS = "once upon a time there was a little girl named lily she loved to play outside in the park".split()
K_MAX = 4


def _prompts(count: int) -> list[str]:
    rng = random.Random(7)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 30))) for _ in range(count)]


@pytest.fixture(scope="module")
def target(stories_path: str) -> LLM:
    return LLM(stories_path, num_blocks=400)


def _adaptive(stories_path: str, draft_dir: str) -> LLM:
    # c = 0.05: the weight-byte prior says speculation pays; only the injected costs say otherwise.
    return LLM(stories_path, num_blocks=400, draft=draft_dir, num_speculative_tokens=K_MAX,
               adaptive_k=True, draft_cost_ratio=0.05)


def _inject(llm: LLM, cost: Callable[[int, int], float],
            observed: list[tuple[int, int, int | None]] | None = None) -> list[dict[int, int]]:
    """Replace the measured step seconds by ``cost(batch, k)``; return the drafts asked for at
    every step (filled as the engine runs); ``observed`` gets each reported (batch, K,
    sequences that drafted)."""
    policy = llm.engine.speculative
    observe, lookaheads = policy.observe_step, policy.lookaheads
    asked: list[dict[int, int]] = []

    def observe_injected(batch: int, k: int, seconds: float, sampled: bool = False,
                         drafting: int | None = None, trees: int = 0, copies: int = 0,
                         rows: int | None = None) -> None:
        if observed is not None:
            observed.append((batch, k, drafting))
        observe(batch, k, cost(batch, k), sampled, drafting, trees, copies, rows)

    def lookaheads_spy(seqs, max_model_len):
        asked.append(lookaheads(seqs, max_model_len))
        return asked[-1]

    policy.observe_step = observe_injected
    policy.lookaheads = lookaheads_spy
    return asked


def _dear(batch: int, k: int) -> float:
    return 1.0 + 2.0 * k  # every draft costs two plain steps: no acceptance makes that pay


def _cheap(batch: int, k: int) -> float:
    return 1.0 + 0.01 * k


def test_greedy_output_is_the_targets_while_k_switches_off_and_on(
    target: LLM, stories_path: str, draft_dir: str
) -> None:
    """The injected cost flips between cheap and dear every 20 steps, so sequences go to K = 0,
    probe, come back with a draft that must catch up, and drafts of every K up to the cap
    are verified. Output equals the target alone's; both pools are empty after. Mutation
    caught: the greedy accept rule ``ids == argmax[:, :max_draft]`` → ``<=`` in
    ``verify_drafts`` (a draft id at or below the target's argmax accepted). The step cost
    model is told how many sequences of each step drafted (steps where only some did are
    scaled to all of them); mutation caught: the engine reporting the batch size instead."""
    llm = _adaptive(stories_path, draft_dir)
    steps = [0]

    def flipping(batch: int, k: int) -> float:
        steps[0] += 1
        return (_cheap if (steps[0] // 20) % 2 == 0 else _dear)(batch, k)

    observed: list[tuple[int, int, int | None]] = []
    asked = _inject(llm, flipping, observed)
    prompts = _prompts(8)
    params = [SamplingParams(max_tokens=60 + 7 * i, temperature=0.0, ignore_eos=True) for i in range(8)]
    outs = llm.generate(prompts, params)
    alone = target.generate(prompts, params)
    assert [o.token_ids for o in outs] == [a.token_ids for a in alone]
    ks = {k for a in asked for k in a.values()}
    assert {1, K_MAX} <= ks, ks  # probes and full speculation both ran
    assert sum(1 for a in asked if not a) > 10  # and steps with no drafts at all
    assert all(d == 0 if k == 0 else d is not None and 1 <= d <= b for b, k, d in observed), observed
    assert any(k and d < b for b, k, d in observed) and any(k and d == b for b, k, d in observed)
    engine = llm.engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    drafter = engine.speculative.drafter
    assert drafter.block_manager.num_free_blocks == drafter.block_manager.num_blocks
    assert not engine.speculative._adaptive and not engine.speculative._last_k


def _drafting_steps(stories_path: str, draft_dir: str, cost, prompts: list[str]) -> tuple[list[dict[int, int]], list]:
    llm = _adaptive(stories_path, draft_dir)
    asked = _inject(llm, cost)
    params = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    return asked, outs


def test_engine_stops_drafting_when_the_step_cost_says_speculation_loses(
    target: LLM, stories_path: str, draft_dir: str
) -> None:
    """Dear speculation (injected): after the first steps only back-off probes of one draft
    remain, fewer and fewer; the output is still the target's. Cheap speculation: it keeps
    drafting. Mutations caught: ``k_min=0`` → ``k_min=1`` in ``SpeculativeDecoder.lookahead``
    (drafts forever); the engine's ``self._observe_step_cost(...)`` call dropped (no
    measurement: the 0.05 weight-byte prior says speculate, so it never stops)."""
    prompts = _prompts(4)
    asked, outs = _drafting_steps(stories_path, draft_dir, _dear, prompts)
    alone = target.generate(prompts, SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in outs] == [a.token_ids for a in alone]
    later = asked[20:]
    assert len(later) > 60
    drafting = [i for i, a in enumerate(later) if a]
    assert all(k == 1 for a in later for k in a.values())  # probes only
    assert len(drafting) <= 5, drafting
    gaps = [b - a for a, b in zip(drafting, drafting[1:])]
    assert gaps == sorted(gaps)  # backing off

    asked, _ = _drafting_steps(stories_path, draft_dir, _cheap, prompts)
    later = asked[20:]
    assert sum(1 for a in later if a) >= 0.8 * len(later)
    assert max(k for a in later for k in a.values()) > 1


def test_the_first_decode_step_after_a_prompt_is_not_a_cost_sample(stories_path: str, draft_dir: str) -> None:
    """The first decode step after a prompt's forward pays one-off costs (2x a steady step at
    batch 8 on 2 cores); as a plain baseline it made K = 1 look free. So the step right after
    one with a prompt chunk is never reported, and every later decode step is. Mutation caught:
    ``if after_prompt: return`` dropped (that step is reported)."""
    llm = _adaptive(stories_path, draft_dir)
    observed: list[tuple[int, int, int | None]] = []
    _inject(llm, _cheap, observed)
    engine = llm.engine
    step = engine.step
    kinds: list[tuple[bool, bool]] = []  # (had a prompt chunk, was reported)

    def spy():  # noqa: ANN202
        before = len(observed)
        out = step()
        items = engine._running_step.items if engine._running_step is not None else []
        kinds.append((any(it.num_new_tokens != 1 for it in items), len(observed) > before))
        return out

    engine.step = spy
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    llm.generate(_prompts(2), params)
    llm.generate(_prompts(3), params)  # a second prompt phase, after decode steps
    after = [i for i in range(1, len(kinds)) if kinds[i - 1][0] and not kinds[i][0]]
    assert len(after) >= 2
    assert not any(kinds[i][1] for i in after)
    later = [i for i in range(1, len(kinds)) if not kinds[i - 1][0] and not kinds[i][0]]
    assert later and all(kinds[i][1] for i in later)
