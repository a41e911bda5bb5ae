"""In-process stand-ins for the lockstep tests: an engine that records every call with its arguments, and
in-memory channel ends that behave like a broadcast (or like a dead or stalled peer)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from model_service.controls import NO_CONTROLS, SamplingControls
from model_service.scheduler import Emission, SchedulerError
from tests.engine.fake_engine import FakeEngine, FakeOutput


@dataclass
class RecordingEngine(FakeEngine):
    """FakeEngine that also compiles and records prefill's full arguments."""

    def compile_all(self) -> dict[str, float]:
        self._log("compile_all")
        return {"fake": 0.0}

    def prefill(self, tokens: Sequence[int], *, seed: int, temperature: float, top_p: float,
                allowed: Sequence[int] = (), blocked: Sequence[int] = (), top_logprobs: int = 0,
                controls: SamplingControls = NO_CONTROLS, prompt_logprobs: int | None = None) -> tuple[int, FakeOutput]:
        self._log("prefill_args", tuple(tokens), seed, temperature, top_p, tuple(sorted(set(allowed))),
                  tuple(sorted(set(blocked))), top_logprobs)
        if controls != NO_CONTROLS:
            self._log("controls", controls)
        if prompt_logprobs is not None:
            self._log("prompt_logprobs", prompt_logprobs)
        return super().prefill(tokens, seed=seed, temperature=temperature, top_p=top_p, allowed=allowed,
                               blocked=blocked, top_logprobs=top_logprobs, prompt_logprobs=prompt_logprobs)

    def begin_prefill(self, tokens: Sequence[int], *, slot: int, seed: int, temperature: float, top_p: float,
                      allowed: Sequence[int] = (), blocked: Sequence[int] = (), top_logprobs: int = 0,
                      controls: SamplingControls = NO_CONTROLS) -> list:
        self._log("begin_prefill_args", tuple(tokens), slot, seed, temperature, top_p,
                  tuple(sorted(set(allowed))), tuple(sorted(set(blocked))), top_logprobs)
        if controls != NO_CONTROLS:
            self._log("controls", controls)
        return super().begin_prefill(tokens, slot=slot, seed=seed, temperature=temperature, top_p=top_p,
                                     allowed=allowed, blocked=blocked, top_logprobs=top_logprobs)


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
