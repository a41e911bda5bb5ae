"""Process 0's LockstepEngine and a follower's loop, in one process over an in-memory broadcast.

The real Scheduler drives the LockstepEngine; the follower replays onto its own engine. Peer failure is
simulated at the channel: a dead peer makes the collective fail, a stalled one makes it hang.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from model_service.distributed.config import EXIT_GROUP_BROKEN, DistributedConfig
from model_service.distributed.follower import Watchdog, follow
from model_service.distributed.lockstep import GroupBroken, LockstepEngine, receive, send
from model_service.distributed.ops import HEADER_SIZE, Call, Codec, Op, Replica, codec_for
from model_service.requests import ErrorKind, GenerationRequest
from model_service.sampling_settings import SamplingSettings
from model_service.scheduler import Scheduler
from model_service.step_batch import SlotStart, StepBatch
from tests.distributed.fakes import (
    Collector,
    DeadPeer,
    FollowerEnd,
    GatedEngine,
    GatedPending,
    LeaderEnd,
    RecordingEngine,
    SwitchableChannel,
    Wire,
    same_batch,
)
from tests.waiting import wait_until

STEP_TIMEOUT = 1.0
KEEPALIVE = 0.2


def lockstep(engine: RecordingEngine, channel: Any, broken: list[str]) -> LockstepEngine:
    return LockstepEngine(engine, channel, step_timeout=STEP_TIMEOUT, startup_timeout=5.0,
                          keepalive_seconds=KEEPALIVE, on_broken=broken.append)


def dist_config(**kw: Any) -> DistributedConfig:
    return DistributedConfig(**{"coordinator": "127.0.0.1:1", "num_processes": 2, "process_id": 1,
                                "step_timeout": STEP_TIMEOUT, "startup_timeout": 5.0, **kw})


class FollowerThreadOn:
    """A follower's loop on a thread over `channel`, with a watchdog that records instead of ending the test
    process."""

    def __init__(self, engine: RecordingEngine, channel: Any) -> None:
        self.engine = engine
        self.expired: list[int] = []
        self.watchdog = Watchdog(on_expiry=self.expired.append)
        self.code: int | None = None
        codec = codec_for(engine)
        self.thread = threading.Thread(target=self._run, args=(codec, channel), daemon=True)
        self.thread.start()

    def _run(self, codec: Codec, channel: Any) -> None:
        self.code = follow(Replica(self.engine), channel, codec, dist_config(), self.watchdog)


class FollowerThread(FollowerThreadOn):
    """A follower over the in-memory wire."""

    def __init__(self, engine: RecordingEngine, wire: Wire) -> None:
        super().__init__(engine, FollowerEnd(wire))


@pytest.fixture()
def group() -> Iterator[tuple[Scheduler, RecordingEngine, FollowerThread, list[str]]]:
    wire, broken = Wire(), []
    leader_engine, follower_engine = RecordingEngine(slots=3), RecordingEngine(slots=3)
    follower = FollowerThread(follower_engine, wire)
    engine = lockstep(leader_engine, LeaderEnd(wire), broken)
    engine.compile()
    sched = Scheduler(engine, max_queue=16)
    sched.start()
    yield sched, leader_engine, follower, broken
    sched.stop()
    engine.close()
    follower.thread.join(5)


def req(prompt: tuple[int, ...], **kw: Any) -> GenerationRequest:
    return GenerationRequest(request_id=f"r{prompt}", prompt=prompt, **kw)


def followed(leader: RecordingEngine, follower: FollowerThread) -> bool:
    """The follower ran exactly the leader's steps (wait until it caught up first)."""
    wait_until(lambda: len(follower.engine.steps) >= len(leader.steps))
    return len(follower.engine.steps) == len(leader.steps) and all(
        same_batch(a, b) for a, b in zip(leader.steps, follower.engine.steps))


def test_follower_runs_every_step_with_the_same_batch(group: Any) -> None:
    sched, leader_engine, follower, broken = group
    outs = [Collector() for _ in range(5)]
    sampling = SamplingSettings(temperature=0.5, top_p=0.9, allowed=(22, 23, 24), blocked=(23,))
    requests = [req((20, 21), sampling=sampling, max_tokens=4, seed=7),
                req((30,), max_tokens=1), req((40, 41, 42), max_tokens=6, ignore_eos=True),
                req((50,), max_tokens=3), req((55,), max_tokens=2, seed=2**32 - 1)]
    for r, c in zip(requests, outs):
        sched.submit(r, c)
    for c in outs:
        assert c.done.wait(5)
    assert [c.tokens for c in outs] == [[22, 23, 24, 25], [31], [43, 44, 45, 46, 47, 48], [51, 52, 53], [56, 57]]
    sched.stop()
    assert followed(leader_engine, follower)
    assert broken == [] and follower.expired == []
    starts = [st for b in follower.engine.steps for st in b.starts]
    first = next(st for st in starts if st.prompt == (20, 21))
    assert first.seed == 7 and first.settings.temperature == pytest.approx(0.5)
    assert first.settings.top_p == pytest.approx(0.9) and set(first.settings.allowed) == {22, 23, 24}
    assert next(st for st in starts if st.prompt == (55,)).seed == 2**32 - 1


def test_a_long_prompt_runs_on_the_follower_too_and_a_cancelled_one_frees_its_blocks() -> None:
    wire, broken = Wire(), []
    leader_engine = RecordingEngine(slots=2, max_rows=4, step_delay=0.01)
    follower = FollowerThread(RecordingEngine(slots=2, max_rows=4, step_delay=0.01), wire)
    engine = lockstep(leader_engine, LeaderEnd(wire), broken)
    engine.compile()
    sched = Scheduler(engine, max_queue=4)
    sched.start()
    try:
        long, cancelled = Collector(), Collector()
        sched.submit(req(tuple(range(10, 24)), max_tokens=3, ignore_eos=True), long)  # 14 tokens: 4 steps of 4
        handle = sched.submit(req(tuple(range(40, 54)), max_tokens=3), cancelled)
        handle.cancel()
        assert long.done.wait(5) and long.tokens == [24, 25, 26]
        assert cancelled.done.wait(5) and cancelled.error is not None
        wait_until(lambda: sched.stats()["free"] == 2 and sched.kv.usage().used == 0)
    finally:
        sched.stop()
        engine.close()
        follower.thread.join(5)
    assert followed(leader_engine, follower)
    assert len(follower.engine.steps) >= 6 and broken == []


def test_shutdown_ends_the_follower_loop_cleanly(group: Any) -> None:
    sched, leader_engine, follower, _ = group
    sched.stop()
    sched.engine.close()
    follower.thread.join(5)
    assert follower.code == 0


def keepalives(wire: Wire) -> int:
    """NOOP calls the leader has sent so far (each a first message: the header, then zeros)."""
    firsts = [message[0] for message in list(wire.sent) if len(message) == 1 and message[0].ndim == 1]
    return sum(1 for first in firsts if first.shape[0] >= HEADER_SIZE and first[0] == Op.NOOP)


def test_idle_leader_sends_keepalives_the_follower_receives() -> None:
    wire, broken = Wire(), []
    follower = FollowerThread(RecordingEngine(), wire)
    engine = lockstep(RecordingEngine(), LeaderEnd(wire), broken)
    engine.compile()
    wait_until(lambda: keepalives(wire) >= 2, timeout=20 * KEEPALIVE + 1, message="no keep-alives went out")
    engine.close()
    follower.thread.join(5)
    assert follower.code == 0 and follower.expired == []


def test_dead_peer_fails_the_running_request_with_unavailable_and_breaks_the_group_once() -> None:
    broken: list[str] = []
    channel = SwitchableChannel()
    engine = lockstep(RecordingEngine(slots=2, step_delay=0.05), channel, broken)
    engine.compile()
    sched = Scheduler(engine, max_queue=4)
    sched.start()
    running, queued = Collector(), Collector()
    sched.submit(req((14,), max_tokens=25, ignore_eos=True), running)
    wait_until(lambda: len(running.tokens) >= 2)
    channel.fail = True
    assert running.done.wait(5)
    assert running.error is not None and running.error.kind is ErrorKind.UNAVAILABLE
    assert "lost a process of its group" in running.error.message and "retry" in running.error.message
    assert len(broken) == 1 and "Connection reset" in broken[0]
    with pytest.raises(GroupBroken):
        engine.init_state()
    sched.stop()


def test_stalled_peer_fails_the_request_with_unavailable_within_the_step_timeout() -> None:
    broken: list[str] = []
    channel = SwitchableChannel()
    engine = lockstep(RecordingEngine(slots=2, step_delay=0.05), channel, broken)
    engine.compile()
    sched = Scheduler(engine, max_queue=4)
    sched.start()
    running = Collector()
    sched.submit(req((14,), max_tokens=25, ignore_eos=True), running)
    wait_until(lambda: len(running.tokens) >= 2)
    channel.stall.set()
    stalled_at = time.monotonic()
    assert running.done.wait(STEP_TIMEOUT + 3)
    assert time.monotonic() - stalled_at < STEP_TIMEOUT + 1.5
    assert running.error is not None and running.error.kind is ErrorKind.UNAVAILABLE
    assert broken and "stalled" in broken[0]
    sched.stop()


def test_a_peer_lost_while_idle_is_noticed_by_the_keepalive() -> None:
    broken: list[str] = []
    channel = SwitchableChannel()
    engine = lockstep(RecordingEngine(), channel, broken)
    engine.compile()
    channel.fail = True
    wait_until(lambda: bool(broken), timeout=4 * KEEPALIVE + 1)
    assert "NOOP" in broken[0]


def test_group_start_fails_when_a_follower_never_answers() -> None:
    broken: list[str] = []
    with pytest.raises(GroupBroken):
        lockstep(RecordingEngine(), DeadPeer(), broken).compile()
    assert broken and "COMPILE" in broken[0]


def test_follower_leaves_when_calls_skip_a_number() -> None:
    wire = Wire()
    follower = FollowerThread(RecordingEngine(), wire)
    codec = codec_for(RecordingEngine())
    send(LeaderEnd(wire), codec, Call(Op.NOOP, seq=0))
    send(LeaderEnd(wire), codec, Call(Op.NOOP, seq=2))
    follower.thread.join(5)
    assert follower.code == EXIT_GROUP_BROKEN


def test_follower_watchdog_fires_when_process_0_goes_silent() -> None:
    expired: list[int] = []
    watchdog = Watchdog(on_expiry=expired.append)
    watchdog.arm(0.2, "the next call")
    wait_until(lambda: expired == [EXIT_GROUP_BROKEN], timeout=2)


def test_a_batch_that_cannot_be_encoded_is_refused_on_process_0_and_keeps_the_group_in_step(group: Any) -> None:
    sched, leader_engine, follower, broken = group
    engine = sched.engine
    from model_service.step_batch import SlotStart, empty_batch

    tables = np.zeros((engine.slots, engine.table_len), np.int32)
    too_long = SlotStart(0, 0, SamplingSettings(), tuple(range(engine.sequence_len + 1)))
    batch = dataclasses.replace(empty_batch(engine.max_rows, engine.max_samples, tables), starts=(too_long,))
    with pytest.raises(ValueError, match="at most"):
        engine.step(sched._state, batch)
    done = Collector()
    sched.submit(req((7,), max_tokens=2), done)
    assert done.done.wait(5) and done.tokens == [8, 9]
    assert broken == []


def test_engine_methods_outside_the_op_table_are_refused() -> None:
    engine = lockstep(RecordingEngine(), SwitchableChannel(), [])
    assert engine.slots == 4 and engine.vocab_size == 64
    with pytest.raises(AttributeError, match="lockstep op table"):
        engine.prompt_rows()


def test_receive_reads_exactly_what_send_wrote() -> None:
    wire, engine = Wire(), RecordingEngine(slots=2, vocab_size=40)
    codec = codec_for(engine)
    tables = np.arange(2 * engine.table_len, dtype=np.int32).reshape(2, -1)
    mask = np.zeros(40, bool)
    mask[[3, 39]] = True
    batch = StepBatch(np.arange(16, dtype=np.int32), np.arange(16) % 3 == 0, np.arange(16, dtype=np.int32) * 2,
                      np.arange(16, dtype=np.int32) % 2, 9, tables, np.array([8, 3], np.int32),
                      np.array([1, 2], np.int32), np.arange(16) < 5, np.arange(16, dtype=np.int32) + 1,
                      (SlotStart(1, 2**32 - 1, SamplingSettings(temperature=0.3, allowed=(39,), logit_bias=((4, -1.5),)),
                                 (1, 2, 3), (9, 8)),), ((1, mask),))
    send(LeaderEnd(wire), codec, Call(Op.STEP, seq=3, batch=batch))
    got = receive(FollowerEnd(wire), codec)
    assert got.op == Op.STEP and got.seq == 3 and got.batch is not None and same_batch(got.batch, batch)


def test_a_decode_step_is_one_broadcast_and_a_step_that_starts_a_slot_two() -> None:
    """The header travels with the parts every step has; only starts, masks, scores and drafts add a message."""
    wire, engine = Wire(), RecordingEngine(slots=2, vocab_size=40)
    codec = codec_for(engine)
    tables = np.arange(2 * engine.table_len, dtype=np.int32).reshape(2, -1)
    decode = StepBatch(np.arange(16, dtype=np.int32), np.arange(16) % 2 == 0, np.arange(16, dtype=np.int32),
                       np.zeros(16, np.int32), 2, tables, np.array([0, 1], np.int32), np.array([0, 1], np.int32))
    start = dataclasses.replace(decode, starts=(SlotStart(1, 7, SamplingSettings(), (1, 2), ()),))
    for batch, messages in ((decode, 1), (start, 2)):
        before = len(wire.sent)
        send(LeaderEnd(wire), codec, Call(Op.STEP, seq=1, batch=batch))
        got = receive(FollowerEnd(wire), codec)
        assert len(wire.sent) - before == messages
        assert got.batch is not None and same_batch(got.batch, batch)
    send(LeaderEnd(wire), codec, Call(Op.NOOP, seq=3))
    assert receive(FollowerEnd(wire), codec) == Call(Op.NOOP, 3) and len(wire.sent[-1]) == 1


def decode_batch(engine: RecordingEngine) -> StepBatch:
    from model_service.step_batch import empty_batch

    return empty_batch(engine.max_rows, engine.max_samples, np.zeros((engine.slots, engine.table_len), np.int32))


def test_process_0_dispatches_steps_without_waiting_for_them_to_finish() -> None:
    """As on one process, the scheduler dispatches the next step while this one runs; only get() waits."""
    wire, broken = Wire(), []
    inner = GatedEngine()
    engine = lockstep(inner, LeaderEnd(wire), broken)
    engine.compile()
    state = engine.init_state()
    began = time.monotonic()
    state, first = engine.step(state, decode_batch(inner))
    state, second = engine.step(state, decode_batch(inner))
    assert time.monotonic() - began < STEP_TIMEOUT / 2 and len(inner.steps) == 2
    inner.gate.set()
    assert first.get().token.shape == second.get().token.shape == (inner.max_samples,)
    assert broken == []
    engine.close()


def test_a_dispatched_step_that_never_finishes_breaks_the_group_within_the_step_timeout() -> None:
    broken: list[str] = []
    inner = GatedEngine()
    engine = lockstep(inner, SwitchableChannel(), broken)
    engine.compile()
    _, pending = engine.step(engine.init_state(), decode_batch(inner))
    began = time.monotonic()
    with pytest.raises(GroupBroken):
        pending.get()
    assert STEP_TIMEOUT - 0.1 < time.monotonic() - began < STEP_TIMEOUT + 1
    assert len(broken) == 1 and "STEP 2 did not finish" in broken[0] and "stalled" in broken[0]
    inner.gate.set()


def test_a_follower_dispatches_the_next_step_while_its_last_one_still_runs() -> None:
    wire = Wire()
    follower = FollowerThread(GatedEngine(), wire)
    codec, leader = codec_for(follower.engine), LeaderEnd(wire)
    batch = decode_batch(follower.engine)
    for seq, op in enumerate((Op.INIT, Op.STEP, Op.STEP)):
        send(leader, codec, Call(op, seq=seq, batch=batch if op == Op.STEP else None))
    wait_until(lambda: len(follower.engine.steps) == 2, message="the follower waited for its first step")
    follower.engine.gate.set()
    send(leader, codec, Call(Op.SHUTDOWN, seq=3))
    follower.thread.join(5)
    assert follower.code == 0 and follower.expired == []


def test_a_follower_whose_step_fails_at_run_time_leaves_the_group() -> None:
    import jax

    class Failing(GatedPending):
        def get(self) -> Any:
            raise jax.errors.JaxRuntimeError("gloo: connection closed by peer")

    wire = Wire()
    follower = FollowerThread(GatedEngine(), wire)
    follower.engine.step = lambda state, batch: (state, Failing(None, follower.engine.gate))  # type: ignore[method-assign]
    codec, leader = codec_for(follower.engine), LeaderEnd(wire)
    batch = decode_batch(follower.engine)
    for seq, op in enumerate((Op.INIT, Op.STEP, Op.NOOP)):
        send(leader, codec, Call(op, seq=seq, batch=batch if op == Op.STEP else None))
    follower.thread.join(5)
    assert follower.code == EXIT_GROUP_BROKEN
