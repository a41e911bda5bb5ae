"""n > 1: several samples of one prompt sharing one prefill, each in its own slot with seed + i.

Against FakeEngine (every sample draws the same tokens there) for the scheduler's routing and block sharing, and
against the golden engine and the model service for the property that defines the feature: sample i of a
request equals a plain request with seed + i, and n = 1 is exactly a plain request."""

from __future__ import annotations

import threading

import grpc
import pytest

from grok.model.v1 import model_pb2, model_pb2_grpc
from model_service.engine import Engine
from model_service.requests import Emission, FinishReason, GenerationRequest, SchedulerError
from model_service.sampling_settings import SamplingSettings
from model_service.scheduler import Scheduler
from model_service.validation import MAX_SAMPLES
from tests.engine.conftest import Runner
from tests.engine.fake_engine import FakeEngine
from tests.engine.test_scheduler import Collector, prompt_tokens, req
from tests.waiting import wait_until


class SampleCollector(Collector):
    """Done when every one of `n` samples finished (or on an error)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.open = n

    def __call__(self, emission: Emission) -> None:
        self.emissions.append(emission)
        self.open -= emission.finish_reason is not None
        if self.open == 0 or emission.error is not None:
            self.finished.set()

    def ids_of(self, index: int) -> list[int]:
        return [t.id for e in self.emissions if e.index == index for t in e.tokens]


def test_samples_share_the_prompt_blocks_compute_only_their_tail_and_stream_by_index(running: Runner) -> None:
    engine = FakeEngine(slots=4, block_size=4, max_rows=32)
    sched = running(engine, max_queue=4)
    out = SampleCollector(3)
    prompt = tuple(range(30, 41))  # 11 tokens: two full blocks shared, the third block each sample's own
    sched.submit(req(prompt, max_tokens=3, seed=0, n=3), out)
    out.wait()
    first = engine.steps[0]
    assert [(st.slot, st.seed) for st in first.starts] == [(0, 0), (1, 1), (2, 2)]
    rows = [(int(s), int(p)) for s, p in zip(first.seq[:first.rows], first.positions[:first.rows])]
    assert rows == [(0, p) for p in range(11)] + [(1, p) for p in range(8, 11)] + [(2, p) for p in range(8, 11)]
    assert (first.tables[1][:2] == first.tables[0][:2]).all() and first.tables[1][2] != first.tables[0][2]
    assert [out.ids_of(i) for i in range(3)] == [[41, 42, 43]] * 3
    finishes = [(e.index, e.finish_reason, e.completion_tokens) for e in out.emissions if e.finish_reason]
    assert sorted(finishes) == [(i, FinishReason.LENGTH, 3) for i in range(3)]
    wait_until(lambda: sched.stats()["free"] == 4)


def test_a_request_of_n_samples_waits_for_n_free_slots_in_queue_order(running: Runner) -> None:
    engine = FakeEngine(slots=2, step_delay=0.01)
    sched = running(engine, max_queue=4)
    first, pair, after = Collector(), SampleCollector(2), Collector()
    sched.submit(req((10,), max_tokens=20), first)
    wait_until(lambda: bool(first.emissions))
    sched.submit(req((20,), max_tokens=2, n=2), pair)
    sched.submit(req((30,), max_tokens=1), after)
    first.wait()
    pair.wait()
    after.wait()
    prompts = [t for t in prompt_tokens(engine) if t]
    assert prompts[:3] == [(10,), (20, 20), (30,)]  # the single request behind the pair did not overtake it


def test_cancelling_a_request_frees_every_samples_slot(running: Runner) -> None:
    engine = FakeEngine(slots=4, step_delay=0.01)
    sched = running(engine, max_queue=4)
    out = SampleCollector(3)
    handle = sched.submit(req((20,), max_tokens=25, n=3, seed=0, ignore_eos=True), out)
    wait_until(lambda: sched.stats()["active"] == 3)
    handle.cancel()
    wait_until(lambda: sched.stats()["free"] == 4)


def test_n_out_of_range_is_invalid_naming_n() -> None:
    sched = Scheduler(FakeEngine(slots=4), max_queue=4)
    for n in (0, MAX_SAMPLES + 1):
        with pytest.raises(SchedulerError) as caught:
            sched.validate(GenerationRequest("t", (5,), n=n))
        assert str(caught.value).startswith(f"n: must be in 1..{MAX_SAMPLES}")


def test_n_beyond_the_slots_runs_the_samples_beyond_them_as_slots_free(running: Runner) -> None:
    """Issue 65.8: n was capped by the slots (vLLM's n does not depend on max_num_seqs). Ten samples on four
    slots: four at a time, each drawing what it draws alone, streamed by index, every slot back at the end."""
    engine = FakeEngine(slots=4, step_delay=0.002)
    sched = running(engine, max_queue=4)
    out = SampleCollector(10)
    active: list[int] = []
    sched.submit(req((20, 21, 22, 23, 24, 25), max_tokens=5, n=10, seed=0, ignore_eos=True), out)
    while not out.finished.wait(0.001):
        active.append(sched.stats()["active"])
    assert not [e.error for e in out.emissions if e.error is not None]
    assert [out.ids_of(i) for i in range(10)] == [[26, 27, 28, 29, 30]] * 10
    assert max(active) <= 4
    seeds = sorted(st.seed for b in engine.steps for st in b.starts)
    assert seeds == list(range(10))  # sample i draws with seed + i, wherever it ran
    wait_until(lambda: sched.stats()["free"] == 4 and sched.kv.usage().used == 0)


def test_a_request_behind_samples_beyond_the_slots_waits_for_all_of_them(running: Runner) -> None:
    engine = FakeEngine(slots=2, step_delay=0.002)
    sched = running(engine, max_queue=4)
    many, after = SampleCollector(5), Collector()
    sched.submit(req((20,), max_tokens=3, n=5, ignore_eos=True), many)
    sched.submit(req((40,), max_tokens=1), after)
    many.wait()
    after.wait()
    prompts = [t for b in prompt_tokens(engine) for t in b]
    assert prompts.index(40) > max(i for i, t in enumerate(prompts) if t == 20)  # nothing overtakes the head


def test_each_sample_equals_a_plain_request_with_seed_plus_index(golden_engine: Engine, running: Runner) -> None:
    sampling = SamplingSettings(temperature=1.1, top_k=30, frequency_penalty=0.5)
    scheduler = running(golden_engine)

    def run(request: GenerationRequest, n: int) -> SampleCollector:
        out = SampleCollector(n)
        scheduler.submit(request, out)
        return out.wait(120)

    prompt = (17, 40, 9, 311, 5)
    together = run(GenerationRequest("n", prompt, sampling, seed=2**32 - 2, max_tokens=6, ignore_eos=True, n=3), 3)
    for i in range(3):
        alone = run(GenerationRequest("1", prompt, sampling, seed=(2**32 - 2 + i) % 2**32, max_tokens=6,
                                      ignore_eos=True), 1)
        assert together.ids_of(i) == alone.ids_of(0)
    assert len({tuple(together.ids_of(i)) for i in range(3)}) > 1  # the samples do differ


def test_n_samples_over_grpc_carry_their_index_and_match_seeded_requests(
        golden_stub: model_pb2_grpc.ModelServiceStub) -> None:
    base = dict(token_ids=[17, 40, 9, 311, 5], max_tokens=5, temperature=0.9, seed=7, ignore_eos=True)
    replies = list(golden_stub.Generate(model_pb2.GenerateRequest(n=3, **base), timeout=120))
    for i in range(3):
        mine = [r for r in replies if r.index == i]
        assert mine[-1].finish_reason == model_pb2.FINISH_REASON_LENGTH and mine[-1].completion_tokens == 5
        seeded = dict(base, seed=7 + i)
        alone = [t for r in golden_stub.Generate(model_pb2.GenerateRequest(**seeded), timeout=60) for t in r.token_ids]
        assert [t for r in mine for t in r.token_ids] == alone
    plain = list(golden_stub.Generate(model_pb2.GenerateRequest(**base), timeout=60))
    one = list(golden_stub.Generate(model_pb2.GenerateRequest(n=1, **base), timeout=60))
    assert [t for r in one for t in r.token_ids] == [t for r in plain for t in r.token_ids]
    assert {r.index for r in one} == {0}
    with pytest.raises(grpc.RpcError) as caught:
        list(golden_stub.Generate(model_pb2.GenerateRequest(n=MAX_SAMPLES + 1, **base), timeout=30))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and caught.value.details().startswith("n:")


def test_concurrent_n_requests_leave_no_slot_behind(golden_service: object,
                                                    golden_stub: model_pb2_grpc.ModelServiceStub) -> None:
    errors: list[BaseException] = []

    def one(seed: int) -> None:
        try:
            list(golden_stub.Generate(model_pb2.GenerateRequest(token_ids=[5, 6, 7], max_tokens=3, n=3, seed=seed,
                                                                temperature=1.0, ignore_eos=True), timeout=120))
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=one, args=(s,)) for s in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    scheduler = golden_service.scheduler  # type: ignore[attr-defined]
    wait_until(lambda: scheduler.stats()["free"] == scheduler.engine.slots, timeout=30)


def test_samples_of_a_prompt_longer_than_a_step_ending_one_past_a_block_equal_a_plain_request(
        golden_engine: Engine, running: Runner) -> None:
    """A prompt of 16k + 1 tokens computed over several steps (beside a decoding stream; 16-position blocks): the
    other samples share all but the last position and compute only that; they wait for the first sample to
    write the shared blocks (they once ran at once and read blocks not yet written)."""
    engine = golden_engine
    assert engine.block_size == 16
    scheduler = running(engine)
    prompt = tuple((7 * i + 3) % 500 + 3 for i in range(81))
    together, alone, stream = SampleCollector(3), SampleCollector(1), Collector()
    # A stream decoding first: the prompt then gets a few rows a step (pacing), so it takes several steps.
    scheduler.submit(GenerationRequest("s", (5, 6, 7), max_tokens=100, ignore_eos=True), stream)
    assert stream.first_token.wait(120)
    scheduler.submit(GenerationRequest("n", prompt, SamplingSettings(top_logprobs=2), max_tokens=4, ignore_eos=True,
                                       n=3), together)
    together.wait(120)
    scheduler.submit(GenerationRequest("1", prompt, SamplingSettings(top_logprobs=2), max_tokens=4, ignore_eos=True),
                     alone)
    alone.wait(120), stream.wait(120)

    def scored(c: SampleCollector, i: int) -> list[tuple[int, float]]:
        return [(t.id, t.prob) for e in c.emissions if e.index == i for t in e.tokens]
    assert scored(together, 0) == scored(together, 1) == scored(together, 2) == scored(alone, 0)
