"""Behind Ray Serve the replica runs the Ray engine at every tensor-parallel size: its own
target shard actors, draft actor and KV-block manager actor, each step one compiled graph.
Driven by the official ``openai`` client against the in-process engine's greedy output (the
oracle): TP 1 and TP 2 with a draft; a client that disconnects frees its blocks in the
KV-block manager actor (the server's KV gauges are that actor's counts); a target shard killed
mid-request is replaced and the request still completes with the same text."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
from ray_serve_cluster import metrics, ray_serve_cluster

from keyserve import LLM, SamplingParams
from keyserve.cluster.serve_app import build_app

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Ray's own pydantic use
PROMPT = "Once upon a time"
ACTORS = ("TargetShardActor", "DraftActor", "KVManagerActor")


@pytest.fixture(scope="module")
def serve_url():
    pytest.importorskip("ray")
    with ray_serve_cluster() as url:
        yield url


def deploy(url: str, name: str, stories_path: str, draft_dir: str | None, tp: int, replicas: int = 1) -> str:
    """An app at ``tp`` (with a draft unless None); its base URL once healthy."""
    from ray import serve

    args = {"model": stories_path, "tp": tp, "num_blocks": 128, "num_cpus": 0.25, "num_replicas": replicas,
            "worker_num_cpus": 0.25, "draft_num_cpus": 0.25, "worker_threads": 1, "compiled_graph": True,
            "served_model_name": name, "deployment_name": name, **({"draft": draft_dir} if draft_dir else {})}
    serve.run(build_app(args), name=name, route_prefix=f"/{name}")
    base = f"{url}/{name}"
    deadline = time.monotonic() + 300
    while httpx.get(base + "/health", timeout=30).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    return base


def alive(class_name: str) -> list[dict]:
    import ray

    return [a for a in ray._private.state.actors().values()
            if a["ActorClassName"] == class_name and a["State"] == "ALIVE"]


@pytest.fixture(scope="module")
def reference(stories_path: str, draft_dir: str) -> LLM:
    return LLM(stories_path, draft=draft_dir, num_blocks=128)


def greedy(reference: LLM, max_tokens: int) -> str:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return reference.generate([PROMPT], params)[0].outputs[0].text


@pytest.fixture(scope="module")
def tp1(serve_url: str, stories_path: str, draft_dir: str) -> str:
    return deploy(serve_url, "tp1", stories_path, draft_dir, tp=1)


def test_tp1_with_a_draft_runs_the_ray_engine(tp1: str, reference: LLM) -> None:
    from openai import OpenAI

    assert [len(alive(name)) for name in ACTORS] == [1, 1, 1]  # the replica's own actors
    client = OpenAI(base_url=tp1 + "/v1", api_key="unused", max_retries=0)
    out = client.completions.create(model="tp1", prompt=PROMPT, max_tokens=40, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text == greedy(reference, 40) and out.usage.completion_tokens == 40
    m = metrics(tp1)
    assert m["keyserve:spec_decode_num_draft_tokens_total"] > 0  # drafted by the draft actor
    assert m["keyserve:num_kv_blocks"] == 128  # the KV-block manager actor's pool


def test_disconnect_frees_blocks_in_the_kv_manager_actor(tp1: str) -> None:
    body = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", tp1 + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        busy = metrics(tp1)
    assert busy["keyserve:num_kv_blocks_free"] < busy["keyserve:num_kv_blocks"]  # blocks held mid-stream
    deadline = time.monotonic() + 60
    while True:
        m = metrics(tp1)
        if m["keyserve:num_requests_running"] == 0 and m["keyserve:num_kv_blocks_free"] == m["keyserve:num_kv_blocks"]:
            break
        assert time.monotonic() < deadline, m
        time.sleep(0.2)
    assert m["keyserve:request_success_total{abort}"] >= 1


def test_a_shard_killed_behind_serve_and_the_request_completes(tp1: str, reference: LLM) -> None:
    from openai import OpenAI

    [shard] = alive("TargetShardActor")
    client = OpenAI(base_url=tp1 + "/v1", api_key="unused", max_retries=0)
    stream = client.completions.create(model="tp1", prompt=PROMPT, max_tokens=400, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = [next(iter(stream))]
    os.kill(shard["Pid"], signal.SIGKILL)
    chunks += list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    [replacement] = alive("TargetShardActor")  # the group was recreated during the request
    assert replacement["ActorID"] != shard["ActorID"]
    assert text == greedy(reference, 400)


def test_tp2_with_a_draft(serve_url: str, tp1: str, stories_path: str, draft_dir: str, reference: LLM) -> None:
    from openai import OpenAI
    from ray import serve

    base = deploy(serve_url, "tp2", stories_path, draft_dir, tp=2)
    try:
        assert [len(alive(name)) for name in ACTORS] == [3, 2, 2]  # tp1's and tp2's
        client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        out = client.completions.create(model="tp2", prompt=PROMPT, max_tokens=40, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert out.choices[0].text == greedy(reference, 40)
        assert metrics(base)["keyserve:spec_decode_num_draft_tokens_total"] > 0
    finally:
        serve.delete("tp2")


def test_two_replicas_each_with_their_own_actors(serve_url: str, tp1: str, stories_path: str) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from openai import OpenAI
    from ray import serve

    base = deploy(serve_url, "two", stories_path, None, tp=1, replicas=2)
    try:
        deadline, healthy = time.monotonic() + 300, 0
        while len(alive("KVManagerActor")) < 3 or healthy < 20:  # both replicas up, not only one
            assert time.monotonic() < deadline
            healthy = healthy + 1 if httpx.get(base + "/health", timeout=30).status_code == 200 else 0
        managers = alive("KVManagerActor")
        assert len(managers) == 3  # tp1's and one per replica, each owned by its replica
        assert len({(a["OwnerAddress"]["IPAddress"], a["OwnerAddress"]["Port"]) for a in managers}) == 3
        client = OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        sizes = [2**i for i in range(8)]  # every subset has its own sum: each replica's total names it

        def ask(n: int) -> int:
            out = client.completions.create(model="two", prompt=PROMPT, max_tokens=n, temperature=0,
                                            extra_body={"ignore_eos": True})
            return out.usage.completion_tokens

        with ThreadPoolExecutor(len(sizes)) as pool:
            assert list(pool.map(ask, sizes)) == sizes
        totals = {metrics(base)["keyserve:generation_tokens_total"] for _ in range(40)}
        assert len(totals) == 2 and min(totals) > 0 and sum(totals) == sum(sizes)  # Serve used both
    finally:
        serve.delete("two")
