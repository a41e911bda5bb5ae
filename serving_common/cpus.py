"""How many CPUs this process may keep busy: its CPU affinity, capped by a cgroup CPU limit.

A container's `--cpus 2` or a Kubernetes pod's `limits.cpu: 2` is a quota (cgroup v2 `cpu.max`, v1
`cpu.cfs_quota_us` over `cpu.cfs_period_us`), not an affinity: every CPU of the host stays visible, so a
pool sized by the visible CPUs runs more threads than the quota lets run, and the kernel stops all of them
for the rest of each period once the quota is spent. So a pool gets as many threads as the limit, rounded to the
nearest (at least one), or the affinity's CPUs when fewer. The limit is read from the cgroup the process is in
and every cgroup above it (the smallest counts), through the mounts listed in /proc/self/mountinfo.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CpuBudget:
    threads: int  # threads worth running: the affinity's CPUs, at most the quota rounded to the nearest (at least 1)
    affinity: int  # CPUs this process may run on
    quota: float | None  # CPUs' worth of time per period the cgroup allows (None: no limit)


def _mounts(mountinfo: Path) -> list[tuple[str, str, str, set[str]]]:
    """(root inside the hierarchy, mount point, filesystem type, super options) of every cgroup mount."""
    out = []
    for line in mountinfo.read_text().splitlines():
        head, sep, tail = line.partition(" - ")
        fields, rest = head.split(), tail.split()
        if not sep or len(fields) < 5 or len(rest) < 3 or rest[0] not in ("cgroup", "cgroup2"):
            continue
        out.append((fields[3], fields[4], rest[0], set(rest[2].split(","))))
    return out


def _limit_v2(directory: Path) -> float | None:
    try:
        quota, period = (directory / "cpu.max").read_text().split()[:2]
        if quota == "max" or int(period) <= 0:
            return None
        return int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _limit_v1(directory: Path) -> float | None:
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def _smallest(mount_point: str, relative: str, limit: Callable[[Path], float | None]) -> float | None:
    """The smallest limit of the cgroup at `relative` under `mount_point` and of each one above it."""
    directory, top = Path(mount_point) / relative.lstrip("/"), Path(mount_point)
    found: list[float] = []
    while True:
        value = limit(directory)
        if value is not None:
            found.append(value)
        if directory == top or top not in directory.parents:
            break
        directory = directory.parent
    return min(found) if found else None


def cpu_quota(mountinfo: Path = Path("/proc/self/mountinfo"), cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """CPUs' worth of time this process's cgroups allow per period (the smallest along its path), or None."""
    try:
        mounts = _mounts(mountinfo)
        memberships = [line.split(":", 2) for line in cgroup.read_text().splitlines() if line.count(":") >= 2]
    except OSError:
        return None
    limits: list[float] = []
    for _, controllers, path in memberships:
        v2 = controllers == ""
        for root, point, fstype, options in mounts:
            if (fstype == "cgroup2") != v2 or (not v2 and "cpu" not in controllers.split(",")) or \
                    (not v2 and "cpu" not in options):
                continue
            # The mount shows the hierarchy from `root` on; a path outside it (another namespace's view) is read
            # at the mount point itself.
            if root == "/":
                relative = path
            else:
                relative = path[len(root):] if path == root or path.startswith(root + "/") else ""
            value = _smallest(point, relative, _limit_v2 if v2 else _limit_v1)
            if value is not None:
                limits.append(value)
    return min(limits) if limits else None


def cpu_budget(mountinfo: Path = Path("/proc/self/mountinfo"), cgroup: Path = Path("/proc/self/cgroup"),
               affinity: int | None = None) -> CpuBudget:
    if affinity is None:
        try:
            affinity = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            affinity = os.cpu_count() or 1
    quota = cpu_quota(mountinfo, cgroup)
    # To the nearest, halves up: on the 2-CPU box one thread beat two under limits of 1.0 and 1.2 CPUs, two beat
    # one under 1.5 (benchmarks/measured/as-user-medium-cpu-limit-*.json, and docs/performance.md in git history).
    threads = affinity if quota is None else max(1, min(affinity, math.floor(quota + 0.5)))
    return CpuBudget(threads, affinity, quota)
