"""Continuous batching: a bounded waiting queue, the KV block allocator, and one thread that carries out the plan.

Requests are validated (validation.py) and queued by `submit` (any thread). At each step the decode thread takes
a snapshot of its queue and running samples, asks plan.schedule for the step's plan (who ends, who is admitted
into which slots, which rows of which samples run), turns it into the engine's StepBatch (step_builder.py: block
tables from the allocator it owns, kv_blocks.KVBlocks, consulting the prefix cache for every prompt) and
dispatches one `Engine.step`; while the engine computes it, the previous step's draws are handed to their
requests (JetStream's overlap of host work with the device). A sample whose request ended is released at the
next step; a draw already in flight for it is discarded.

When the next step's decode rows would need more KV blocks than are left, the youngest running request is
preempted (its blocks freed, itself put back at the head of the queue) and later recomputed: its prompt and the
tokens it delivered become known rows (the prefix cache may serve the prompt), its key schedule resumes after
the draws it made, and by batch invariance it then draws what it would have drawn. The scheduler knows only
the engine's interface (engine_api.EngineLike); it never touches JAX, so a fake engine can drive it in tests.
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
from model_service.kv_blocks import KVBlocks
from model_service.loop_state import Heartbeat, InFlight, Running, SchedulerMetrics, step_kind
from model_service.pacing import DEFAULT_SLOWDOWN, Pacing, key_scale, rows_cost
from model_service.plan import Chunk, Key, Policy, StepPlan, View, schedule, scored_tokens
from model_service.speculative import SpeculativeConfig
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
from model_service.step_builder import StepBuilder
from model_service.structured import Compiled, GrammarCompiler
from model_service.validation import validate

log = logging.getLogger(__name__)

INITIAL_PREFILL_ROWS = 16  # prompt rows per step while samples decode, until step times are measured (pacing.py)


class Scheduler:
    """Slots and KV blocks over one Engine; `start()` launches the decode thread, `stop()` ends it.

    While samples decode, each step gives prompts the row-equivalents pacing.Pacing measures they can take
    without the step taking more than `slowdown` times a decode-only step, or exactly `prefill_rows` when given
    (plan.py); with nothing decoding, the whole step."""

    def __init__(self, engine: EngineLike, max_queue: int, metrics: SchedulerMetrics | None = None,
                 prefill_rows: int | None = None, grammars: GrammarCompiler | None = None,
                 prefix_caching: bool = True, speculative: SpeculativeConfig | None = None,
                 slowdown: float = DEFAULT_SLOWDOWN) -> None:
        self.engine = engine
        self.guidance = Guidance(engine, grammars)  # structured output (constraints)
        self.max_queue = max_queue
        self.metrics = metrics or SchedulerMetrics()
        self.delivery = Delivery(engine, self.metrics, self.guidance)  # a step's tokens to their requests
        self.prefix_caching = prefix_caching
        self.speculative = speculative if getattr(engine, "draft_tokens", 0) else None
        self.fixed_prefill = prefill_rows
        self.pacing = Pacing(float(prefill_rows or INITIAL_PREFILL_ROWS), float(engine.max_rows), slowdown=slowdown)
        self.key_scale = key_scale(engine.model_config) if hasattr(engine, "model_config") else float("inf")
        self._cond = threading.Condition()
        self._queue: collections.deque[RequestHandle] = collections.deque()
        self._running: dict[Key, Running] = {}
        self._free = set(range(engine.slots))
        self._accepting = False
        self._stopping = False
        self._state: Any = None
        self._in_flight: InFlight | None = None
        self._thread: threading.Thread | None = None
        self._steps = 0
        self._admitted = 0
        self._beat = time.monotonic()
        self._delivered_at = 0.0  # when the last step's results arrived (a step's device time starts after it)
        self._reset_memory()

    def _reset_memory(self) -> None:
        e = self.engine
        self.kv = KVBlocks(e.num_blocks, e.block_size, e.slots, e.table_len, self.prefix_caching)
        self.builder = StepBuilder(e, self.kv, self.guidance, self.speculative)

    # ---- any thread -------------------------------------------------------------------------
    def start(self) -> None:
        self._state = self.engine.init_state()
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

    def submit(self, request: GenerationRequest, emit: EmitFn, grammar: Compiled | None = None) -> RequestHandle:
        """Validate and queue a request; raises SchedulerError (invalid, queue full, unavailable). `grammar` is
        its constraint as `await self.guidance.compile_async(request)` compiled it (the servicer's way: nothing
        compiles here); without it a constraint is compiled here, blocking the caller."""
        self.validate(request)
        handle = RequestHandle(request, emit, self._withdraw, lambda: self._steps)
        handle.grammar = grammar if grammar is not None else self.guidance.compile(request)
        with self._cond:
            if not self._accepting:
                raise SchedulerError(ErrorKind.UNAVAILABLE, "the model service is not accepting requests "
                                     "(starting up or draining); retry on another replica or later")
            # Free slots take waiting requests at the next step: a burst may fill them too.
            if len(self._queue) >= self.max_queue + len(self._free):
                raise SchedulerError(ErrorKind.RESOURCE_EXHAUSTED, f"the waiting queue is full "
                                     f"({self.max_queue} requests); retry later")
            if not self._queue and not self._running and self._in_flight is None:
                # The loop was idle: the watchdog's clock starts now, not at the last step before idling (the
                # decode thread may take a while to wake on a busy machine).
                self._beat = time.monotonic()
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
            requests = {id(r.handle) for r in self._running.values()}
            return Heartbeat(self._steps, self._beat, len(requests) + len(self._queue), alive)

    def fail_pending(self, error: SchedulerError) -> int:
        """End every running and waiting request with `error` now (the decode loop may be stuck); their
        slots are freed if the loop comes back. Returns how many requests were ended."""
        with self._cond:
            handles = list({id(r.handle): r.handle for r in self._running.values()}.values()) + list(self._queue)
            self._queue.clear()
            self.metrics.set_queued(0)
        for handle in handles:
            handle.abandon(error)
        return len(handles)

    def stats(self) -> dict[str, int]:
        """Busy slots, free slots and queued requests (for tests and health reporting)."""
        with self._cond:
            return {"active": len(self._running), "free": len(self._free), "queued": len(self._queue)}

    def _withdraw(self, handle: RequestHandle) -> None:
        """A request was cancelled: a waiting one leaves the queue now, so its place goes to a live request."""
        with self._cond:
            try:
                self._queue.remove(handle)
                queued = True
                self.metrics.set_queued(len(self._queue))
            except ValueError:  # running: its slot is freed at the next step
                queued = False
            self._cond.notify_all()
        if queued:
            handle.emit(Emission((), 0, len(handle.request.prompt), error=cancelled_error()))

    # ---- decode thread ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while self._wait_for_work():
                if self.builder.drafts_due(self._running.values()) or any(
                        r.guide is not None for r in self._running.values()):
                    self._finish_in_flight()  # drafts and a constrained draw's mask depend on the previous draw
                self._make_room()
                self._step(self._plan())
        except Exception:
            log.exception("decode loop crashed")
        finally:
            with self._cond:
                self._accepting = False  # nothing would serve new requests any more
            self._fail_all(SchedulerError(ErrorKind.UNAVAILABLE, "the model service is shutting down; retry"))

    def _wait_for_work(self) -> bool:
        with self._cond:
            while not self._stopping and not self._queue and not self._running and self._in_flight is None:
                self._cond.wait()
                self._beat = time.monotonic()  # work (re)starts now, not at the last step before idling
            return not self._stopping

    def _plan(self) -> tuple[StepPlan, dict[int, RequestHandle]]:
        """Snapshot the queue and samples, ask the policy, and take the admitted requests and their slots."""
        now = time.monotonic()
        holders = self._holders()
        with self._cond:
            handles = {id(h): h for h in self._queue}
            waiting = tuple(self.builder.waiting(h, now, holders.get(id(h), ())) for h in self._queue)
        # Drafts take rows nothing else needs; none while requests wait for a slot (they would only delay them).
        drafting = self.speculative is not None and (len(self._running) < self.engine.slots or not waiting)
        running = tuple(self.builder.sample(r, now, drafting) for r in self._running.values())
        blocks = self.kv.available() - self.builder.growth(self._running.values())  # the decode rows' come first
        plan = schedule(View(waiting, running, frozenset(self._free), max(0, blocks)), self._policy())
        with self._cond:
            gone = {a.ref for a in plan.admit if not a.rest} | set(plan.end_waiting)
            self._queue = collections.deque(h for h in self._queue if id(h) not in gone)
            self.metrics.set_queued(len(self._queue))
        return plan, handles

    def _policy(self) -> Policy:
        """The step's rows, and while streams decode the prompt rows pacing allows (or exactly --prefill-tokens)."""
        e = self.engine
        if self.fixed_prefill:
            return Policy(e.max_rows, float(self.fixed_prefill), self.key_scale, e.slots)
        return Policy(e.max_rows, self.pacing.budget(), self.key_scale, e.slots, self.pacing.keys_per_row(),
                      self.pacing.min_rows, e.buckets)

    def _holders(self) -> dict[int, list[Running]]:
        """The running samples of each request (samples of it may wait while others hold slots)."""
        out: dict[int, list[Running]] = {}
        for run in self._running.values():
            out.setdefault(id(run.handle), []).append(run)
        return out

    def _step(self, planned: tuple[StepPlan, dict[int, RequestHandle]]) -> None:
        """Carry out the plan: end, admit, build the batch and dispatch it; then deliver the previous step."""
        plan, handles = planned
        now = time.monotonic()
        for key in plan.end_running:
            run = self._running.get(key)
            if run is not None:
                self._end(run.handle, now, run.generated)
                self._release(run)
        for ref in plan.end_waiting:
            self._end(handles[ref], now, reclaimed=False)
        holders = self._holders() if plan.admit else {}
        for admit in plan.admit:
            self._admit(handles[admit.ref], admit.slots, admit.samples, now, holders.get(admit.ref, ()))
        # A request whose admission ended it (cancelled or past its deadline since the plan, or a constraint
        # that failed) has no running samples: its rows leave the step.
        chunks = tuple(c for c in plan.chunks if c.key in self._running)
        batch = None
        if chunks:
            try:
                batch, owners, scored = self.builder.build(chunks, self._running)
                for run in self.builder.failed:  # their grammar failed: they ended, their draw is not made
                    self._release(run)
                self.builder.failed.clear()
                self._state, pending = self.engine.step(self._state, batch)
            except Exception as e:
                self._step_failed(e)
                return
            self._observe_kv()
            previous, self._in_flight = self._in_flight, InFlight(pending, owners, scored, time.monotonic(),
                                                                  *self._shape(chunks))
            if previous is not None:
                self._deliver(previous)
        else:
            self._finish_in_flight()
        self.metrics.set_active(len(self._running))

    def _shape(self, chunks: tuple[Chunk, ...]) -> tuple[bool, float, float]:
        """Whether the step decodes, its prompt rows' cost in row-equivalents and the keys their sequences held
        before them (pacing.py)."""
        decoding, cost, keys = False, 0.0, 0.0
        for c in chunks:
            run = self._running.get(c.key)
            if run is not None and c.start >= run.known:
                decoding = True
            else:
                cost += rows_cost(c.start, c.rows, self.key_scale)
                keys += c.start
        return decoding, cost, keys

    def _admit(self, handle: RequestHandle, slots: tuple[int, ...], samples: tuple[int, ...], now: float,
               holders: list[Running]) -> None:
        """Give the request's samples their slots and KV blocks; their rows run from this step on."""
        if handle.abandoned(now) is not None:
            self._end(handle, now, reclaimed=False)
            return
        try:
            runs = self.builder.admit(handle, slots, samples, now, self._admitted, holders)
        except Exception as e:  # e.g. a constraint the library cannot follow from its first token
            handle.fail(engine_failure(e, f"admission failed (request {handle.request.request_id})"))
            log.exception("admission failed", extra={"request_id": handle.request.request_id})
            return
        self._admitted += 1
        with self._cond:
            for run in runs:
                self._free.discard(run.slot)
                self._running[(id(handle), run.index)] = run
            self._beat = time.monotonic()

    def _make_room(self) -> None:
        """Preempt the youngest running requests until the next step's new KV blocks fit (when one request alone
        holds the pool, its youngest samples, which wait for its others); a single sample that cannot fit alone
        ends its request with RESOURCE_EXHAUSTED."""
        while self._running and self.builder.blocks_short(self._running.values()) > 0:
            self._finish_in_flight()  # its draws are part of what the preempted request delivered
            if not self._running or self.builder.blocks_short(self._running.values()) <= 0:
                return
            last = max(self._running.values(), key=lambda r: (r.order, r.index))
            youngest = last.handle
            runs = [r for r in self._running.values() if r.handle is youngest]
            if len(runs) == len(self._running) == 1:  # nothing else to preempt
                self._release(last)
                youngest.fail(kv_full_error(last.length, self.kv.num_blocks * self.kv.block_size),
                              sum(len(t) for t in youngest.delivered.values()))
                return
            for run in runs if len(runs) < len(self._running) else [last]:
                self._release(run)
            log.info("preempted", extra={"request_id": youngest.request.request_id})
            self.metrics.preempted()
            with self._cond:
                if youngest not in self._queue:  # (one of more samples than slots may wait there already)
                    self._queue.appendleft(youngest)
                self.metrics.set_queued(len(self._queue))

    def _end(self, handle: RequestHandle, now: float, generated: int = 0, reclaimed: bool = True) -> None:
        """End a cancelled or expired request (its slots are the caller's to free)."""
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

    def _finish_in_flight(self) -> None:
        previous, self._in_flight = self._in_flight, None
        if previous is not None:
            self._deliver(previous)

    def _deliver(self, step: InFlight) -> None:
        """Hand a step's scores and draws to their samples; a sample that finishes gives its slot back."""
        try:
            out = step.pending.get()
        except Exception as e:
            self._step_failed(e)
            return
        now = time.monotonic()
        seconds = now - step.dispatched_at
        period = now - max(step.dispatched_at, self._delivered_at)
        self.pacing.observe(period, step.decoding, step.prompt_cost, step.prompt_keys)
        self._delivered_at = now
        with self._cond:
            self._steps += 1
            self._beat = time.monotonic()
        self.metrics.observe_step(seconds, step_kind(step.decoding, step.prompt_cost), period)
        for run, row, position, rows in step.scored:
            if self._live(run):
                run.scored.extend(scored_tokens(run.handle.request, out, row, position, rows))
        with self.delivery.holding():  # the step's emissions leave together, at its end
            self._hand_back(step, out, seconds)

    def _hand_back(self, step: InFlight, out: Any, seconds: float) -> None:
        entry = 0
        while entry < len(step.owners):  # a sample's draws are consecutive entries (several: speculative)
            run, first = step.owners[entry], entry
            while entry < len(step.owners) and step.owners[entry] is run:
                entry += 1
            if not self._live(run):  # ended (and maybe replaced) after the dispatch
                continue
            counted = [e for e in range(first, entry) if out.accepted is None or out.accepted[e]]
            self._take(run, out, counted, entry - first - 1, seconds)

    def _take(self, run: Running, out: Any, entries: list[int], drafted: int, seconds: float) -> None:
        """One sample's counted draws of a step: its speculative bookkeeping, then delivery."""
        run.in_flight -= 1
        run.steps += 1
        run.step_seconds += seconds
        if drafted:
            run.pacer.verified(drafted, len(entries) - 1)
            self.metrics.speculated(drafted, len(entries) - 1)
            run.computed += len(entries) - 1  # the accepted drafts' rows hold their keys
            run.length += len(entries) - 1
        if not run.prefill_seconds:  # its first draw since admission
            run.prefill_seconds = time.monotonic() - run.admitted_at
            self.metrics.observe_prefill(run.prefill_seconds)
        prompt = tuple(run.scored) if run.handle.request.prompt_logprobs is not None and run.index == 0 \
            and run.generated == 0 else None
        if self.delivery.deliver(run, out, entries, prompt):
            run.finished = True
            self._release(run)

    def _live(self, run: Running) -> bool:
        return self._running.get((id(run.handle), run.index)) is run and not run.finished

    def _step_failed(self, error: Exception) -> None:
        log.exception("step failed")
        self._in_flight = None
        self._fail_running(engine_failure(error, "the model step failed; retry"))  # a fresh state holds none
        self._state = self.engine.init_state()
        self._reset_memory()

    def _observe_kv(self) -> None:
        self.metrics.observe_kv(self.kv.usage())

    def _release(self, run: Running) -> None:
        """The sample's slot and blocks go back (cached blocks stay reusable)."""
        key = (id(run.handle), run.index)
        if self._running.get(key) is not run:
            return
        self.kv.release(run.slot)
        self._observe_kv()
        with self._cond:
            del self._running[key]
            self._free.add(run.slot)
            self.metrics.set_active(len(self._running))

    def _fail_running(self, error: SchedulerError) -> None:
        """End every request holding a slot with `error`."""
        for run in list(self._running.values()):
            run.handle.emit(Emission((), run.generated, len(run.handle.request.prompt), error=error))
            with self._cond:
                self._running.pop((id(run.handle), run.index), None)
                self._free.add(run.slot)
        self.metrics.set_active(0)

    def _fail_all(self, error: SchedulerError) -> None:
        self._fail_running(error)
        with self._cond:
            queued, self._queue = list(self._queue), collections.deque()
            self.metrics.set_queued(0)
        for handle in queued:
            handle.emit(Emission((), 0, len(handle.request.prompt), error=error))
