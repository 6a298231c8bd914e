"""bench/spec_bench.py's step clock against a real engine: it wraps the engine's own methods
by name, so a rename in the engine (ModelRunner._sample -> sample did once) must fail here, not
at the start of a bench run. No timing is asserted: only that every phase is seen."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from keyserve import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.spec_bench import PHASES, StepClock  # noqa: E402


def test_the_step_clock_sees_every_phase_of_plain_and_speculative_steps(stories_path: str, draft_dir: str) -> None:
    llm = LLM(stories_path, num_blocks=200, draft=draft_dir, num_speculative_tokens=2)
    clock = StepClock(llm.engine)
    with torch.inference_mode():
        for speculative in (False, True):
            clock.reset()
            params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, speculative=speculative)
            llm.generate("Once upon a time", params)
            decode = [s for s in clock.steps if "prefill" not in s]
            assert decode, "no decode step was timed"
            seen = set().union(*decode)
            want = {"total", "target", "verify/sample"} | ({"draft", "draft_forward"} if speculative else set())
            assert want <= seen, f"phases never timed: {want - seen}"
            assert set(PHASES[:3]) - {"draft"} <= seen


def test_tree_rows_run_on_the_engine_and_are_rendered_beside_chains(stories_path: str, draft_dir: str) -> None:
    """``--trees``: a tree row really verifies trees (``tree_shape`` switches the engine's
    policy for the run and back), and the table measures it against plain decoding -- a tree
    row (K = 0) must not be taken for the plain baseline, and the fastest row may be a tree."""
    from bench.spec_bench import Row, render, tree_shape

    llm = LLM(stories_path, num_blocks=200, draft=draft_dir, num_speculative_tokens=3)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    with torch.inference_mode(), tree_shape(llm, "2x1"):
        [out] = llm.generate("Once upon a time", params)  # (keyserve_run sends chat prompts)
    drafted = out.stats.spec_draft_tokens
    assert drafted > 0 and drafted % 4 == 0  # 4 nodes a step, not chains of 3
    [out] = llm.generate("Once upon a time", params)
    assert out.stats.spec_draft_tokens % 3 == 0 and llm.engine.speculative.tree is None  # chains again
    rows = [Row("keyserve", 1, 0.0, 0, 100, 10.0), Row("keyserve", 1, 0.0, 1, 100, 8.0),
            Row("keyserve", 1, 0.0, 0, 100, 5.0, drafted=40, accepted=20, target_forwards=60, tree="3")]
    meta = dict(num_prompts=1, max_tokens=100, repeats=1, threads=2, transformers="-", load_before="-",
                load_after="-", wall_min=0.0, draft_params_m=1.0, target_params_m=10.0)
    text = render(rows, meta)
    assert "| 1 | 0 | 10.0 | tree 3: 20.0 | 2.00× |" in text  # plain 10 tok/s, the tree 20 tok/s
    assert "| keyserve | 1 | 0 | tree 3 |" in text
    # adaptive rows, chains' and a tree's: the summary quotes the faster, the verdicts name each
    rows += [Row("keyserve", 1, 0.0, 3, 100, 9.0, adaptive=True),
             Row("keyserve", 1, 0.0, 3, 100, 6.0, drafted=30, accepted=15, target_forwards=60, adaptive=True, tree="3")]
    text = render(rows, meta)
    assert "| adaptive tree 3: 16.7 (1.67×) |" in text
    assert "adaptive K (adaptive tree 3) never slower than plain, batch 1, T = 0.0: **met** (1.67×" in text
    assert "adaptive K (adaptive ≤ 3) never slower than plain, batch 1, T = 0.0: **met** (1.11×" in text
    assert "| keyserve adaptive | 1 | 0 | adaptive tree 3 |" in text


def test_adaptive_tree_rows_verify_trees_or_nothing(stories_path: str, draft_dir: str) -> None:
    """An adaptive tree row (``adaptive_k`` and ``tree_shape`` together, as the bench runs it)
    verifies trees of the shape or decodes plainly -- never chains -- and its output is the
    target's own (greedy)."""
    from bench.spec_bench import adaptive_k, tree_shape

    llm = LLM(stories_path, num_blocks=200, draft=draft_dir, num_speculative_tokens=3)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    [alone] = LLM(stories_path, num_blocks=200).generate("Once upon a time", params)
    with torch.inference_mode(), adaptive_k(llm, True), tree_shape(llm, "2x1"):
        [out] = llm.generate("Once upon a time", params)
    assert out.outputs[0].token_ids == alone.outputs[0].token_ids
    policy = llm.engine.speculative
    assert out.stats.spec_draft_tokens > 0
    assert set(policy.costs.estimates(1)) <= {0}  # no chain step: the chains' model saw only plain ones
    assert 2 in policy.tree_costs.estimates(1)  # tree steps (depth 2) measured for the trees' choice


def test_lookup_rows_and_slices_of_a_round_render_as_one_contender() -> None:
    """``--lookups``: a chain row with prompt lookup first is its own contender beside the same
    K without it, with the share of its drafts that were copies; ``--slices``: the parts of a
    round add up to one row (tokens, time and counts summed, so tok/s is the round's); the
    copies' and the model's acceptance apart (15 of 25 copies, 5 of 25 model drafts)."""
    from bench.spec_bench import Row, render

    first = Row("keyserve", 1, 0.0, 3, 60, 2.0, drafted=30, accepted=10, target_forwards=40, lookup=3,
                lookup_drafted=12, lookup_accepted=7)
    second = Row("keyserve", 1, 0.0, 3, 40, 3.0, drafted=20, accepted=10, target_forwards=25, lookup=3,
                 lookup_drafted=13, lookup_accepted=8)
    whole = first.merged(second)
    assert (whole.tokens, whole.seconds, whole.drafted, whole.lookup_drafted, whole.lookup_accepted) == (
        100, 5.0, 50, 25, 15)
    assert whole.contender == first.contender and first.tokens == 60  # the parts unchanged
    rows = [Row("keyserve", 1, 0.0, 0, 100, 10.0), Row("keyserve", 1, 0.0, 3, 100, 8.0, drafted=40, accepted=10,
                                                       target_forwards=70), whole]
    meta = dict(num_prompts=1, max_tokens=100, repeats=1, slices=2, threads=2, transformers="-", load_before="-",
                load_after="-", wall_min=0.0, draft_params_m=1.0, target_params_m=10.0)
    text = render(rows, meta)
    assert "| 1 | 0 | 10.0 | 3 + lookup ≤ 3: 20.0 | 2.00× |" in text  # the fastest chain is the lookup's
    assert "| keyserve | 1 | 0 | 3 | 100 | 12.5 |" in text
    assert "| keyserve | 1 | 0 | 3 + lookup ≤ 3 | 100 | 20.0 |" in text and "| 2.00× | – | 0.50 | 0.60 / 0.20 |" in text
    assert "each round in 2 slices of the prompts" in text
