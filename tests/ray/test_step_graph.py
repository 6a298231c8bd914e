"""The step as one Ray Compiled Graph (KV-block manager -> draft actor -> target shards): it is
compiled once and re-executed; the driver makes no plain actor call per step; and its outputs
equal the plain-actor paths' (Ray calls, step channels called by the driver, the step relayed
actor to actor over the channels) and the in-process engine's (greedy tokens, seeded samples,
log-probabilities, speculation statistics) with a draft at TP = 2, n > 1 forks and preemptions."""

from __future__ import annotations

import random

import pytest
import ray
import torch
from helpers.drive import run_with_action

from keyserve import LLM, SamplingParams
from keyserve.actors.step_graph import use_compiled_graph
from keyserve.core.cpu_count import usable_cpus
from keyserve.llm import RayLLM

pytestmark = pytest.mark.usefixtures("ray_local")

WORDS = "once upon a time there was a little girl named lily she loved to play outside in the park".split()
OPTIONS = dict(num_blocks=60, block_size=8)  # small: the 16 requests preempt each other


def _workload() -> tuple[list[str], list[SamplingParams]]:
    rng = random.Random(5)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 40))) for _ in range(16)]
    params = [
        SamplingParams(max_tokens=12 + i % 7, temperature=0.8 if i % 3 == 1 else 0.0,
                       seed=50 + i if i % 3 == 1 else None, n=2 if i % 5 == 2 else 1, logprobs=True,
                       ignore_eos=i % 4 == 0, num_speculative_tokens=1 + i % 4)
        for i in range(16)
    ]
    return prompts, params


def _forbid(obj: object, name: str, unless: dict | None = None) -> None:
    inner = getattr(obj, name)

    def fail(*args, **kwargs):
        if unless is not None and kwargs.items() >= unless.items():
            return inner(*args, **kwargs)
        raise AssertionError(f"{name} called on the compiled path")

    setattr(obj, name, fail)


class _NoRayCall:
    """An actor handle whose ``method`` may not be called through Ray."""

    def __init__(self, actor: object, method: str) -> None:
        self._actor, self._method = actor, method

    def __getattr__(self, name: str):
        if name == self._method:
            raise AssertionError(f"a Ray call to {name} on the step-channel path")
        return getattr(self._actor, name)


def _count_sends(channels: list) -> list[int]:
    """Counts of each channel's messages, kept up to date in the returned list."""
    counts = [0] * len(channels)
    for i, channel in enumerate(channels):
        inner = channel.send

        def send(payload: bytes, i=i, inner=inner) -> None:
            counts[i] += 1
            inner(payload)

        channel.send = send
    return counts


def _count_drafted(group) -> list[int]:
    """[steps sent to the target group, of them with the draft actor's probabilities (these go
    by Ray call: an object reference, actor to actor)], kept up to date."""
    counts = [0, 0]
    inner = group.execute

    def execute(step, draft_probs=None):
        counts[0] += 1
        counts[1] += isinstance(draft_probs, ray.ObjectRef)
        return inner(step, draft_probs)

    group.execute = execute
    return counts


def test_compiled_graph_equals_plain_actors_and_in_process(stories_path: str, draft_dir: str) -> None:
    prompts, params = _workload()
    opts = dict(OPTIONS, draft=draft_dir, tensor_parallel_size=2, worker_threads=1, worker_num_cpus=0.1)
    want = LLM(stories_path, **OPTIONS, draft=draft_dir).generate(prompts, params)
    # auto would pick plain calls here (two cores, both taken by the shards' threads)
    with RayLLM(stories_path, compiled_graph=False, step_channels=False, **opts) as ray_calls_llm:
        ray_calls = ray_calls_llm.generate(prompts, params)
        assert ray_calls_llm.engine.core_client.channel is None and not ray_calls_llm.engine.group.channels
    with RayLLM(stories_path, compiled_graph=False, step_relay=False, **opts) as plain_llm:
        engine = plain_llm.engine
        # plain calls go over the step channels: never a Ray call to the KV-block manager's
        # step or the draft actor's propose, and every step reaches both shards over theirs
        # (the draft probabilities too, not as an object reference)
        engine.core_client.actor = _NoRayCall(engine.core_client.actor, "step")
        engine.drafter_client.actor = _NoRayCall(engine.drafter_client.actor, "propose")
        sends = _count_sends(engine.group.channels)
        by_ray = _count_drafted(engine.group)
        plain = plain_llm.generate(prompts, params)
        assert engine.num_graph_compiles == 0
        assert engine.core_client.channel is not None and engine.drafter_client.channel is not None
        steps, drafted_by_ray = by_ray
        assert sends == [steps, steps] and steps > 20 and drafted_by_ray == 0
        assert engine.speculative.stats.num_draft_tokens > 0
    with RayLLM(stories_path, compiled_graph=False, **opts) as relay_llm:
        engine = relay_llm.engine
        assert engine.relayed and not engine.compiled_graph
        # The relayed graph: the driver sends the KV-block manager its request and reads the
        # actors' replies; it never calls the target group or the draft actor itself, nor the
        # KV-block manager's step by Ray or by plain channel call (but once when idle).
        _forbid(engine.core_client, "_call", unless={"schedule": False})
        _forbid(engine.group, "execute")
        _forbid(engine.drafter_client, "propose")
        engine.core_client.actor = _NoRayCall(engine.core_client.actor, "step")
        relayed = relay_llm.generate(prompts, params)
        assert engine.num_steps > 20 and engine.num_graph_compiles == 0
        assert not engine.group.channels  # the driver's own step channels to the shards: closed
        assert engine._graph is not None and engine._graph.has_draft
        assert engine.speculative.stats.num_draft_tokens > 0
    with RayLLM(stories_path, compiled_graph=True, **opts) as llm:
        engine = llm.engine
        assert engine.compiled_graph
        # The driver only submits the graph and reads it: no plain call to any actor per step
        # (one to the KV-block manager when the engine falls idle, to free finished requests).
        _forbid(engine.core_client, "_call", unless={"schedule": False})
        _forbid(engine.group, "execute")
        _forbid(engine.drafter_client, "propose")
        got = llm.generate(prompts, params)
        assert engine.num_graph_compiles == 1 and engine.num_steps > 20  # compiled once, re-executed
        assert engine.stats().num_preemptions > 0
        spec = engine.speculative.stats
        assert spec.num_draft_tokens > 0 and 0 < spec.acceptance_rate < 1
        engine.flush()
        view = engine.check_consistent()
        assert view.num_free_blocks == view.num_blocks
    for other in (ray_calls, plain, relayed, got):
        for a, b in zip(want, other, strict=True):
            assert [o.token_ids for o in b.outputs] == [o.token_ids for o in a.outputs]
            for x, y in zip(a.outputs, b.outputs):
                torch.testing.assert_close(torch.tensor(y.logprobs), torch.tensor(x.logprobs), atol=1e-5, rtol=0)
            assert b.stats.spec_draft_tokens == a.stats.spec_draft_tokens
            assert b.stats.spec_accepted_tokens == a.stats.spec_accepted_tokens


def test_a_shard_lost_between_steps_loses_no_command(stories_path: str, draft_dir: str) -> None:
    """A shard dies between two steps and Ray notices before the next one: whatever of that
    step's message the KV-block manager did not read (the previous step's commit, an abort,
    new requests) is sent again and applied once; every request ends as it would have."""
    import time

    import ray

    prompts, params = _workload()
    # Greedy: the later arrivals change the steps, which changes what a sampled speculative
    # request draws (not its distribution), but not a greedy one's tokens.
    params = [p.model_copy(update={"temperature": 0.0, "seed": None}) for p in params]
    want = LLM(stories_path, **OPTIONS, draft=draft_dir).generate(prompts[:8], params[:8])
    with RayLLM(stories_path, draft=draft_dir, tensor_parallel_size=2, worker_threads=1, worker_num_cpus=0.1,
                compiled_graph=True, **OPTIONS) as llm:
        engine = llm.engine

        def lose_a_shard_then_add_two() -> list[str]:
            victim = engine.group.workers[1]
            ray.kill(victim)
            while any(a["State"] != "DEAD" for a in ray._private.state.actors().values()
                      if a["ActorID"] == victim._actor_id.hex()):
                time.sleep(0.1)
            time.sleep(1.0)  # the graph's own monitor sees it too
            return [engine.add_request(p, sp) for p, sp in zip(prompts[6:8], params[6:8])]

        got = run_with_action(engine, prompts[:6], params[:6], lose_a_shard_then_add_two, at_step=3)
        assert engine.group.num_restarts == 1 and engine.num_graph_compiles == 2
        engine.flush()
        view = engine.check_consistent()
        assert view.num_free_blocks == view.num_blocks and view.num_running_seqs == view.num_waiting_seqs == 0
    for a, b in zip(want, got, strict=True):
        assert [o.token_ids for o in b.outputs] == [o.token_ids for o in a.outputs]


def test_an_abort_reads_the_relayed_step_in_flight_first(stories_path: str) -> None:
    """The relay submits step n + 1 as soon as step n is committed, so between two ``step``
    calls a step is in flight. An abort then first reads and accepts that step (``_drain``): a
    request it finished still gets its final output from the next ``step`` (here the last one
    left), with the tokens it would have had; the aborted requests end at once; every block
    comes back. Without the drain the abort would change the
    KV-block manager under a step it scheduled; without the held outputs the finished request's
    last output would be lost."""
    prompts = ["once upon a time", "the little girl", "lily loved to play"]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (30, 6, 12)]
    want = LLM(stories_path, **OPTIONS).generate(prompts, params)
    with RayLLM(stories_path, worker_threads=1, worker_num_cpus=0.1, compiled_graph=False, **OPTIONS) as llm:
        engine = llm.engine
        assert engine.relayed
        ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        final: dict[str, object] = {}
        for _ in range(5):  # the prompt step, then four decode steps: step 6 (the short one's last) is in flight
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = out
        assert engine._inflight is not None and not final
        aborted = engine.abort(ids[0])
        assert aborted is not None and aborted.finished and engine._inflight is None
        assert len(aborted.outputs[0].token_ids) < 30
        assert engine.abort(ids[1]) is None  # the drained step finished it: nothing to abort
        assert engine.abort(ids[2]).finished
        assert not engine.requests and engine.has_unfinished_requests()  # one output still to give
        last = engine.step()
        assert [o.request_id for o in last] == [ids[1]] and last[0].finished
        assert [o.token_ids for o in last[0].outputs] == [o.token_ids for o in want[1].outputs]
        assert not engine.has_unfinished_requests()
        view = engine.check_consistent()
        assert view.num_free_blocks == view.num_blocks and view.num_running_seqs == view.num_waiting_seqs == 0


def _cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of these processes so far (from /proc)."""
    import os

    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/stat"), reason="needs /proc for CPU times")
def test_an_idle_graph_is_released_and_compiled_again(stories_path: str) -> None:
    """While the compiled graph exists its actors busy-wait on their channels (a core each);
    after ``graph_idle_release_s`` without requests it is torn down -- the actors' CPU time
    stops growing -- and the next request compiles it again and gets the same tokens."""
    import time

    import ray

    prompts, params = _workload()
    prompts, params = prompts[:3], [p.model_copy(update={"temperature": 0.0, "seed": None}) for p in params[:3]]
    with RayLLM(stories_path, worker_threads=1, worker_num_cpus=0.1, graph_idle_release_s=0.5, compiled_graph=True,
                **OPTIONS) as llm:
        engine = llm.engine
        first = llm.generate(prompts, params)
        assert engine.num_graph_compiles == 1
        deadline = time.monotonic() + 60
        while engine.num_graph_releases == 0:
            assert time.monotonic() < deadline, "the idle graph was never released"
            time.sleep(0.1)
        assert engine._graph is None
        pids = [a["Pid"] for a in ray._private.state.actors().values()
                if a["State"] == "ALIVE" and a["ActorClassName"] in ("TargetShardActor", "KVManagerActor")]
        assert len(pids) == 2
        time.sleep(1.0)  # the teardown itself (channel close, thread joins) is not the busy-wait
        before = _cpu_seconds(pids)
        time.sleep(2.0)
        used = _cpu_seconds(pids) - before
        # two actors busy-waiting take ~2 cores (~4 CPU-s here); idle Ray actors on a slow 2-core
        # machine were seen at 0.52 CPU-s (heartbeats, metrics), so the line is half a core.
        assert used < 1.0, f"the released graph's actors still used {used:.2f} CPU-s in 2 s"
        again = llm.generate(prompts, params)
        assert engine.num_graph_compiles == 2
    for a, b in zip(first, again, strict=True):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]


@pytest.mark.parametrize(("setting", "on_gpu", "cpus", "tp", "threads", "draft", "want"), [
    (None, False, 2, 1, None, False, False),  # the shards' default threads take both cores
    (None, False, 2, 2, 1, True, False),
    (None, False, 16, 2, 4, False, True),  # 8 cores to spare for 2 readers
    (None, False, 16, 2, 7, True, False),  # 2 to spare for 3 readers
    (None, False, 16, 2, 6, True, True),  # 4 to spare for 3
    (None, True, 2, 1, None, True, True),  # on a GPU the spinners cost nobody's cores
    (True, False, 2, 1, None, False, True),  # an explicit setting wins
    (False, True, 64, 1, 1, False, False),
])
def test_auto_uses_the_graph_only_with_a_core_per_reader(setting, on_gpu, cpus, tp, threads, draft, want) -> None:
    assert use_compiled_graph(setting, on_gpu, cpus, tp, threads, draft) is want


def test_auto_picks_the_relay_on_this_two_core_machine(stories_path: str) -> None:
    with RayLLM(stories_path, worker_threads=2, worker_num_cpus=0.1, **OPTIONS) as llm:
        assert llm.engine.config.parallel.compiled_graph is None
        assert llm.engine.compiled_graph is (usable_cpus() - 2 >= 2)
        assert llm.engine.relayed is not llm.engine.compiled_graph  # the relay wherever the graph is not
        llm.generate(["once upon a time"], SamplingParams(max_tokens=4, temperature=0.0))
        assert llm.engine.num_graph_compiles == (1 if llm.engine.compiled_graph else 0)
