"""Per-rank speed settings that change no result: CPU threads, the C allocator, and the device defaults
(precision, channels_last) that `precision=auto` and `channels_last=null` resolve to."""

from __future__ import annotations

import ctypes
import os

import torch

# glibc's mallopt(3) parameters.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD_MAX = 32 << 20  # glibc refuses more on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX)


def limit_threads(local_world_size: int, quota: float | None = None) -> int:
    """Split the cores between this node's ranks; N ranks x all cores each oversubscribes the CPU (on 2 cores,
    2 ranks with 2 threads each run at about 0.6x the speed of 1 thread each). The cores are the fewer of the
    affinity mask's and a container's CPU `quota` (cpu_quota(): a pod with limits.cpu: 4 on a 64-core node sees
    64 cores)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if quota is not None:
        cores = min(cores, max(1, int(quota)))
    threads = max(1, cores // local_world_size)
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set: a second job in the same process (gpus=1 inside a multirun)
        pass
    return threads


def cpu_quota(cgroup_root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> float | None:
    """The CPUs this process's cgroup may use (quota / period), the tightest of its cgroup and each parent; None
    without a quota. cgroup v2: `cpu.max` ("400000 100000", or "max 100000"); v1: `cpu.cfs_quota_us` (-1: none) and
    `cpu.cfs_period_us` in the cpu controller's hierarchy."""
    try:
        with open(proc_cgroup) as f:
            lines = [line.strip().split(":", 2) for line in f if line.count(":") >= 2]
    except OSError:
        return None
    found = []
    for _, controllers, path in lines:
        if controllers == "":  # v2's unified hierarchy
            dirs = [cgroup_root]
            names = ("cpu.max",)
        elif "cpu" in controllers.split(","):
            dirs = [os.path.join(cgroup_root, c) for c in (controllers, "cpu", "cpu,cpuacct")]
            names = ("cpu.cfs_quota_us", "cpu.cfs_period_us")
        else:
            continue
        for top in dict.fromkeys(dirs):
            parts = [p for p in path.split("/") if p]
            for depth in range(len(parts), -1, -1):  # the cgroup, then each parent: a limit anywhere holds
                value = _read_quota(os.path.join(top, *parts[:depth]), names)
                if value is not None:
                    found.append(value)
    return min(found) if found else None


def _read_quota(folder: str, names: tuple[str, ...]) -> float | None:
    try:
        if names == ("cpu.max",):
            with open(os.path.join(folder, "cpu.max")) as f:
                quota, period = f.read().split()[:2]
        else:
            quota, period = (open(os.path.join(folder, n)).read().strip() for n in names)
    except (OSError, ValueError):
        return None
    if quota in ("max", "-1") or int(period) <= 0:
        return None
    return int(quota) / int(period)


def keep_freed_memory() -> bool:
    """Make glibc malloc keep freed blocks for reuse instead of returning them to the kernel.

    PyTorch's CPU allocator is plain malloc. glibc serves big blocks (above 128 KiB at first, a threshold that then
    follows the freed sizes) with a fresh mmap, unmaps them on free and trims the heap top, so a step's
    activations keep arriving as new pages that the kernel must fault in and zero: the cnn at batch 128 took
    13k-28k page faults per step on one core here. With the mmap threshold at its maximum and trimming off, each
    step re-uses the previous step's memory (~0-500 faults per step) and ran 8-28 % faster. Peak RSS is what the
    step needs either way; the memory is only not handed back between steps. Changes no result.
    Returns False where the C library is not glibc (nothing is done)."""
    try:
        libc = ctypes.CDLL(None)  # this process's symbols, the C library's among them
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 (glibc only: musl's mallopt is a no-op, macOS has none)
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


def speed_defaults(cfg, device: torch.device, model: torch.nn.Module) -> tuple[str, bool]:  # type: ignore[no-untyped-def]
    """precision=auto and channels_last=null resolved: bf16 autocast and channels_last convolutions on a GPU
    (tensor cores want both), plain fp32 NCHW on a CPU, so a CPU run is bit-equal to a hand-written fp32 loop
    (channels_last=true on a CPU is faster for the cnn here, but rounds differently)."""
    cuda = device.type == "cuda"
    precision = cfg.precision
    if precision == "auto":
        precision = "bf16" if cuda and torch.cuda.is_bf16_supported() else "fp32"
    channels_last = cfg.channels_last
    if channels_last is None:
        channels_last = cuda and any(isinstance(m, torch.nn.Conv2d) for m in model.modules())
    return precision, channels_last
