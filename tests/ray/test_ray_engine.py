"""The Ray engine (KV-block manager, draft and target shard as actors) gives exactly the
in-process engine's outputs for 32 concurrent requests -- plain, with KV budgets, and with
speculative sampling (chains and trees of drafts) -- including preemptions (a small pool), n > 1 forks, seeded sampling and
log-probabilities; and it streams through the async front."""

from __future__ import annotations

import asyncio
import os
import random

import pytest
import ray
import torch

from keyserve import LLM, SamplingParams
from keyserve.llm import RayLLM

pytestmark = pytest.mark.usefixtures("ray_local")

WORDS = "once upon a time there was a little girl named lily she loved to play outside in the park".split()
POLICIES = ["window", "h2o", "keyformer", "streaming_llm"]


def _prompts(count: int, seed: int = 1) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 50))) for _ in range(count)]


def _policy(i: int) -> str:
    """The policy of request ``i`` (an even one) with budgets: the even requests cycle through
    all four policies (``POLICIES[i % 4]`` over even ``i`` only ever picked window and
    keyformer)."""
    return POLICIES[(i // 2) % len(POLICIES)]


def _params(i: int, budgets: bool = False, **kw) -> SamplingParams:
    sampled = i % 3 == 1
    policy = _policy(i) if budgets and i % 2 == 0 else None
    return SamplingParams(
        max_tokens=16 + i % 9, temperature=0.8 if sampled else 0.0, top_k=40 if i % 6 == 1 else 0,
        seed=100 + i if sampled else None, n=2 if i % 7 == 3 else 1, logprobs=True, top_logprobs=3 * (i % 4 == 1),
        ignore_eos=i % 5 == 0, kv_policy=policy, kv_budget=0.5 if policy else None,
        prompt_logprobs=(i % 3) if i % 4 == 2 else None, **kw,
    )


def _close_logprobs(got: list[float], want: list[float], near_ties: bool) -> None:
    """Log-probabilities equal to 1e-5. With ``near_ties`` (a request that evicted KV, on a
    tensor-parallel group): at most two positions may move further, each by at most 1e-2. TP's
    all-reduce rounds differently from one rank (~1e-6), and an eviction whose two candidates
    score within that much of each other can go either way for a step: request 10 of
    ``_prompts(32, seed=5)`` (H2O) moves its 14th log-probability by 2.8e-3 at TP 2 on a Xeon,
    and so does the in-process engine when its weights are scaled by 1 + 1e-6 noise (3 of 4
    seeds); everything else moves by ~1e-5."""
    diff = (torch.tensor(got) - torch.tensor(want)).abs()
    if not near_ties:
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=1e-5, rtol=0)
        return
    assert len(got) == len(want)
    assert int((diff > 1e-5).sum()) <= 2 and (diff.numel() == 0 or float(diff.max()) <= 1e-2), diff


def _same(prompts: list[str], want, got, tp: int = 1) -> None:
    """Ray outputs equal the in-process ones, request by request, each answering its own
    prompt in order (the old ``is not None`` on a list of ids could not fail): mutating
    ``LLM.generate`` to return ``list(done.values())`` (finish order) instead of
    ``[done[rid] for rid in ids]`` fails here. ``tp``: the Ray group's size (see
    ``_close_logprobs`` for what it allows an evicting request)."""
    assert [o.prompt for o in got] == prompts and [o.prompt for o in want] == prompts
    assert [o.request_id for o in got] == [o.request_id for o in want]
    for a, b in zip(want, got, strict=True):
        assert len(a.outputs) == len(b.outputs)
        for x, y in zip(a.outputs, b.outputs):
            assert y.token_ids == x.token_ids
            assert y.finish_reason == x.finish_reason
            _close_logprobs(y.logprobs, x.logprobs, near_ties=tp > 1 and a.stats.kv_tokens_evicted > 0)
            assert (y.top_logprobs is None) == (x.top_logprobs is None)
            if x.top_logprobs is not None:  # the alternatives, from the shards' rows (rank 0's gather)
                assert [[t for t, _ in top] for top in y.top_logprobs] == [[t for t, _ in top] for top in x.top_logprobs]
                torch.testing.assert_close(torch.tensor([[v for _, v in top] for top in y.top_logprobs]),
                                           torch.tensor([[v for _, v in top] for top in x.top_logprobs]),
                                           atol=1e-4, rtol=0)  # TP's all-reduce order: tails of ~-10 move ~1e-5
        assert (b.prompt_logprobs is None) == (a.prompt_logprobs is None)
        if a.prompt_logprobs is not None:  # the prompt rows' LM head, a pass at a time on every rank
            assert len(b.prompt_logprobs) == len(a.prompt_logprobs) == len(a.prompt_token_ids)
            assert len(b.prompt_logprob_ranks) == len(a.prompt_token_ids)  # ranks: ties may order apart at TP 2
            torch.testing.assert_close(torch.tensor(b.prompt_logprobs[1:]), torch.tensor(a.prompt_logprobs[1:]),
                                       atol=1e-4, rtol=0)
            assert (b.prompt_top_logprobs is None) == (a.prompt_top_logprobs is None)
            if a.prompt_top_logprobs is not None:
                assert [[t for t, _ in top] for top in b.prompt_top_logprobs[1:]] == \
                    [[t for t, _ in top] for top in a.prompt_top_logprobs[1:]]
        assert b.stats.generated_tokens == a.stats.generated_tokens
        assert b.stats.kv_tokens_evicted == a.stats.kv_tokens_evicted
        assert b.stats.kv_tokens_held == a.stats.kv_tokens_held


OPTIONS = dict(num_blocks=70, block_size=8)  # small: 32 requests preempt each other


def test_plain_and_kv_budgets_equal_in_process(stories_path: str) -> None:
    prompts = _prompts(32)
    params = [_params(i, budgets=True) for i in range(32)]
    assert {p.kv_policy for p in params} == {None, *POLICIES}  # every policy, and unbudgeted
    local = LLM(stories_path, **OPTIONS)
    want = local.generate(prompts, params)
    with RayLLM(stories_path, worker_threads=1, **OPTIONS) as ray_llm:
        got = ray_llm.generate(prompts, params)
        engine = ray_llm.engine
        stats = engine.stats()  # the KV-block manager actor's counts, as the in-process engine's
        assert stats.num_preemptions > 0 and stats.num_free_blocks == stats.num_blocks == 70
        expected = local.engine.stats()
        for field in ("prompt_tokens", "generation_tokens", "kv_tokens_evicted", "num_requests_running",
                      "num_requests_waiting", "block_size"):
            assert getattr(stats, field) == getattr(expected, field), field
        assert not hasattr(engine, "block_manager") and not hasattr(engine, "scheduler")  # no views
        view = engine.check_consistent()
        assert view.num_free_blocks == view.num_blocks
    _same(prompts, want, got)
    assert any(o.stats.kv_tokens_evicted for o in got)


@pytest.mark.parametrize("draft_kv_policy,target_budgets,tree,lookup,confidence", [
    (None, False, None, 0, 0.0),
    ("h2o", False, None, 0, 0.0),  # a budgeted draft (h2o: deterministic)
    # budgeted targets speculating: spare slots, settled on every rank; prompt lookup in the
    # draft actor (the draft counts below differ if the actor drafted by model alone)
    (None, True, None, 3, 0.0),
    (None, True, "2x2", 0, 0.0),  # trees of drafts from the draft actor, chains for the budgeted requests
    # chains that end where the draft doubts, in the actor (the draft counts below differ if
    # the actor drafted every K)
    (None, False, None, 0, 0.3),
])
def test_speculative_equals_in_process(stories_path: str, draft_dir: str, draft_kv_policy: str | None,
                                       target_budgets: bool, tree: str | None, lookup: int,
                                       confidence: float) -> None:
    prompts = _prompts(32, seed=2)
    params = [_params(i, num_speculative_tokens=1 + i % 4) for i in range(32)]
    if target_budgets:  # the score-based and score-free policies whose noise is not random
        for i, p in enumerate(params):
            if i % 2 == 0:
                params[i] = p.model_copy(update=dict(kv_policy=["window", "h2o", "streaming_llm"][i % 3],
                                                     kv_budget=0.5))
    opts = dict(OPTIONS, draft=draft_dir, draft_kv_policy=draft_kv_policy,
                draft_kv_budget=0.5 if draft_kv_policy else None, speculative_tree=tree,
                prompt_lookup_max=lookup, draft_confidence_threshold=confidence)
    local = LLM(stories_path, **opts)
    want = local.generate(prompts, params)
    if lookup:
        assert local.engine.speculative.drafter.lookup_proposals > 0
    if confidence:  # the threshold cut chains: fewer drafts than the same engine without it
        unsure = LLM(stories_path, **dict(opts, draft_confidence_threshold=0.0))
        unsure.generate(prompts, params)
        assert local.engine.speculative.stats.num_draft_tokens < unsure.engine.speculative.stats.num_draft_tokens
    with RayLLM(stories_path, worker_threads=1, actor_niceness=0, **opts) as ray_llm:
        got = ray_llm.generate(prompts, params)
        engine = ray_llm.engine
        assert engine.speculative.stats.num_draft_tokens > 0
        assert 0 < engine.speculative.stats.acceptance_rate < 1
        if tree:  # the actor drafted trees, the shard verified them (some off the first choices)
            assert engine.speculative.tree_capable and engine.speculative.stats.mean_tokens_per_forward > 1
        engine.flush()
        # actor_niceness=0: every engine actor runs at niceness 0, not at the 15 Ray starts its
        # pooled workers at (checked: 15 without the option)
        actors = [*engine.group.workers, engine.core_client.actor, engine.drafter_client.actor]
        niceness = [a.__ray_call__.remote(lambda _: os.getpriority(os.PRIO_PROCESS, 0)) for a in actors]
        assert ray.get(niceness) == [0] * len(actors)
        draft = engine.drafter_client.stats()
        assert draft["num_free_blocks"] == draft["num_blocks"] and draft["num_mirrors"] == 0
        if lookup:  # the actor says which drafts were copies, as the in-process drafter does
            copies = engine.speculative.lookup_stats
            assert copies == local.engine.speculative.lookup_stats
            assert 0 < copies.num_draft_tokens == local.engine.speculative.drafter.lookup_tokens
    _same(prompts, want, got)
    if target_budgets:
        assert any(o.stats.kv_tokens_evicted and o.stats.spec_draft_tokens for o in got)
    for a, b in zip(want, got):
        assert b.stats.spec_draft_tokens == a.stats.spec_draft_tokens
        assert b.stats.spec_accepted_tokens == a.stats.spec_accepted_tokens


def test_trees_on_the_plain_step_path_equal_in_process(stories_path: str, draft_dir: str) -> None:
    """Without the relayed graph the engine asks the draft actor for trees itself
    (``RemoteDrafter.propose_tree``): the same tokens, logprobs and draft counts as in process
    (seeded sampled requests included, which a chain would draw differently)."""
    prompts = _prompts(8, seed=4)
    params = [_params(i) for i in range(8)]
    opts = dict(OPTIONS, draft=draft_dir, speculative_tree="2x2")
    want = LLM(stories_path, **opts).generate(prompts, params)
    with RayLLM(stories_path, worker_threads=1, compiled_graph=False, step_relay=False, **opts) as ray_llm:
        assert not ray_llm.engine.relayed
        got = ray_llm.generate(prompts, params)
        assert ray_llm.engine.speculative.stats.num_accepted_tokens > 0
    _same(prompts, want, got)
    for a, b in zip(want, got):
        assert b.stats.spec_draft_tokens == a.stats.spec_draft_tokens


def test_lookup_on_the_plain_step_path_equals_in_process(stories_path: str, draft_dir: str) -> None:
    """Without the relayed graph the engine asks the draft actor itself
    (``RemoteDrafter.propose``): prompt lookup's copies come back marked as such, so the
    engine's lookup share equals the in-process engine's (adaptive K leaves copies out)."""
    prompts = _prompts(8, seed=5)
    params = [_params(i, num_speculative_tokens=1 + i % 4) for i in range(8)]
    opts = dict(OPTIONS, draft=draft_dir, prompt_lookup_max=3, prompt_lookup_min=1)
    local = LLM(stories_path, **opts)
    want = local.generate(prompts, params)
    with RayLLM(stories_path, worker_threads=1, compiled_graph=False, step_relay=False, **opts) as ray_llm:
        assert not ray_llm.engine.relayed
        got = ray_llm.generate(prompts, params)
        copies = ray_llm.engine.speculative.lookup_stats
    assert copies == local.engine.speculative.lookup_stats
    assert 0 < copies.num_draft_tokens == local.engine.speculative.drafter.lookup_tokens
    _same(prompts, want, got)


def test_ngram_draft_actor_equals_in_process(stories_path: str) -> None:
    """``draft="ngram"`` on Ray: the draft actor hosts the ``LookupDrafter`` (no weights, no
    KV pool) on the default step path; same tokens, draft counts and lookup counts as in
    process, every draft a copy."""
    prompts = _prompts(8, seed=6)
    params = [_params(i, num_speculative_tokens=1 + i % 4) for i in range(8)]
    opts = dict(OPTIONS, draft="ngram", prompt_lookup_max=3, prompt_lookup_min=1)
    local = LLM(stories_path, **opts)
    want = local.generate(prompts, params)
    with RayLLM(stories_path, worker_threads=1, **opts) as ray_llm:
        got = ray_llm.generate(prompts, params)
        spec = ray_llm.engine.speculative
        assert not spec.tree_capable and ray_llm.engine.drafter_client.weight_bytes == 0
        draft = ray_llm.engine.drafter_client.stats()
        assert (draft["num_blocks"], draft["num_free_blocks"], draft["num_mirrors"]) == (0, 0, 0)
    assert spec.stats == local.engine.speculative.stats
    # every draft a copy; the engine's steps also count the misses (a step without a match)
    copies = spec.lookup_stats
    assert (copies.num_draft_tokens, copies.num_accepted_tokens) == (spec.stats.num_draft_tokens,
                                                                     spec.stats.num_accepted_tokens)
    assert spec.stats.num_steps == copies.num_steps + spec.num_misses
    assert spec.stats.num_accepted_tokens > 0
    _same(prompts, want, got)
    for a, b in zip(want, got):
        assert b.stats.spec_draft_tokens == a.stats.spec_draft_tokens


def test_a_step_nobody_drafts_in_skips_the_draft_actor(stories_path: str, draft_dir: str) -> None:
    """Relayed, a step with no drafts goes from the KV-block manager straight to the shards
    (``ChannelGraph.submit``): requests that do not speculate never reach the draft actor, and
    with speculating ones only their drafting steps do (not the prompt steps, not a step
    after they all finished). The tokens are the in-process engine's either way. Sending every
    step by the draft actor (as before) fails the first count."""
    prompts = _prompts(6, seed=7)
    opts = dict(OPTIONS, draft=draft_dir)
    plain = [_params(i, speculative=False) for i in range(6)]
    spec = [_params(i, num_speculative_tokens=2) for i in range(6)]
    local = LLM(stories_path, **opts)
    want_plain, want_spec = local.generate(prompts, plain), local.generate(prompts, spec)
    with RayLLM(stories_path, worker_threads=1, draft_threads=2, **opts) as ray_llm:
        engine = ray_llm.engine
        assert engine.relayed
        got_plain = ray_llm.generate(prompts, plain)
        assert engine.num_steps > 0 and engine.drafter_client.stats()["num_relayed"] == 0
        steps = engine.num_steps
        got_spec = ray_llm.generate(prompts, spec)
        engine.flush()
        relayed = engine.drafter_client.stats()["num_relayed"]
        assert 0 < relayed < engine.num_steps - steps
        assert engine.speculative.stats.num_draft_tokens > 0
        draft = engine.drafter_client.stats()
        assert draft["num_free_blocks"] == draft["num_blocks"] and draft["num_mirrors"] == 0
        assert draft["torch_threads"] == 2  # draft_threads, not the one thread Ray starts it at
    _same(prompts, want_plain, got_plain)
    _same(prompts, want_spec, got_spec)


def test_lookup_aware_adaptive_k_through_the_draft_actor(stories_path: str) -> None:
    """Adaptive K with ``draft="ngram"`` on Ray: the engine looks each sequence up before
    choosing K, and the draft actor's lookup, over the tokens relayed to it, finds the same
    matches: no sequence reserves slots it gets no copies for (no misses). Greedy tokens equal
    the engine's in process (K depends on measured step times, so the draws of sampled rows
    would not line up)."""
    prompts = _prompts(8, seed=6)
    params = [SamplingParams(max_tokens=24 + i % 9, temperature=0.0, ignore_eos=True) for i in range(8)]
    opts = dict(OPTIONS, draft="ngram", prompt_lookup_max=3, prompt_lookup_min=1, adaptive_k=True)
    want = LLM(stories_path, **opts).generate(prompts, params)
    with RayLLM(stories_path, worker_threads=1, **opts) as ray_llm:
        got = ray_llm.generate(prompts, params)
        spec = ray_llm.engine.speculative
    assert spec.stats.num_accepted_tokens > 0 and spec.num_misses == 0
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_streams_through_the_async_front(stories_path: str) -> None:
    """The serving layer's AsyncLLMEngine drives a RayEngine: tokens arrive as steps accept them."""
    pytest.importorskip("keyserve.engine.async_engine")
    from keyserve.actors.ray_engine import AsyncRayEngine
    from keyserve.config import EngineConfig

    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    [want] = LLM(stories_path, **OPTIONS).generate("once upon a time", params)
    config = EngineConfig.from_flat(model=stories_path, worker_threads=1, **OPTIONS)
    engine = AsyncRayEngine(config)

    async def run() -> list[list[int]]:
        await engine.wait_ready(timeout=300)
        seen = []
        async for out in engine.generate("once upon a time", params):
            seen.append(list(out.token_ids))
        return seen

    try:
        seen = asyncio.run(run())
    finally:
        eng = engine.engine
        engine.shutdown()
        if eng is not None:
            eng.shutdown()
    assert len(seen) > 1 and seen[-1] == want.token_ids
    assert all(seen[i] == seen[-1][: len(seen[i])] for i in range(len(seen)))


def test_stream_takes_prompts_as_generate_does_and_leaves_none_behind(stories_path: str) -> None:
    """``RayLLM.stream``: a refused prompt raises with none of the prompts before it left
    running in the engine (they used to stay queued, unseen, and run in the next call), and one
    text is one prompt (it used to be streamed as one request per character)."""
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with RayLLM(stories_path, worker_threads=1, **OPTIONS) as ray_llm:
        [want] = ray_llm.generate("once upon a time", params)
        with pytest.raises(ValueError, match="empty"):
            list(ray_llm.stream(["once upon a time", ""], params))
        assert not ray_llm.engine.requests and not ray_llm.engine.has_unfinished_requests()
        with pytest.raises(ValueError, match="prompt 1"):
            list(ray_llm.stream(["once upon a time", 3.5], params))  # type: ignore[list-item]
        snapshots = list(ray_llm.stream("once upon a time", params))
        assert {s.prompt for s in snapshots} == {"once upon a time"}
        assert snapshots[-1].finished and snapshots[-1].outputs[0].token_ids == want.outputs[0].token_ids
        [by_ids] = [s for s in ray_llm.stream(want.prompt_token_ids, params) if s.finished]
        assert by_ids.outputs[0].token_ids == want.outputs[0].token_ids
        counts = ray_llm.engine.check_consistent()
        assert counts.num_free_blocks == counts.num_blocks


def test_a_stream_is_one_call_at_a_time(stories_path: str) -> None:
    """``RayLLM.stream`` takes its turn as ``generate`` does: a ``generate`` from another thread
    waits until the stream is exhausted (before, it ran its requests in the stream's steps and
    the stream yielded their snapshots; each call then dropped the other's), and one from inside
    the loop over the stream raises."""
    import threading

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    with RayLLM(stories_path, worker_threads=1, **OPTIONS) as ray_llm:
        [want_a] = ray_llm.generate("once upon a time", params)
        [want_b] = ray_llm.generate("the dog ran", params)
        other: list = []
        started = threading.Event()
        seen = set()
        for snapshot in ray_llm.stream("once upon a time", params):
            seen.add(snapshot.prompt)
            if not started.is_set():
                thread = threading.Thread(target=lambda: other.extend(ray_llm.generate("the dog ran", params)))
                thread.start()
                started.set()
                with pytest.raises(RuntimeError, match="inside a running call"):
                    ray_llm.generate("lily", params)
            last = snapshot
        thread.join(timeout=120)
        assert seen == {"once upon a time"}  # only the stream's own request
        assert last.finished and last.outputs[0].token_ids == want_a.outputs[0].token_ids
        assert [o.outputs[0].token_ids for o in other] == [want_b.outputs[0].token_ids]
        counts = ray_llm.engine.check_consistent()
        assert counts.num_free_blocks == counts.num_blocks

