"""A real Ray instance per test module (2 CPUs, a small object store), always shut down."""

from __future__ import annotations

import pytest

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def ray_local():
    ray.init(num_cpus=2, object_store_memory=200 * 1024**2, include_dashboard=False,
             log_to_driver=False, configure_logging=False)
    try:
        yield
    finally:
        ray.shutdown()
