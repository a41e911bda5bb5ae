"""A follower process: no gRPC API; it replays process 0's Engine calls on its own devices, in lockstep.

Every wait is bounded. A follower leaves with EXIT_GROUP_BROKEN when process 0 is gone (its collective
fails), when the calls stop arriving (process 0 stalled: the watchdog ends the process, since a thread
blocked inside a collective cannot be interrupted), or when the calls skip a number (diverged). It leaves
with 0 when process 0 sends SHUTDOWN. On SIGTERM it goes on following for a while, since process 0, signalled
at the same time (a Kubernetes deletion), drains its streams and then shuts the whole group down; if that does
not come within `--grace-seconds` + FOLLOWER_SHUTDOWN_MARGIN (`docker compose down` stops the follower first),
it leaves with 0 on its own, like every other service on SIGTERM.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from model_service.distributed.config import EXIT_GROUP_BROKEN, DistributedConfig
from model_service.distributed.lockstep import Channel, is_runtime_failure, receive
from model_service.distributed.ops import Call, Codec, Op, Replica
from model_service.engine_api import PendingStepLike

log = logging.getLogger(__name__)


def exit_now(code: int) -> None:
    """Leave without jax.distributed's exit barrier, which would wait for (or abort on) the lost peer."""
    logging.shutdown()
    sys.stderr.flush()
    os._exit(code)


class Watchdog:
    """Ends the process when the current wait passes its deadline."""

    def __init__(self, on_expiry: Callable[[int], None] = exit_now) -> None:
        self._deadline = float("inf")
        self._what = ""
        self._on_expiry = on_expiry
        self._cond = threading.Condition()
        threading.Thread(target=self._watch, name="follower-watchdog", daemon=True).start()

    def arm(self, seconds: float, what: str) -> None:
        with self._cond:
            self._deadline, self._what = time.monotonic() + seconds, what
            self._cond.notify()

    def disarm(self) -> None:
        self.arm(float("inf"), "")

    def _watch(self) -> None:
        with self._cond:
            while True:
                left = self._deadline - time.monotonic()
                if left <= 0:
                    log.error("process 0 went silent: leaving the group", extra={"waiting_for": self._what})
                    self._on_expiry(EXIT_GROUP_BROKEN)
                    return
                self._cond.wait(min(left, 3600.0))


def follow(replica: Replica, channel: Channel, codec: Codec, config: DistributedConfig,
           watchdog: Watchdog) -> int:
    """Replay calls until SHUTDOWN (returns 0) or until the group breaks (returns EXIT_GROUP_BROKEN).

    A step is dispatched and then the previous one is waited for (within the step bound: a stalled peer
    shows there), so this process reads the next call while its devices still run the last one."""
    expected = 0
    wait = config.startup_timeout  # process 0 sends the first call (COMPILE) once its weights are loaded
    previous: PendingStepLike | None = None
    while True:
        watchdog.arm(wait, "the next call from process 0")
        try:
            call = receive(channel, codec)
        except Exception as e:
            log.error("lost process 0", extra={"error": str(e)[:500]})
            return EXIT_GROUP_BROKEN
        if call.seq != expected:
            log.error("diverged from process 0", extra={"expected_seq": expected, "got_seq": call.seq})
            return EXIT_GROUP_BROKEN
        expected += 1
        bound = config.startup_timeout if call.op == Op.COMPILE else config.step_timeout
        watchdog.arm(bound, call.op.name)
        result = _run(replica, call)
        if result is _FAILED:
            return EXIT_GROUP_BROKEN
        if previous is not None and not _finished(previous):
            return EXIT_GROUP_BROKEN
        previous = result[1] if call.op == Op.STEP and result is not None else None
        if call.op == Op.SHUTDOWN:
            watchdog.disarm()
            log.info("process 0 shut the group down")
            return 0
        if call.op == Op.COMPILE:
            log.info("compiled; following process 0")
        wait = config.follower_wait


_FAILED = object()


def _run(replica: Replica, call: Call) -> Any:
    """Dispatch `call`; _FAILED when the group is broken, None when this process refused it as process 0 did."""
    try:
        return replica.run(call)
    except Exception as e:
        if is_runtime_failure(e):
            log.error("a lockstep call failed", extra={"op": call.op.name, "error": str(e)[:500]})
            return _FAILED
        # Bad arguments fail on every process alike; process 0 reports them to the request.
        log.warning("call refused here as on process 0", extra={"op": call.op.name, "error": str(e)[:500]})
        return None


def _finished(pending: PendingStepLike) -> bool:
    """Wait for a dispatched step; False when it failed at run time (the group is broken)."""
    try:
        pending.get()
    except Exception as e:
        if is_runtime_failure(e):
            log.error("a lockstep step failed", extra={"error": str(e)[:500]})
            return False
        log.warning("step refused here as on process 0", extra={"error": str(e)[:500]})
    return True


# Seconds a follower waits past the drain time for process 0's SHUTDOWN (its drain ends, then it broadcasts).
FOLLOWER_SHUTDOWN_MARGIN = 5.0


def stop_on_sigterm(grace_seconds: float, on_expiry: Callable[[int], None] = exit_now) -> None:
    """On SIGTERM, leave with 0 after `grace_seconds` + FOLLOWER_SHUTDOWN_MARGIN unless process 0 shuts the
    group down first (see the module docstring). A timer thread leaves: the main thread may be blocked in a
    collective, which no signal interrupts."""
    def leave_later(signum: int, frame: object) -> None:
        wait = grace_seconds + FOLLOWER_SHUTDOWN_MARGIN
        log.info("SIGTERM: following until process 0 shuts the group down, leaving in at most "
                 f"{wait:.0f} s", extra={"leave_after_seconds": wait})

        def leave() -> None:
            log.info("SIGTERM: process 0 did not shut the group down in time; leaving")
            on_expiry(0)

        timer = threading.Timer(wait, leave)
        timer.daemon = True
        timer.start()
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one timer: a second SIGTERM changes nothing

    signal.signal(signal.SIGTERM, leave_later)
