"""A container's CPU quota (cgroup v2 cpu.max, v1 cpu.cfs_quota_us) caps the threads each rank takes: a pod with
limits.cpu: 4 on a 64-core node must not run 64 threads a rank. Read from fake cgroup trees laid out as the kernel
lays them out."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ddpexp.rank.speed import cpu_quota, limit_threads


def lay(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_cgroup_v2_cpu_max_of_the_cgroup_or_a_parent(tmp_path: Path) -> None:
    proc = tmp_path / "cgroup"
    proc.write_text("0::/kubepods/pod1/ctr\n")
    lay(tmp_path / "fs", {"kubepods/pod1/ctr/cpu.max": "max 100000\n", "kubepods/pod1/cpu.max": "400000 100000\n",
                          "kubepods/cpu.max": "max 100000\n"})  # fmt: skip
    assert cpu_quota(str(tmp_path / "fs"), str(proc)) == 4.0  # the pod's limit holds for its container
    (tmp_path / "fs" / "kubepods/pod1/ctr/cpu.max").write_text("150000 100000\n")
    assert cpu_quota(str(tmp_path / "fs"), str(proc)) == 1.5  # the tighter one
    proc.write_text("0::/\n")
    lay(tmp_path / "top", {"cpu.max": "max 100000\n"})
    assert cpu_quota(str(tmp_path / "top"), str(proc)) is None  # no limit
    assert cpu_quota(str(tmp_path / "none"), str(tmp_path / "missing")) is None


def test_cgroup_v1_cfs_quota(tmp_path: Path) -> None:
    proc = tmp_path / "cgroup"
    proc.write_text("12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n")
    lay(tmp_path / "fs", {"cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "200000\n",
                          "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n"})  # fmt: skip
    assert cpu_quota(str(tmp_path / "fs"), str(proc)) == 2.0
    (tmp_path / "fs" / "cpu,cpuacct/docker/abc/cpu.cfs_quota_us").write_text("-1\n")
    assert cpu_quota(str(tmp_path / "fs"), str(proc)) is None


def test_the_quota_caps_each_rank_s_threads() -> None:
    before = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0))
    try:
        assert limit_threads(1, quota=None) == cores
        assert limit_threads(1, quota=1.0) == 1  # a 1-CPU quota on any host: one thread
        assert limit_threads(1, quota=0.5) == 1 and torch.get_num_threads() == 1  # at least one
        assert limit_threads(2, quota=64.0) == max(1, cores // 2)  # a quota above the cores changes nothing
    finally:
        torch.set_num_threads(before)
