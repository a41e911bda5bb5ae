"""The benchmark's record of the box: CPU time used by processes that are not the benchmark's is seen."""

from __future__ import annotations

import subprocess
import sys
import time

from benchmarks import box
from tests.waiting import wait_until

SPIN = "import time\nend = time.time() + {seconds}\nwhile time.time() < end: pass\n"
# The same, then it leaves a file saying it is done.
SPIN_THEN_MARK = SPIN + "open({marker!r}, 'w').close()\n"


def test_a_process_that_is_not_ours_spinning_during_the_run_makes_it_not_quiet(capsys, tmp_path) -> None:
    marker = tmp_path / "spun"
    watch = box.CpuWatch()
    watch.start()
    # The shell exits at once: the spinner is reparented away from us, as another user's job would be.
    script = SPIN_THEN_MARK.format(seconds=1.0, marker=str(marker)).replace("'", '"')
    subprocess.run(["sh", "-c", f"{sys.executable} -c '{script}' >/dev/null 2>&1 &"], check=True)
    wait_until(marker.exists, timeout=60, message="the spinner never finished")
    report = watch.stop()
    assert report is not None
    assert report.others_cpu_cores > box.OTHERS_LIMIT and not report.quiet
    box.warn_if_busy(report, "test run")
    assert "other processes used" in capsys.readouterr().err


def test_our_own_child_spinning_counts_as_ours() -> None:
    watch = box.CpuWatch()
    watch.start()
    subprocess.run([sys.executable, "-c", SPIN.format(seconds=1.0)], check=True)
    report = watch.stop()
    assert report is not None
    assert report.own_cpu_cores > 0.05  # the waited-for child's CPU time is ours (up to 1 core while it ran)
