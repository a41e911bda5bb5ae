"""Admission against the KV pool: a request whose samples can never fit is refused up front, naming the numbers
(INVALID_ARGUMENT, before any work); what only waits for memory to free is queued (fake_engine.py)."""

from __future__ import annotations

import pytest

from model_service.loop_state import SchedulerMetrics
from model_service.requests import Emission, ErrorKind, SchedulerError
from model_service.scheduler import Scheduler
from tests.engine.conftest import Runner
from tests.engine.fake_engine import FakeEngine
from tests.engine.test_scheduler import Collector, req
from tests.waiting import wait_until


@pytest.fixture
def tight(running: Runner) -> Scheduler:
    """A pool of 12 blocks of 4 (48 tokens) under a 32-token context."""
    return running(FakeEngine(num_blocks=12))


def test_samples_that_certainly_outgrow_the_pool_are_refused_before_any_step_naming_the_numbers(
        tight: Scheduler) -> None:
    """Two samples of a 10-token prompt drawing 20 tokens each, nothing able to end them earlier: each ends at 30
    tokens (8 blocks), the second sharing the prompt's 2 full blocks: 14 blocks of the pool's 12."""
    with pytest.raises(SchedulerError) as err:
        tight.submit(req(tuple(range(5, 15)), n=2, max_tokens=20, ignore_eos=True), Collector())
    message = err.value.message
    assert err.value.kind is ErrorKind.INVALID_ARGUMENT, message
    assert message.startswith("n: ") and "56 KV tokens" in message and "48" in message and "--kv-tokens" in message
    assert not tight.engine.steps  # type: ignore[attr-defined]


def test_one_sample_that_certainly_outgrows_the_pool_names_max_tokens(running: Runner) -> None:
    scheduler = running(FakeEngine(num_blocks=5))  # 20 tokens
    with pytest.raises(SchedulerError) as err:
        scheduler.submit(req(tuple(range(5, 15)), max_tokens=20, ignore_eos=True), Collector())
    assert err.value.kind is ErrorKind.INVALID_ARGUMENT and err.value.message.startswith("max_tokens: ")
    with pytest.raises(SchedulerError) as err:  # no max_tokens: it runs to the context (32 tokens)
        scheduler.submit(req(tuple(range(5, 15)), ignore_eos=True), Collector())
    assert err.value.kind is ErrorKind.INVALID_ARGUMENT and "32 KV tokens" in err.value.message


def test_min_tokens_count_as_certain_tokens(tight: Scheduler) -> None:
    with pytest.raises(SchedulerError) as err:
        tight.submit(req(tuple(range(5, 15)), n=2, max_tokens=20, min_tokens=20), Collector())
    assert err.value.kind is ErrorKind.INVALID_ARGUMENT


@pytest.mark.parametrize("ending", [dict(), dict(stop_token_ids=(9,))])
def test_samples_that_may_end_early_are_served_as_far_as_they_fit(tight: Scheduler, ending: dict) -> None:
    """Without ignore_eos (or with a stop id) a request may end before it outgrows the pool: it is admitted."""
    c = Collector()
    tight.submit(req(tuple(range(5, 15)), n=2, max_tokens=6, **ending), c)
    c.wait()
    assert c.last.error is None


def test_samples_that_fit_the_pool_exactly_are_accepted(tight: Scheduler) -> None:
    """Two samples of a 9-token prompt drawing 15 tokens: 6 blocks each, 2 shared: 10 of 12."""
    c = Collector()
    tight.submit(req(tuple(range(20, 29)), n=2, max_tokens=15, ignore_eos=True), c)
    c.wait()
    assert c.last.error is None and c.last.finish_reason is not None


class Preemptions(SchedulerMetrics):
    def __init__(self) -> None:
        self.count = 0

    def preempted(self) -> None:
        self.count += 1


def test_preempted_samples_of_one_prompt_share_its_blocks_again_and_resume_on_a_tight_pool(running: Runner) -> None:
    """Issue 64.2's repro in blocks of 16: a pool of 256 tokens, four requests of n = 2 drawing 60 tokens each on
    69/57/50/73-token prompts. Alone the 73-token one takes 14 blocks (9 a sample, the 4 full prompt blocks
    shared) of 16; resumed after a preemption its samples held their own prompt blocks (18) and it failed with
    RESOURCE_EXHAUSTED. Every request must end, each sample with the tokens it draws alone."""
    engine = FakeEngine(slots=8, sequence_len=256, vocab_size=4096, max_rows=64, block_size=16, num_blocks=16)
    metrics = Preemptions()
    scheduler = running(engine, metrics=metrics)
    collectors = []
    for i, length in enumerate((69, 57, 50, 73)):
        prompt = tuple(range(100 * (i + 1), 100 * (i + 1) + length))
        c = Collector()
        scheduler.submit(req(prompt, n=2, max_tokens=60, ignore_eos=True, seed=3), c)
        collectors.append((prompt, c))
    for prompt, c in collectors:
        wait_until(lambda: any(e.error is not None for e in c.emissions) or sum(e.finish_reason is not None for e in c.emissions) == 2,
                   timeout=60)
        errors = [e.error for e in c.emissions if e.error is not None]
        assert not errors, errors
        for index in (0, 1):
            ids = [t.id for e in c.emissions if e.index == index for t in e.tokens]
            assert ids == list(range(prompt[-1] + 1, prompt[-1] + 61)), (len(prompt), index)
    assert metrics.count > 0  # the pool was tight enough to preempt
    wait_until(lambda: scheduler.kv.usage().used == 0)


def test_every_request_of_a_burst_that_fits_gets_its_first_token_before_any_of_them_finishes(
        running: Runner) -> None:
    """Issue 64.7 scaled to the fake engine: 32 slots, 32 rows a step, a pool for every request, a burst of 32
    requests of 8 + 24 tokens. With decodes first, admission slowed as streams began (8 * H(32) ~ 32 steps for
    the last prompt against 24 for the first stream to end)."""
    engine = FakeEngine(slots=32, max_rows=32, num_blocks=256, vocab_size=4096)
    scheduler = running(engine, max_queue=64, prefill_rows=32)
    events: list[tuple[str, int]] = []  # in the decode thread's order

    def collector(i: int) -> Collector:
        c = Collector()

        def emit(e: Emission) -> None:
            if e.tokens and not any(kind == "first" and j == i for kind, j in events):
                events.append(("first", i))
            if e.finish_reason is not None or e.error is not None:
                events.append(("end", i) if e.error is None else ("error", i))
            c(e)
        c.emit = emit  # type: ignore[attr-defined]
        return c

    engine.running.clear()  # the first request's step waits until the whole burst has arrived
    collectors = [collector(i) for i in range(32)]
    for i, c in enumerate(collectors):
        scheduler.submit(req(tuple(range(100 * (i + 1), 100 * (i + 1) + 8)), max_tokens=24, ignore_eos=True),
                         c.emit)  # type: ignore[attr-defined]
    engine.running.set()
    for c in collectors:
        c.wait(60)
    assert not [e for e in events if e[0] == "error"]
    kinds = [kind for kind, _ in events]
    assert kinds.index("end") > max(i for i, kind in enumerate(kinds) if kind == "first"), events


def test_a_lone_request_whose_samples_outgrow_the_pool_together_runs_them_in_turn(tight: Scheduler) -> None:
    """Two samples that may end early (no ignore_eos) but draw 20 tokens each: 14 blocks together, 8 each, on a
    pool of 12. Nothing else to preempt: the youngest sample waits for the other instead of the request failing
    with RESOURCE_EXHAUSTED."""
    c = Collector()
    tight.submit(req(tuple(range(30, 40)), n=2, max_tokens=20, seed=1), c)
    wait_until(lambda: any(e.error is not None for e in c.emissions)
               or sum(e.finish_reason is not None for e in c.emissions) == 2, timeout=30)
    assert not [e.error for e in c.emissions if e.error is not None]
    for index in (0, 1):
        assert [t.id for e in c.emissions if e.index == index for t in e.tokens] == list(range(40, 60))


def test_a_single_sample_that_outgrows_the_pool_ends_with_the_tokens_it_drew_and_the_numbers(
        running: Runner) -> None:
    scheduler = running(FakeEngine(num_blocks=5))  # 20 tokens under a 32-token context
    c = Collector()
    scheduler.submit(req(tuple(range(30, 40)), max_tokens=20), c)  # may end early: admitted
    c.wait()
    error = c.last.error
    assert error is not None and error.kind is ErrorKind.RESOURCE_EXHAUSTED
    assert "holds 20" in error.message and "--kv-tokens" in error.message
    assert c.ids == list(range(40, 40 + len(c.ids))) and len(c.ids) >= 9


SEED = 5


def test_random_mixes_of_n_beyond_the_slots_preemption_and_cancels_end_every_request_and_return_every_block(
        running: Runner) -> None:
    """Requests of 1 to 9 samples on 4 slots and a pool of 14 blocks of 4 (56 tokens; each sample grows to 12-26
    tokens), some cancelled: every sample that ends draws exactly its tokens (t + 1, ...), every request ends
    (finished or cancelled), and at the end every slot and block is back."""
    import random

    rng = random.Random(SEED)
    engine = FakeEngine(slots=4, sequence_len=32, vocab_size=4096, max_rows=16, num_blocks=14)
    metrics = Preemptions()
    scheduler = running(engine, max_queue=64, metrics=metrics)
    submitted = []
    for k in range(24):
        length, n, tokens = rng.randint(3, 10), rng.randint(1, 9), rng.randint(3, 16)
        prompt = tuple(range(100 * (k + 1), 100 * (k + 1) + length))
        c = Collector()
        handle = scheduler.submit(req(prompt, n=n, max_tokens=tokens, seed=k), c)
        submitted.append((prompt, n, tokens, c, handle, rng.random() < 0.2))
    for _, _, _, c, handle, cancel in submitted:
        if cancel:
            handle.cancel()
    for prompt, n, tokens, c, handle, cancel in submitted:
        wait_until(lambda: any(e.error is not None for e in c.emissions)
                   or sum(e.finish_reason is not None for e in c.emissions) == n, timeout=60)
        errors = [e.error for e in c.emissions if e.error is not None]
        assert not errors or (cancel and errors[0].kind is ErrorKind.CANCELLED), errors
        for i in range(n):
            ids = [t.id for e in c.emissions if e.index == i for t in e.tokens]
            assert ids == list(range(prompt[-1] + 1, prompt[-1] + 1 + len(ids)))
            if not errors:
                assert len(ids) == tokens
    wait_until(lambda: scheduler.stats() == {"active": 0, "free": 4, "queued": 0}
               and scheduler.kv.usage().used == 0, timeout=30)
    assert metrics.count > 0
