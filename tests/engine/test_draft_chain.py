"""Greedy draft forwards chained without the runner's ``execute`` (``engine/draft_chain.py``):
every proposal equals the one the runner's own path makes. The oracle is that path, on the same
engine, over the same requests: drafts never change a greedy output, so only a comparison of the
proposals themselves can catch a wrong draft (it would only lower acceptance).

The default target and its committed draft (a pruned 8,192-token head, argmaxed over its own
tokens), 4-token blocks so that rows' block tables grow inside a proposal, and a different K per
request so that rows leave the chain mid-proposal. Mutations caught: the positions not moved on
(``inputs.positions + 1`` -> ``inputs.positions``), the block table not refreshed when a row's
grew (``tables`` ignored), the pruned argmax not mapped back to token ids."""

from __future__ import annotations

import pytest
import torch
from helpers.proposals import recorded_proposals

from keyserve import LLM, SamplingParams
from keyserve.engine import draft_chain, drafter as drafter_module

PROMPTS = [
    "Write a haiku about the sea.",
    "What is the capital of France?",
    "List three prime numbers.",
    "Explain what a compiler does in one sentence.",
]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(draft="default", num_speculative_tokens=6, adaptive_k=False, block_size=4)


def _params(ks: tuple[int, ...], max_tokens: int = 40) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, num_speculative_tokens=k)
            for k in ks]


def _proposals(llm: LLM, chained: bool) -> tuple[list, list[list[int]]]:
    return recorded_proposals(llm, PROMPTS, _params((6, 3, 5, 2)), chained, chat=True)


def _count_chained(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Per chained forward: whether a row's block table had grown."""
    calls: list[bool] = []
    real_next = draft_chain.next_decode_inputs

    def next_inputs(inputs, tokens, tables, block_size):
        calls.append(tables is not None)
        return real_next(inputs, tokens, tables, block_size)

    monkeypatch.setattr(drafter_module, "next_decode_inputs", next_inputs)
    return calls


def test_chained_greedy_drafts_equal_the_runners_path(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    chained_calls = _count_chained(monkeypatch)
    want, want_tokens = _proposals(llm, chained=False)
    assert not chained_calls
    got, got_tokens = _proposals(llm, chained=True)
    assert got_tokens == want_tokens
    assert len(got) == len(want) > 10
    for step, (a, b) in enumerate(zip(got, want)):
        assert a == b, f"proposal {step} differs"
    assert any(chained_calls) and not all(chained_calls)  # chained, across grown tables too
    accepted = llm.engine.speculative.stats
    assert 0 < accepted.num_accepted_tokens < accepted.num_draft_tokens


STORIES_PROMPTS = ["Once upon a time", "The dog ran to the park and", "Tom had a big red ball.", "One day,"]


@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")),
])
def test_chained_drafts_on_stories260k(stories_path: str, draft_dir: str, device: str,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The same oracle on stories260K and a perturbed copy of it as the draft (a full
    vocabulary head), on the CPU and, where there is one, the GPU (the target's CUDA graphs
    beside the draft's chained eager forwards)."""
    llm = LLM(stories_path, device=device, draft=draft_dir, num_speculative_tokens=6, adaptive_k=False,
              block_size=4, num_blocks=512)
    chained_calls = _count_chained(monkeypatch)
    params = _params((6, 2, 5, 3), max_tokens=48)
    want, want_tokens = recorded_proposals(llm, STORIES_PROMPTS, params, chained=False)
    assert not chained_calls
    got, got_tokens = recorded_proposals(llm, STORIES_PROMPTS, params, chained=True)
    assert got_tokens == want_tokens
    assert len(got) == len(want) > 10
    for step, (a, b) in enumerate(zip(got, want)):
        assert a == b, f"proposal {step} differs"
    assert any(chained_calls) and not all(chained_calls)
    stats = llm.engine.speculative.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
