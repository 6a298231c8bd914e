"""The draft's side of tree speculation against an independent oracle: every node of a proposed
tree carries the draft model's rank-th likeliest token after the prompt and that node's path
(transformers on the draft's own weights, one dense forward per path), for two sequences
batched together, and the mirrors hold no tree KV afterwards (the next proposal re-syncs).

Mutations caught: every child given the draft's top-1 token (ranks ignored), a level's rows
packed without their masks or with chain positions (the deeper nodes' tokens change)."""

from __future__ import annotations

import pytest
import torch

from keyserve import LLM, SamplingParams
from keyserve.core.spec_tree import TreeShape


@pytest.fixture(scope="module")
def draft_hf(draft_dir: str):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(
        draft_dir, attn_implementation="eager", dtype=torch.float32).eval()


def _path(parents: list[int], tokens: list[int], j: int) -> list[int]:
    out = []
    while j > 0:
        out.append(tokens[j - 1])
        j = parents[j]
    return out[::-1]


@pytest.mark.parametrize("shape", ["3x2", "2x2x2"])
def test_tree_nodes_are_the_drafts_ranked_tokens(stories_path: str, draft_dir: str, draft_hf, shape: str) -> None:
    llm = LLM(stories_path, num_blocks=200, draft=draft_dir, draft_dtype="float32", speculative_tree=shape)
    engine = llm.engine
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, speculative=False)
    rids = [engine.add_request(p, params) for p in ("once upon a time there was", "the little dog ran to the")]
    engine.step()
    seqs = [engine.requests[r].seqs[0] for r in rids]
    tree = TreeShape.parse(shape)
    parents = list(tree.parents)
    drafter = engine.speculative.drafter
    proposal = drafter.propose_tree(seqs, [list(parents), list(parents)])
    assert proposal.num_draft.tolist() == [tree.num_nodes] * 2
    assert proposal.parents[0].tolist() == parents
    for row, seq in enumerate(seqs):
        tokens = proposal.token_ids[row].tolist()
        for j in range(tree.num_nodes + 1):
            kids = [c for c in range(1, tree.num_nodes + 1) if parents[c] == j]
            if not kids:
                continue
            with torch.inference_mode():
                logits = draft_hf(torch.tensor([seq.token_ids + _path(parents, tokens, j)])).logits[0, -1]
            want = torch.topk(logits, len(kids)).indices.tolist()
            assert [tokens[c - 1] for c in kids] == want, (row, j)
        mirror = drafter.mirrors[seq.seq_id]
        assert mirror.num_computed_tokens == seq.num_tokens  # the root's KV, no node's
