"""The scheduling policy as data: plan.schedule on hand-built snapshots, no thread, no engine."""

from __future__ import annotations

import dataclasses
import math
import random

import numpy as np

from model_service.plan import Admit, Chunk, Policy, Sample, StepPlan, View, Waiting, finish_reason, schedule, token_out
from model_service.requests import FinishReason, GenerationRequest
from model_service.sampling_settings import SamplingSettings
from tests.engine.fake_engine import FakeEngine

POLICY = Policy(max_rows=16, prefill_budget=4)


def waiting(ref: int, length: int = 5, n: int = 1, cached: int = 0, shared: int = 0, blocks: int = 1,
            ended: bool = False) -> Waiting:
    samples = (Sample((ref, 0), -1, cached, length),) + tuple(
        Sample((ref, i), -1, shared, length, after=(ref, 0), shared=shared) for i in range(1, n))
    return Waiting(ref, samples, blocks, ended)


def decoding(ref: int, slot: int, length: int = 10, **kw: object) -> Sample:
    return Sample((ref, 0), slot, length - 1, length, **kw)  # type: ignore[arg-type]


def prefilling(ref: int, slot: int, computed: int, length: int, **kw: object) -> Sample:
    return Sample((ref, 0), slot, computed, length, **kw)  # type: ignore[arg-type]


def view(queue: tuple[Waiting, ...] = (), running: tuple[Sample, ...] = (), free: tuple[int, ...] = (0, 1, 2, 3),
         blocks: int | None = None) -> View:
    return View(queue, running, frozenset(free), blocks)


def test_with_nothing_running_waiting_prompts_are_admitted_into_the_lowest_slots_and_computed_whole() -> None:
    plan = schedule(view((waiting(1), waiting(2, length=3)), free=(3, 1, 2)), POLICY)
    assert plan.admit == (Admit(1, (1,), (0,)), Admit(2, (2,), (0,)))
    assert plan.chunks == (Chunk((1, 0), 0, 5, True), Chunk((2, 0), 0, 3, True))


def test_decodes_come_first_then_prompts_within_prefill_rows() -> None:
    running = (decoding(7, 0), prefilling(8, 1, 0, 10))
    plan = schedule(view((waiting(1),), running, free=(2, 3)), POLICY)
    assert plan.chunks[0] == Chunk((7, 0), 9, 1, True)
    assert plan.chunks[1] == Chunk((8, 0), 0, 4, False)  # prefill_rows = 4 while something decodes
    assert plan.admit == ()  # no prompt rows left this step: the head waits


def test_a_prompt_gets_the_whole_step_when_nothing_decodes() -> None:
    plan = schedule(view((waiting(1, length=40),), free=(0,)), POLICY)
    assert plan.chunks == (Chunk((1, 0), 0, 16, False),)
    plan = schedule(view(running=(prefilling(1, 0, 32, 40),), free=()), POLICY)
    assert plan.chunks == (Chunk((1, 0), 32, 8, True),)


def test_a_cached_prefix_is_not_computed_again() -> None:
    plan = schedule(view((waiting(1, length=40, cached=32),), free=(0,)), POLICY)
    assert plan.chunks == (Chunk((1, 0), 32, 8, True),)


def test_the_other_samples_of_a_prompt_compute_only_their_tail_once_the_first_computed_the_shared_blocks() -> None:
    plan = schedule(view((waiting(1, length=10, n=3, shared=8),), free=(0, 1, 2)), POLICY)
    assert plan.admit == (Admit(1, (0, 1, 2), (0, 1, 2)),)
    assert plan.chunks == (Chunk((1, 0), 0, 10, True), Chunk((1, 1), 8, 2, True), Chunk((1, 2), 8, 2, True))
    # A long prompt: its first sample takes two steps; the others wait for the shared blocks.
    plan = schedule(view((waiting(1, length=30, n=2, shared=28),), free=(0, 1)), POLICY)
    assert plan.chunks == (Chunk((1, 0), 0, 16, False),)
    running = (prefilling(1, 0, 16, 30), Sample((1, 1), 1, 28, 30, after=(1, 0), shared=28))
    plan = schedule(view(running=running, free=()), POLICY)
    assert plan.chunks == (Chunk((1, 0), 16, 14, True), Chunk((1, 1), 28, 2, True))


def test_another_sample_whose_tail_is_its_last_prompt_token_waits_for_the_shared_blocks_too() -> None:
    """A 49-token prompt on 16 blocks: the other samples share 48 positions and compute one row, which looks like
    a decode row (all but the newest token computed); it must still wait until the first sample computed the 48
    (it once ran at once and read blocks not yet written: greedy samples of one prompt differed)."""
    plan = schedule(view((waiting(1, length=49, n=2, shared=48),), free=(0, 1)), POLICY)
    assert plan.chunks == (Chunk((1, 0), 0, 16, False),)
    running = (prefilling(1, 0, 16, 49), Sample((1, 1), 1, 48, 49, after=(1, 0), shared=48))
    assert schedule(view(running=running, free=()), POLICY).chunks == (Chunk((1, 0), 16, 16, False),)
    running = (prefilling(1, 0, 48, 49), Sample((1, 1), 1, 48, 49, after=(1, 0), shared=48))
    assert schedule(view(running=running, free=()), POLICY).chunks == (Chunk((1, 0), 48, 1, True),
                                                                       Chunk((1, 1), 48, 1, True))


def test_a_request_of_n_samples_waits_for_n_free_slots_and_nothing_overtakes_it() -> None:
    queue = (waiting(1, n=3), waiting(2))
    assert schedule(view(queue, free=(2, 3)), POLICY).admit == ()
    assert schedule(view(queue, free=(1, 2, 3)), POLICY).admit[0] == Admit(1, (1, 2, 3), (0, 1, 2))


def test_the_head_waits_for_kv_blocks() -> None:
    queue = (waiting(1, blocks=5), waiting(2, blocks=1))
    assert schedule(view(queue, blocks=4), POLICY).admit == ()
    assert [a.ref for a in schedule(view(queue, blocks=6), POLICY).admit] == [1, 2]


def test_ended_requests_leave_first_and_their_slots_serve_this_step() -> None:
    running = (decoding(5, 0, ended=True), decoding(6, 1))
    plan = schedule(view((waiting(1, ended=True), waiting(2)), running, free=()), POLICY)
    assert plan.end_running == ((5, 0),) and plan.end_waiting == (1,)
    assert plan.admit == (Admit(2, (0,), (0,)),)
    assert plan.chunks == (Chunk((6, 0), 9, 1, True), Chunk((2, 0), 0, 4, False))


def test_done_samples_get_no_rows() -> None:
    plan = schedule(view(running=(decoding(5, 0, done=True),), free=(1, 2, 3)), POLICY)
    assert plan == StepPlan()


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
    engine = FakeEngine()
    ids, probs = engine._alternatives(np.array([40, 7]))
    out = type("Out", (), {"token": np.array([40, 7]), "prob": np.array([0.5, 0.5]), "top_ids": ids,
                           "top_probs": probs})
    assert token_out(out, 1, SamplingSettings().top_logprobs).top == ()  # type: ignore[arg-type]
    assert token_out(out, 1, 2).id == 7 and token_out(out, 1, 2).top == ((7, 0.5), (8, 0.25))  # type: ignore


def test_random_snapshots_keep_every_invariant_of_a_step() -> None:
    rng = random.Random(3)
    for _ in range(500):
        slots = list(range(8))
        rng.shuffle(slots)
        busy, free = slots[:rng.randint(0, 8)], slots
        running = []
        for i, slot in enumerate(busy):
            length = rng.randint(2, 40)
            computed = length - 1 if rng.random() < 0.6 else rng.randint(0, length - 1)
            running.append(Sample((100 + i, 0), slot, computed, length, done=rng.random() < 0.1,
                                  ended=rng.random() < 0.2))
        free = [s for s in range(8) if s not in busy]
        queue = tuple(waiting(i, length=rng.randint(1, 40), n=rng.randint(1, 3), blocks=rng.randint(0, 6),
                              ended=rng.random() < 0.2) for i in range(rng.randint(0, 6)))
        policy = Policy(rng.choice((8, 16, 64)), rng.choice((1, 4, 32)))
        plan = schedule(View(queue, tuple(running), frozenset(free), rng.choice((None, 3, 20))), policy)
        taken = [slot for a in plan.admit for slot in a.slots]
        ended = {s.slot for s in running if s.ended}
        assert len(taken) == len(set(taken)) and set(taken) <= set(free) | ended
        assert not plan.admitted & {w.ref for w in queue if w.ended}
        assert plan.rows <= policy.max_rows
        keys = [c.key for c in plan.chunks]
        assert len(keys) == len(set(keys))  # a sample computes one run of rows per step
        live = {s.key: s for s in running if not s.ended}
        decodes = [c for c in plan.chunks if c.key in live and live[c.key].computed == live[c.key].length - 1]
        assert plan.chunks[:len(decodes)] == tuple(decodes)  # decodes first
        assert all(not live[k].done for k in keys if k in live)
        if decodes:
            assert plan.rows - len(decodes) <= max(1, policy.prefill_budget)


def test_while_decoding_later_prompt_rows_cost_more_for_the_keys_they_read() -> None:
    running = (decoding(7, 0), prefilling(8, 1, 0, 100), prefilling(9, 2, 90, 200))
    plan = schedule(view(running=running, free=()), Policy(max_rows=64, prefill_budget=20, key_scale=100))
    # rows at 0..: 1 + p/100 each -> 18 rows cost 19.53; from 90 a row costs ~1.9: the budget was spent first
    assert plan.chunks[1] == Chunk((8, 0), 0, 18, False) and len(plan.chunks) == 3
    assert plan.chunks[2].rows == 1  # one row of the last prompt at least, as the budget allows none more


def test_prompts_that_arrived_together_fill_the_step_beside_streams_that_started_after_them() -> None:
    # A burst: requests 1-3 arrived at t=0; 7 and 8 (of the same burst) began decoding at t=1, after them.
    running = (decoding(7, 0, arrived=0.0, decoding_since=1.0), decoding(8, 1, arrived=0.0, decoding_since=1.0))
    queue = (Waiting(1, waiting(1, length=10).samples, 1, arrived=0.0), Waiting(2, waiting(2, length=10).samples, 1,
                                                                            arrived=0.0))
    plan = schedule(view(queue, running, free=(2, 3)), POLICY)
    assert [c.rows for c in plan.chunks] == [1, 1, 10, 4]  # every row of the step, not prefill_budget = 4


def test_a_prompt_arriving_after_streams_began_decoding_is_paced() -> None:
    running = (decoding(7, 0, arrived=0.0, decoding_since=1.0), prefilling(9, 1, 0, 40, arrived=2.0))
    plan = schedule(view(running=running, free=(2, 3)), POLICY)
    assert [c.rows for c in plan.chunks] == [1, 4]  # prefill_budget = 4: stream 7 was there first
    # The same prompt beside a stream that started after it arrived: not held back.
    running = (decoding(7, 0, arrived=0.0, decoding_since=3.0), prefilling(9, 1, 0, 40, arrived=2.0))
    assert [c.rows for c in schedule(view(running=running, free=(2, 3)), POLICY).chunks] == [1, 15]


def burst(decoding_streams: int, waiting_prompts: int, drawn: tuple[int, ...] = ()) -> View:
    """A burst that arrived at t=0: `decoding_streams` of it decode since t=1 (stream i has drawn drawn[i]),
    `waiting_prompts` 8-token prompts of it still wait."""
    running = tuple(decoding(100 + i, i, arrived=0.0, decoding_since=1.0, drawn=drawn[i] if drawn else 1)
                    for i in range(decoding_streams))
    queue = tuple(Waiting(i, waiting(i, length=8).samples, 1, arrived=0.0) for i in range(waiting_prompts))
    return view(queue, running, free=tuple(range(decoding_streams, 64)))


def test_in_a_burst_waiting_prompts_keep_half_the_step_however_many_of_it_decode() -> None:
    """Issue 64.7: decodes used to come first, so as a burst's streams began decoding its waiting prompts got
    fewer rows every step and its tail's first token came after its head had finished. Prompts of the burst
    now keep half the step's rows; the decodes that fit are those of the streams that drew least."""
    policy = Policy(max_rows=16, prefill_budget=4)
    plan = schedule(burst(12, 3, drawn=(5, 1, 4, 2, 9, 3, 1, 8, 7, 6, 2, 1)), policy)
    decoded = [c.key[0] - 100 for c in plan.chunks if c.key[0] >= 100]
    assert sorted(decoded) == [0, 1, 2, 3, 5, 6, 10, 11]  # 8 rows: the streams that drew 1, 1, 1, 2, 2, 3, 4, 5
    assert plan.rows == 16 and [a.ref for a in plan.admit] == [0]
    assert sum(c.rows for c in plan.chunks if c.key[0] < 100) == 8


def test_rows_the_burst_prompts_leave_go_back_to_the_deferred_decodes() -> None:
    policy = Policy(max_rows=16, prefill_budget=4)
    plan = schedule(burst(12, 0), policy)  # nothing waits: every stream decodes
    assert len(plan.chunks) == 12
    plan = schedule(burst(14, 1), policy)  # one 8-row prompt: 8 rows reserved, 6 decodes deferred, 0 left
    assert plan.rows == 16 and sum(c.rows for c in plan.chunks if c.key[0] < 100) == 8
    head = schedule(View(burst(14, 1).waiting, burst(14, 1).running, frozenset(), None), policy)  # no free slot
    assert head.admit == () and len(head.chunks) == 14  # the prompt cannot enter: its rows go to the decodes


def test_streams_that_were_decoding_before_the_prompts_arrived_keep_decoding_first() -> None:
    running = tuple(decoding(100 + i, i, arrived=0.0, decoding_since=1.0) for i in range(14))
    queue = (Waiting(1, waiting(1, length=8).samples, 1, arrived=2.0),)
    plan = schedule(view(queue, running, free=(20,)), Policy(max_rows=16, prefill_budget=4))
    assert len([c for c in plan.chunks if c.key[0] >= 100]) == 14  # paced: the prompt gets the rest only


def test_a_request_of_more_samples_than_slots_is_admitted_as_far_as_slots_and_blocks_allow() -> None:
    """Issue 65.8: its first samples take the free slots, the rest stay at the head of the queue."""
    many = Waiting(1, waiting(1, length=10, n=6, shared=8).samples, 12, each=(3,) + (1,) * 5)
    policy = Policy(max_rows=32, prefill_budget=4, slots=4)
    plan = schedule(view((many, waiting(2)), free=(0, 2, 3)), policy)
    assert plan.admit == (Admit(1, (0, 2, 3), (0, 1, 2), rest=True),)
    assert schedule(view((many, waiting(2)), free=(0, 2, 3), blocks=4), policy).admit == (
        Admit(1, (0, 2), (0, 1), rest=True),)
    assert schedule(view((many,), free=(0, 2, 3), blocks=2), policy).admit == ()  # not even its first sample
    # No more samples than slots: it waits for all of them (they share one prefill).
    few = Waiting(1, waiting(1, length=10, n=3, shared=8).samples, 5, each=(3, 1, 1))
    assert schedule(view((few,), free=(0, 2)), policy).admit == ()


def streams_and_prompts(streams: int, prompts: int, length: int = 8) -> View:
    """`streams` decoding since t=1, `prompts` waiting that arrived at t=2 (paced: the streams came first)."""
    running = tuple(decoding(100 + i, i, arrived=0.0, decoding_since=1.0) for i in range(streams))
    queue = tuple(Waiting(i, waiting(i, length=length).samples, 1, arrived=2.0) for i in range(prompts))
    return view(queue, running, free=tuple(range(streams, 64)))


def test_paced_prompts_take_the_rows_up_to_the_bucket_the_step_runs_anyway() -> None:
    """A mixed step on an accelerator runs the least compiled row bucket holding its rows, padded: 8 decodes and 4
    paced prompt rows run the 16-row program, so the prompt takes the 4 padding rows too; without buckets (CPU)
    the step keeps to the paced budget."""
    plain = schedule(streams_and_prompts(8, 4), Policy(max_rows=64, prefill_budget=4))
    assert plain.rows == 12 and plain.chunks[8:] == (Chunk((0, 0), 0, 4, False),)
    filled = schedule(streams_and_prompts(8, 4), Policy(max_rows=64, prefill_budget=4, buckets=(16, 32, 64)))
    assert filled.rows == 16 and filled.chunks[:8] == plain.chunks[:8]
    assert filled.chunks[8:] == (Chunk((0, 0), 0, 8, True),) and [a.ref for a in filled.admit] == [0]


def test_the_bucket_fill_continues_the_paced_prompts_and_admits_from_the_queue_in_order() -> None:
    # 8 decodes + 10 paced rows (prompt 0 whole, 2 rows of prompt 1) = 18 rows: the 32-row program; its 14 more
    # rows finish prompt 1 (one chunk of 8) and take prompt 2 whole; prompt 3 waits for the next step.
    plan = schedule(streams_and_prompts(8, 4), Policy(max_rows=64, prefill_budget=10, buckets=(16, 32, 64)))
    assert plan.rows == 32
    assert plan.chunks[8:] == (Chunk((0, 0), 0, 8, True), Chunk((1, 0), 0, 8, True), Chunk((2, 0), 0, 8, True))
    assert [a.ref for a in plan.admit] == [0, 1, 2] and [a.slots for a in plan.admit] == [(8,), (9,), (10,)]


def test_the_bucket_fill_gives_a_long_prompts_dear_rows_nothing_beyond_their_cost() -> None:
    # Rows at position 1,000 cost 11 row-equivalents each (key_scale 100): the padding's 3 rows hold none of them.
    running = (tuple(decoding(100 + i, i, arrived=0.0, decoding_since=1.0) for i in range(12))
               + (prefilling(9, 12, 1000, 2000, arrived=2.0),))
    policy = Policy(max_rows=64, prefill_budget=4, key_scale=100, buckets=(16, 32, 64))
    plan = schedule(view(running=running, free=(20,)), policy)
    assert plan.chunks[12:] == (Chunk((9, 0), 1000, 1, False),) and plan.rows == 13
    short = (prefilling(8, 13, 0, 40, arrived=2.0),)  # a short prompt after it still takes the cheap rows
    plan = schedule(view(running=running + short, free=(20,)), policy)
    # its rows at 0, 1, 2 cost 1, 1.01, 1.02: two fit the 3 padding rows' row-equivalents
    assert plan.chunks[12:] == (Chunk((9, 0), 1000, 1, False), Chunk((8, 0), 0, 2, False)) and plan.rows == 15


def test_random_snapshots_with_buckets_extend_the_plan_without_buckets_up_to_its_bucket() -> None:
    rng = random.Random(5)
    for _ in range(500):
        streams = rng.randint(0, 12)
        running = [decoding(100 + i, i, arrived=0.0, decoding_since=1.0) for i in range(streams)]
        running += [prefilling(200 + i, 20 + i, rng.randint(0, 30), rng.randint(31, 60), arrived=2.0)
                    for i in range(rng.randint(0, 2))]
        queue = tuple(Waiting(i, waiting(i, length=rng.randint(1, 40), n=rng.randint(1, 2)).samples[:1],
                              rng.randint(0, 3), arrived=2.0) for i in range(rng.randint(0, 5)))
        v = View(queue, tuple(running), frozenset(range(40, 48)), rng.choice((None, 2, 20)))
        base = Policy(rng.choice((32, 64)), rng.choice((1, 4, 16)), key_scale=rng.choice((math.inf, 50.0)))
        buckets = (8, 16, 32, base.max_rows)
        plain, filled = schedule(v, base), schedule(v, dataclasses.replace(base, buckets=buckets))
        assert plain.rows <= filled.rows <= max(plain.rows, next(b for b in buckets if b >= plain.rows))
        assert filled.admit[:len(plain.admit)] == plain.admit
        extended = {c.key: c for c in filled.chunks}
        for c in plain.chunks:  # every chunk of the plain plan, from the same start, at least as long
            assert extended[c.key].start == c.start and extended[c.key].rows >= c.rows
        taken = [slot for a in filled.admit for slot in a.slots]
        assert len(taken) == len(set(taken)) and set(taken) <= set(range(40, 48))
        if v.free_blocks is not None:
            assert sum(w.blocks for w in queue if w.ref in filled.admitted) <= v.free_blocks
