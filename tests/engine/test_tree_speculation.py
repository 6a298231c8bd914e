"""Tree speculation in the engine (``speculative_tree``; stories260K target, a perturbed copy as
the draft): greedy output equals the target alone for every shape, the sampled distribution
equals the target's exact one, seeded requests do not depend on their batch, and the KV of an
accepted path that was not the draft's first choice is moved where the next step reads it.

Mutation caught (checked by hand): the runner skipping ``_move_slots`` (greedy outputs diverge
after the first accepted second-choice node). The rows' masks and positions are checked against
transformers in ``test_tree_rows.py``, the drafter's tokens in ``test_tree_drafter.py``, the
walk's exactness per draw in ``tests/unit/test_spec_tree.py``."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from pydantic import ValidationError

from keyserve import LLM, SamplingParams
from keyserve.config import EngineConfig
from keyserve.engine.model_runner import ModelRunner

from tests.engine.test_speculative_engine import _exact_first_two, assert_counts_match

WORDS = "once upon a time there was a little girl named lily she loved to play outside in the park".split()


def _prompts(count: int) -> list[str]:
    rng = random.Random(3)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40))) for _ in range(count)]


@pytest.fixture(scope="module")
def target(stories_path: str) -> LLM:
    return LLM(stories_path, num_blocks=400)


@pytest.fixture
def moves(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many KV slots each tree verification moved (the real method runs)."""
    counts: list[int] = []
    real = ModelRunner._move_slots

    def counting(self: ModelRunner, pairs: list[tuple[int, int]]) -> None:
        counts.append(len(pairs))
        real(self, pairs)

    monkeypatch.setattr(ModelRunner, "_move_slots", counting)
    return counts


@pytest.mark.parametrize("shape", ["2x2", "3x2x1", "4", "1x1x1"])
def test_greedy_tree_equals_target(target: LLM, stories_path: str, draft_dir: str, shape: str,
                                   moves: list[int]) -> None:
    prompts = _prompts(12)
    lengths = [20 + (i * 7) % 30 for i in range(12)]
    alone = target.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths])
    llm = LLM(stories_path, num_blocks=400, draft=draft_dir, speculative_tree=shape)
    outs = llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths])
    for a, b in zip(alone, outs):
        assert b.token_ids == a.token_ids
    stats = llm.engine.speculative.stats
    assert stats.num_steps > 0 and stats.num_accepted_tokens > 0
    assert stats.mean_tokens_per_forward > 1.0
    if shape in ("2x2", "3x2x1"):  # some accepted path left the draft's first choices
        assert sum(moves) > 0
    if shape == "1x1x1":  # a chain laid out as a tree: always in place
        assert sum(moves) == 0
    engine = llm.engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    drafter = engine.speculative.drafter
    assert drafter.block_manager.num_free_blocks == drafter.block_manager.num_blocks
    assert not drafter.mirrors


def test_tree_depth_is_cut_to_the_tokens_left(target: LLM, stories_path: str, draft_dir: str) -> None:
    """max_tokens and stop tokens inside a verified path: the output is the target's, cut."""
    llm = LLM(stories_path, num_blocks=400, draft=draft_dir, speculative_tree="2x2x2")
    prompt = "once upon a time"
    [free] = target.generate(prompt, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    for n in (1, 2, 3, 5):
        [short] = llm.generate(prompt, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
        assert short.token_ids == free.token_ids[:n]
    stop = free.token_ids[9]
    [cut] = llm.generate(prompt, SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[stop]))
    assert cut.token_ids == free.token_ids[: free.token_ids.index(stop) + 1]


def test_tree_logprobs_are_the_targets(target: LLM, stories_path: str, draft_dir: str) -> None:
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=3)
    [a] = target.generate("lily went to the park", params)
    llm = LLM(stories_path, num_blocks=400, draft=draft_dir, speculative_tree="3x2")
    [b] = llm.generate("lily went to the park", params)
    a, b = a.outputs[0], b.outputs[0]
    assert b.token_ids == a.token_ids
    assert b.logprobs == pytest.approx(a.logprobs, abs=1e-4)
    assert len(b.top_logprobs) == len(a.top_logprobs) == 24
    for mine, theirs in zip(b.top_logprobs, a.top_logprobs):
        assert [t for t, _ in mine] == [t for t, _ in theirs]
        assert [v for _, v in mine] == pytest.approx([v for _, v in theirs], abs=1e-4)
    assert llm.engine.speculative.stats.num_accepted_tokens > 0


def test_sampled_tree_equals_target_exactly(stories_path: str, draft_dir: str) -> None:
    """Temperature 0.7, top-p 0.9, top-k 50: the first two tokens of 20,480 samples -- the
    second one from the first tree verification, a node the target's draw matched or the draw
    itself -- against the target's exact joint q(t1)·q(t2 | t1). Same power as the chain's test
    (``test_speculative_engine``): a 0.02 shift in any cell is >= 5.7 standard errors."""
    params = SamplingParams(n=64, max_tokens=4, temperature=0.7, top_p=0.9, top_k=50, ignore_eos=True)
    llm = LLM(stories_path, num_blocks=1400, max_num_seqs=512, draft=draft_dir, speculative_tree="3x2")
    prompt = llm.tokenizer.encode("the little dog")
    requests = 320
    outs = llm.generate([prompt] * requests, [params.model_copy(update={"seed": i}) for i in range(requests)])
    stats = llm.engine.speculative.stats
    assert stats.num_draft_tokens > 0 and 0 < stats.num_accepted_tokens
    counts = Counter((o.token_ids[0], o.token_ids[1]) for out in outs for o in out.outputs)
    n = sum(counts.values())
    assert n == requests * 64
    exact = _exact_first_two(stories_path, prompt, params)
    assert set(counts) <= set(exact), f"emitted outside the target's support: {set(counts) - set(exact)}"
    assert_counts_match(counts, exact, n)


def test_seeded_tree_request_is_the_same_alone_or_batched(stories_path: str, draft_dir: str) -> None:
    llm = LLM(stories_path, num_blocks=400, draft=draft_dir, speculative_tree="2x2")
    seeded = SamplingParams(max_tokens=60, temperature=1.0, seed=99, ignore_eos=True)
    partner = SamplingParams(max_tokens=90, temperature=0.0, ignore_eos=True)
    [alone] = llm.generate(["Once upon a time"], seeded)
    batched, _ = llm.generate(["Once upon a time", "The dog"], [seeded, partner])
    assert batched.token_ids == alone.token_ids


def test_budgeted_requests_verify_chains_beside_trees(stories_path: str, draft_dir: str) -> None:
    """A request under a KV budget verifies a chain in a tree engine: its output is what a
    chain engine (same draft, same K) gives it -- under a budget, speculation changes when
    evictions happen, so not the target alone's -- and its neighbour's is the target's."""
    budget = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, kv_policy="h2o", kv_budget=12)
    plain = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prompts = ["once upon a time there was a little girl named lily she loved to play", "the park"]
    [_, alone] = LLM(stories_path, num_blocks=400).generate(prompts, [budget, plain])
    chain = LLM(stories_path, num_blocks=400, draft=draft_dir, num_speculative_tokens=3)
    [chained, _] = chain.generate(prompts, [budget, plain])
    llm = LLM(stories_path, num_blocks=400, draft=draft_dir, num_speculative_tokens=3, speculative_tree="2x2")
    [budgeted, neighbour] = llm.generate(prompts, [budget, plain])
    assert budgeted.token_ids == chained.token_ids
    assert neighbour.token_ids == alone.token_ids
    assert llm.engine.speculative.stats.num_draft_tokens > 0


@pytest.mark.parametrize("bad", ["3x0", "x2", "", "64", "2xa"])
def test_bad_tree_shapes_are_refused(bad: str) -> None:
    with pytest.raises(ValidationError):
        EngineConfig.from_flat(speculative_tree=bad)


def test_tree_and_adaptive_k_combine() -> None:
    cfg = EngineConfig.from_flat(speculative_tree="2x2", adaptive_k=True)
    assert cfg.spec.speculative_tree == "2x2" and cfg.spec.adaptive_k
