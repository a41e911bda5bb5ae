"""A follower (a multi-process replica's process 1..N-1) stops on SIGTERM like every other service: it keeps
following while process 0 may still drain and shut the group down, and leaves with 0 on its own at most
`grace + FOLLOWER_SHUTDOWN_MARGIN` seconds after the signal (`docker compose down` stops it first; it used to
ignore SIGTERM and wait for the kill)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from tests.procs import ROOT

# A follower blocked in a collective (receive), as it is between process 0's calls: only a thread can end it.
BLOCKED_FOLLOWER = """
import logging, sys, threading
logging.basicConfig(level=logging.INFO)
from model_service.distributed.follower import stop_on_sigterm
stop_on_sigterm(float(sys.argv[1]))
print("following", flush=True)
threading.Event().wait(120)
sys.exit(3)
"""


def test_a_follower_leaves_with_0_within_its_grace_after_sigterm() -> None:
    from model_service.distributed.follower import FOLLOWER_SHUTDOWN_MARGIN

    proc = subprocess.Popen([sys.executable, "-c", BLOCKED_FOLLOWER, "1.5"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "following"
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=1.5 + FOLLOWER_SHUTDOWN_MARGIN + 30)
        waited = time.monotonic() - sent
    finally:
        proc.kill()
    assert code == 0, proc.stderr.read() if proc.stderr else ""
    assert 1.5 + FOLLOWER_SHUTDOWN_MARGIN - 0.5 <= waited, waited  # it gave process 0 the time to shut it down
    assert "SIGTERM" in (proc.stderr.read() if proc.stderr else "")
