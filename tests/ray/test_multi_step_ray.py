"""Multi-step scheduling on the Ray engine (``num_scheduler_steps``): the shards run a round's
decode steps back to back (under tensor parallelism rank 0 broadcasts each step's tokens), the
KV-block manager actor reserves and commits the round. The oracle is the in-process engine with
one step per round: the same tokens, log-probabilities and finish reasons for 32 mixed requests
(every KV-budget policy beside the rounds, n > 1, seeded sampling, preemptions in a small pool),
on the relay at TP = 1 and the compiled graph at TP = 2; and a shard or the KV-block manager
killed in the middle of the rounds costs no token."""

from __future__ import annotations

import pytest
import ray
from test_ray_engine import OPTIONS, _params, _prompts, _same

from helpers.drive import run_with_action

from keyserve import LLM, SamplingParams
from keyserve.llm import RayLLM

pytestmark = pytest.mark.usefixtures("ray_local")


@pytest.mark.parametrize("tp,graph", [(1, False), (2, True)], ids=["relay-tp1", "graph-tp2"])
def test_rounds_equal_the_in_process_engine_with_single_steps(stories_path: str, tp: int, graph: bool) -> None:
    prompts = _prompts(32, seed=5)
    params = [_params(i, budgets=True) for i in range(32)]
    local = LLM(stories_path, **OPTIONS)
    want = local.generate(prompts, params)
    with RayLLM(stories_path, num_scheduler_steps=4, tensor_parallel_size=tp, compiled_graph=graph,
                worker_threads=1, worker_num_cpus=0.1, **OPTIONS) as ray_llm:
        got = ray_llm.generate(prompts, params)
        engine = ray_llm.engine
        assert engine.compiled_graph is graph and engine.relayed is not graph
        assert engine.num_steps < local.engine.num_steps  # rounds of several steps ran
        assert engine.stats().num_preemptions > 0
        view = engine.check_consistent()
        assert view.num_free_blocks == view.num_blocks
    _same(prompts, want, got, tp)


def test_with_the_draft_actor_the_steps_nobody_drafts_in_run_as_rounds(stories_path: str, draft_dir: str) -> None:
    """The draft actor loaded: steps in which no sequence drafts are rounds on the shards (the
    draft actor is not asked to draft for a round's lookahead), steps with drafts verify; the
    in-process engine with the same draft, one step per round, is the oracle."""
    prompts = _prompts(16, seed=6)
    quiet = [_params(i, speculative=False) for i in range(16)]
    mixed = [_params(i, speculative=i % 3 == 0) for i in range(16)]
    opts = dict(OPTIONS, draft=draft_dir, num_speculative_tokens=2)
    local = LLM(stories_path, **opts)
    want_quiet = local.generate(prompts, quiet)
    single_steps = local.engine.num_steps
    want_mixed = local.generate(prompts, mixed)
    with RayLLM(stories_path, num_scheduler_steps=4, worker_threads=1, worker_num_cpus=0.1, **opts) as ray_llm:
        engine = ray_llm.engine
        got_quiet = ray_llm.generate(prompts, quiet)
        assert engine.num_steps < single_steps  # rounds ran
        assert engine.speculative.stats.num_draft_tokens == 0
        got_mixed = ray_llm.generate(prompts, mixed)
        assert engine.speculative.stats.num_draft_tokens > 0
        view = engine.check_consistent()
        assert view.num_free_blocks == view.num_blocks
    _same(prompts, want_quiet, got_quiet)
    _same(prompts, want_mixed, got_mixed)


@pytest.fixture(scope="module")
def rounds_engine(stories_path: str):
    llm = RayLLM(stories_path, num_scheduler_steps=4, tensor_parallel_size=2, worker_threads=1,
                 worker_num_cpus=0.1, max_restarts=2, num_blocks=120, block_size=8)
    assert llm.engine.relayed
    yield llm.engine
    llm.shutdown()


def _workload(seeded: bool) -> tuple[list[str], list[SamplingParams]]:
    """Greedy requests, and with ``seeded`` every other one sampled with a seed: a seeded
    stream survives a KV-block manager loss (the generators live on rank 0), not a shard loss
    (the whole group is replaced, docs/ray.md "Faults")."""
    prompts = _prompts(8, seed=9)
    params = [SamplingParams(max_tokens=30 + i, temperature=0.9 if seeded and i % 2 == 0 else 0.0, seed=50 + i,
                             ignore_eos=True, n=2 if i == 3 else 1) for i in range(8)]
    return prompts, params


@pytest.mark.parametrize("victim", ["shard", "kv_manager"])
def test_an_actor_killed_between_rounds_costs_no_token(rounds_engine, stories_path: str, victim: str) -> None:
    prompts, params = _workload(seeded=victim == "kv_manager")
    want = LLM(stories_path, num_blocks=120, block_size=8).generate(prompts, params)
    engine = rounds_engine
    core, group = engine.core_client, engine.group
    losses, restarts = core.num_losses, group.num_restarts

    def kill() -> None:
        ray.kill(group.workers[1] if victim == "shard" else core.actor, no_restart=False)

    got = run_with_action(engine, prompts, params, kill, at_step=3)
    assert (group.num_restarts - restarts, core.num_losses - losses) == ((1, 0) if victim == "shard" else (0, 1))
    for a, b in zip(want, got, strict=True):
        assert [o.token_ids for o in b.outputs] == [o.token_ids for o in a.outputs]
    engine.flush()
    view = engine.check_consistent()
    assert view.num_free_blocks == view.num_blocks
