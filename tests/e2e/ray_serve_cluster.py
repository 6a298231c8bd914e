"""A local Ray cluster with Ray Serve's HTTP proxy on a free port: the start-up both Ray Serve
test modules share (one per module: Ray's start-up costs seconds on 2 cores)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
from prometheus_client.parser import text_string_to_metric_families

from keyserve.cluster.launcher import free_port


@contextmanager
def ray_serve_cluster() -> Iterator[str]:
    """Yields Serve's base URL; Serve and Ray are shut down after. Replicas and actors get one
    OpenMP thread each (2 cores) and this process's PYTHONPATH."""
    import ray
    from ray import serve

    port = free_port()
    env = {"OMP_NUM_THREADS": "1", **({"PYTHONPATH": os.environ["PYTHONPATH"]} if "PYTHONPATH" in os.environ else {})}
    ray.init(address="local", num_cpus=2, object_store_memory=200 * 1024 * 1024, include_dashboard=False,
             runtime_env={"env_vars": env})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
        serve.shutdown()
    finally:
        ray.shutdown()


def metrics(base: str) -> dict[str, float]:
    """The server's Prometheus samples by name, with the finished_reason or status label (if
    any) in braces."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(base + "/metrics", timeout=30).text):
        for s in family.samples:
            label = s.labels.get("finished_reason") or s.labels.get("status")
            out[s.name + (f"{{{label}}}" if label else "")] = s.value
    return out
