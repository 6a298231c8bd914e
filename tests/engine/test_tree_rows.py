"""A tree of drafts in one target forward, against an independent oracle: the logits of every
node equal transformers' logits after the prompt and that node's root-to-node path (teacher
forced, one dense forward per path), and after the KV of an accepted path that was not the
draft's first choice is moved into place, the next token's logits equal transformers' too.

Mutations caught: packing tree rows without their masks (a node sees its siblings' KV), giving
them chain positions (RoPE of the wrong depth), and skipping ``_move_slots`` (the next step
reads a sibling's KV)."""

from __future__ import annotations

import pytest
import torch

from keyserve import LLM, SamplingParams
from keyserve.core.spec_tree import TreeShape
from keyserve.engine.step_input import StepInput, StepItem


@pytest.fixture(scope="module")
def llm(stories_path: str) -> LLM:
    return LLM(stories_path, num_blocks=64)


def _hf_last_logits(hf, ids: list[int]) -> torch.Tensor:  # [vocab]
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0, -1].float()


def _prefilled(llm: LLM, prompt: str):
    """A sequence whose prompt is computed and whose first token was sampled (the root)."""
    engine = llm.engine
    rid = engine.add_request(prompt, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    engine.step()
    return rid, engine.requests[rid].seqs[0]


@pytest.mark.parametrize("shape", ["3x2", "2x2x1"])
def test_every_node_sees_its_path_alone(llm: LLM, stories_hf, shape: str) -> None:
    engine, runner = llm.engine, llm.engine.runner
    rid, seq = _prefilled(llm, "once upon a time there was a little girl named lily")
    tree = TreeShape.parse(shape)
    parents = list(tree.parents)
    root_pos = seq.num_tokens - 1
    assert engine.block_manager.allocate_slots(seq, 1 + tree.num_nodes, speculative=True) is not None
    gen = torch.Generator().manual_seed(0)
    nodes = torch.randint(3, 500, (tree.num_nodes,), generator=gen).tolist()  # [num_nodes] draft tokens
    item = StepItem(seq.seq_id, [seq.token_ids[-1]], root_pos, list(seq.block_table),
                    draft_token_ids=nodes, draft_parents=parents[1:])
    inputs = runner.prepare(StepInput([item], 0))
    logits, _ = runner.forward_logits(inputs, list(range(1 + tree.num_nodes)))  # [1 + N, vocab]
    assert inputs.meta.decode_tree_masks is not None
    prefix = seq.token_ids
    for j in range(tree.num_nodes + 1):
        path, a = [], j
        while a > 0:
            path.append(nodes[a - 1])
            a = parents[a]
        expected = _hf_last_logits(stories_hf, prefix + path[::-1])
        torch.testing.assert_close(logits[j], expected, atol=2e-4, rtol=1e-4)
    engine.abort(rid)


def test_moved_path_is_what_the_next_step_reads(llm: LLM, stories_hf) -> None:
    """Greedy verification of a tree whose second depth-1 node is the target's token: the
    accepted node's KV moves from its preorder slot to the root's next one, and the next
    forward (the bonus token) matches transformers over prompt + accepted + bonus."""
    engine, runner = llm.engine, llm.engine.runner
    rid, seq = _prefilled(llm, "lily and ben went to the park and")
    prefix = list(seq.token_ids)
    greedy = _hf_last_logits(stories_hf, prefix).argmax().item()
    second = _hf_last_logits(stories_hf, prefix + [greedy]).argmax().item()
    tree = TreeShape.parse("2x2")  # 1: wrong, 2-3 its children, 4: the target's token, 5-6: wrong
    wrong = [t for t in range(3, 40) if t not in (greedy, second)]
    nodes = [wrong[0], wrong[1], wrong[2], greedy, wrong[3], wrong[4]]
    assert engine.block_manager.allocate_slots(seq, 1 + tree.num_nodes, speculative=True) is not None
    item = StepItem(seq.seq_id, [seq.token_ids[-1]], seq.num_tokens - 1, list(seq.block_table),
                    draft_token_ids=nodes, draft_parents=list(tree.parents)[1:], sample_seq_ids=[seq.seq_id])
    out = runner.execute(StepInput([item], 0))
    assert out.num_accepted[seq.seq_id] == 1
    assert out.tokens[seq.seq_id] == [greedy, second]
    # the next step: the bonus token at the slot after the moved node
    nxt = StepItem(seq.seq_id, [second], seq.num_tokens + 1, list(seq.block_table), sample_seq_ids=[seq.seq_id])
    inputs = runner.prepare(StepInput([nxt], 1))
    logits, _ = runner.forward_logits(inputs, [0])
    torch.testing.assert_close(logits[0], _hf_last_logits(stories_hf, prefix + [greedy, second]),
                               atol=2e-4, rtol=1e-4)
    engine.abort(rid)
