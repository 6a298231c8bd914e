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


def _proposals(llm: LLM, chained: bool) -> tuple[list, list[list[int]]]:
    drafter = llm.engine.speculative.drafter
    drafter.chained = chained
    seen: list[tuple[list, list]] = []
    real = drafter.propose

    def propose(targets, num_draft):
        out = real(targets, num_draft)
        seen.append((out.token_ids.tolist(), out.num_draft.tolist()))
        return out

    drafter.propose = propose
    try:
        params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, num_speculative_tokens=k)
                  for k in (6, 3, 5, 2)]
        outs = llm.generate(PROMPTS, params, chat=True)
    finally:
        del drafter.propose
    return seen, [o.token_ids for o in outs]


def test_chained_greedy_drafts_equal_the_runners_path(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    chained_calls: list[bool] = []  # per chained forward: whether a block table had grown
    real_next = draft_chain.next_decode_inputs

    def next_inputs(inputs, tokens, tables, block_size):
        chained_calls.append(tables is not None)
        return real_next(inputs, tokens, tables, block_size)

    monkeypatch.setattr(drafter_module, "next_decode_inputs", next_inputs)
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
