"""Continuous batching: a bounded waiting queue, N decode slots, and one thread that drives the Engine.

Requests are validated and queued by `submit` (any thread). The decode thread admits waiting
requests into free slots between decode steps (a prefill each; all of them when nothing is decoding,
else up to a prompt-token budget per step so running slots are never starved; a long prompt is
prefilled one chunk per step, so it never stalls running streams for its whole length), dispatches one
`Engine.generate` step for all slots and, while the engine computes it, hands each request its token
from the previous step through the request's `emit` callback (JetStream's overlap of host work with
the next step), and frees a slot as soon as its request is done (EOS, max_tokens, full context),
cancelled, past its deadline or failed. A step already in flight for a slot whose request ended is
discarded. The scheduler knows only the Engine's interface (`EngineLike`); it never touches JAX, so a
fake engine can drive it in tests.
"""

from __future__ import annotations

import collections
import enum
import logging
import math
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from model_service.controls import NO_CONTROLS, SamplingControls, controls_problem, stop_token_ids_problem


class FinishReason(enum.Enum):
    LENGTH = "length"
    EOS = "eos"
    CONTEXT_LENGTH = "context_length"
    STOP_TOKEN = "stop_token"  # one of the request's stop_token_ids (included in the tokens)


class ErrorKind(enum.Enum):
    """Failure classes; the servicer maps each to one gRPC status code."""

    INVALID_ARGUMENT = "invalid_argument"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    UNAVAILABLE = "unavailable"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    CANCELLED = "cancelled"
    INTERNAL = "internal"


class SchedulerError(Exception):
    def __init__(self, kind: ErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


@dataclass(frozen=True)
class GenerationRequest:
    """One request in domain terms (the servicer builds it from the proto)."""

    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    top_logprobs: int = 0
    allowed: tuple[int, ...] = ()
    blocked: tuple[int, ...] = ()
    deadline: float | None = None  # time.monotonic() value
    controls: SamplingControls = NO_CONTROLS  # top_k, min_p, penalties, logit_bias (controls.py)
    stop_token_ids: tuple[int, ...] = ()
    # Samples of the prompt, sharing one prefill, each in its own slot; sample i uses seed + i (mod 2**32), as
    # vLLM derives them, so sample i equals a request with that seed (n = 1 is exactly a plain request).
    n: int = 1
    prompt_logprobs: int | None = None  # score the prompt's tokens, with this many alternatives each (0..8)


@dataclass(frozen=True)
class TokenOut:
    id: int
    prob: float
    top: tuple[tuple[int, float], ...]  # (id, probability), most probable first


@dataclass(frozen=True)
class Timings:
    queue_seconds: float
    prefill_seconds: float
    mean_step_seconds: float


@dataclass(frozen=True)
class Emission:
    """What a request receives after a step: its new tokens, and on the last one why it ended."""

    tokens: tuple[TokenOut, ...]
    completion_tokens: int
    prompt_tokens: int
    finish_reason: FinishReason | None = None
    error: SchedulerError | None = None
    timings: Timings | None = None
    index: int = 0  # which of the request's n samples (tokens, counts and finish are per sample)
    prompt: tuple[TokenOut, ...] | None = None  # prompt tokens 1..n-1 scored (first emission, when asked for)


class StepOutputLike(Protocol):
    """Host arrays of one prefill (batch 1) or decode step (batch = slots)."""

    token: Any  # [B] int
    prob: Any  # [B] float
    top_ids: Any  # [B, K] int
    top_probs: Any  # [B, K] float
    bad: Any  # [B] bool
    prompt: Any  # PromptLogprobs-like (logprob [n-1], top_ids / top_logprobs [n-1, K]) or None


class PendingStepLike(Protocol):
    """A dispatched decode step; `get()` waits for its host arrays."""

    def get(self) -> StepOutputLike: ...


class EngineLike(Protocol):
    """The part of model_service.engine.Engine the scheduler uses; decode state and prefix are opaque."""

    slots: int
    buckets: tuple[int, ...]
    sequence_len: int
    vocab_size: int
    eos_id: int
    pad_id: int
    prefill_chunk: int  # tokens per chunk of a chunked prefill

    def init_decode_state(self) -> Any: ...
    def bucket_for(self, length: int) -> int: ...
    def prefill(self, tokens: Sequence[int], *, seed: int, temperature: float, top_p: float,
                allowed: Sequence[int], blocked: Sequence[int], top_logprobs: int,
                controls: SamplingControls, prompt_logprobs: int | None) -> tuple[Any, StepOutputLike]: ...
    def resample(self, prefix: Any, *, seed: int) -> tuple[Any, StepOutputLike]: ...
    def insert(self, prefix: Any, state: Any, slot: int) -> Any: ...
    def chunked(self, length: int) -> bool: ...
    def begin_prefill(self, tokens: Sequence[int], *, slot: int, seed: int, temperature: float, top_p: float,
                      allowed: Sequence[int], blocked: Sequence[int], top_logprobs: int,
                      controls: SamplingControls) -> Any: ...
    def prefill_next_chunk(self, job: Any, state: Any) -> tuple[Any, StepOutputLike | None]: ...
    def generate(self, state: Any) -> tuple[Any, PendingStepLike]: ...
    def free_slot(self, state: Any, slot: int) -> Any: ...


log = logging.getLogger(__name__)

EmitFn = Callable[[Emission], None]


class SchedulerMetrics:
    """Observer hooks; the default ignores everything (metrics.Metrics implements them)."""

    def set_active(self, n: int) -> None: ...
    def set_queued(self, n: int) -> None: ...
    def observe_prefill(self, seconds: float) -> None: ...
    def observe_step(self, seconds: float) -> None: ...
    def add_tokens(self, n: int) -> None: ...
    def finished(self, reason: FinishReason) -> None: ...
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


class RequestHandle:
    """The caller's side of a submitted request: cancel it from any thread."""

    def __init__(self, request: GenerationRequest, emit: EmitFn,
                 on_cancel: Callable[["RequestHandle"], None]) -> None:
        self.request = request
        self._emit = emit
        self._on_cancel = on_cancel
        self._cancelled = threading.Event()
        self.done = threading.Event()
        self.enqueued_at = time.monotonic()
        self.cancelled_at: float | None = None
        self.cancel_step = 0  # the scheduler's step count when cancel() was called
        self._open = request.n  # samples not finished yet

    def cancel(self) -> None:
        """Leave the waiting queue at once, or free the slot at the next step boundary (no-op once done)."""
        if not self.done.is_set() and not self._cancelled.is_set():
            self.cancelled_at = time.monotonic()
            self._cancelled.set()
            self._on_cancel(self)

    def abandon(self, error: "SchedulerError") -> None:
        """End the request with `error` now, from any thread; the decode loop frees its slot later."""
        self._cancelled.set()
        if not self.done.is_set():
            self.emit(Emission((), 0, len(self.request.prompt), error=error))

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def expired(self, now: float) -> bool:
        return self.request.deadline is not None and now >= self.request.deadline

    def emit(self, emission: Emission) -> None:
        if emission.finish_reason is not None:
            self._open -= 1
        if emission.error is not None or self._open <= 0:
            self.done.set()
            if emission.error is not None:
                self._cancelled.set()  # the request failed: its other samples' slots are freed too
        try:
            self._emit(emission)
        except Exception:  # a broken consumer must not take the decode thread down
            log.exception("emit failed", extra={"request_id": self.request.request_id})


class _Active:
    """Bookkeeping of one request that owns a slot."""

    def __init__(self, handle: RequestHandle, seed: int, admitted_at: float, index: int = 0) -> None:
        self.handle = handle
        self.seed = seed
        self.index = index
        self.admitted_at = admitted_at
        self.generated = 0
        self.prefill_seconds = 0.0
        self.step_seconds = 0.0
        self.steps = 0

    def timings(self) -> Timings:
        mean = self.step_seconds / self.steps if self.steps else 0.0
        return Timings(self.admitted_at - self.handle.enqueued_at, self.prefill_seconds, mean)


@dataclass
class _Prefilling:
    """A long prompt being prefilled into its slot one chunk per step."""

    act: _Active
    job: Any


@dataclass
class _InFlight:
    """A dispatched decode step and the requests whose slots it computes."""

    pending: PendingStepLike
    owners: dict[int, _Active]  # slot -> the request that held it at dispatch
    dispatched_at: float


class Scheduler:
    """N slots over one Engine; `start()` launches the decode thread, `stop()` ends it.

    While requests are decoding, each step admits waiting prompts until their padded lengths pass
    `prefill_token_budget` tokens (at least one prompt) and at most `prefills_per_step` of them; with
    nothing decoding it admits as many as there are free slots.
    """

    def __init__(self, engine: EngineLike, max_queue: int, metrics: SchedulerMetrics | None = None,
                 prefills_per_step: int | None = None, prefill_token_budget: int = 128) -> None:
        self.engine = engine
        self.max_queue = max_queue
        self.metrics = metrics or SchedulerMetrics()
        self.prefills_per_step = prefills_per_step
        self.prefill_token_budget = prefill_token_budget
        self._cond = threading.Condition()
        self._queue: collections.deque[RequestHandle] = collections.deque()
        self._active: dict[int, _Active] = {}
        self._prefilling: dict[int, _Prefilling] = {}
        self._free = set(range(engine.slots))
        self._accepting = False
        self._stopping = False
        self._state: Any = None
        self._in_flight: _InFlight | None = None
        self._thread: threading.Thread | None = None
        self._steps = 0
        self._beat = time.monotonic()
        self._in_prefill: RequestHandle | None = None

    # ---- any thread -------------------------------------------------------------------------
    def start(self) -> None:
        self._state = self.engine.init_decode_state()
        self._accepting = True
        self._thread = threading.Thread(target=self._run, name="decode", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop admitting new requests (draining); queued and running ones continue."""
        with self._cond:
            self._accepting = False

    def stop(self, timeout: float = 30.0) -> None:
        """End the decode thread; requests still queued or running fail with UNAVAILABLE."""
        with self._cond:
            self._accepting = False
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(self, request: GenerationRequest, emit: EmitFn) -> RequestHandle:
        """Validate and queue a request; raises SchedulerError (invalid, queue full, unavailable)."""
        self.validate(request)
        handle = RequestHandle(request, emit, self._withdraw)
        with self._cond:
            if not self._accepting:
                raise SchedulerError(ErrorKind.UNAVAILABLE, "the model service is not accepting requests "
                                     "(starting up or draining); retry on another replica or later")
            # Free slots take waiting requests at the next step boundary: a burst may fill them too.
            if len(self._queue) >= self.max_queue + len(self._free):
                raise SchedulerError(ErrorKind.RESOURCE_EXHAUSTED, f"the waiting queue is full "
                                     f"({self.max_queue} requests); retry later")
            self._queue.append(handle)
            self.metrics.set_queued(len(self._queue))
            self._cond.notify_all()
        return handle

    def heartbeat(self) -> Heartbeat:
        with self._cond:
            alive = self._thread is not None and self._thread.is_alive()
            pending = len(self._active) + len(self._prefilling) + len(self._queue) + (self._in_prefill is not None)
            return Heartbeat(self._steps, self._beat, pending, alive)

    def fail_pending(self, error: SchedulerError) -> int:
        """End every running and waiting request with `error` now (the decode loop may be stuck); their
        slots are freed if the loop comes back. Returns how many requests were ended."""
        with self._cond:
            handles = [act.handle for act in self._active.values()] + list(self._queue)
            handles += [job.act.handle for job in list(self._prefilling.values())]
            handles += [self._in_prefill] if self._in_prefill is not None else []
            self._queue.clear()
            self.metrics.set_queued(0)
        for handle in handles:
            handle.abandon(error)
        return len(handles)

    def stats(self) -> dict[str, int]:
        """Active slots, free slots and queued requests (for tests and health reporting)."""
        with self._cond:
            return {"active": len(self._active) + len(self._prefilling), "free": len(self._free),
                    "queued": len(self._queue)}

    def validate(self, request: GenerationRequest) -> None:
        """Raise INVALID_ARGUMENT for anything the engine could not serve as asked."""
        problem = _problem(request, self.engine)
        if problem:
            raise SchedulerError(ErrorKind.INVALID_ARGUMENT, problem)

    def _withdraw(self, handle: RequestHandle) -> None:
        """A request was cancelled: a waiting one leaves the queue now, so its place goes to a live request."""
        with self._cond:
            handle.cancel_step = self._steps
            try:
                self._queue.remove(handle)
                queued = True
                self.metrics.set_queued(len(self._queue))
            except ValueError:  # running: its slot is freed at the next step boundary
                queued = False
            self._cond.notify_all()
        if queued:
            handle.emit(Emission((), 0, len(handle.request.prompt), error=_cancelled()))

    # ---- decode thread ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._wait_for_work():
                self._reap()
                self._admit()
                self._advance_prefills()
                if self._active:
                    self._step()
                else:
                    self._finish_in_flight()
        except Exception:
            log.exception("decode loop crashed")
        finally:
            with self._cond:
                self._accepting = False  # nothing would serve new requests any more
            self._fail_all(SchedulerError(ErrorKind.UNAVAILABLE, "the model service is shutting down; retry"))

    def _wait_for_work(self) -> bool:
        with self._cond:
            while not self._stopping and not self._queue and not self._active and not self._prefilling:
                self._cond.wait()
                self._beat = time.monotonic()  # work (re)starts now, not at the last step before idling
            return not self._stopping

    def _reap(self) -> None:
        """Free the slots of cancelled or expired requests; drop such requests from the queue."""
        now = time.monotonic()
        for slot, act in list(self._active.items()):
            error = _abandoned(act.handle, now)
            if error is not None:
                if not act.handle.done.is_set():
                    act.handle.emit(Emission((), act.generated, len(act.handle.request.prompt), error=error))
                self._release(slot)
                self._observe_reclaim(act.handle, error)
        for slot, job in list(self._prefilling.items()):
            error = _abandoned(job.act.handle, now)
            if error is not None:
                if not job.act.handle.done.is_set():
                    job.act.handle.emit(Emission((), 0, len(job.act.handle.request.prompt), error=error))
                del self._prefilling[slot]
                self._return_slot(slot)  # never activated: the next prefill into it overwrites what it wrote
                self._observe_reclaim(job.act.handle, error)
        with self._cond:
            verdicts = [(h, _abandoned(h, now)) for h in self._queue]
            self._queue = collections.deque(h for h, error in verdicts if error is None)
            self.metrics.set_queued(len(self._queue))
        for handle, error in verdicts:
            if error is not None and not handle.done.is_set():
                handle.emit(Emission((), 0, len(handle.request.prompt), error=error))

    def _observe_reclaim(self, handle: RequestHandle, error: SchedulerError) -> None:
        now = time.monotonic()
        if error.kind is ErrorKind.DEADLINE_EXCEEDED and handle.request.deadline is not None:
            self.metrics.observe_reclaim("deadline", now - handle.request.deadline, None)
        elif handle.cancelled_at is not None:
            self.metrics.observe_reclaim("cancelled", now - handle.cancelled_at, self._steps - handle.cancel_step)

    def _admit(self) -> None:
        decoding = bool(self._active)
        count, tokens = 0, 0
        while not decoding or (count < (self.prefills_per_step or self.engine.slots)
                               and (count == 0 or tokens < self.prefill_token_budget)):
            with self._cond:
                # A request of n samples waits for n free slots (the queue stays in order).
                if not self._queue or len(self._free) < self._queue[0].request.n:
                    return
                handle = self._queue.popleft()
                # The lowest free slots keep the busy slots in the fewest decode tiles.
                slots = sorted(self._free)[:handle.request.n]
                self._free.difference_update(slots)
                self.metrics.set_queued(len(self._queue))
                self._in_prefill = handle  # still pending for the watchdog
            count += 1
            prompt = handle.request.prompt
            try:
                # n > 1 and prompt logprobs need the whole prompt's prefill, which chunks do not keep.
                one_pass = handle.request.n > 1 or handle.request.prompt_logprobs is not None
                if not one_pass and self.engine.chunked(len(prompt)) and self.engine.pad_id not in prompt:
                    tokens += self.engine.prefill_chunk
                    self._begin_chunked(handle, slots[0])
                else:
                    tokens += self.engine.bucket_for(len(prompt))
                    self._prefill(handle, slots)
            finally:
                with self._cond:
                    self._in_prefill = None

    def _prefill(self, handle: RequestHandle, slots: list[int]) -> None:
        """One prefill for the request; each of its samples draws its own first token from it into its slot."""
        req = handle.request
        seed = req.seed if req.seed is not None else secrets.randbits(32)
        admitted = time.monotonic()
        try:
            prefix, out = self.engine.prefill(list(req.prompt), seed=seed, temperature=req.temperature,
                                              top_p=req.top_p, allowed=req.allowed, blocked=req.blocked,
                                              top_logprobs=req.top_logprobs, controls=req.controls,
                                              prompt_logprobs=req.prompt_logprobs)
            samples = [(prefix, out)]
            for i in range(1, req.n):
                samples.append(self.engine.resample(prefix, seed=(seed + i) % 2**32))
        except Exception as e:
            log.exception("prefill failed", extra={"request_id": req.request_id})
            handle.emit(Emission((), 0, len(req.prompt), error=_engine_error(
                e, f"prefill failed (request {req.request_id})")))
            for slot in slots:
                self._return_slot(slot)
            return
        prefill_seconds = time.monotonic() - admitted
        self._beat = time.monotonic()
        self.metrics.observe_prefill(prefill_seconds)
        for index, (slot, (sample, first)) in enumerate(zip(slots, samples)):
            act = _Active(handle, (seed + index) % 2**32, admitted, index)
            act.prefill_seconds = prefill_seconds
            scored = _prompt_out(req, out) if index == 0 else None
            if handle.done.is_set() or self._deliver(act, first, 0, scored):
                self._return_slot(slot)
                continue
            self._state = self.engine.insert(sample, self._state, slot)
            with self._cond:
                self._active[slot] = act
                self.metrics.set_active(len(self._active))

    def _begin_chunked(self, handle: RequestHandle, slot: int) -> None:
        req = handle.request
        seed = req.seed if req.seed is not None else secrets.randbits(32)
        job = self.engine.begin_prefill(list(req.prompt), slot=slot, seed=seed, temperature=req.temperature,
                                        top_p=req.top_p, allowed=req.allowed, blocked=req.blocked,
                                        top_logprobs=req.top_logprobs, controls=req.controls)
        self._prefilling[slot] = _Prefilling(_Active(handle, seed, time.monotonic()), job)

    def _advance_prefills(self) -> None:
        """One chunk of every long prompt being prefilled; a finished one delivers its first token."""
        for slot, job in list(self._prefilling.items()):
            req = job.act.handle.request
            try:
                self._state, out = self.engine.prefill_next_chunk(job.job, self._state)
            except Exception as e:
                log.exception("prefill failed", extra={"request_id": req.request_id})
                job.act.handle.emit(Emission((), 0, len(req.prompt), error=_engine_error(
                    e, f"prefill failed (request {req.request_id})")))
                del self._prefilling[slot]
                self._release(slot)
                continue
            self._beat = time.monotonic()  # a chunk is progress for the watchdog
            if out is None:
                continue
            del self._prefilling[slot]
            act = job.act
            act.prefill_seconds = time.monotonic() - act.admitted_at
            self.metrics.observe_prefill(act.prefill_seconds)
            if self._deliver(act, out, 0):
                self._release(slot)
                continue
            with self._cond:
                self._active[slot] = act
                self.metrics.set_active(len(self._active))

    def _step(self) -> None:
        """Dispatch a decode step, then deliver the previous one's tokens while the engine computes."""
        try:
            self._state, pending = self.engine.generate(self._state)
        except Exception as e:
            self._step_failed(e)
            return
        previous, self._in_flight = self._in_flight, _InFlight(pending, dict(self._active), time.monotonic())
        if previous is not None:
            self._deliver_step(previous)

    def _finish_in_flight(self) -> None:
        previous, self._in_flight = self._in_flight, None
        if previous is not None:
            self._deliver_step(previous)

    def _deliver_step(self, step: _InFlight) -> None:
        try:
            out = step.pending.get()
        except Exception as e:
            self._step_failed(e)
            return
        seconds = time.monotonic() - step.dispatched_at
        with self._cond:
            self._steps += 1
            self._beat = time.monotonic()
        self.metrics.observe_step(seconds)
        for slot, act in step.owners.items():
            if self._active.get(slot) is not act:  # ended (and maybe replaced) after the dispatch
                continue
            act.steps += 1
            act.step_seconds += seconds
            if self._deliver(act, out, slot):
                self._release(slot)

    def _step_failed(self, error: Exception) -> None:
        log.exception("decode step failed")
        self._in_flight = None
        self._fail_active(_engine_error(error, "decode step failed; retry"))
        self._state = self.engine.init_decode_state()

    def _deliver(self, act: _Active, out: StepOutputLike, row: int, prompt: tuple[TokenOut, ...] | None = None) -> bool:
        """Hand the request its token at `row` of `out` (and its scored prompt, on the first); True when the
        request is finished."""
        req = act.handle.request
        if bool(out.bad[row]):
            log.error("non-finite logits", extra={"request_id": req.request_id})
            act.handle.emit(Emission((), act.generated, len(req.prompt), error=SchedulerError(
                ErrorKind.INTERNAL, f"the model produced non-finite logits (request {req.request_id})")))
            return True
        token = _token_out(out, row, req.top_logprobs)
        act.generated += 1
        self.metrics.add_tokens(1)
        reason = _finish_reason(req, act.generated, token.id, self.engine)
        first_or_last = act.generated == 1 or reason is not None
        act.handle.emit(Emission((token,), act.generated, len(req.prompt), finish_reason=reason,
                                 timings=act.timings() if first_or_last else None, index=act.index, prompt=prompt))
        if reason is not None:
            self.metrics.finished(reason)
        return reason is not None

    def _release(self, slot: int) -> None:
        self._state = self.engine.free_slot(self._state, slot)
        with self._cond:
            self._active.pop(slot, None)
            self.metrics.set_active(len(self._active))
        self._return_slot(slot)

    def _return_slot(self, slot: int) -> None:
        with self._cond:
            self._free.add(slot)

    def _fail_active(self, error: SchedulerError) -> None:
        for slot, act in list(self._active.items()):
            act.handle.emit(Emission((), act.generated, len(act.handle.request.prompt), error=error))
            with self._cond:
                self._active.pop(slot, None)
                self._free.add(slot)
        self.metrics.set_active(0)

    def _fail_all(self, error: SchedulerError) -> None:
        self._fail_active(error)
        for slot, job in list(self._prefilling.items()):
            job.act.handle.emit(Emission((), 0, len(job.act.handle.request.prompt), error=error))
            del self._prefilling[slot]
            self._return_slot(slot)
        with self._cond:
            queued, self._queue = list(self._queue), collections.deque()
            self.metrics.set_queued(0)
        for handle in queued:
            handle.emit(Emission((), 0, len(handle.request.prompt), error=error))


def _cancelled() -> SchedulerError:
    return SchedulerError(ErrorKind.CANCELLED, "the request was cancelled by the client")


def _engine_error(error: Exception, message: str) -> SchedulerError:
    """An engine may raise a SchedulerError to choose the status (e.g. UNAVAILABLE when it can no longer run);
    anything else is INTERNAL."""
    return error if isinstance(error, SchedulerError) else SchedulerError(ErrorKind.INTERNAL, message)


def _abandoned(handle: RequestHandle, now: float) -> SchedulerError | None:
    # The deadline first: when it passes, gRPC also cancels the call, but the cause is the deadline.
    if handle.expired(now):
        return SchedulerError(ErrorKind.DEADLINE_EXCEEDED, "the request's deadline passed")
    if handle.cancelled:
        return _cancelled()
    return None


def _alternatives(ids: Any, probs: Any, k: int) -> tuple[tuple[int, float], ...]:
    """The first `k` (id, probability) pairs of a step's top-k, less those of probability 0: a token the step
    could not draw is no alternative (top-k over a filtered distribution pads with such ties)."""
    return tuple((int(i), p) for i, p in ((i, float(p)) for i, p in zip(ids[:k], probs[:k])) if p > 0)


def _token_out(out: StepOutputLike, row: int, top_logprobs: int) -> TokenOut:
    top = _alternatives(out.top_ids[row], out.top_probs[row], top_logprobs)
    return TokenOut(int(out.token[row]), float(out.prob[row]), top)


def _prompt_out(req: GenerationRequest, out: StepOutputLike) -> tuple[TokenOut, ...] | None:
    """Prompt tokens 1..n-1 with their probabilities and `prompt_logprobs` alternatives (from the prefill)."""
    scored = getattr(out, "prompt", None)
    if req.prompt_logprobs is None or scored is None:
        return None
    k = req.prompt_logprobs
    return tuple(TokenOut(int(token), math.exp(float(lp)),
                          _alternatives(ids, [math.exp(float(p)) for p in tops[:k]], k))
                 for token, lp, ids, tops in zip(req.prompt[1:], scored.logprob, scored.top_ids, scored.top_logprobs))


def _finish_reason(req: GenerationRequest, generated: int, token: int, engine: EngineLike) -> FinishReason | None:
    if token == engine.eos_id and not req.ignore_eos:
        return FinishReason.EOS
    if token in req.stop_token_ids:
        return FinishReason.STOP_TOKEN
    if req.max_tokens is not None and generated >= req.max_tokens:
        return FinishReason.LENGTH
    if len(req.prompt) + generated >= engine.sequence_len:
        return FinishReason.CONTEXT_LENGTH
    return None


def _problem(req: GenerationRequest, engine: EngineLike) -> str:
    """The first thing wrong with `req` (naming the field), or "" when it can be served."""
    vocab, n = engine.vocab_size, len(req.prompt)
    if n == 0:
        return "token_ids: the prompt is empty"
    if any(not 0 <= t < vocab for t in req.prompt):
        return f"token_ids: every id must be in [0, {vocab})"
    if n > max(engine.buckets):
        return (f"token_ids: the prompt has {n} tokens; the longest accepted is {max(engine.buckets)} "
                "(the largest prefill bucket): shorten it")
    if n >= engine.sequence_len:
        return f"token_ids: the prompt has {n} tokens and leaves no room in the {engine.sequence_len}-token context"
    if req.max_tokens is not None and req.max_tokens < 1:
        return "max_tokens: must be >= 1 (or unset for as many as fit the context)"
    if req.max_tokens is not None and n + req.max_tokens > engine.sequence_len:
        return (f"max_tokens: prompt ({n}) + max_tokens ({req.max_tokens}) exceeds the context of "
                f"{engine.sequence_len} tokens")
    if not math.isfinite(req.temperature) or req.temperature < 0:
        return "temperature: must be finite and >= 0"
    if not math.isfinite(req.top_p) or not 0 < req.top_p <= 1:
        return "top_p: must be in (0, 1]"
    if not 0 <= req.top_logprobs <= 8:
        return "top_logprobs: must be in 0..8"
    if req.seed is not None and not 0 <= req.seed < 2**32:
        return "seed: must be a uint32"
    if req.prompt_logprobs is not None and not 0 <= req.prompt_logprobs <= 8:
        return "prompt_logprobs: must be in 0..8 (alternatives per prompt token)"
    if not 1 <= req.n <= engine.slots:
        return (f"n: must be in 1..{engine.slots} (each sample takes one of the {engine.slots} slots; got {req.n}): "
                "ask for fewer samples")
    for field, ids in (("allowed_token_ids", req.allowed), ("blocked_token_ids", req.blocked)):
        if any(not 0 <= t < vocab for t in ids):
            return f"{field}: every id must be in [0, {vocab})"
    removed = set(req.blocked) | {engine.pad_id}
    left = bool(set(req.allowed) - removed) if req.allowed else len(removed) < vocab
    if not left:
        return "allowed_token_ids/blocked_token_ids: no token is left to sample (the pad id is never sampled)"
    return controls_problem(req.controls, vocab) or stop_token_ids_problem(req.stop_token_ids, vocab)
