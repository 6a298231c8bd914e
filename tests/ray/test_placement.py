"""Placement across two simulated nodes (``ray.cluster_utils.Cluster``): the target group's
shards packed on one node, the draft actor on the other; each step one compiled graph whose
channels cross the nodes; outputs unchanged."""

from __future__ import annotations


import pytest
import ray
from ray.cluster_utils import Cluster

from keyserve import LLM, SamplingParams
from keyserve.llm import RayLLM


@pytest.fixture(scope="module")
def two_nodes():
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"target_node": 4}, "object_store_memory": 100 * 1024**2,
        "include_dashboard": False,
    })
    draft_node = cluster.add_node(num_cpus=1, resources={"draft_node": 1}, object_store_memory=100 * 1024**2)
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    try:
        yield cluster, draft_node
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_target_group_on_one_node_draft_on_the_other(two_nodes, stories_path: str, draft_dir: str) -> None:
    cluster, draft_node = two_nodes
    head_id = cluster.head_node.node_id
    prompts = ["once upon a time", "lily and ben went to the park", "the little girl saw a big"]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    want = LLM(stories_path, draft=draft_dir, num_blocks=64).generate(prompts, params)
    with RayLLM(stories_path, draft=draft_dir, num_blocks=64, tensor_parallel_size=2, worker_threads=1, compiled_graph=True,
                worker_num_cpus=0.25, worker_resources={"target_node": 1},
                draft_num_cpus=0.25, draft_resources={"draft_node": 1}) as llm:
        engine = llm.engine
        shard_nodes = ray.get([w.node_id.remote() for w in engine.group.workers])
        assert shard_nodes == [head_id, head_id]
        assert ray.get(engine.drafter_client.actor.node_id.remote()) == draft_node.node_id != head_id
        got = llm.generate(prompts, params)
        assert engine.speculative.stats.num_draft_tokens > 0
        assert engine.num_graph_compiles == 1  # every step one compiled graph across both nodes
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
