"""Continuous batching: a bounded waiting queue, N decode slots, and one thread that carries out the plan.

Requests are validated (validation.py) and queued by `submit` (any thread). At each step boundary the
decode thread takes a snapshot of its queue and slots, asks plan.schedule for the step's plan (who
ends, who is admitted into which slots, which chunked prefills advance) and carries it out on the
engine; then it dispatches one `Engine.generate` step for all slots and, while the engine computes it,
hands each request its token from the previous step through the request's `emit` callback (JetStream's
overlap of host work with the next step), freeing a slot as soon as its request is done (EOS,
max_tokens, full context) or failed. A step already in flight for a slot whose request ended is
discarded. Requests are admitted only when the KV pool has blocks for their prompts; when a step would
need more blocks than are left, the youngest running request is preempted (its blocks freed, itself put
back at the head of the queue) and later recomputed with the seed it first drew with: by batch
invariance it draws the same tokens again, and the ones already delivered are not delivered twice. The scheduler knows only the engine's interface (engine_api.EngineLike); it never touches
JAX, so a fake engine can drive it in tests.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any

from model_service.delivery import Delivery
from model_service.engine_api import EngineLike
from model_service.guided import Guidance
from model_service.loop_state import Heartbeat, InFlight, Prefilling, Running, SchedulerMetrics
from model_service.plan import Occupant, Policy, StepPlan, View, Waiting, prompt_out, schedule
from model_service.requests import (
    Emission,
    EmitFn,
    ErrorKind,
    GenerationRequest,
    RequestHandle,
    SchedulerError,
    cancelled_error,
    engine_failure,
    kv_full_error,
)
from model_service.structured import GrammarCompiler
from model_service.validation import validate

log = logging.getLogger(__name__)


class Scheduler:
    """N slots over one Engine; `start()` launches the decode thread, `stop()` ends it.

    While requests are decoding, each step admits waiting prompts until their padded lengths pass
    `prefill_token_budget` tokens (at least one prompt) and at most `prefills_per_step` of them; with
    nothing decoding it admits as many as there are free slots (plan.py).
    """

    def __init__(self, engine: EngineLike, max_queue: int, metrics: SchedulerMetrics | None = None,
                 prefills_per_step: int | None = None, prefill_token_budget: int = 128,
                 grammars: GrammarCompiler | None = None) -> None:
        self.engine = engine
        self.guidance = Guidance(engine, grammars)  # structured output (constraints)
        self.max_queue = max_queue
        self.metrics = metrics or SchedulerMetrics()
        self.delivery = Delivery(engine, self.metrics, self.guidance)  # a step's tokens to their requests
        self.policy = Policy(engine.slots, prefills_per_step, prefill_token_budget)
        self._cond = threading.Condition()
        self._queue: collections.deque[RequestHandle] = collections.deque()
        self._active: dict[int, Running] = {}
        self._prefilling: dict[int, Prefilling] = {}
        self._free = set(range(engine.slots))
        self._accepting = False
        self._stopping = False
        self._state: Any = None
        self._in_flight: InFlight | None = None
        self._thread: threading.Thread | None = None
        self._steps = 0
        self._beat = time.monotonic()
        self._admitting: list[RequestHandle] = []  # admitted by the current plan, not yet prefilled

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
        handle.grammar = self.guidance.compile(request)
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

    def validate(self, request: GenerationRequest) -> None:
        """Raise INVALID_ARGUMENT for anything the engine could not serve as asked."""
        validate(request, self.engine)

    def heartbeat(self) -> Heartbeat:
        with self._cond:
            alive = self._thread is not None and self._thread.is_alive()
            pending = len(self._active) + len(self._prefilling) + len(self._queue) + len(self._admitting)
            return Heartbeat(self._steps, self._beat, pending, alive)

    def fail_pending(self, error: SchedulerError) -> int:
        """End every running and waiting request with `error` now (the decode loop may be stuck); their
        slots are freed if the loop comes back. Returns how many requests were ended."""
        with self._cond:
            handles = [act.handle for act in self._active.values()] + list(self._queue)
            handles += [job.run.handle for job in list(self._prefilling.values())] + self._admitting
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
            handle.emit(Emission((), 0, len(handle.request.prompt), error=cancelled_error()))

    # ---- decode thread: planning ------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._wait_for_work():
                self._carry_out(self._plan())
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

    def _plan(self) -> tuple[StepPlan, dict[int, RequestHandle], float]:
        """Snapshot the queue and slots, ask the policy, and take the admitted requests and their slots."""
        now = time.monotonic()
        with self._cond:
            handles = {id(h): h for h in self._queue}
            view = View(tuple(self._waiting(h, now) for h in self._queue), frozenset(self._free),
                        tuple(Occupant(s, id(a.handle), a.handle.abandoned(now) is not None)
                              for s, a in self._active.items()),
                        tuple(Occupant(s, id(p.run.handle), p.run.handle.abandoned(now) is not None)
                              for s, p in self._prefilling.items()), self.engine.free_blocks())
            plan = schedule(view, self.policy)
            gone = plan.admitted | {w.ref for w in plan.end_waiting}
            self._queue = collections.deque(h for h in self._queue if id(h) not in gone)
            # The slots of ended requests are free for this very plan's admissions: account for both at once.
            self._free |= {o.slot for o in plan.end_decoding + plan.end_prefilling}
            self._free -= {slot for admit in plan.admit for slot in admit.slots}
            self._admitting = [handles[a.ref] for a in plan.admit]  # still pending for the watchdog
            self.metrics.set_queued(len(self._queue))
        return plan, handles, now

    def _waiting(self, handle: RequestHandle, now: float) -> Waiting:
        req = handle.request
        # n > 1 and prompt logprobs need the whole prompt's prefill, which chunks do not keep; pad tokens inside
        # a prompt are masked only within one prefill call.
        one_pass = req.n > 1 or req.prompt_logprobs is not None
        chunked = not one_pass and self.engine.chunked(len(req.prompt)) and self.engine.pad_id not in req.prompt
        cost = self.engine.prefill_chunk if chunked else self.engine.bucket_for(len(req.prompt))
        return Waiting(id(handle), req.n, cost, chunked, handle.abandoned(now) is not None,
                       self.engine.blocks_needed(len(req.prompt), req.n))

    # ---- decode thread: carrying out the plan -----------------------------------------------
    def _carry_out(self, planned: tuple[StepPlan, dict[int, RequestHandle], float]) -> None:
        plan, handles, now = planned
        for o in plan.end_decoding:  # their slots were already counted free by _plan
            run = self._active[o.slot]
            self._end(run.handle, now, run.generated)
            self._release(o.slot, free=False)
        for o in plan.end_prefilling:  # never activated; its KV blocks go back now
            self._end(self._prefilling.pop(o.slot).run.handle, now)
            self._state = self.engine.free_slot(self._state, o.slot)
            self._observe_kv()
        for w in plan.end_waiting:
            self._end(handles[w.ref], now, reclaimed=False)
        for admit in plan.admit:
            handle = handles[admit.ref]
            if handle.abandoned(time.monotonic()) is not None:  # cancelled since the plan: no prefill for it
                self._end(handle, time.monotonic(), reclaimed=False)
                for slot in admit.slots:
                    self._return_slot(slot)
            elif admit.chunked:
                self._begin_chunked(handle, admit.slots[0])
            else:
                self._prefill(handle, list(admit.slots))
            with self._cond:
                self._admitting.remove(handle)
        self._advance_prefills(plan.chunk)

    def _end(self, handle: RequestHandle, now: float, generated: int = 0, reclaimed: bool = True) -> None:
        """End a cancelled or expired request (its slot is the caller's to free)."""
        error = handle.abandoned(now)
        assert error is not None  # cancellation and deadlines never revert
        handle.fail(error, generated)
        if not reclaimed:
            return
        if error.kind is ErrorKind.DEADLINE_EXCEEDED and handle.request.deadline is not None:
            self.metrics.observe_reclaim("deadline", time.monotonic() - handle.request.deadline, None)
        elif handle.cancelled_at is not None:
            self.metrics.observe_reclaim("cancelled", time.monotonic() - handle.cancelled_at,
                                         self._steps - handle.cancel_step)

    def _prefill(self, handle: RequestHandle, slots: list[int]) -> None:
        """One prefill for the request; each of its samples draws its own first token from it into its slot."""
        req = handle.request
        seed = handle.draw_seed()
        admitted = time.monotonic()
        try:
            prefix, out = self.engine.prefill(req.prompt, self.guidance.first_sampling(handle), seed=seed,
                                              prompt_logprobs=req.prompt_logprobs)
            samples = [(prefix, out)]
            for i in range(1, req.n):
                samples.append(self.engine.resample(prefix, seed=(seed + i) % 2**32))
        except Exception as e:
            self._prefill_failed(handle, e)
            for slot in slots:
                self._return_slot(slot)
            return
        prefill_seconds = time.monotonic() - admitted
        self._beat = time.monotonic()
        self.metrics.observe_prefill(prefill_seconds)
        for index, (slot, (sample, first)) in enumerate(zip(slots, samples)):
            if index in handle.finished_samples:  # finished before a preemption
                self._return_slot(slot)
                continue
            act = self.guidance.attach(handle, Running(handle, (seed + index) % 2**32, admitted, index))
            act.prefill_seconds = prefill_seconds
            act.skip = len(handle.delivered.get(index, ()))
            scored = prompt_out(req, out) if index == 0 and not act.skip else None
            if handle.done.is_set() or self.delivery.deliver(act, first, 0, scored):
                self._return_slot(slot)
                continue
            self._state = self.engine.insert(sample, self._state, slot)
            with self._cond:
                self._active[slot] = act
                self.metrics.set_active(len(self._active))

    def _begin_chunked(self, handle: RequestHandle, slot: int) -> None:
        req = handle.request
        seed = handle.draw_seed()
        try:
            job = self.engine.begin_prefill(req.prompt, self.guidance.first_sampling(handle), slot=slot, seed=seed)
        except Exception as e:
            self._prefill_failed(handle, e)
            self._return_slot(slot)
            return
        run = self.guidance.attach(handle, Running(handle, seed, time.monotonic()))
        run.skip = len(handle.delivered.get(0, ()))
        self._prefilling[slot] = Prefilling(run, job)



    def _prefill_failed(self, handle: RequestHandle, error: Exception) -> None:
        rid = handle.request.request_id
        log.exception("prefill failed", extra={"request_id": rid})
        failure = engine_failure(error, f"prefill failed (request {rid})")
        handle.emit(Emission((), 0, len(handle.request.prompt), error=failure))

    def _advance_prefills(self, slots: tuple[int, ...]) -> None:
        """One chunk of each planned long prompt; a finished one delivers its first token."""
        for slot in slots:
            job = self._prefilling.get(slot)
            if job is None:  # its begin_prefill failed
                continue
            try:
                self._state, out = self.engine.prefill_next_chunk(job.job, self._state)
            except Exception as e:
                self._prefill_failed(job.run.handle, e)
                del self._prefilling[slot]
                self._release(slot)
                continue
            self._beat = time.monotonic()  # a chunk is progress for the watchdog
            if out is None:
                continue
            del self._prefilling[slot]
            run = job.run
            run.prefill_seconds = time.monotonic() - run.admitted_at
            self.metrics.observe_prefill(run.prefill_seconds)
            if self.delivery.deliver(run, out, 0):
                self._release(slot)
                continue
            with self._cond:
                self._active[slot] = run
                self.metrics.set_active(len(self._active))

    def _step(self) -> None:
        """Dispatch a decode step, then deliver the previous one's tokens while the engine computes.

        With a constrained request decoding, the step in flight is delivered first: the next step's masks
        depend on its tokens, so host work does not overlap the device for such a batch."""
        try:
            if any(act.guide is not None for act in self._active.values()):
                self._finish_in_flight()
                self._set_masks()
            self._make_room()
            if not self._active:
                self._finish_in_flight()
                return
            self._state, pending = self.engine.generate(self._state)
            self._observe_kv()
        except Exception as e:
            self._step_failed(e)
            return
        previous, self._in_flight = self._in_flight, InFlight(pending, dict(self._active), time.monotonic())
        if previous is not None:
            self._deliver_step(previous)

    def _make_room(self) -> None:
        """Preempt the youngest running requests until the next step's new KV blocks fit; a request that cannot
        fit even alone (its samples at this length) ends with RESOURCE_EXHAUSTED."""
        while self._active and self.engine.blocks_short() > 0:
            youngest = max(self._active.values(), key=lambda a: (a.admitted_at, a.index)).handle
            slots = [slot for slot, act in self._active.items() if act.handle is youngest]
            alone = len(slots) == len(self._active)
            for slot in slots:
                self._release(slot)
            if alone:  # nothing else to preempt
                youngest.fail(kv_full_error(youngest.request.n), sum(len(t) for t in youngest.delivered.values()))
                return
            log.info("preempted", extra={"request_id": youngest.request.request_id})
            self.metrics.preempted()
            with self._cond:
                self._queue.appendleft(youngest)
                self.metrics.set_queued(len(self._queue))

    def _set_masks(self) -> None:
        """Each constrained slot's mask for the next step; a request whose grammar failed ends with its error."""
        self._state, failed = self.guidance.set_masks(self._state, self._active)
        for slot, error in failed.items():
            act = self._active[slot]
            act.handle.emit(Emission((), act.generated, len(act.handle.request.prompt), error=error))
            self._release(slot)

    def _finish_in_flight(self) -> None:
        previous, self._in_flight = self._in_flight, None
        if previous is not None:
            self._deliver_step(previous)

    def _deliver_step(self, step: InFlight) -> None:
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
            if self.delivery.deliver(act, out, slot):
                self._release(slot)

    def _step_failed(self, error: Exception) -> None:
        log.exception("decode step failed")
        self._in_flight = None
        self._fail_running(engine_failure(error, "decode step failed; retry"))  # a fresh state holds none of them
        self._state = self.engine.init_decode_state()

    def _observe_kv(self) -> None:
        self.metrics.observe_kv(self.engine.kv_usage())

    def _release(self, slot: int, free: bool = True) -> None:
        self._state = self.engine.free_slot(self._state, slot)
        self._observe_kv()
        with self._cond:
            self._active.pop(slot, None)
            self.metrics.set_active(len(self._active))
        if free:
            self._return_slot(slot)

    def _return_slot(self, slot: int) -> None:
        with self._cond:
            self._free.add(slot)

    def _fail_running(self, error: SchedulerError) -> None:
        """End every request holding a slot (decoding, or being prefilled in chunks) with `error`."""
        for slot, act in list(self._active.items()):
            act.handle.emit(Emission((), act.generated, len(act.handle.request.prompt), error=error))
            with self._cond:
                self._active.pop(slot, None)
                self._free.add(slot)
        self.metrics.set_active(0)
        for slot, job in list(self._prefilling.items()):
            job.run.handle.emit(Emission((), 0, len(job.run.handle.request.prompt), error=error))
            del self._prefilling[slot]
            self._return_slot(slot)

    def _fail_all(self, error: SchedulerError) -> None:
        self._fail_running(error)
        with self._cond:
            queued, self._queue = list(self._queue) + self._admitting, collections.deque()
            self._admitting = []
            self.metrics.set_queued(0)
        for handle in queued:
            handle.emit(Emission((), 0, len(handle.request.prompt), error=error))

