"""What else the machine did during a measurement: the load average and the CPU time of other processes.

A benchmark on a 2-core box measures the box as much as the stack: a parallel test run halves every number.
`CpuWatch` brackets one run and reports the 1-minute load average at its end and the CPU time, in cores,
used by the benchmark's own processes (this process, its children, and the stack's services) and by every
other process. `python -m benchmarks` records it per run and warns loudly when others used more than
`OTHERS_LIMIT` of a core.

Reads /proc (Linux); elsewhere the watch reports nothing and warns about nothing.
"""

from __future__ import annotations

import os
import pathlib
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass

OTHERS_LIMIT = 0.10  # cores used by other processes during a run above which it is flagged
PROC = pathlib.Path("/proc")
# Command-line markers of the stack's own services (started by the benchmark or by the user).
SERVICE_MODULES = ("tokenizer_service", "model_service", "gateway")
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def busy_seconds() -> float | None:
    """CPU seconds all cores spent busy since boot (user, nice, system, irq, softirq, steal)."""
    try:
        fields = (PROC / "stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / _TICK


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds of the process and its waited-for children) of `pid`."""
    try:
        raw = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2:].split()  # after the command name, which may hold spaces
    ppid = int(fields[1])
    utime, stime, cutime, cstime = (int(x) for x in fields[11:15])
    return ppid, (utime + stime + cutime + cstime) / _TICK


def _is_service(pid: int) -> bool:
    try:
        argv = (PROC / str(pid) / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(arg.decode(errors="replace") in SERVICE_MODULES for arg in argv)


def _process_stats() -> dict[int, tuple[int, float]]:
    stats = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            stat = _stat(int(entry.name))
            if stat is not None:
                stats[int(entry.name)] = stat
    return stats


def _with_descendants(roots: set[int], stats: dict[int, tuple[int, float]]) -> set[int]:
    tree, changed = set(roots), True
    while changed:  # a service's children, k6, AIPerf's workers
        grown = tree | {pid for pid, (ppid, _) in stats.items() if ppid in tree}
        changed, tree = grown != tree, grown
    return tree


def own_cpu_seconds(root: int, extra: Iterable[int] = (), services: bool = False,
                    stack: Iterable[int] = ()) -> tuple[float, float]:
    """CPU seconds of (all ours, the stack's part of it). Ours: `root`, the given pids, the `stack` pids and
    (with `services`) every running process of the stack's services, found by their command lines, each
    with its descendants; the stack's part: the `stack` pids and their descendants."""
    stats = _process_stats()
    stack_tree = _with_descendants(set(stack), stats)
    found = {pid for pid in stats if _is_service(pid)} if services else set()
    ours = _with_descendants({root, *extra, *found}, stats) | stack_tree
    return (sum(stats[pid][1] for pid in ours if pid in stats),
            sum(stats[pid][1] for pid in stack_tree if pid in stats))


@dataclass
class BoxReport:
    seconds: float
    load_avg_1m: float
    own_cpu_cores: float
    others_cpu_cores: float
    stack_cpu_cores: float | None = None  # the part of own_cpu_cores the stack's processes used, if known

    @property
    def quiet(self) -> bool:
        return self.others_cpu_cores <= OTHERS_LIMIT

    def as_dict(self) -> dict[str, object]:
        return {"seconds": round(self.seconds, 3), "load_avg_1m": round(self.load_avg_1m, 2),
                "own_cpu_cores": round(self.own_cpu_cores, 3), "others_cpu_cores": round(self.others_cpu_cores, 3),
                "others_limit_cores": OTHERS_LIMIT, "quiet": self.quiet,
                **({} if self.stack_cpu_cores is None else {
                    "stack_cpu_cores": round(self.stack_cpu_cores, 3),
                    "client_cpu_cores": round(self.own_cpu_cores - self.stack_cpu_cores, 3)})}


class CpuWatch:
    """Bracket a measurement: `start()`, run it, `stop()` -> BoxReport (None where /proc is missing).

    The benchmark's own processes are this one and its descendants (a stack it started is among them),
    `extra_pids`, and with `services` every process running one of SERVICE_MODULES (a stack started by
    someone else: then any other stack on the machine counts as ours too).

    Processes that ended during the run are counted through their parent's waited-for children time when
    the parent is ours; short-lived processes of others that ended within the run are missed (their CPU
    time is then attributed to nobody, and `others` is a lower bound)."""

    def __init__(self, extra_pids: Iterable[int] = (), services: bool = False, stack_pids: Iterable[int] = ()) -> None:
        self.extra = tuple(extra_pids)
        self.services = services
        self.stack = tuple(stack_pids)
        self._start: tuple[float, float, tuple[float, float]] | None = None

    def _own(self) -> tuple[float, float]:
        return own_cpu_seconds(os.getpid(), self.extra, self.services, self.stack)

    def start(self) -> None:
        busy = busy_seconds()
        self._start = None if busy is None else (time.monotonic(), busy, self._own())

    def stop(self) -> BoxReport | None:
        busy = busy_seconds()
        if self._start is None or busy is None:
            return None
        t0, busy0, (own0, stack0) = self._start
        seconds = max(time.monotonic() - t0, 1e-9)
        own_now, stack_now = self._own()
        own = max(own_now - own0, 0.0)
        others = max(busy - busy0 - own, 0.0)
        stack = max(stack_now - stack0, 0.0) / seconds if self.stack else None
        return BoxReport(seconds, os.getloadavg()[0], own / seconds, others / seconds, stack)


def warn_if_busy(report: BoxReport | None, what: str) -> None:
    """Say loudly on stderr that a run shared the machine."""
    if report is not None and not report.quiet:
        print(f"\n!!! {what}: other processes used {report.others_cpu_cores:.2f} cores during the run "
              f"(limit {OTHERS_LIMIT}); load average {report.load_avg_1m:.2f}. Its numbers measure a shared "
              "machine: rerun alone.\n", file=sys.stderr, flush=True)
