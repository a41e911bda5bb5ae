"""Process 0's Engine for a multi-process replica: send each call, then run it, within a time bound.

`LockstepEngine` has the Engine's interface (init_state, compile, step), so the scheduler drives it unaware of
processes. Each call is encoded (ops.Codec: a step is its whole StepBatch, block tables included, one message),
sent to the followers (link.py: one socket per follower; process 0 writes and goes on) and executed on
process 0's own `Replica` while the followers execute the same call on theirs.

A step is dispatched, not waited for: `step` returns as on one process, and the scheduler plans and dispatches
the next step while this one runs, then asks for its tokens. Its host arrays are fetched on a thread of their
own, so `get()` can be bounded.

A process that dies makes the next send or the step's collectives fail (gloo reports the closed connection);
one that stalls makes the step hang. So every call runs on a worker thread, every step's result is waited for
at most `step_timeout`, and either way the group is then broken for good: `on_broken` is called once (the
server reports NOT_SERVING and exits non-zero so the orchestrator restarts the group) and this and every later
call raise `GroupBroken`, which the scheduler reports to the requests as UNAVAILABLE. While the scheduler
is idle a keep-alive no-op runs every few seconds, so a lost process is noticed without traffic.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from model_service.distributed.ops import Call, Codec, Op, Replica, codec_for
from model_service.requests import ErrorKind, SchedulerError
from model_service.step_batch import StepBatch

log = logging.getLogger(__name__)


class GroupBroken(SchedulerError):
    """A process of this replica's group died or stalled; nothing can run on it until the group restarts."""

    def __init__(self, reason: str) -> None:
        super().__init__(ErrorKind.UNAVAILABLE, f"this model replica lost a process of its group ({reason}); "
                         "it is restarting: retry (another replica can serve the request)")
        self.reason = reason


class Channel(Protocol):
    """Process 0's arrays on every process (followers pass zeros of the same shapes); link.py's ends."""

    def broadcast(self, arrays: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]: ...


def send(channel: Channel, codec: Codec, call: Call) -> Call:
    """Process 0's side of one call: one message with the header and a step's always-present parts (all a
    decode step needs), then, only when the header announces them, the other parts. Returns the call as the
    followers decode it, which is what process 0 must run too (e.g. its floats rounded to float32)."""
    header = codec.header(call)
    payload = codec.payload(call)
    base = len(codec.base_shapes(header))
    channel.broadcast((codec.first_message(header, payload[:base]),))
    if payload[base:]:
        channel.broadcast(payload[base:])
    return codec.decode(header, payload)


def receive(channel: Channel, codec: Codec) -> Call:
    """A follower's side of `send`."""
    (first,) = channel.broadcast((codec.empty_first_message(),))
    header, base = codec.split_first_message(first)
    rest = codec.empty_payload(header)[len(base):]
    payload = base + (channel.broadcast(rest) if rest else ())
    return codec.decode(header, payload)


class _Worker:
    """One daemon thread running calls in order. A call stuck in a collective whose peer stalled can never be
    interrupted; a daemon thread does not keep the process from exiting (concurrent.futures joins its
    workers at exit)."""

    def __init__(self, name: str = "lockstep") -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]] | None] = \
            queue.SimpleQueue()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._jobs.put((fn, future))
        return future

    def stop(self) -> None:
        self._jobs.put(None)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, future = job
            try:
                future.set_result(fn())
            except BaseException as e:  # handed to the waiting caller
                future.set_exception(e)


class _BoundedPending:
    """A step dispatched on every process (PendingStepLike); `get()` waits for it at most the step timeout."""

    def __init__(self, engine: "LockstepEngine", future: concurrent.futures.Future[Any], seq: int) -> None:
        self._engine, self._future, self._seq = engine, future, seq

    def get(self) -> Any:
        return self._engine._wait_step(self._future, self._seq)


def is_runtime_failure(error: BaseException) -> bool:
    """A failed collective or device program (as opposed to a bad argument every process rejects alike)."""
    import jax

    return isinstance(error, jax.errors.JaxRuntimeError)


class LockstepEngine:
    """The Engine interface on process 0 of a group; see the module docstring."""

    def __init__(self, engine: Any, channel: Channel, step_timeout: float, startup_timeout: float,
                 keepalive_seconds: float, on_broken: Callable[[str], None]) -> None:
        self._engine = engine
        self._channel = channel
        self._codec = codec_for(engine)
        self._replica = Replica(engine)
        self._step_timeout = step_timeout
        self._startup_timeout = startup_timeout
        self._keepalive_seconds = keepalive_seconds
        self._on_broken = on_broken
        self._lock = threading.Lock()  # one call at a time, in one order for every process
        self._worker = _Worker()
        self._fetcher = _Worker("lockstep-fetch")  # waits for dispatched steps, so _worker can dispatch the next
        self._seq = 0
        self._broken: str | None = None
        self._broken_lock = threading.Lock()
        self._last_call = time.monotonic()
        self._stop = threading.Event()
        self._keepalive: threading.Thread | None = None
        self._closed = False

    def __getattr__(self, name: str) -> Any:
        # Engine attributes (slots, max_rows, vocab_size, ...) read through; a method missing here would run on
        # process 0 alone and desynchronise the group, so it is refused.
        if name.startswith("_"):
            raise AttributeError(name)
        value = getattr(self._engine, name)
        if callable(value):
            raise AttributeError(f"Engine.{name} is not in the lockstep op table: add it to "
                                 "model_service/distributed/ops.py and LockstepEngine")
        return value

    @property
    def broken(self) -> str | None:
        return self._broken

    # ---- the Engine interface ---------------------------------------------------------------
    def compile(self) -> dict[str, float]:
        """Compile everywhere; waits (up to startup_timeout) for every process to have loaded its weights."""
        timings = self._call(Call(Op.COMPILE), self._startup_timeout)
        if self._keepalive is None:
            self._keepalive = threading.Thread(target=self._keep_alive, name="lockstep-keepalive", daemon=True)
            self._keepalive.start()
        return timings

    def init_state(self) -> Any:
        return self._call(Call(Op.INIT))

    def step(self, state: Any, batch: StepBatch) -> tuple[Any, Any]:
        self._check_state(state)
        self._codec.payload(Call(Op.STEP, batch=batch))  # refuse what cannot be encoded before anything is sent
        return self._call(Call(Op.STEP, batch=batch))

    def close(self) -> None:
        """Tell the followers to leave their loop (clean shutdown of the whole group); later calls fail."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._broken is None:
            try:
                self._call(Call(Op.SHUTDOWN))
                log.info("followers told to shut down")
            except GroupBroken:
                pass
        self._broken = self._broken or "the group was shut down"
        self._worker.stop()
        self._fetcher.stop()

    # ---- internals --------------------------------------------------------------------------
    def _check_state(self, state: Any) -> None:
        if state is not self._replica.state and self._broken is None:
            raise ValueError("the decode state must be the one the previous Engine call returned (the followers "
                             "replay calls on their single copy of it)")

    def _call(self, call: Call, timeout: float | None = None) -> Any:
        with self._lock:
            return self._call_locked(call, timeout)

    def _call_locked(self, call: Call, timeout: float | None) -> Any:
        if self._broken is not None:
            raise GroupBroken(self._broken)
        call = dataclasses.replace(call, seq=self._seq)
        self._seq += 1
        limit = timeout or self._step_timeout
        future = self._worker.submit(lambda: self._send_and_run(call))
        try:
            return future.result(limit)
        except concurrent.futures.TimeoutError:
            raise self._break(f"{call.op.name} did not finish within {limit:g} s: a process stalled") from None
        finally:
            self._last_call = time.monotonic()

    def _send_and_run(self, call: Call) -> Any:
        try:
            sent = send(self._channel, self._codec, call)
        except Exception as e:
            raise self._break(f"sending {call.op.name} failed: {e}") from e
        try:
            result = self._replica.run(sent)
        except Exception as e:
            if is_runtime_failure(e):
                raise self._break(f"{call.op.name} failed: {e}") from e
            raise
        if sent.op == Op.STEP:
            state, pending = result
            return state, _BoundedPending(self, self._fetcher.submit(pending.get), sent.seq)
        return result

    def _wait_step(self, future: concurrent.futures.Future[Any], seq: int) -> Any:
        """A step's host arrays, waited for at most step_timeout: its cross-process collectives are where a
        dead peer shows (gloo fails at once) and where a stalled one hangs."""
        try:
            return future.result(self._step_timeout)
        except concurrent.futures.TimeoutError:
            raise self._break(f"STEP {seq} did not finish within {self._step_timeout:g} s: a process stalled") \
                from None
        except Exception as e:
            if is_runtime_failure(e):
                raise self._break(f"STEP {seq} failed: {e}") from e
            raise
        finally:
            self._last_call = time.monotonic()

    def _break(self, reason: str) -> GroupBroken:
        first = False
        with self._broken_lock:
            if self._broken is None:
                self._broken, first = reason, True
        if first:
            log.error("process group broken", extra={"reason": reason})
            self._stop.set()
            try:
                self._on_broken(reason)
            except Exception:
                log.exception("on_broken failed")
        return GroupBroken(self._broken or reason)

    def _keep_alive(self) -> None:
        while not self._stop.wait(self._keepalive_seconds / 2):
            if time.monotonic() - self._last_call < self._keepalive_seconds:
                continue
            if not self._lock.acquire(blocking=False):
                continue  # a call is running: it proves liveness itself
            try:
                self._call_locked(Call(Op.NOOP), None)
            except GroupBroken:
                return
            finally:
                self._lock.release()
