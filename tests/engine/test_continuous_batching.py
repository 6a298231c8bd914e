"""The engine on a real model (stories260K): batching, preemption and forks change nothing."""

from __future__ import annotations

import random

import pytest

from keyserve import LLM, SamplingParams

WORDS = "once upon a time there was a little girl named lily she loved to play outside in the park".split()


def _prompts(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60))) for _ in range(count)]


@pytest.fixture(scope="module")
def llm(stories_path: str) -> LLM:
    return LLM(stories_path, num_blocks=400, block_size=16, max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def alone(llm: LLM) -> dict[str, list[int]]:
    """Each prompt's greedy tokens when it runs by itself."""
    out = {}
    for i, prompt in enumerate(_prompts(32)):
        params = SamplingParams(max_tokens=10 + (i * 7) % 40, temperature=0.0, ignore_eos=True)
        llm.engine.block_manager.reset_prefix_cache()
        [res] = llm.generate(prompt, params)
        out[prompt] = res.token_ids
    return out


def _params(i: int) -> SamplingParams:
    return SamplingParams(max_tokens=10 + (i * 7) % 40, temperature=0.0, ignore_eos=True)


def test_32_concurrent_requests_match_running_alone(llm: LLM, alone: dict[str, list[int]]) -> None:
    prompts = _prompts(32)
    results = llm.generate(prompts, [_params(i) for i in range(32)])
    for prompt, res in zip(prompts, results):
        assert res.token_ids == alone[prompt]
        assert res.finish_reason == "length"
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_preemption_gives_the_same_tokens(stories_path: str, alone: dict[str, list[int]]) -> None:
    # 24 blocks of 16 slots cannot hold 32 sequences of up to ~110 tokens: preemption must happen.
    small = LLM(stories_path, num_blocks=24, block_size=16, max_num_batched_tokens=128)
    prompts = _prompts(32)
    results = small.generate(prompts, [_params(i) for i in range(32)])
    assert small.engine.scheduler.num_preemptions > 0
    for prompt, res in zip(prompts, results):
        assert res.token_ids == alone[prompt]
    assert small.engine.block_manager.num_free_blocks == 24


def test_requests_join_and_leave_between_steps(llm: LLM, alone: dict[str, list[int]]) -> None:
    engine = llm.engine
    prompts = _prompts(32)
    pending = list(enumerate(prompts))
    done = {}
    ids = {}
    while pending or engine.has_unfinished_requests():
        for _ in range(min(3, len(pending))):  # three new requests arrive per step
            i, prompt = pending.pop(0)
            ids[engine.add_request(prompt, _params(i))] = prompt
        for out in engine.step():
            if out.finished:
                done[ids[out.request_id]] = out.token_ids
    assert done == alone


def test_chunked_prefill_matches_whole_prefill(stories_path: str) -> None:
    prompt = " ".join(WORDS * 6)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    whole = LLM(stories_path, num_blocks=64, max_num_batched_tokens=512).generate(prompt, params)
    chunked = LLM(stories_path, num_blocks=64, max_num_batched_tokens=16).generate(prompt, params)
    assert whole[0].token_ids == chunked[0].token_ids


def test_prefix_cache_hits_are_reported_and_harmless(llm: LLM) -> None:
    prompt = " ".join(WORDS * 3)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    llm.engine.block_manager.reset_prefix_cache()
    [first] = llm.generate(prompt, params)
    [second] = llm.generate(prompt, params)
    assert first.stats.prefix_cache_hit_tokens == 0
    assert second.stats.prefix_cache_hit_tokens >= 16 * ((first.stats.prompt_tokens - 1) // 16)
    assert second.token_ids == first.token_ids


def test_n_samples_share_prompt_blocks_and_are_seeded(llm: LLM) -> None:
    prompt = " ".join(WORDS * 2)
    params = SamplingParams(n=4, max_tokens=16, temperature=1.0, seed=7, ignore_eos=True)
    [a] = llm.generate(prompt, params)
    [b] = llm.generate(prompt, params)
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1  # different samples
    prompt_blocks = -(-a.stats.prompt_tokens // 16)
    # Forked samples share the prompt's full blocks: far fewer than 4 private copies.
    assert a.stats.kv_blocks_used < 4 * (prompt_blocks + 2)
    # A seeded request gives the same tokens whatever else shares its batch.
    others = _prompts(5, seed=3)
    mixed = llm.generate([prompt] + others, [params] + [_params(i) for i in range(5)])
    assert [o.token_ids for o in mixed[0].outputs] == [o.token_ids for o in a.outputs]


def test_a_request_of_n_samples_aborted_before_its_first_token_ends_with_n_completions(llm: LLM) -> None:
    """Its siblings have not forked yet (they fork at the first sample); they end with it, one
    completion per sample, as after a first token; no block stays held."""
    engine = llm.engine
    params = SamplingParams(n=4, max_tokens=8, temperature=1.0, seed=3, ignore_eos=True)
    rid = engine.add_request(" ".join(WORDS), params)
    out = engine.abort(rid)
    assert out is not None and out.finished
    assert [(o.index, o.finish_reason, o.token_ids) for o in out.outputs] == [(i, "abort", []) for i in range(4)]
    rid = engine.add_request(" ".join(WORDS), params)
    engine.step()
    out = engine.abort(rid)
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    assert all(o.finish_reason == "abort" and len(o.token_ids) == 1 for o in out.outputs)
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_stop_conditions(llm: LLM) -> None:
    prompt = "once upon a time"
    [free] = llm.generate(prompt, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    text = free.text
    assert len(text) > 10
    stop = text[5:9]
    [stopped] = llm.generate(prompt, SamplingParams(max_tokens=40, temperature=0.0, stop=[stop]))
    assert stopped.finish_reason == "stop"
    assert stopped.text == text[: text.find(stop)]
    tok = free.token_ids[3]
    [by_id] = llm.generate(prompt, SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[tok]))
    assert by_id.finish_reason == "stop"
    assert by_id.token_ids == free.token_ids[: free.token_ids.index(tok) + 1]
    [lp] = llm.generate(prompt, SamplingParams(max_tokens=5, temperature=0.0, logprobs=True))
    assert len(lp.outputs[0].logprobs) == 5 and all(x <= 0.0 for x in lp.outputs[0].logprobs)
