"""Watchdog of the decode loop: a model service whose decode steps stop advancing must say so.

A hung device call (a wedged accelerator, a deadlocked collective) stops the decode thread without
an exception; the process stays up, its health would keep saying SERVING and every stream would
wait forever. Every `interval` the watchdog reads the scheduler's heartbeat (decode steps, time of
the last progress, pending requests). When work is pending and nothing advanced for `stall_seconds`
(or the decode thread died), it reports NOT_SERVING, ends every running and waiting request with
UNAVAILABLE, and makes new requests fail with UNAVAILABLE at once; the gateway then sends traffic
to other replicas. When the loop advances again, the service reports SERVING again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Protocol

from model_service.loop_state import Heartbeat
from model_service.requests import ErrorKind, SchedulerError

log = logging.getLogger(__name__)


class Beating(Protocol):
    def heartbeat(self) -> Heartbeat: ...
    def fail_pending(self, error: SchedulerError) -> int: ...


class Health(Protocol):
    async def set(self, serving: bool) -> None: ...


class Watchdog:
    """Checks `scheduler` every `interval` seconds; `refuse(reason | None)` blocks or reopens admission."""

    def __init__(self, scheduler: Beating, health: Health, refuse: Callable[[str | None], None],
                 stall_seconds: float, interval: float | None = None) -> None:
        self.scheduler = scheduler
        self.health = health
        self.refuse = refuse
        self.stall_seconds = stall_seconds
        self.interval = interval if interval is not None else min(1.0, stall_seconds / 4)
        self.stalled_since: float | None = None
        self.stalls = 0

    def diagnose(self, beat: Heartbeat, now: float) -> str | None:
        """Why the decode loop counts as stalled, or None."""
        if not beat.alive:
            return "the decode loop is not running"
        if beat.pending and now - beat.at > self.stall_seconds:
            return (f"no decode step for {now - beat.at:.1f} s with {beat.pending} request(s) pending "
                    f"(watchdog limit {self.stall_seconds:g} s)")
        return None

    async def check(self) -> None:
        now = time.monotonic()
        beat = self.scheduler.heartbeat()
        problem = self.diagnose(beat, now)
        if problem is not None:
            error = SchedulerError(ErrorKind.UNAVAILABLE, f"the model service stopped making progress ({problem}); "
                                   "retry, another replica may serve it")
            if self.stalled_since is None:
                self.stalled_since = now
                self.stalls += 1
                log.error("decode loop stalled: reporting NOT_SERVING", extra={"problem": problem,
                                                                              "steps": beat.steps})
                self.refuse(error.message)
                await self.health.set(False)
            failed = self.scheduler.fail_pending(error)  # also requests that were queued since
            if failed:
                log.warning("failed pending requests of a stalled model", extra={"requests": failed})
        elif self.stalled_since is not None and beat.at > self.stalled_since:
            log.warning("decode loop advancing again: reporting SERVING",
                        extra={"stalled_seconds": round(now - self.stalled_since, 3), "steps": beat.steps})
            self.stalled_since = None
            self.refuse(None)
            await self.health.set(True)

    async def run(self) -> None:
        """Check until cancelled."""
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.check()
            except Exception:  # the watchdog must outlive its own bugs
                log.exception("watchdog check failed")
