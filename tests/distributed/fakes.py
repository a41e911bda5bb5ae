"""In-process stand-ins for the lockstep tests: an engine that records every call with its arguments, and
in-memory channel ends that behave like a broadcast (or like a dead or stalled peer)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from model_service.requests import Emission, SchedulerError
from model_service.sampling_settings import GREEDY, SamplingSettings
from tests.engine.fake_engine import FakeEngine, FakeOutput


@dataclass
class RecordingEngine(FakeEngine):
    """FakeEngine that also compiles and records prefill's full arguments."""

    def compile_all(self) -> dict[str, float]:
        self._log("compile_all")
        return {"fake": 0.0}

    def prefill(self, tokens: Sequence[int], sampling: SamplingSettings = GREEDY, *, seed: int,
                prompt_logprobs: int | None = None) -> tuple[int, FakeOutput]:
        self._log("prefill_args", tuple(tokens), seed, *_flat(sampling))
        if not sampling.controls_off:
            self._log("controls", sampling)
        if prompt_logprobs is not None:
            self._log("prompt_logprobs", prompt_logprobs)
        return super().prefill(tokens, sampling, seed=seed, prompt_logprobs=prompt_logprobs)

    def begin_prefill(self, tokens: Sequence[int], sampling: SamplingSettings = GREEDY, *, slot: int,
                      seed: int) -> list:
        self._log("begin_prefill_args", tuple(tokens), slot, seed, *_flat(sampling))
        if not sampling.controls_off:
            self._log("controls", sampling)
        return super().begin_prefill(tokens, sampling, slot=slot, seed=seed)


def _flat(s: SamplingSettings) -> tuple:
    """The reference's settings as recorded: temperature, top_p, allowed and blocked sets, top_logprobs."""
    return s.temperature, s.top_p, tuple(sorted(set(s.allowed))), tuple(sorted(set(s.blocked))), s.top_logprobs


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
