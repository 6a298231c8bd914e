"""KV budgets on a real model (stories260K): exactness, the ring buffer, real memory savings."""

from __future__ import annotations

import pytest
import torch

from keyserve import LLM, SamplingParams

POLICIES = ["window", "streaming_llm", "h2o", "keyformer"]
PROMPT = (
    "Once upon a time there was a little girl named Lily. She loved to play outside in the park. "
    "One day she saw a big red ball and she wanted to play with it."
)


@pytest.fixture(scope="module")
def llm(stories_path: str) -> LLM:
    return LLM(stories_path, num_blocks=256, block_size=8)


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=kw.pop("max_tokens", 40), temperature=0.0, ignore_eos=True, **kw)


@pytest.mark.parametrize("policy", POLICIES)
def test_budget_covering_the_sequence_equals_full(llm: LLM, policy: str) -> None:
    [full] = llm.generate(PROMPT, _greedy())
    [same] = llm.generate(PROMPT, _greedy(kv_policy=policy, kv_budget=500))
    assert same.token_ids == full.token_ids
    assert same.stats.kv_tokens_evicted == 0


def test_window_policy_equals_sliding_window_attention(llm: LLM) -> None:
    """Decode queries see exactly the k most recent tokens: the same as the full cache with a
    sliding-window mask of k on decode steps (the prompt phase attends causally to all n)."""
    k = 12
    [ring] = llm.generate(PROMPT, _greedy(kv_policy="window", kv_budget=k, logprobs=True))
    engine = llm.engine
    runner = engine.runner
    model = engine.loaded.model
    full_layers, graphs = model._full_attention_layers, runner.graphs
    model._full_attention_layers = [False] * len(full_layers)  # every layer takes the window
    runner.graphs = None  # on a GPU: captured graphs would replay without the mask set below
    rid = engine.add_request(PROMPT, _greedy(logprobs=True))
    outs = {}
    try:
        while engine.has_unfinished_requests():
            seq = engine.requests[rid].seqs[0] if rid in engine.requests else None
            # Once the prompt is computed, decode steps use a sliding-window mask of k.
            runner.sliding_window = k if seq is not None and seq.output_token_ids else None
            for out in engine.step():
                outs[out.request_id] = out
    finally:
        runner.sliding_window = None
        model._full_attention_layers, runner.graphs = full_layers, graphs
    masked = outs[rid]
    assert ring.token_ids == masked.token_ids
    torch.testing.assert_close(
        torch.tensor(ring.outputs[0].logprobs), torch.tensor(masked.outputs[0].logprobs), atol=1e-4, rtol=0
    )
    assert ring.stats.kv_tokens_held == k


@pytest.mark.parametrize("policy", POLICIES)
def test_blocks_stop_growing_at_the_budget_and_return_to_the_pool(llm: LLM, policy: str) -> None:
    engine = llm.engine
    bm = engine.block_manager
    free_at_start = bm.num_free_blocks
    k = 20
    rid = engine.add_request(PROMPT, _greedy(kv_policy=policy, kv_budget=k, max_tokens=60))
    held = []
    while engine.has_unfinished_requests():
        engine.step()
        if rid in engine.requests and engine.requests[rid].seqs[0].output_token_ids:
            held.append(len(engine.requests[rid].seqs[0].block_table))
    assert held and set(held) == {-(-k // bm.block_size)}  # constant from the first token on
    assert bm.num_free_blocks == free_at_start


def test_kv_stats_and_bytes_proportional_to_budget(llm: LLM) -> None:
    n_prompt = len(llm.tokenizer.encode(PROMPT))
    for frac in (0.25, 0.5):
        [out] = llm.generate(PROMPT, _greedy(kv_policy="h2o", kv_budget=frac, max_tokens=30))
        k = max(1, round(frac * n_prompt))
        assert out.stats.kv_tokens_held == k
        assert out.stats.kv_tokens_evicted == n_prompt + 30 - 1 - k


def test_mixed_policies_in_one_batch_match_running_alone(llm: LLM) -> None:
    deterministic = ["full", "window", "streaming_llm", "h2o"]
    params = [_greedy(kv_policy=p, kv_budget=16) for p in deterministic]
    alone = [llm.generate(PROMPT, p)[0].token_ids for p in params]
    keyformer = _greedy(kv_policy="keyformer", kv_budget=16)
    together = llm.generate([PROMPT] * 5, params + [keyformer])
    assert [o.token_ids for o in together[:4]] == alone
    assert together[4].stats.kv_tokens_held == 16


def test_budgets_survive_preemption_and_forks(stories_path: str) -> None:
    small = LLM(stories_path, num_blocks=20, block_size=8, max_num_batched_tokens=64)
    prompts = [PROMPT + " " + str(i) for i in range(10)]
    params = [
        SamplingParams(max_tokens=40, temperature=0.8, seed=i, n=2 if i % 3 == 0 else 1, ignore_eos=True,
                       kv_policy=POLICIES[i % 4], kv_budget=0.5 if i % 2 else 60)
        for i in range(10)
    ]
    outs = small.generate(prompts, params)
    assert all(len(o.token_ids) == 40 for out in outs for o in out.outputs)
    assert small.engine.scheduler.num_preemptions > 0
    assert small.engine.block_manager.num_free_blocks == 20
    assert not small.engine.runner.budget.states


def test_compressed_blocks_are_never_offered_as_prefix(llm: LLM) -> None:
    llm.engine.block_manager.reset_prefix_cache()
    [budgeted] = llm.generate(PROMPT, _greedy(kv_policy="h2o", kv_budget=0.3))
    [full] = llm.generate(PROMPT, _greedy())
    assert full.stats.prefix_cache_hit_tokens == 0  # the budgeted run cached nothing
    [again] = llm.generate(PROMPT, _greedy(kv_policy="h2o", kv_budget=0.3))
    assert again.stats.prefix_cache_hit_tokens == 0  # budgeted requests recompute their prompt
    assert again.token_ids == budgeted.token_ids


def test_seeded_keyformer_is_reproducible(llm: LLM) -> None:
    """Keyformer's Gumbel noise is a function of the request's seed and the token positions
    (``kernels/noise.py``), so a seeded request evicts the same tokens, and says the same
    thing, every time."""
    for temperature in (0.0, 0.8):
        params = SamplingParams(max_tokens=30, temperature=temperature, seed=11, kv_policy="keyformer",
                                kv_budget=12, ignore_eos=True)
        runs = [llm.generate(PROMPT, params)[0].token_ids for _ in range(2)]
        assert runs[0] == runs[1]


def test_seeded_keyformer_is_the_same_whatever_its_batch(llm: LLM) -> None:
    """A seeded Keyformer request gives the same tokens alone and batched with different other
    requests (other lengths, an unseeded Keyformer request, H2O rows making the step "mixed",
    a plain one), greedy and sampled, because its noise is drawn per row from its seed and
    positions; a different seed does change its tokens (so the noise matters here).
    Mutations caught: ``SlotPlanner.score_args`` indexing prefill rows' keys without the
    ``len(dec) +`` offset, and ``keyformer.noise_keys`` treating every row as unseeded."""
    others = ["Tom had a dog.", "The sun was hot and the sky was blue and the birds sang all day long in the trees."]

    def keyformer(seed: int, temperature: float) -> SamplingParams:
        return SamplingParams(max_tokens=40, temperature=temperature, seed=seed, kv_policy="keyformer",
                              kv_budget=12, ignore_eos=True)

    batches = [
        [SamplingParams(max_tokens=25, temperature=0.8, kv_policy="keyformer", kv_budget=10, ignore_eos=True),
         SamplingParams(max_tokens=50, temperature=0.0, kv_policy="h2o", kv_budget=0.5, ignore_eos=True)],
        [SamplingParams(max_tokens=35, temperature=0.0, kv_policy="keyformer", kv_budget=8, seed=3, ignore_eos=True),
         SamplingParams(max_tokens=10)],
    ]
    for temperature in (0.0, 0.8):
        [alone] = llm.generate(PROMPT, keyformer(11, temperature))
        for i, extra in enumerate(batches):
            prompts = others + [PROMPT] if i == 0 else [PROMPT] + others[::-1]
            params = extra + [keyformer(11, temperature)] if i == 0 else [keyformer(11, temperature)] + extra
            outs = llm.generate(prompts, params)
            mine = outs[2] if i == 0 else outs[0]
            assert mine.token_ids == alone.token_ids, (temperature, i)
            assert mine.stats.kv_tokens_evicted == alone.stats.kv_tokens_evicted
        # Arriving while the others decode: its prompt rows come after their decode rows.
        engine = llm.engine
        for prompt, sp in zip(others, batches[0]):
            engine.add_request(prompt, sp)
        for _ in range(3):
            engine.step()
        rid = engine.add_request(PROMPT, keyformer(11, temperature))
        done = {}
        while engine.has_unfinished_requests():
            done.update((out.request_id, out) for out in engine.step() if out.finished)
        assert done[rid].token_ids == alone.token_ids, (temperature, "late")
    [greedy_11] = llm.generate(PROMPT, keyformer(11, 0.0))
    differs = [llm.generate(PROMPT, keyformer(seed, 0.0))[0].token_ids != greedy_11.token_ids for seed in (12, 13)]
    assert any(differs)


def test_forked_samples_compact_at_the_prompt_end_whatever_the_pool(stories_path: str) -> None:
    """A budgeted request of n = 2 whose pool is nearly full when its prompt ends gives what it
    gives alone. Its prompt is compacted before the siblings fork (they share the k kept slots),
    so compaction never waits on copies of shared blocks: the pressure falls on the next step's
    writes, where the scheduler preempts the newer plain request (recomputed exactly).
    Mutation caught: compacting only after the fork, which deferred compaction to a step the
    pool could copy in, and the decode scores seen meanwhile chose other tokens."""
    prompt = [1] + [(7 * i) % 500 + 3 for i in range(47)]  # 6 blocks of 8
    other = [1] + [(11 * i) % 500 + 5 for i in range(39)]  # 5 blocks of 8
    budgeted = SamplingParams(n=2, max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=True,
                              kv_policy="h2o", kv_budget=0.8)
    plain = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True)

    def run(num_blocks: int, requests: list[tuple[list[int], SamplingParams]]) -> tuple[LLM, list]:
        llm = LLM(stories_path, num_blocks=num_blocks, block_size=8, max_num_batched_tokens=128)
        return llm, llm.generate(list(p for p, _ in requests), list(sp for _, sp in requests))

    _, [alone] = run(200, [(prompt, budgeted)])
    _, [other_alone] = run(200, [(other, plain)])
    small, [got, other_got] = run(14, [(prompt, budgeted), (other, plain)])
    assert got.stats.num_preemptions == 0
    for out, ref in zip(got.outputs, alone.outputs, strict=True):
        assert out.token_ids == ref.token_ids
        assert out.logprobs == pytest.approx(ref.logprobs, abs=1e-4)
    assert other_got.token_ids == other_alone.token_ids
    assert small.engine.block_manager.num_free_blocks == 14
    assert not small.engine.runner.budget.states
