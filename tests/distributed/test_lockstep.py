"""Process 0's LockstepEngine and a follower's loop, in one process over an in-memory broadcast.

The real Scheduler drives the LockstepEngine; the follower replays onto its own engine. Peer failure is
simulated at the channel: a dead peer makes the collective fail, a stalled one makes it hang.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from model_service.distributed.config import EXIT_GROUP_BROKEN, DistributedConfig
from model_service.distributed.follower import Watchdog, follow
from model_service.distributed.lockstep import GroupBroken, LockstepEngine, receive, send
from model_service.distributed.ops import Call, Codec, Op, Replica, codec_for
from model_service.requests import ErrorKind, GenerationRequest
from model_service.sampling_settings import SamplingSettings
from model_service.scheduler import Scheduler
from tests.distributed.fakes import Collector, DeadPeer, FollowerEnd, LeaderEnd, RecordingEngine, SwitchableChannel, Wire
from tests.waiting import wait_until

STEP_TIMEOUT = 1.0
KEEPALIVE = 0.2


def lockstep(engine: RecordingEngine, channel: Any, broken: list[str]) -> LockstepEngine:
    return LockstepEngine(engine, channel, step_timeout=STEP_TIMEOUT, startup_timeout=5.0,
                          keepalive_seconds=KEEPALIVE, on_broken=broken.append)


def dist_config(**kw: Any) -> DistributedConfig:
    return DistributedConfig(**{"coordinator": "127.0.0.1:1", "num_processes": 2, "process_id": 1,
                                "step_timeout": STEP_TIMEOUT, "startup_timeout": 5.0, **kw})


class FollowerThread:
    """A follower's loop on a thread, with a watchdog that records instead of ending the test process."""

    def __init__(self, engine: RecordingEngine, wire: Wire) -> None:
        self.engine = engine
        self.expired: list[int] = []
        self.watchdog = Watchdog(on_expiry=self.expired.append)
        self.code: int | None = None
        codec = codec_for(engine)
        self.thread = threading.Thread(target=self._run, args=(codec, wire), daemon=True)
        self.thread.start()

    def _run(self, codec: Codec, wire: Wire) -> None:
        self.code = follow(Replica(self.engine), FollowerEnd(wire), codec, dist_config(), self.watchdog)


@pytest.fixture()
def group() -> Iterator[tuple[Scheduler, RecordingEngine, FollowerThread, list[str]]]:
    wire, broken = Wire(), []
    leader_engine, follower_engine = RecordingEngine(slots=3), RecordingEngine(slots=3)
    follower = FollowerThread(follower_engine, wire)
    engine = lockstep(leader_engine, LeaderEnd(wire), broken)
    engine.compile_all()
    sched = Scheduler(engine, max_queue=16)
    sched.start()
    yield sched, leader_engine, follower, broken
    sched.stop()
    engine.close()
    follower.thread.join(5)


def req(prompt: tuple[int, ...], **kw: Any) -> GenerationRequest:
    return GenerationRequest(request_id=f"r{prompt}", prompt=prompt, **kw)


def test_follower_replays_every_engine_call_with_the_same_arguments(group: Any) -> None:
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
    wait_until(lambda: len(follower.engine.calls) >= len(leader_engine.calls))
    assert follower.engine.calls == leader_engine.calls
    assert broken == [] and follower.expired == []
    assert ("prefill_args", (20, 21), 7, pytest.approx(0.5), pytest.approx(0.9), (22, 23, 24), (23,), 0) \
        in follower.engine.calls
    assert ("prefill_args", (55,), 2**32 - 1, 0.0, 1.0, (), (), 0) in follower.engine.calls


def test_a_chunked_prefill_runs_on_the_follower_too_and_a_cancelled_one_is_released() -> None:
    wire, broken = Wire(), []
    leader_engine = RecordingEngine(slots=2, prefill_chunk=4, step_delay=0.01)
    follower = FollowerThread(RecordingEngine(slots=2, prefill_chunk=4, step_delay=0.01), wire)
    engine = lockstep(leader_engine, LeaderEnd(wire), broken)
    engine.compile_all()
    sched = Scheduler(engine, max_queue=4)
    sched.start()
    try:
        long, cancelled = Collector(), Collector()
        sched.submit(req(tuple(range(10, 24)), max_tokens=3, ignore_eos=True), long)  # 14 tokens: 4 chunks
        handle = sched.submit(req(tuple(range(40, 54)), max_tokens=3), cancelled)
        handle.cancel()
        assert long.done.wait(5) and long.tokens == [24, 25, 26]
        assert cancelled.done.wait(5) and cancelled.error is not None
        wait_until(lambda: sched.stats()["free"] == 2)
    finally:
        sched.stop()
        engine.close()
        follower.thread.join(5)
    assert follower.engine.calls == leader_engine.calls
    assert sum(c[0] == "chunk" for c in follower.engine.calls) >= 4 and broken == []


def test_shutdown_ends_the_follower_loop_cleanly(group: Any) -> None:
    sched, leader_engine, follower, _ = group
    sched.stop()
    sched.engine.close()
    follower.thread.join(5)
    assert follower.code == 0


def keepalives(wire: Wire) -> int:
    """NOOP headers the leader has sent so far."""
    headers = [message[0] for message in list(wire.sent) if len(message) == 1]
    return sum(1 for header in headers if header.shape == (12,) and header[0] == Op.NOOP)


def test_idle_leader_sends_keepalives_the_follower_receives() -> None:
    wire, broken = Wire(), []
    follower = FollowerThread(RecordingEngine(), wire)
    engine = lockstep(RecordingEngine(), LeaderEnd(wire), broken)
    engine.compile_all()
    wait_until(lambda: keepalives(wire) >= 2, timeout=20 * KEEPALIVE + 1, message="no keep-alives went out")
    engine.close()
    follower.thread.join(5)
    assert follower.code == 0 and follower.expired == []


def test_dead_peer_fails_the_running_request_with_unavailable_and_breaks_the_group_once() -> None:
    broken: list[str] = []
    channel = SwitchableChannel()
    engine = lockstep(RecordingEngine(slots=2, step_delay=0.05), channel, broken)
    engine.compile_all()
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
        engine.generate(None)
    sched.stop()


def test_stalled_peer_fails_the_request_with_unavailable_within_the_step_timeout() -> None:
    broken: list[str] = []
    channel = SwitchableChannel()
    engine = lockstep(RecordingEngine(slots=2, step_delay=0.05), channel, broken)
    engine.compile_all()
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
    engine.compile_all()
    channel.fail = True
    wait_until(lambda: bool(broken), timeout=4 * KEEPALIVE + 1)
    assert "NOOP" in broken[0]


def test_group_start_fails_when_a_follower_never_answers() -> None:
    broken: list[str] = []
    with pytest.raises(GroupBroken):
        lockstep(RecordingEngine(), DeadPeer(), broken).compile_all()
    assert broken and "COMPILE_ALL" in broken[0]


def test_follower_leaves_when_calls_skip_a_number() -> None:
    wire = Wire()
    follower = FollowerThread(RecordingEngine(), wire)
    codec = Codec(16, 64)
    send(LeaderEnd(wire), codec, Call(Op.NOOP, seq=0))
    send(LeaderEnd(wire), codec, Call(Op.NOOP, seq=2))
    follower.thread.join(5)
    assert follower.code == EXIT_GROUP_BROKEN


def test_follower_watchdog_fires_when_process_0_goes_silent() -> None:
    expired: list[int] = []
    watchdog = Watchdog(on_expiry=expired.append)
    watchdog.arm(0.2, "the next call")
    wait_until(lambda: expired == [EXIT_GROUP_BROKEN], timeout=2)


def test_bad_arguments_are_refused_on_process_0_and_keep_the_group_in_step(group: Any) -> None:
    sched, leader_engine, follower, broken = group
    engine = sched.engine
    with pytest.raises(ValueError, match="largest prefill bucket"):
        engine.prefill(list(range(40)), seed=0)
    done = Collector()
    sched.submit(req((7,), max_tokens=2), done)
    assert done.done.wait(5) and done.tokens == [8, 9]
    assert broken == []


def test_engine_methods_outside_the_op_table_are_refused() -> None:
    engine = lockstep(RecordingEngine(), SwitchableChannel(), [])
    assert engine.slots == 4 and engine.vocab_size == 64
    with pytest.raises(AttributeError, match="lockstep op table"):
        engine.count("generate")


def test_receive_reads_exactly_what_send_wrote() -> None:
    wire, codec = Wire(), Codec(8, 40)
    call = Call(Op.PREFILL, seq=3, prompt=(1, 2, 3), seed=5, sampling=SamplingSettings(allowed=(39,)))
    send(LeaderEnd(wire), codec, call)
    got = receive(FollowerEnd(wire), codec)
    assert got == call


def test_a_prefilled_prefix_stays_on_every_process_until_process_0_drops_it() -> None:
    wire, broken = Wire(), []
    follower_engine = RecordingEngine()
    follower = FollowerThread(follower_engine, wire)
    engine = lockstep(RecordingEngine(), LeaderEnd(wire), broken)
    engine.compile_all()
    state = engine.init_decode_state()
    ref, _ = engine.prefill([20], seed=0)
    sent = keepalives(wire)  # keep-alives go out while the scheduler still holds the prefix
    wait_until(lambda: keepalives(wire) >= sent + 2, timeout=20 * KEEPALIVE + 1, message="no keep-alives went out")
    state = engine.insert(ref, state, 0)
    del ref  # released: the next call tells the followers to drop it
    engine.free_slot(state, 0)
    engine.close()
    follower.thread.join(5)
    assert follower.code == 0 and broken == []
    assert ("insert", 0) in follower_engine.calls
