"""The scheduling policy as data: plan.schedule on hand-built snapshots, no thread, no engine."""

from __future__ import annotations

import random

import numpy as np

from model_service.plan import Admit, Occupant, Policy, StepPlan, View, Waiting, finish_reason, schedule, token_out
from model_service.requests import FinishReason, GenerationRequest
from model_service.sampling_settings import SamplingSettings
from tests.engine.fake_engine import FakeEngine

POLICY = Policy(slots=4)


def waiting(ref: int, samples: int = 1, cost: int = 8, chunked: bool = False, ended: bool = False) -> Waiting:
    return Waiting(ref, samples, cost, chunked, ended)


def view(queue: tuple[Waiting, ...] = (), free: tuple[int, ...] = (0, 1, 2, 3), decoding: tuple[int, ...] = (),
         prefilling: tuple[int, ...] = (), ended: tuple[int, ...] = ()) -> View:
    """Occupants are named by their slot (ref = 100 + slot); `ended` lists the slots whose request ended."""
    occupants = lambda slots: tuple(Occupant(s, 100 + s, s in ended) for s in slots)  # noqa: E731
    return View(queue, frozenset(free), occupants(decoding), occupants(prefilling))


def test_with_nothing_decoding_every_waiting_request_that_fits_is_admitted_into_the_lowest_slots() -> None:
    plan = schedule(view((waiting(1), waiting(2), waiting(3)), free=(3, 1, 2)), POLICY)
    assert plan == StepPlan(admit=(Admit(1, (1,), False), Admit(2, (2,), False), Admit(3, (3,), False)))


def test_while_requests_decode_admission_stops_at_the_prompt_token_budget() -> None:
    queue = tuple(waiting(i, cost=64) for i in range(1, 4))
    plan = schedule(view(queue, free=(1, 2, 3), decoding=(0,)), Policy(slots=4, prefill_token_budget=128))
    assert [a.ref for a in plan.admit] == [1, 2]  # 64 + 64 reaches the budget


def test_while_requests_decode_one_prompt_is_admitted_even_over_the_budget() -> None:
    plan = schedule(view((waiting(1, cost=512),), free=(1,), decoding=(0,)), Policy(slots=2, prefill_token_budget=16))
    assert plan.admit == (Admit(1, (1,), False),)


def test_while_requests_decode_at_most_prefills_per_step_are_admitted() -> None:
    queue = tuple(waiting(i, cost=1) for i in range(1, 4))
    plan = schedule(view(queue, free=(1, 2, 3), decoding=(0,)), Policy(slots=4, prefills_per_step=1))
    assert [a.ref for a in plan.admit] == [1]


def test_a_request_of_n_samples_waits_for_n_free_slots_and_nothing_overtakes_it() -> None:
    plan = schedule(view((waiting(1, samples=3), waiting(2)), free=(2, 3), decoding=(0, 1)), POLICY)
    assert plan.admit == ()
    plan = schedule(view((waiting(1, samples=3), waiting(2)), free=(1, 2, 3), decoding=(0,)), POLICY)
    assert plan.admit == (Admit(1, (1, 2, 3), False),)


def test_ended_requests_leave_first_and_their_slots_serve_this_step() -> None:
    plan = schedule(view((waiting(1, ended=True), waiting(2), waiting(3)), free=(), decoding=(0, 1), prefilling=(2,),
                         ended=(0, 2)), POLICY)
    assert plan.end_decoding == (Occupant(0, 100, True),)
    assert plan.end_prefilling == (Occupant(2, 102, True),)
    assert plan.end_waiting == (waiting(1, ended=True),)
    assert plan.admit == (Admit(2, (0,), False), Admit(3, (2,), False))  # slot 1 still decodes: budget applies


def test_when_every_decoding_request_ended_the_step_admits_as_if_nothing_decoded() -> None:
    queue = tuple(waiting(i, cost=1000) for i in range(1, 4))
    plan = schedule(view(queue, free=(1, 2, 3), decoding=(0,), ended=(0,)), Policy(slots=4, prefill_token_budget=8))
    assert [a.ref for a in plan.admit] == [1, 2, 3]


def test_chunked_prefills_advance_one_chunk_each_the_new_ones_last() -> None:
    queue = (waiting(1, chunked=True, cost=4), waiting(2))
    plan = schedule(view(queue, free=(0, 3), prefilling=(2, 1), decoding=()), POLICY)
    assert plan.admit == (Admit(1, (0,), True), Admit(2, (3,), False))
    assert plan.chunk == (2, 1, 0)
    assert schedule(view(free=(), prefilling=(2, 1), ended=(1,)), POLICY).chunk == (2,)


def test_a_full_queue_with_no_free_slot_plans_nothing() -> None:
    assert schedule(view((waiting(1),), free=(), decoding=(0, 1, 2, 3)), POLICY) == StepPlan()


def test_finish_reasons_in_their_order_of_precedence() -> None:
    engine = FakeEngine()  # eos 2, context 32

    def reason(token: int, generated: int = 1, **kw: object) -> FinishReason | None:
        req = GenerationRequest("t", (5, 6), **kw)  # type: ignore[arg-type]
        return finish_reason(req, generated, token, engine.eos_id, engine.sequence_len)

    assert reason(2, max_tokens=1) is FinishReason.EOS
    assert reason(2, ignore_eos=True, max_tokens=1) is FinishReason.LENGTH
    assert reason(9, stop_token_ids=(9,), max_tokens=1) is FinishReason.STOP_TOKEN
    assert reason(9, generated=30) is FinishReason.CONTEXT_LENGTH  # 2 + 30 fills the 32-token context
    assert reason(9, generated=29) is None


def test_token_out_reports_as_many_alternatives_as_the_request_asked_for() -> None:
    out = FakeEngine()._out(np.array([40, 7]))
    assert token_out(out, 1, SamplingSettings().top_logprobs).top == ()
    assert token_out(out, 1, 2).id == 7 and token_out(out, 1, 2).top == ((7, 0.5), (8, 0.25))


def test_admissions_use_only_free_or_freed_slots_and_never_share_one() -> None:
    rng = random.Random(3)
    for _ in range(500):
        slots = list(range(8))
        rng.shuffle(slots)
        decoding, prefilling, free = slots[:3], slots[3:5], slots[5:]
        ended = tuple(s for s in decoding + prefilling if rng.random() < 0.5)
        queue = tuple(waiting(i, samples=rng.randint(1, 3), cost=rng.choice((4, 32, 64)), chunked=rng.random() < 0.3,
                              ended=rng.random() < 0.2) for i in range(rng.randint(0, 6)))
        plan = schedule(view(queue, tuple(free), tuple(decoding), tuple(prefilling), ended), Policy(8, None, 64))
        taken = [slot for a in plan.admit for slot in a.slots]
        assert len(taken) == len(set(taken)) and set(taken) <= set(free) | set(ended)
        assert all(len(a.slots) == next(w.samples for w in queue if w.ref == a.ref) for a in plan.admit)
        assert not plan.admitted & {w.ref for w in queue if w.ended}
