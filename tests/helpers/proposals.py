"""Record every proposal a speculative engine's drafter makes, with its chained greedy path
(``engine/draft_chain.py``) switched on or off: the oracle of the chained path is the runner's."""

from __future__ import annotations

from keyserve import LLM, SamplingParams


def recorded_proposals(
    llm: LLM, prompts: list[str], params: list[SamplingParams], chained: bool, chat: bool = False,
) -> tuple[list[tuple[list, list]], list[list[int]]]:
    """(each proposal's drafted tokens and per-row counts, each request's output tokens)."""
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
        outs = llm.generate(prompts, params, chat=chat)
    finally:
        del drafter.propose
    return seen, [o.token_ids for o in outs]
