"""The cores this process may really use, for sizing torch's thread pool.

``os.cpu_count()`` is the machine's count. In a Kubernetes pod with a CPU limit (a cgroup CPU
quota) or a process pinned to some cores, it overcounts: a shard that starts one torch thread
per machine core on a 64-core node under a 2-CPU limit is throttled into the ground. So: the
CPU affinity, capped by the cgroup quota (v2 ``cpu.max`` or v1 ``cpu.cfs_quota_us``), rounded
up. Pure standard library; read once per actor or engine, never per step.
"""

from __future__ import annotations

import math
import os
from pathlib import Path


def cgroup_cpu_quota(root: str | Path = "/sys/fs/cgroup") -> float | None:
    """CPUs the cgroup's quota allows (2.5 for 250000 per 100000 us), or None without a quota."""
    root = Path(root)
    try:
        fields = (root / "cpu.max").read_text().split()  # cgroup v2: "max 100000" | "200000 100000"
        if fields[0] == "max":
            return None
        quota, period = int(fields[0]), int(fields[1])
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError, IndexError):
        pass
    try:  # cgroup v1
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def usable_cpus(root: str | Path = "/sys/fs/cgroup") -> int:
    """The process's CPU affinity, capped by the cgroup CPU quota (rounded up); at least 1."""
    try:
        count = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        count = os.cpu_count() or 1
    quota = cgroup_cpu_quota(root)
    if quota is not None:
        count = min(count, math.ceil(quota))
    return max(1, count)


def threads_per_shard(worker_threads: int | None, num_shards: int, cpus: int) -> int:
    """A target shard's torch threads: ``worker_threads`` if set, else its share of ``cpus``."""
    return worker_threads or max(1, cpus // num_shards)
