"""The cores a process may use: CPU affinity capped by a cgroup CPU quota (a Kubernetes limit),
read from a fake cgroup tree."""

from __future__ import annotations

import os

import pytest

from keyserve.core.cpu_count import cgroup_cpu_quota, usable_cpus


def _affinity() -> int:
    return len(os.sched_getaffinity(0))


@pytest.mark.parametrize(("files", "quota"), [
    ({"cpu.max": "250000 100000\n"}, 2.5),  # cgroup v2 with a limit
    ({"cpu.max": "max 100000\n"}, None),  # v2, no limit
    ({"cpu/cpu.cfs_quota_us": "150000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 1.5),  # v1
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),  # v1, no limit
    ({"cpu.max": "garbage"}, None),
    ({}, None),  # no cgroup files at all
])
def test_quota(tmp_path, files, quota) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cgroup_cpu_quota(tmp_path) == quota


def test_usable_cpus_is_the_affinity_capped_by_the_quota_rounded_up(tmp_path) -> None:
    assert usable_cpus(tmp_path) == _affinity()  # no quota
    (tmp_path / "cpu.max").write_text("50000 100000\n")  # half a CPU: still one thread
    assert usable_cpus(tmp_path) == 1
    (tmp_path / "cpu.max").write_text(f"{100000 * _affinity() + 1} 100000\n")  # more than the affinity
    assert usable_cpus(tmp_path) == _affinity()
    if _affinity() >= 2:
        (tmp_path / "cpu.max").write_text("110000 100000\n")  # 1.1 CPUs -> 2
        assert usable_cpus(tmp_path) == 2
