"""Speculative sampling on a target that runs under a KV budget (docs/algorithms.md §3, "A target
under a KV budget").

The K + 1 verified positions go into spare slots and nothing is evicted until the verdict is
known; then the accepted positions stay (their attention scores counted, the rejected rows'
not), rejected slots are dropped and the policy evicts down to the budget. The oracle for the
score-free policies is transformers' dense model run over the final tokens with a 4D mask that
lets every position see exactly what the schedule let it see: the held window at the start of
its step plus the step's own positions before it.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from keyserve import LLM, SamplingParams

PROMPTS = [
    "Once upon a time there was a little girl named Lily. She loved to play outside.",
    "The dog ran to the park and",
    "Tom had a big red ball. He liked to play with it every day, and one day his friend Sue came over",
]
POLICIES = ["window", "streaming_llm", "h2o", "keyformer"]


@pytest.fixture(scope="module")
def target(stories_path: str) -> LLM:
    return LLM(stories_path, num_blocks=400, block_size=8)


@pytest.fixture(scope="module")
def speculative(stories_path: str, draft_dir: str) -> LLM:
    return LLM(stories_path, num_blocks=400, block_size=8, draft=draft_dir, num_speculative_tokens=5)


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=kw.pop("max_tokens", 40), temperature=0.0, ignore_eos=True, **kw)


class _StepLog:
    """Records what the target runner was asked to compute and what it accepted (a spy: the
    real ``execute`` runs unchanged)."""

    def __init__(self, llm: LLM) -> None:
        self.runner = llm.engine.runner
        self.steps: list[list[tuple[int, int, int, bool, int | None]]] = []
        self._execute = self.runner.execute

    def __enter__(self) -> "_StepLog":
        def spy(step, draft_probs=None, *args, **kwargs):
            out = self._execute(step, draft_probs, *args, **kwargs)
            self.steps.append([(it.seq_id, it.start, it.num_query_tokens, it.verifies,
                                out.num_accepted.get(it.seq_id)) for it in step.items])
            return out

        self.runner.execute = spy
        return self

    def __exit__(self, *exc: object) -> None:
        del self.runner.execute


@pytest.mark.parametrize("policy", POLICIES)
def test_budget_covering_the_sequence_equals_the_full_target(target: LLM, speculative: LLM, policy: str) -> None:
    """Spare slots, rollback of rejected drafts and settling without eviction leave exactly the
    full cache: the output is the target's, token for token."""
    full = target.generate(PROMPTS, _greedy())
    outs = speculative.generate(PROMPTS, _greedy(kv_policy=policy, kv_budget=500))
    for a, b in zip(outs, full):
        assert a.token_ids == b.token_ids
        assert a.stats.kv_tokens_evicted == 0
    assert sum(o.stats.spec_draft_tokens for o in outs) > sum(o.stats.spec_accepted_tokens for o in outs) > 0


def _allowed_mask(n_prompt: int, total: int, sinks: int, recent: int, seq_id: int,
                  steps: list[list[tuple[int, int, int, bool, int | None]]]) -> torch.Tensor:
    """[total, total] bool: which positions each query position attended when it was computed
    (as an accepted row), by the rules of docs/algorithms.md §2/§3 for a score-free policy."""
    lo = {q: 0 for q in range(n_prompt)}  # prompt rows: causal, no eviction yet
    for step in steps:
        for sid, start, n, verifies, accepted in step:
            if sid != seq_id or start < n_prompt:
                continue
            if verifies:  # held at the step's start: the `recent` newest before it (+ sinks)
                for q in range(start, start + accepted + 1):
                    lo[q] = start - recent
            else:  # one token: evict, then write it
                lo[start] = start - recent + 1
    mask = torch.zeros(total, total, dtype=torch.bool)
    for q, low in lo.items():
        keys = torch.arange(q + 1)
        mask[q, : q + 1] = (keys < sinks) | (keys >= low)
    return mask


@pytest.mark.parametrize("policy,sinks", [("window", 0), ("streaming_llm", 4)])
@pytest.mark.parametrize("k", [1, 3])
def test_score_free_policies_equal_a_dense_oracle_of_the_schedule(
    stories_path: str, draft_dir: str, policy: str, sinks: int, k: int
) -> None:
    budget = 12
    llm = LLM(stories_path, num_blocks=400, block_size=8, draft=draft_dir, num_speculative_tokens=k)
    hf = transformers.AutoModelForCausalLM.from_pretrained(stories_path, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    with _StepLog(llm) as log:
        for prompt in PROMPTS:
            rid = llm.engine.add_request(prompt, _greedy(kv_policy=policy, kv_budget=budget, logprobs=True))
            seq_id = llm.engine.requests[rid].seqs[0].seq_id
            log.steps.clear()
            outs = {}
            while llm.engine.has_unfinished_requests():
                for out in llm.engine.step():
                    outs[out.request_id] = out
            result = outs[rid]
            prompt_ids = result.prompt_token_ids
            tokens = prompt_ids + result.token_ids
            n, total = len(prompt_ids), len(tokens)
            assert any(v for step in log.steps for (_, _, _, v, _) in step), "no step speculated"
            assert any(a is not None and a < m - 1 for step in log.steps for (_, _, m, v, a) in step if v)
            mask = _allowed_mask(n, total, sinks, budget - sinks, seq_id, log.steps)
            additive = torch.zeros(1, 1, total, total)
            additive[0, 0][~mask] = torch.finfo(torch.float32).min
            with torch.no_grad():
                logits = hf(torch.tensor([tokens]), attention_mask=additive).logits[0]
            expect = torch.log_softmax(logits[n - 1 : total - 1], dim=-1)
            assert expect.argmax(-1).tolist() == result.token_ids
            got = torch.tensor(result.outputs[0].logprobs)
            torch.testing.assert_close(got, expect.gather(-1, torch.tensor(result.token_ids)[:, None])[:, 0],
                                       atol=1e-4, rtol=0)
            assert result.stats.kv_tokens_held == budget


@pytest.mark.parametrize("policy", POLICIES)
def test_memory_stays_bounded_and_returns(speculative: LLM, policy: str) -> None:
    """During speculation a budgeted target holds at most k + K + 1 slots; after settling
    exactly k; every block comes back at the end and no pending verdict is left behind."""
    engine = speculative.engine
    bm = engine.block_manager
    free = bm.num_free_blocks
    k, spare = 16, 5 + 1
    ids = [engine.add_request(p, _greedy(kv_policy=policy, kv_budget=k, max_tokens=48)) for p in PROMPTS]
    outs = {}
    bound = bm.blocks_for_slots(k + spare)
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs[out.request_id] = out
        for seq in engine.core.seqs.values():
            if seq.kv_slot_cap is not None:
                assert len(seq.block_table) <= bound
        for state in engine.runner.budget.states.values():
            assert state.num_slots <= k + spare
    for rid in ids:
        stats = outs[rid].stats
        assert stats.kv_tokens_held == k
        assert stats.spec_draft_tokens > 0
        assert len(outs[rid].token_ids) == 48
    assert bm.num_free_blocks == free
    assert not engine.runner.budget.pending and not engine.runner.budget.states


def test_sampled_budgeted_target_is_reproducible_and_mixes_with_full_requests(speculative: LLM) -> None:
    params = [
        SamplingParams(max_tokens=32, temperature=0.8, seed=7, kv_policy="keyformer", kv_budget=0.5),
        SamplingParams(max_tokens=32, temperature=0.8, seed=8),
        SamplingParams(max_tokens=32, temperature=0.0, kv_policy="h2o", kv_budget=10),
    ]
    runs = []
    for _ in range(2):
        speculative.engine.block_manager.reset_prefix_cache()  # the same batches both times
        runs.append(speculative.generate(PROMPTS, params))
    # Seeded Keyformer noise (drawn per step from the seeds of the step's Keyformer sequences)
    # and seeded sampling make the same batch give the same tokens.
    assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[1]]
    assert all(o.stats.spec_draft_tokens > 0 for o in runs[0])
    [alone] = speculative.generate(PROMPTS[:1], params[:1])
    [again] = speculative.generate(PROMPTS[:1], params[:1])
    assert alone.token_ids == again.token_ids
