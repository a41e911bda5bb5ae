"""What tests/conftest.py does with tests/file_seconds.json (each test file's seconds in a recorded run) besides the
longest-first order: the run's estimate, a progress line by recorded time, and the fast subset.

pytest's own percentage counts tests; with the longest files handed out first it reads 26 % when 81 % of the
time is spent. `TimedProgress` counts each finished file's recorded seconds instead and says so every tenth.
`--max-file-seconds S` (`make test-fast`) keeps only the files that took at most S seconds in the recorded run.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable

SHARE_STEP = 10  # a line every this many percent of the recorded seconds


def duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def file_of(nodeid: str) -> str:
    return nodeid.split("::")[0]


def recorded(seconds: dict[str, float], name: str) -> float:
    """A file's recorded seconds; a file not in the table counts as one second."""
    return seconds.get(name, 1.0)


def fast_files(files: Iterable[str], seconds: dict[str, float], limit: float) -> set[str]:
    """The files that took at most `limit` seconds in the recorded run (new files included)."""
    return {name for name in files if recorded(seconds, name) <= limit}


class TimedProgress:
    """Progress by recorded seconds: a file counts once its last test has finished."""

    def __init__(self, seconds: dict[str, float], write: Callable[[str], None]) -> None:
        self.seconds, self.write = seconds, write
        self.left: collections.Counter[str] = collections.Counter()
        self.total = self.done = 0.0
        self.next_share = SHARE_STEP

    def plan(self, nodeids: Iterable[str], workers: int = 1) -> None:
        """The tests this run will report (once: every xdist worker collects the same); `workers`: the processes
        that run them at once (no more than the CPUs)."""
        if self.left:
            return
        self.left.update(file_of(nodeid) for nodeid in nodeids)
        self.total = sum(recorded(self.seconds, name) for name in self.left)
        if self.total:
            self.write(f"{len(self.left)} test files, {self.total:.0f} s of test time in the recorded run "
                       f"(tests/file_seconds.json): about {duration(self.total / max(workers, 1))} of pytest "
                       f"{workers} at a time on a quiet machine like that one's, longer on a busy one; "
                       f"progress by that time is printed every {SHARE_STEP} %")

    def finished(self, nodeid: str) -> None:
        name = file_of(nodeid)
        if self.left[name] <= 0:
            return
        self.left[name] -= 1
        if self.left[name] == 0 and self.total > 0:  # files all recorded at 0 s: no time to share out
            self.done += recorded(self.seconds, name)
            share = 100 * self.done / self.total
            if share >= self.next_share:
                self.next_share = (int(share) // SHARE_STEP + 1) * SHARE_STEP
                self.write(f"progress by recorded time: {share:.0f} % ({self.done:.0f} of {self.total:.0f} s)")
