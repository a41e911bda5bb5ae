"""In-process stand-ins for the lockstep tests: an engine that records every step it runs, and
in-memory channel ends that behave like a broadcast (or like a dead or stalled peer)."""

from __future__ import annotations

import dataclasses
import queue
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from model_service.requests import Emission, SchedulerError
from model_service.sampling_settings import SamplingSettings
from model_service.step_batch import StepBatch
from tests.engine.fake_engine import FakeEngine


@dataclass
class RecordingEngine(FakeEngine):
    """FakeEngine that also compiles (recorded, as its steps are)."""

    compiles: int = 0

    def compile(self) -> dict[str, float]:
        self.compiles += 1
        return {"fake": 0.0}


def same_batch(a: StepBatch, b: StepBatch) -> bool:
    """Two step batches carry the same rows, tables, draws, scores, starts and masks."""
    arrays = ("tokens", "from_last", "positions", "seq", "tables", "sample_rows", "sample_slots")
    if a.rows != b.rows or not all(np.array_equal(getattr(a, f), getattr(b, f)) for f in arrays):
        return False
    if (a.score is None) != (b.score is None) or (a.score is not None and not (
            np.array_equal(a.score, b.score) and np.array_equal(a.targets, b.targets))):
        return False
    starts = [(st.slot, st.seed, st.prompt, st.drawn, _flat(st.settings)) for st in a.starts]
    if starts != [(st.slot, st.seed, st.prompt, st.drawn, _flat(st.settings)) for st in b.starts]:
        return False
    return len(a.masks) == len(b.masks) and all(x[0] == y[0] and np.array_equal(x[1], y[1])
                                                for x, y in zip(a.masks, b.masks))


def _flat(s: SamplingSettings) -> SamplingSettings:
    """Settings as compared: token sets as sets (the wire sends them as bitmaps), floats as float32 values."""
    f32 = lambda x: float(np.float32(x))  # noqa: E731
    return dataclasses.replace(
        s, allowed=tuple(sorted(set(s.allowed))), blocked=tuple(sorted(set(s.blocked))),
        temperature=f32(s.temperature), top_p=f32(s.top_p), min_p=f32(s.min_p),
        repetition_penalty=f32(s.repetition_penalty), presence_penalty=f32(s.presence_penalty),
        frequency_penalty=f32(s.frequency_penalty), logit_bias=tuple((t, f32(b)) for t, b in s.logit_bias))


class Wire:
    """A broadcast between process 0 and one follower: process 0's arrays come out at the follower."""

    def __init__(self) -> None:
        self.messages: queue.Queue[tuple[np.ndarray, ...]] = queue.Queue()
        self.sent: list[tuple[np.ndarray, ...]] = []


class LeaderEnd:
    def __init__(self, wire: Wire) -> None:
        self.wire = wire

    def broadcast(self, arrays: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
        copies = tuple(np.array(a) for a in arrays)
        self.wire.sent.append(copies)
        self.wire.messages.put(copies)
        return arrays


class FollowerEnd:
    def __init__(self, wire: Wire, timeout: float = 10.0) -> None:
        self.wire = wire
        self.timeout = timeout

    def broadcast(self, arrays: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
        got = self.wire.messages.get(timeout=self.timeout)
        assert [a.shape for a in got] == [a.shape for a in arrays], "followers must expect the shapes sent"
        return got


class DeadPeer:
    """Like gloo when a peer process died: the collective fails at once."""

    def broadcast(self, arrays: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
        raise RuntimeError("Gloo all-reduce failed: Connection reset by peer")


class SwitchableChannel:
    """Works (as a broadcast to nobody) until `fail` or `stall` is set."""

    def __init__(self) -> None:
        self.fail = False
        self.stall = threading.Event()
        self.calls = 0

    def broadcast(self, arrays: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
        self.calls += 1
        if self.fail:
            raise RuntimeError("Gloo all-reduce failed: Connection reset by peer")
        if self.stall.is_set():
            threading.Event().wait()  # a stalled peer: the collective never returns
        return arrays


class Collector:
    """A request's emissions as seen by its stream: token ids, and the error it ended with."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.error: SchedulerError | None = None
        self.done = threading.Event()

    def __call__(self, emission: Emission) -> None:
        self.tokens += [t.id for t in emission.tokens]
        self.error = emission.error
        if emission.finish_reason is not None or emission.error is not None:
            self.done.set()


class GatedPending:
    """A step still running on the device: `get()` waits until the gate opens (like a step whose
    cross-process collectives wait for a peer)."""

    def __init__(self, inner: Any, gate: threading.Event) -> None:
        self.inner, self.gate = inner, gate

    def get(self) -> Any:
        self.gate.wait()
        return self.inner.get()


@dataclass
class GatedEngine(RecordingEngine):
    """RecordingEngine whose steps finish only once `gate` is set (dispatch itself returns at once)."""

    gate: threading.Event = dataclasses.field(default_factory=threading.Event)

    def step(self, state: Any, batch: StepBatch) -> tuple[Any, GatedPending]:
        state, pending = super().step(state, batch)
        return state, GatedPending(pending, self.gate)
