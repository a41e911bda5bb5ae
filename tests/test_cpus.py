"""The CPUs a process may keep busy: its affinity capped by a cgroup CPU limit (cgroup v2 and v1, read through
fake /proc files), and the model process's compute threads sized from it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from serving_common.cpus import cpu_budget, cpu_quota

ROOT = Path(__file__).resolve().parent.parent


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def v2_tree(tmp_path: Path, cgroup_path: str, limits: dict[str, str], root: str = "/") -> tuple[Path, Path]:
    """A cgroup2 mount at tmp/unified showing the hierarchy from `root`, the process in `cgroup_path`, and
    cpu.max files {directory under the mount: contents}."""
    mount = tmp_path / "unified"
    mount.mkdir()
    for directory, text in limits.items():
        write(mount / directory / "cpu.max", text)
    info = tmp_path / "mountinfo"
    info.write_text(f"22 1 0:20 / /proc rw - proc proc rw\n"
                    f"31 23 0:28 {root} {mount} rw,relatime shared:9 - cgroup2 cgroup2 rw,nsdelegate\n")
    cgroup = tmp_path / "cgroup"
    cgroup.write_text(f"0::{cgroup_path}\n")
    return info, cgroup


def test_a_v2_limit_is_its_quota_over_its_period(tmp_path: Path) -> None:
    info, cgroup = v2_tree(tmp_path, "/pod/ctr", {"pod/ctr": "150000 100000\n"})
    assert cpu_quota(info, cgroup) == 1.5


def test_the_smallest_limit_on_the_path_counts(tmp_path: Path) -> None:
    # a pod's limit above the container's own, looser one
    info, cgroup = v2_tree(tmp_path, "/pod/ctr", {"pod/ctr": "400000 100000", "pod": "200000 100000", "": "max 100000"})
    assert cpu_quota(info, cgroup) == 2.0


def test_no_limit_anywhere_is_none_and_the_affinity_counts(tmp_path: Path) -> None:
    info, cgroup = v2_tree(tmp_path, "/a", {"a": "max 100000", "": "max 100000"})
    assert cpu_quota(info, cgroup) is None
    assert cpu_budget(info, cgroup, affinity=6).threads == 6


def test_inside_a_cgroup_namespace_the_mount_point_is_the_process_cgroup(tmp_path: Path) -> None:
    # a container sees its own cgroup as "/" and the mount shows the hierarchy from there
    info, cgroup = v2_tree(tmp_path, "/", {"": "100000 100000"}, root="/kubepods/pod1/ctr")
    assert cpu_quota(info, cgroup) == 1.0


def test_a_v1_cpu_controller_limit(tmp_path: Path) -> None:
    mount = tmp_path / "cpu,cpuacct"
    write(mount / "docker" / "c1" / "cpu.cfs_quota_us", "250000\n")
    write(mount / "docker" / "c1" / "cpu.cfs_period_us", "100000\n")
    write(mount / "cpu.cfs_quota_us", "-1\n")
    write(mount / "cpu.cfs_period_us", "100000\n")
    info = tmp_path / "mountinfo"
    info.write_text(f"33 31 0:30 / {tmp_path / 'cpuacct'} rw - cgroup cgroup rw,cpuacct\n"
                    f"32 31 0:29 / {mount} rw,relatime - cgroup cgroup rw,cpu,cpuacct\n")
    cgroup = tmp_path / "cgroup"
    cgroup.write_text("5:memory:/docker/c1\n3:cpu,cpuacct:/docker/c1\n0::/\n")
    assert cpu_quota(info, cgroup) == 2.5
    cgroup.write_text("3:cpu,cpuacct:/\n")  # the v1 root's -1: no limit
    assert cpu_quota(info, cgroup) is None


@pytest.mark.parametrize("quota, affinity, threads", [(1.0, 16, 1), (1.2, 16, 1), (1.5, 16, 2), (2.5, 16, 3),
                                                     (0.5, 16, 1), (0.2, 16, 1), (8.0, 2, 2)])
def test_threads_are_the_affinity_capped_by_the_quota_rounded_to_the_nearest(tmp_path: Path, quota: float, affinity: int,
                                                                     threads: int) -> None:
    info, cgroup = v2_tree(tmp_path, "/c", {"c": f"{int(quota * 100000)} 100000"})
    budget = cpu_budget(info, cgroup, affinity=affinity)
    assert (budget.threads, budget.affinity, budget.quota) == (threads, affinity, quota)


def test_unreadable_proc_files_mean_no_limit(tmp_path: Path) -> None:
    assert cpu_quota(tmp_path / "missing", tmp_path / "missing") is None


def test_a_malformed_limit_file_is_no_limit(tmp_path: Path) -> None:
    info, cgroup = v2_tree(tmp_path, "/c", {"c": "lots 100000"})
    assert cpu_quota(info, cgroup) is None


def xla_pool_threads(threads: int | None, env: dict[str, str]) -> int:
    """XLA CPU pool threads of a fresh process that ran prepare_process(threads), then one computation."""
    code = ("import os, jax.numpy as jnp\n"
            "from model_service.__main__ import prepare_process\n"
            f"prepare_process({threads!r})\n"
            "(jnp.ones((256, 256)) @ jnp.ones((256, 256))).block_until_ready()\n"
            "names = [open(f'/proc/self/task/{t}/comm').read() for t in os.listdir('/proc/self/task')]\n"
            "print(sum('XLAEigen' in n for n in names))\n")
    clean = {k: v for k, v in os.environ.items() if k not in ("NPROC", "XLA_FLAGS")}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**clean, **env}, capture_output=True,
                         text=True, timeout=120, check=True)
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads through Linux's /proc")
def test_the_model_process_runs_as_many_compute_threads_as_asked_or_budgeted() -> None:
    assert xla_pool_threads(1, {}) == 1
    assert xla_pool_threads(None, {"NPROC": "3"}) == 3  # XLA's own setting is kept without --threads
    assert xla_pool_threads(None, {}) == cpu_budget().threads


@pytest.mark.parametrize("value", ["two", "0", "-1"])
def test_a_malformed_nproc_stops_the_service_with_a_message_naming_it(value: str) -> None:
    clean = {k: v for k, v in os.environ.items() if k not in ("NPROC", "XLA_FLAGS")}
    out = subprocess.run([sys.executable, "-m", "model_service", "--config", str(ROOT / "configs" / "demo.json"),
                          "--random-init", "--port", "0"], cwd=ROOT, env={**clean, "NPROC": value},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert f"NPROC={value!r}" in out.stderr and "--threads" in out.stderr
