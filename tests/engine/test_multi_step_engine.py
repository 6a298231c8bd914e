"""Multi-step scheduling (``num_scheduler_steps``, core/multi_step.py, engine/multi_step.py)
changes how many decode steps one scheduling round runs, never a token: the oracle is the same
engine with one step per round, on a mix of greedy and seeded sampled requests with
log-probabilities, stop strings inside a round, n > 1 forks, KV budgets beside them and
preemptions in a small pool."""

from __future__ import annotations

import random

import pytest
import torch

from keyserve import LLM, SamplingParams

WORDS = "once upon a time there was a little girl named lily she loved to play outside in the park".split()
OPTIONS = dict(num_blocks=60, block_size=8, max_num_batched_tokens=256)  # small: 24 requests preempt


def _prompts(count: int, seed: int = 3) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 40))) for _ in range(count)]


def _params(i: int) -> SamplingParams:
    sampled = i % 3 == 1
    budgeted = i % 8 == 6
    return SamplingParams(
        max_tokens=8 + (i * 5) % 29, temperature=0.8 if sampled else 0.0, top_p=0.9 if i % 6 == 1 else 1.0,
        top_k=40 if i % 6 == 4 else 0, seed=200 + i if sampled else None, n=2 if i % 7 == 3 else 1,
        logprobs=True, ignore_eos=i % 5 == 0, stop=[" play", "Lily."] if i % 4 == 2 else None,
        kv_policy="h2o" if budgeted else None, kv_budget=0.5 if budgeted else None,
    )


def _run(stories_path: str, steps: int, **options) -> tuple[LLM, list]:
    llm = LLM(stories_path, num_scheduler_steps=steps, **{**OPTIONS, **options})
    prompts = _prompts(24)
    return llm, llm.generate(prompts, [_params(i) for i in range(24)])


@pytest.fixture(scope="module")
def single(stories_path: str) -> tuple[LLM, list]:
    return _run(stories_path, 1)


def _same(want: list, got: list) -> None:
    for a, b in zip(want, got, strict=True):
        assert len(a.outputs) == len(b.outputs)
        for x, y in zip(a.outputs, b.outputs):
            assert y.token_ids == x.token_ids
            assert y.text == x.text
            assert y.finish_reason == x.finish_reason
            torch.testing.assert_close(torch.tensor(y.logprobs), torch.tensor(x.logprobs), atol=1e-5, rtol=0)
        assert b.stats.generated_tokens == a.stats.generated_tokens
        assert b.stats.kv_tokens_evicted == a.stats.kv_tokens_evicted


@pytest.mark.parametrize("steps", [2, 5])
def test_n_steps_per_round_emit_what_one_step_per_round_emits(stories_path: str, single, steps: int) -> None:
    one_llm, want = single
    llm, got = _run(stories_path, steps)
    _same(want, got)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0  # the small pool preempted, as with one step per round
    assert sum(o.finish_reason == "stop" for r in got for o in r.outputs) >= 2  # stop strings inside rounds
    assert any(r.stats.kv_tokens_evicted for r in got)  # budgets ran beside the multi-step rounds
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    assert llm.engine.num_steps < one_llm.engine.num_steps  # fewer rounds for the same tokens


def test_with_a_draft_loaded_the_steps_nobody_drafts_in_run_as_rounds(stories_path: str, draft_dir: str, single) -> None:
    """A draft loaded, the 24 requests with ``speculative=False``: the steps run as the rounds an
    engine without a draft runs (before, no round ran once a draft was loaded), emitting what one
    step per round emits; the draft never proposes. Then half of them speculating: a step in
    which any sequence drafts is a verification, the others rounds -- the target's tokens
    either way."""
    one_llm, want = single
    prompts = _prompts(24)
    llm = LLM(stories_path, num_scheduler_steps=4, draft=draft_dir, num_speculative_tokens=3, **OPTIONS)
    got = llm.generate(prompts, [_params(i).model_copy(update={"speculative": False}) for i in range(24)])
    _same(want, got)
    assert llm.engine.num_steps < one_llm.engine.num_steps  # rounds ran
    assert llm.engine.speculative.stats.num_draft_tokens == 0
    greedy = [i for i in range(24) if _params(i).temperature == 0.0]
    mixed = [_params(i).model_copy(update={"speculative": i % 4 < 2}) for i in greedy]
    llm2 = LLM(stories_path, num_scheduler_steps=4, draft=draft_dir, num_speculative_tokens=3, **OPTIONS)
    got2 = llm2.generate([prompts[i] for i in greedy], mixed)
    for i, out in zip(greedy, got2, strict=True):
        assert [o.token_ids for o in out.outputs] == [o.token_ids for o in want[i].outputs]
    assert llm2.engine.speculative.stats.num_draft_tokens > 0


def test_a_lone_request_runs_in_rounds_of_n_tokens(stories_path: str) -> None:
    """40 tokens at 4 per round: the prompt's round (its first token), then 39 more in 10
    rounds of at most 4 -- each round's tokens arrive together."""
    llm = LLM(stories_path, num_scheduler_steps=4, num_blocks=64)
    engine = llm.engine
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    rid = engine.add_request("once upon a time", params)
    sizes, seen = [], 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid:
                n = len(out.outputs[0].token_ids)
                sizes.append(n - seen)
                seen = n
    assert sizes == [1] + [4] * 9 + [3]
    [want] = LLM(stories_path, num_blocks=64).generate("once upon a time", params)
    assert out.outputs[0].token_ids == want.outputs[0].token_ids


def test_a_new_prompt_waits_at_most_one_round(stories_path: str) -> None:
    """A request that arrives while others decode in rounds of 8 gets its first token from the
    next step: a round is never started while a prompt waits."""
    llm = LLM(stories_path, num_scheduler_steps=8, num_blocks=64)
    engine = llm.engine
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    engine.add_request("once upon a time", params)
    engine.step()  # its prompt
    engine.step()  # a round of 8
    late = engine.add_request("lily and ben", params)
    outs = {o.request_id: o for o in engine.step()}
    assert len(outs[late].outputs[0].token_ids) == 1
    assert len(engine._running_step.items) == 2 and not engine._running_step.multi_step


def test_a_step_run_twice_emits_the_same_seeded_tokens(stories_path: str) -> None:
    """A round whose result was lost and that runs again (the Ray engine after a fault) draws
    the same: each sampled sequence's generator is marked once per round, before its first
    draw (marking it again before each extra step would rewind the rerun to the round's last
    step and change every token after)."""
    params = [SamplingParams(max_tokens=20, temperature=1.0, seed=s, ignore_eos=True) for s in (1, 2)]
    prompts = ["once upon a time", "the dog ran to the park"]
    want = [o.outputs[0].token_ids for o in LLM(stories_path, num_blocks=64).generate(prompts, params)]
    llm = LLM(stories_path, num_scheduler_steps=4, num_blocks=64)
    runner = llm.engine.runner
    real = runner.execute

    def twice(*args, **kwargs):
        real(*args, **kwargs)
        return real(*args, **kwargs)

    runner.execute = twice
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == want


def test_rounds_run_under_a_full_queue_as_in_a_batch_job(stories_path: str) -> None:
    """Eight requests for two seats: the queued ones cannot start before a seat is free, so
    the two running decode in rounds meanwhile; each queued one starts in the round after a
    seat frees, and every request emits what it emits with single steps."""
    prompts = _prompts(8, seed=11)
    params = [SamplingParams(max_tokens=12 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(8)]
    one = LLM(stories_path, max_num_seqs=2, num_blocks=64)
    want = [o.outputs[0].token_ids for o in one.generate(prompts, params)]
    rounds = LLM(stories_path, max_num_seqs=2, num_blocks=64, num_scheduler_steps=4)
    got = [o.outputs[0].token_ids for o in rounds.generate(prompts, params)]
    assert got == want
    assert rounds.engine.num_steps < 0.5 * one.engine.num_steps


@pytest.mark.parametrize("stop", [dict(stop=[" big"]), dict(stop_token_ids=[414])])
def test_a_round_cut_by_a_stop_holds_the_kv_of_its_kept_tokens(stories_path: str, stop: dict) -> None:
    """A stop inside a round drops the round's later tokens: the request's kv_tokens_held counts
    the KV of the tokens it kept, as with one step per round (not the round's dropped rows)."""
    params = SamplingParams(max_tokens=60, temperature=0.0, logprobs=True, ignore_eos=True, **stop)
    prompts = ["once upon a time", "lily and ben went to the park"]
    want = LLM(stories_path, num_blocks=64).generate(prompts, params)
    for steps in (3, 8):
        llm = LLM(stories_path, num_blocks=64, num_scheduler_steps=steps)
        got = llm.generate(prompts, params)
        assert [o.outputs[0].finish_reason for o in got] == ["stop", "stop"]
        _same(want, got)
        assert [o.stats.kv_tokens_held for o in got] == [o.stats.kv_tokens_held for o in want]
        assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_a_round_never_preempts_what_one_step_would_not(stories_path: str) -> None:
    """A full pool (9 blocks of 16): the short request's round would take the last free block
    before its budgeted neighbour's third sample got its next slot, preempting it (recomputed,
    its Keyformer budget chose other tokens to keep). The round waits until it fits."""
    options = dict(num_blocks=9, block_size=16, max_model_len=48)
    words = (" ".join(WORDS) + " ") * 4
    params = [
        SamplingParams(max_tokens=3, temperature=0.0, logprobs=True, kv_policy="streaming_llm", kv_budget=0.5),
        SamplingParams(max_tokens=8, temperature=0.0, logprobs=True),
        SamplingParams(max_tokens=2, temperature=0.0, logprobs=True, n=3, kv_policy="keyformer", kv_budget=0.5),
    ]
    runs = []
    for steps in (1, 7):
        llm = LLM(stories_path, num_scheduler_steps=steps, **options)
        ids = llm.tokenizer.encode(words)
        runs.append((llm, llm.generate([ids[:44], ids[5:18], ids[9:55]], params)))
    (one, want), (llm, got) = runs
    _same(want, got)
    assert [o.stats.kv_tokens_held for o in got] == [o.stats.kv_tokens_held for o in want]
    assert llm.engine.stats().num_preemptions == one.engine.stats().num_preemptions
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
