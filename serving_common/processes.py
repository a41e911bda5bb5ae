"""Stopping a child process the way an orchestrator does: SIGTERM, then SIGKILL after a grace period."""

from __future__ import annotations

import signal
import subprocess


def terminate(proc: subprocess.Popen, timeout: float) -> int:
    """SIGTERM `proc` (it should drain), SIGKILL it if still alive after `timeout` s; its exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode
