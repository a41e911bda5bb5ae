"""Scheduler unit suite against FakeEngine (token after t is t + 1; see fake_engine.py)."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest

from model_service.loop_state import SchedulerMetrics
from model_service.requests import Emission, ErrorKind, FinishReason, GenerationRequest, RequestHandle, SchedulerError
from model_service.sampling_settings import SamplingSettings
from model_service.scheduler import Scheduler
from tests.engine.conftest import Runner
from tests.engine.fake_engine import POISON, FakeEngine
from tests.waiting import wait_until


def rows_of(engine: FakeEngine, slot: int) -> list[tuple[int, ...]]:
    """Per step, the positions its rows computed for `slot`."""
    return [tuple(int(p) for p, s in zip(b.positions[:b.rows], b.seq[:b.rows]) if s == slot) for b in engine.steps]


def prompt_tokens(engine: FakeEngine) -> list[tuple[int, ...]]:
    """Per step, the prompt tokens its rows held (decode rows read the device's last token)."""
    return [tuple(int(t) for t, last in zip(b.tokens[:b.rows], b.from_last[:b.rows]) if not last)
            for b in engine.steps]


class Collector:
    """Receives a request's emissions; `wait()` blocks until the last one."""

    def __init__(self) -> None:
        self.emissions: list[Emission] = []
        self.finished = threading.Event()
        self.first_token = threading.Event()

    def __call__(self, emission: Emission) -> None:
        self.emissions.append(emission)
        if emission.tokens:
            self.first_token.set()
        if emission.finish_reason is not None or emission.error is not None:
            self.finished.set()

    def wait(self, timeout: float = 10.0) -> "Collector":
        assert self.finished.wait(timeout), "request did not finish"
        return self

    @property
    def ids(self) -> list[int]:
        return [t.id for e in self.emissions for t in e.tokens]

    @property
    def last(self) -> Emission:
        return self.emissions[-1]


SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingSettings)}


def req(prompt: tuple[int, ...], **kw: object) -> GenerationRequest:
    """A request; keyword arguments naming a SamplingSettings field go into its sampling settings."""
    sampling = SamplingSettings(**{k: kw.pop(k) for k in list(kw) if k in SAMPLING_FIELDS})  # type: ignore[arg-type]
    return GenerationRequest(request_id="t", prompt=prompt, sampling=sampling, **kw)  # type: ignore[arg-type]


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def sched(engine: FakeEngine, running: Runner) -> Scheduler:
    return running(engine)


def test_tokens_follow_the_engine_and_stop_at_max_tokens(sched: Scheduler) -> None:
    c = Collector()
    sched.submit(req((5, 40), max_tokens=4, top_logprobs=2), c)
    c.wait()
    assert c.ids == [41, 42, 43, 44]
    assert [len(e.tokens) for e in c.emissions] == [1, 1, 1, 1]  # one message per step
    assert [e.completion_tokens for e in c.emissions] == [1, 2, 3, 4]
    assert c.last.finish_reason is FinishReason.LENGTH and c.last.prompt_tokens == 2
    assert c.emissions[0].tokens[0].top == ((41, 0.5), (42, 0.25))
    assert c.emissions[0].timings is not None and c.last.timings is not None
    assert c.emissions[1].timings is None


def test_alternatives_of_probability_zero_are_not_reported() -> None:
    engine = FakeEngine(kept=2)  # as a nucleus that left two tokens: top-k pads with ids 0, 1, ... at 0
    s = Scheduler(engine, max_queue=8)
    s.start()
    try:
        c = Collector()
        s.submit(req((5, 40, 9), max_tokens=2, top_logprobs=5, prompt_logprobs=4), c)
        c.wait()
    finally:
        s.stop()
    assert [t.top for e in c.emissions for t in e.tokens] == [((10, 0.5), (11, 0.25)), ((11, 0.5), (12, 0.25))]
    scored = [t for e in c.emissions if e.prompt for t in e.prompt]
    assert [t.top for t in scored] == [((40, 0.5), (41, 0.25)), ((9, 0.5), (10, 0.25))]


def test_eos_stops_and_is_included_unless_ignore_eos(sched: Scheduler) -> None:
    c = Collector()
    sched.submit(req((7, 63), max_tokens=10), c)  # 0 (pad id is only masked by the real sampler), 1, 2=EOS
    assert c.wait().ids == [0, 1, 2] and c.last.finish_reason is FinishReason.EOS
    c2 = Collector()
    sched.submit(req((7, 63), max_tokens=5, ignore_eos=True), c2)
    assert c2.wait().ids == [0, 1, 2, 3, 4] and c2.last.finish_reason is FinishReason.LENGTH


def test_context_full_finishes_with_context_length(sched: Scheduler, engine: FakeEngine) -> None:
    c = Collector()
    prompt = tuple(range(20, 30))  # 10 tokens; context 32 leaves 22
    sched.submit(req(prompt), c)
    c.wait()
    assert len(c.ids) == engine.sequence_len - len(prompt)
    assert c.last.finish_reason is FinishReason.CONTEXT_LENGTH


def test_max_tokens_one_finishes_at_its_prompt_step_without_a_decode_row(sched: Scheduler,
                                                                          engine: FakeEngine) -> None:
    c = Collector()
    sched.submit(req((3,), max_tokens=1), c)
    assert c.wait().ids == [4]
    wait_until(lambda: sched.stats()["free"] == engine.slots)
    assert len(engine.steps) == 1 and not engine.steps[0].from_last.any()


@pytest.mark.parametrize("bad, field", [
    (dict(prompt=()), "token_ids"),
    (dict(prompt=(64,)), "token_ids"),
    (dict(prompt=(-1,)), "token_ids"),
    (dict(prompt=tuple([5] * 32)), "token_ids"),  # fills the context: nothing left to generate
    (dict(prompt=(5,), max_tokens=0), "max_tokens"),
    (dict(prompt=tuple([5] * 16), max_tokens=17), "max_tokens"),  # 16 + 17 > 32
    (dict(prompt=(5,), temperature=-0.1), "temperature"),
    (dict(prompt=(5,), temperature=float("nan")), "temperature"),
    (dict(prompt=(5,), top_p=0.0), "top_p"),
    (dict(prompt=(5,), top_p=1.5), "top_p"),
    (dict(prompt=(5,), top_logprobs=21), "top_logprobs"),
    (dict(prompt=(5,), allowed=(64,)), "allowed_token_ids"),
    (dict(prompt=(5,), blocked=(99,)), "blocked_token_ids"),
    (dict(prompt=(5,), allowed=(0, 3), blocked=(3,)), "blocked_token_ids"),  # only pad left
    (dict(prompt=(5,), blocked=tuple(range(1, 64))), "blocked_token_ids"),
])
def test_invalid_requests_are_rejected_before_queueing(sched: Scheduler, engine: FakeEngine,
                                                       bad: dict, field: str) -> None:
    prompt = bad.pop("prompt")
    with pytest.raises(SchedulerError) as err:
        sched.submit(req(prompt, **bad), Collector())
    assert err.value.kind is ErrorKind.INVALID_ARGUMENT and field in err.value.message
    assert not engine.steps


def test_queue_full_is_resource_exhausted_and_says_retry(engine: FakeEngine) -> None:
    s = Scheduler(engine, max_queue=2)
    s._accepting = True  # accept but never run the decode thread: the queue only fills
    s._free.clear()  # every slot is busy
    s.submit(req((5,)), Collector())
    s.submit(req((5,)), Collector())
    with pytest.raises(SchedulerError) as err:
        s.submit(req((5,)), Collector())
    assert err.value.kind is ErrorKind.RESOURCE_EXHAUSTED and "retry" in err.value.message


def test_a_cancelled_waiting_request_leaves_the_queue_at_once(engine: FakeEngine) -> None:
    engine.slots = 1
    s = Scheduler(engine, max_queue=2)
    s._accepting = True  # no decode thread: nothing but cancel() can take a request out of the queue
    s._free.clear()  # the only slot is busy
    cancelled, kept = Collector(), Collector()
    handle = s.submit(req((5,)), cancelled)
    s.submit(req((6,)), kept)
    handle.cancel()
    assert s.stats()["queued"] == 1
    assert cancelled.last.error is not None and cancelled.last.error.kind is ErrorKind.CANCELLED
    s.submit(req((7,)), Collector())  # a live request takes the place, instead of RESOURCE_EXHAUSTED
    with pytest.raises(SchedulerError) as err:
        s.submit(req((8,)), Collector())
    assert err.value.kind is ErrorKind.RESOURCE_EXHAUSTED
    assert not kept.emissions


def test_a_simultaneous_burst_admits_free_slots_plus_the_queue(engine: FakeEngine) -> None:
    engine.slots = 4
    s = Scheduler(engine, max_queue=2)
    s._accepting = True  # the burst arrives before the decode thread moved anyone into a slot
    for i in range(6):
        s.submit(req((5 + i,)), Collector())
    with pytest.raises(SchedulerError) as err:
        s.submit(req((20,)), Collector())
    assert err.value.kind is ErrorKind.RESOURCE_EXHAUSTED


def test_new_request_joins_when_a_slot_frees_without_waiting_for_the_batch(engine: FakeEngine, running: Runner) -> None:
    engine.slots = 2
    s = running(engine)
    long_, short, late = Collector(), Collector(), Collector()
    s.submit(req((40,), max_tokens=12), long_)
    s.submit(req((20,), max_tokens=2), short)
    s.submit(req((30,), max_tokens=2), late)
    for c in (long_, short, late):
        c.wait()
    assert late.ids == [31, 32] and long_.ids == list(range(41, 53))
    late_step = prompt_tokens(engine).index((30,))
    assert late_step < 11  # it joined while the long request was still running
    assert [st.slot for st in engine.steps[late_step].starts] == [1]  # in the slot the short request freed


def test_prompts_join_the_decode_steps_of_running_requests(engine: FakeEngine, running: Runner) -> None:
    engine.slots = 4
    s = running(engine)
    engine.step_delay = 0.01
    first = Collector()
    s.submit(req((30,), max_tokens=20), first)
    assert first.first_token.wait(5)
    others = [Collector() for _ in range(3)]
    for i, c in enumerate(others):
        s.submit(req((20 + 5 * i,), max_tokens=3), c)
    for c in [first, *others]:
        c.wait()
    decoding = rows_of(engine, 0)
    last = max(i for i, r in enumerate(decoding) if r)
    assert all(decoding[1:last + 1])  # every step while it ran held its decode row, the prompts' steps too
    assert sum(1 for t in prompt_tokens(engine)[1:] if t) >= 1 and all(o.ids for o in others)


def test_cancel_frees_the_slot_within_one_step(engine: FakeEngine, running: Runner) -> None:
    engine.slots = 1
    engine.step_delay = 0.005
    s = running(engine)
    c = Collector()
    steps_at_cancel: list[int] = []
    handle = None

    def emit(e: Emission) -> None:  # runs on the decode thread: cancel right after the 3rd token
        c(e)
        if len(c.ids) == 3 and not steps_at_cancel:
            steps_at_cancel.append(len(engine.steps))
            assert handle is not None
            handle.cancel()

    handle = s.submit(req((20,), max_tokens=25), emit)
    c.wait()
    assert c.last.error is not None and c.last.error.kind is ErrorKind.CANCELLED
    assert c.ids == [21, 22, 23]
    assert len(engine.steps) == steps_at_cancel[0]  # freed before the next step
    wait_until(lambda: s.stats()["free"] == 1)
    later = Collector()
    s.submit(req((40,), max_tokens=2), later)
    assert later.wait().ids == [41, 42]


def test_a_slot_freed_by_a_cancel_goes_to_one_waiting_request_only(engine: FakeEngine, running: Runner) -> None:
    engine.slots = 1
    s = running(engine)
    first, second, third = Collector(), Collector(), Collector()
    handle = None

    def emit(e: Emission) -> None:  # on the decode thread: cancel at the 3rd token, before the next boundary
        first(e)
        if len(first.ids) == 3:
            assert handle is not None
            handle.cancel()

    handle = s.submit(req((20,), max_tokens=25), emit)
    s.submit(req((30,), max_tokens=4), second)
    s.submit(req((40,), max_tokens=4), third)
    assert first.wait().last.error is not None and first.last.error.kind is ErrorKind.CANCELLED
    assert second.wait().ids == [31, 32, 33, 34] and third.wait().ids == [41, 42, 43, 44]
    assert [st.slot for b in engine.steps for st in b.starts] == [0, 0, 0]
    wait_until(lambda: s.stats() == {"active": 0, "free": 1, "queued": 0})


def test_expired_deadline_fails_with_deadline_exceeded_and_frees_the_slot(engine: FakeEngine, running: Runner) -> None:
    engine.step_delay = 0.01
    s = running(engine)
    c = Collector()
    handle = s.submit(req((20,), max_tokens=31, deadline=time.monotonic() + 3600), c)
    assert c.first_token.wait(10)
    object.__setattr__(handle.request, "deadline", time.monotonic())  # the deadline passes mid-stream
    c.wait()
    assert c.last.error is not None and c.last.error.kind is ErrorKind.DEADLINE_EXCEEDED
    assert 0 < len(c.ids) < 31
    wait_until(lambda: s.stats() == {"active": 0, "free": engine.slots, "queued": 0})


def test_nan_logits_fail_only_that_request(sched: Scheduler) -> None:
    poisoned, healthy = Collector(), Collector()
    sched.submit(req((10,), max_tokens=6), poisoned)  # reaches token 13 = POISON
    sched.submit(req((30,), max_tokens=6), healthy)
    poisoned.wait()
    healthy.wait()
    assert poisoned.ids == [11, 12] and poisoned.last.error is not None
    assert poisoned.last.error.kind is ErrorKind.INTERNAL and POISON not in poisoned.ids
    assert healthy.ids == [31, 32, 33, 34, 35, 36] and healthy.last.finish_reason is FinishReason.LENGTH


def test_a_failed_step_fails_its_requests_and_the_service_goes_on(engine: FakeEngine, sched: Scheduler) -> None:
    engine.fail_on = 50
    failing = Collector()
    sched.submit(req((50, 1), max_tokens=3), failing)
    assert failing.wait().last.error is not None and failing.last.error.kind is ErrorKind.INTERNAL
    wait_until(lambda: sched.stats()["free"] == engine.slots)
    healthy = Collector()
    sched.submit(req((20,), max_tokens=3), healthy)
    assert healthy.wait().ids == [21, 22, 23]
    assert sched.kv.available() == engine.num_blocks - sched.kv.usage().used


def test_draining_refuses_new_requests_and_stop_fails_the_rest(engine: FakeEngine, running: Runner) -> None:
    engine.slots = 1
    engine.step_delay = 0.01
    s = running(engine)
    busy, queued = Collector(), Collector()
    s.submit(req((14,), max_tokens=30), busy)
    s.submit(req((20,), max_tokens=3), queued)
    s.close()
    with pytest.raises(SchedulerError) as err:
        s.submit(req((5,)), Collector())
    assert err.value.kind is ErrorKind.UNAVAILABLE
    s.stop()
    for c in (busy, queued):
        assert c.wait().last.error is not None and c.last.error.kind is ErrorKind.UNAVAILABLE


def test_many_requests_all_complete_and_every_slot_returns(engine: FakeEngine, sched: Scheduler) -> None:
    collectors = [Collector() for _ in range(8)]
    for i, c in enumerate(collectors):
        sched.submit(req((i + 20,), max_tokens=1 + i % 5), c)
    for i, c in enumerate(collectors):
        assert c.wait().ids == list(range(i + 21, i + 22 + i % 5))
    wait_until(lambda: sched.stats() == {"active": 0, "free": engine.slots, "queued": 0})


def test_prompts_waiting_while_nothing_decodes_are_all_computed_in_the_first_step(engine: FakeEngine,
        running: Runner) -> None:
    engine.slots = 4
    s = running(engine, start=False)
    s._accepting = True  # queue them before the decode thread starts, as if they arrived together
    collectors = [Collector() for _ in range(4)]
    for i, c in enumerate(collectors):
        s.submit(req((10 * i + 5,), max_tokens=3), c)
    s.start()
    for c in collectors:
        c.wait()
    assert prompt_tokens(engine)[0] == (5, 15, 25, 35) and len(engine.steps[0].starts) == 4


def test_while_requests_decode_prompts_get_at_most_prefill_rows_per_step(engine: FakeEngine,
        running: Runner) -> None:
    engine.slots = 4
    engine.step_delay = 0.01
    s = running(engine, prefill_rows=4)
    first = Collector()
    s.submit(req((30,), max_tokens=30), first)
    assert first.first_token.wait(5)
    others = [Collector() for _ in range(3)]
    for i, c in enumerate(others):
        s.submit(req((20 + i, 3, 4), max_tokens=2), c)
    for c in [first, *others]:
        c.wait()
    while_decoding = [t for t, mine in zip(prompt_tokens(engine), rows_of(engine, 0)) if mine][1:]
    assert max(len(t) for t in while_decoding) == 4  # 9 prompt rows: 4 + 4 + 1
    assert sum(len(t) for t in while_decoding) == 9


def test_a_long_prompt_is_computed_a_chunk_per_step_while_others_stream(engine: FakeEngine,
        running: Runner) -> None:
    engine.slots = 2
    engine.step_delay = 0.005
    s = running(engine, prefill_rows=4)
    streaming, long_ = Collector(), Collector()
    s.submit(req((30,), max_tokens=20), streaming)
    assert streaming.first_token.wait(5)
    s.submit(req(tuple(range(3, 16)), max_tokens=3), long_)  # 13 tokens: rows 0-3, 4-7, 8-11, 12
    assert long_.wait().ids == [16, 17, 18]
    assert streaming.wait().ids == list(range(31, 51))
    chunks = [r for r in rows_of(engine, 1) if r and r[0] < 13]
    assert [r[0] for r in chunks] == [0, 4, 8, 12]
    streamed = rows_of(engine, 0)
    assert all(streamed[i] for i, r in enumerate(rows_of(engine, 1)) if r and r[0] < 13)  # a decode row beside each


def test_the_pacing_is_told_each_steps_prompt_rows_and_the_keys_their_sequences_held(engine: FakeEngine,
        running: Runner) -> None:
    """pacing.py prices a prompt chunk's rows and the read of its sequence's keys apart: each mixed step's keys are
    the positions its prompt chunks start at."""
    engine.slots, engine.sequence_len = 2, 128
    engine.step_delay = 0.005
    s = running(engine)  # paced from measured step times
    seen: list[tuple[bool, float, float]] = []
    observe = s.pacing.observe

    def record(seconds: float, decoding: bool, prompt_cost: float, prompt_keys: float = 0.0) -> None:
        seen.append((decoding, prompt_cost, prompt_keys))
        observe(seconds, decoding, prompt_cost, prompt_keys)

    s.pacing.observe = record  # type: ignore[method-assign]
    streaming, long_ = Collector(), Collector()
    s.submit(req((30,), max_tokens=60), streaming)
    assert streaming.first_token.wait(5)
    s.submit(req(tuple(range(3, 43)), max_tokens=1), long_)  # 40 prompt rows, in several chunks
    long_.wait()
    streaming.wait()
    chunks = [r for r in rows_of(engine, 1) if r and r[0] < 40]
    assert len(chunks) > 1 and sum(len(r) for r in chunks) == 40
    assert [(cost, keys) for decoding, cost, keys in seen if decoding and cost] == [(len(r), r[0]) for r in chunks]


def test_a_request_cancelled_between_planning_and_admission_ends_alone(engine: FakeEngine) -> None:
    """The plan admitted a request and gave its prompt rows; the cancel arrived before the plan was carried
    out: the request ends CANCELLED, the others' step runs (it once failed every request of the step)."""
    engine.slots = 2
    s = Scheduler(engine, max_queue=2)
    s._state = engine.init_state()
    s._accepting = True  # no decode thread: the test carries out each plan itself
    kept, cancelled = Collector(), Collector()
    s.submit(req((5,), max_tokens=3), kept)
    s._step(s._plan())
    handle = s.submit(req((6, 7), max_tokens=3), cancelled)
    planned = s._plan()
    assert any(c.key[0] == id(handle) for c in planned[0].chunks)  # its prompt rows are in this step
    handle.cancel()
    s._step(planned)
    assert cancelled.last.error is not None and cancelled.last.error.kind is ErrorKind.CANCELLED
    while not kept.finished.is_set():
        s._step(s._plan())
    assert kept.last.error is None and kept.ids == [6, 7, 8]
    assert s.stats() == {"active": 0, "free": 2, "queued": 0} and s.kv.usage().used == 0


def test_cancelling_a_request_while_its_prompt_is_computed_frees_its_slot_and_blocks(engine: FakeEngine,
                                                                                    running: Runner) -> None:
    engine.slots, engine.max_rows = 1, 2  # a 13-token prompt takes 7 steps
    engine.step_delay = 0.005
    s = running(engine)
    c = Collector()
    handle = s.submit(req(tuple(range(3, 16)), max_tokens=3), c)
    wait_until(lambda: len(engine.steps) >= 1)
    handle.cancel()
    assert c.wait().last.error is not None and c.last.error.kind is ErrorKind.CANCELLED
    assert c.ids == [] and len(engine.steps) < 7  # stopped before its prompt was done
    wait_until(lambda: s.stats() == {"active": 0, "free": 1, "queued": 0})
    assert s.kv.usage().used == 0  # its KV blocks went back
    later = Collector()
    s.submit(req((40,), max_tokens=2), later)
    assert later.wait().ids == [41, 42]


def test_a_prompt_arriving_before_the_first_token_of_a_stream_is_not_paced_for_it(engine: FakeEngine,
        running: Runner) -> None:
    """A burst whose requests reach the loop a moment apart: the first one's decode row is planned (and
    dispatched) before its first token is delivered. A prompt arriving then came before that stream: it gets
    every row of the step, as if the two had arrived together (it once got `prefill_rows`)."""
    engine.slots = 2
    gate, second_step = threading.Event(), threading.Event()
    step = engine.step

    def gated(state, batch):  # type: ignore[no-untyped-def]
        if len(engine.steps) == 1:  # the first stream's first decode row: hold it until the prompt arrived
            second_step.set()
            assert gate.wait(10)
        return step(state, batch)

    engine.step = gated  # type: ignore[method-assign]
    s = running(engine, prefill_rows=4)
    first, burst = Collector(), Collector()
    s.submit(req((30,), max_tokens=5), first)
    assert second_step.wait(10)
    assert not first.first_token.is_set()  # its first token comes with the next delivery
    s.submit(req(tuple(range(40, 50)), max_tokens=2), burst)  # 10 prompt tokens
    gate.set()
    assert burst.wait().ids == [50, 51] and first.wait().ids == [31, 32, 33, 34, 35]
    assert max(len(t) for t in prompt_tokens(engine)[1:]) == 10  # the whole prompt in one step, not 4 rows


class ReclaimLog(SchedulerMetrics):
    """Scheduler metrics that keep what `observe_reclaim` was told."""

    def __init__(self) -> None:
        self.reclaims: list[tuple[str, int | None]] = []

    def observe_reclaim(self, reason: str, seconds: float, steps: int | None) -> None:
        self.reclaims.append((reason, steps))


def test_steps_after_a_cancel_count_from_the_cancel_even_when_the_decode_thread_sees_it_first(
        engine: FakeEngine, running: Runner) -> None:
    # The decode thread can end a cancelled request before the cancelling thread has told the scheduler
    # (seen under load as a cancel reclaimed after "more than 64 steps"): here the scheduler's side of the
    # cancel waits until the request has ended.
    engine.slots = 1
    metrics = ReclaimLog()
    s = running(engine, metrics=metrics)
    told = s._withdraw

    def after_the_end(handle: RequestHandle) -> None:
        assert handle.done.wait(10.0)
        told(handle)

    s._withdraw = after_the_end  # type: ignore[method-assign]
    c = Collector()
    engine.step_delay = 0.005
    handle = s.submit(req((20,), max_tokens=30), c)
    wait_until(lambda: len(c.ids) >= 6)
    handle.cancel()
    assert c.wait().last.error is not None and c.last.error.kind is ErrorKind.CANCELLED
    [(reason, steps)] = metrics.reclaims
    assert reason == "cancelled" and steps is not None and steps <= 1


def test_a_request_arriving_after_an_idle_spell_is_not_counted_as_stalled_before_the_loop_wakes(
        engine: FakeEngine, running: Runner) -> None:
    # The watchdog reads the heartbeat from another thread: between a request's arrival and the decode thread
    # waking up, the time of the last progress must not be that of the last step before the loop went idle (a
    # CI run on a busy box saw "no decode step for 64.2 s with 1 request(s) pending" after 64 s of idling, and
    # the watchdog failed the request). Here the decode thread never wakes, so the arrival is all it sees.
    s = running(engine, start=False)
    s._accepting = True  # admission open, the decode thread not started
    arrived = time.monotonic()
    s.submit(req((20,), max_tokens=2), Collector())
    beat = s.heartbeat()
    assert beat.pending == 1 and beat.at >= arrived


def test_steps_are_counted_by_kind_with_the_loops_time_for_each(engine: FakeEngine, running: Runner) -> None:
    from model_service.metrics import Metrics

    metrics = Metrics()
    engine.step_delay = 0.01  # the second request arrives while the first decodes
    s = running(engine, metrics=metrics)
    first = Collector()
    s.submit(req((5, 40, 41, 42), max_tokens=20, ignore_eos=True), first)
    assert first.first_token.wait(10.0)
    second = Collector()
    s.submit(req((7, 50, 51), max_tokens=3, ignore_eos=True), second)  # its prompt joins steps that decode
    first.wait()
    second.wait()

    def kinds() -> dict[str, int]:
        out = {"decode": 0, "mixed": 0, "prompt": 0}
        for b in engine.steps:
            decode = any(bool(x) for x in b.from_last[:b.rows])
            prompt = not all(bool(x) for x in b.from_last[:b.rows])
            out["mixed" if decode and prompt else "decode" if decode else "prompt"] += 1
        return out

    def counted(kind: str) -> float:
        return metrics.registry.get_sample_value("grok_model_steps_total", {"kind": kind}) or 0.0

    wait_until(lambda: sum(counted(k) for k in ("decode", "mixed", "prompt")) == len(engine.steps))
    want = kinds()
    assert want["prompt"] >= 1 and want["mixed"] >= 1 and want["decode"] >= 1
    assert {k: counted(k) for k in want} == want
    assert metrics.registry.get_sample_value("grok_model_decode_step_seconds_count") == len(engine.steps)
    # A step's period (from the previous delivery, or its dispatch if later) is within its dispatch-to-delivery time.
    periods = [metrics.registry.get_sample_value("grok_model_step_period_seconds_total", {"kind": k}) for k in want]
    assert all(p is not None and p > 0.0 for p in periods)
    assert sum(periods) <= metrics.registry.get_sample_value("grok_model_decode_step_seconds_sum")
