"""What the decode loop (scheduler.py) keeps per slot and per step, and what it reports to observers.

`Running` is a request's sample holding a slot, `Prefilling` a long prompt being prefilled into its slot in
chunks, `InFlight` a dispatched decode step. `SchedulerMetrics` are the loop's observer hooks (metrics.py
implements them with Prometheus) and `Heartbeat` is how a watchdog on another thread sees the loop.
No JAX here: a job, prefix or pending step is whatever the engine returned.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from model_service.engine_api import PendingStepLike
from model_service.requests import FinishReason, RequestHandle, Timings


class SchedulerMetrics:
    """Observer hooks; the default ignores everything (metrics.Metrics implements them)."""

    def set_active(self, n: int) -> None: ...
    def set_queued(self, n: int) -> None: ...
    def observe_prefill(self, seconds: float) -> None: ...
    def observe_step(self, seconds: float) -> None: ...
    def add_tokens(self, n: int) -> None: ...
    def finished(self, reason: FinishReason) -> None: ...
    def observe_kv(self, usage: Any) -> None:
        """The KV pool's occupancy and prefix-cache counters (kv_blocks.KVUsage), after a step."""

    def preempted(self) -> None:
        """A running request was preempted (KV pool full); it is recomputed when readmitted."""

    def observe_reclaim(self, reason: str, seconds: float, steps: int | None) -> None:
        """A cancelled or expired request's slot was freed `seconds` after the cancel/deadline, after
        `steps` more decode steps (None when not counted)."""


@dataclass(frozen=True)
class Heartbeat:
    """How the decode loop is doing, for a watchdog on another thread."""

    steps: int  # decode steps run so far
    at: float  # time.monotonic() of the last progress (a prefill, a step, or waking up to new work)
    pending: int  # requests running or waiting
    alive: bool  # the decode thread is running


class Running:
    """Bookkeeping of one sample of a request that owns a slot."""

    def __init__(self, handle: RequestHandle, seed: int, admitted_at: float, index: int = 0) -> None:
        self.handle = handle
        self.seed = seed
        self.index = index
        self.admitted_at = admitted_at
        self.generated = 0
        self.prefill_seconds = 0.0
        self.step_seconds = 0.0
        self.steps = 0
        self.skip = 0  # tokens already delivered before a preemption: recomputed, not emitted again
        self.guide: Any = None  # structured output: this sample's grammar position (structured.Guide)
        self.base_mask: Any = None  # [V] bool, the request's allowed/blocked/pad mask that a guide's mask is ANDed with

    def timings(self) -> Timings:
        mean = self.step_seconds / self.steps if self.steps else 0.0
        return Timings(self.admitted_at - self.handle.enqueued_at, self.prefill_seconds, mean)


@dataclass
class Prefilling:
    """A long prompt being prefilled into its slot one chunk per step."""

    run: Running
    job: Any  # what Engine.begin_prefill returned


@dataclass
class InFlight:
    """A dispatched decode step and the requests whose slots it computes."""

    pending: PendingStepLike
    owners: dict[int, Running]  # slot -> the request that held it at dispatch
    dispatched_at: float
