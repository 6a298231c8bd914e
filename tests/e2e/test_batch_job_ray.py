"""The batch job on Ray with a draft, at ``--tp 2`` and at TP 1 (on Ray the Ray engine runs at
every size): target shard actors, the draft actor and the KV-block manager actor (each step one
compiled graph) answer every line exactly as the batch job in a process without Ray does
(greedy), and the job leaves no actor alive."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from keyserve.cluster.batch_job import main as batch_main


def _texts(path: Path) -> dict[str, str]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return {r["custom_id"]: r["response"]["body"]["choices"][0]["text"] for r in records}


def test_batch_job_on_ray_with_tp2_and_tp1(tmp_path: Path, stories_path: str, draft_dir: str) -> None:
    ray = pytest.importorskip("ray")
    assert not ray.is_initialized()
    src = tmp_path / "in.jsonl"
    src.write_text("".join(
        json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                    "body": {"prompt": f"Once upon a time {i}", "max_tokens": 16 + i, "temperature": 0,
                             "ignore_eos": True}}) + "\n"
        for i in range(8)))
    flags = ["--input", str(src), "--model", stories_path, "--draft", draft_dir, "--num-blocks", "128",
             "--no-progress", "--worker-threads", "1"]
    assert batch_main([*flags, "--output", str(tmp_path / "local.jsonl")]) == 0  # no Ray: in this process
    want = _texts(tmp_path / "local.jsonl")
    assert len(want) == 8
    ray.init(num_cpus=2, object_store_memory=200 * 1024**2, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    try:
        for tp, shards in (("2", 2), ("1", 3)):  # on Ray, TP = 1 too runs the Ray engine
            out = tmp_path / f"tp{tp}.jsonl"
            assert batch_main([*flags, "--output", str(out), "--tp", tp, "--compiled-graph"]) == 0
            assert _texts(out) == want
            assert len(_actors(ray, "TargetShardActor")) == shards  # every one of them gone now
            assert len(_actors(ray, "KVManagerActor")) == shards - 1 and len(_actors(ray, "DraftActor")) == shards - 1
            assert not _actors(ray, "TargetShardActor", "ALIVE")
    finally:
        ray.shutdown()


def _actors(ray, class_name: str, state: str | None = None) -> list[dict]:
    return [a for a in ray._private.state.actors().values()
            if a["ActorClassName"] == class_name and state in (None, a["State"])]
