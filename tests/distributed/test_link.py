"""The lockstep link (model_service/distributed/link.py) over real sockets on 127.0.0.1, in one process: a
dict stands in for jax.distributed's coordination service."""

from __future__ import annotations

import concurrent.futures
import socket
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from model_service.distributed.link import (
    ADDRESS_KEY,
    FollowerLink,
    LeaderLink,
    LinkError,
    connect_follower,
    open_leader,
)
from model_service.distributed.lockstep import LockstepEngine, receive, send
from model_service.distributed.ops import Call, Op, codec_for
from model_service.scheduler import Scheduler
from model_service.step_batch import SlotStart, StepBatch
from model_service.sampling_settings import SamplingSettings
from tests.distributed.fakes import Collector, RecordingEngine, same_batch
from tests.distributed.test_lockstep import FollowerThreadOn, req
from tests.waiting import wait_until

COORDINATOR = "127.0.0.1:1"  # only its host is used


class Store:
    """key_value_set / blocking_key_value_get over a dict, as the coordination client offers them."""

    def __init__(self) -> None:
        self.values: dict[str, str] = {}
        self.cond = threading.Condition()

    def key_value_set(self, key: str, value: str) -> None:
        with self.cond:
            self.values[key] = value
            self.cond.notify_all()

    def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str:
        with self.cond:
            if not self.cond.wait_for(lambda: key in self.values, timeout_in_ms / 1000):
                raise TimeoutError(key)
            return self.values[key]


def open_group(followers: int = 1) -> tuple[LeaderLink, list[FollowerLink]]:
    store = Store()
    with concurrent.futures.ThreadPoolExecutor(followers + 1) as pool:
        leader = pool.submit(open_leader, store, COORDINATOR, followers + 1, 10.0)
        ends = [pool.submit(connect_follower, store, COORDINATOR, pid, 10.0) for pid in range(1, followers + 1)]
        return leader.result(), [end.result() for end in ends]


@pytest.fixture()
def link() -> Iterator[tuple[LeaderLink, list[FollowerLink]]]:
    leader, followers = open_group(2)
    yield leader, followers
    leader.close()
    for end in followers:
        end.close()


def test_every_follower_reads_exactly_what_process_0_sent(link: tuple[LeaderLink, list[FollowerLink]]) -> None:
    leader, followers = link
    engine = RecordingEngine(slots=2, vocab_size=40)
    codec = codec_for(engine)
    tables = np.arange(2 * engine.table_len, dtype=np.int32).reshape(2, -1)
    batch = StepBatch(np.arange(16, dtype=np.int32), np.arange(16) % 3 == 0, np.arange(16, dtype=np.int32),
                      np.zeros(16, np.int32), 9, tables, np.array([8, 3], np.int32), np.array([1, 2], np.int32),
                      starts=(SlotStart(1, 2**32 - 1, SamplingSettings(temperature=0.3, allowed=(39,)), (1, 2), (9,)),))
    for seq in range(3):  # several calls back to back: the stream keeps its message boundaries
        send(leader, codec, Call(Op.STEP, seq=seq, batch=batch))
    send(leader, codec, Call(Op.NOOP, seq=3))
    for end in followers:
        for seq in range(3):
            got = receive(end, codec)
            assert got.seq == seq and got.batch is not None and same_batch(got.batch, batch)
        assert receive(end, codec) == Call(Op.NOOP, 3)


def test_a_connection_without_the_groups_token_is_refused() -> None:
    store = Store()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        opening = pool.submit(open_leader, store, COORDINATOR, 2, 10.0)
        port = int(wait_until(lambda: store.values.get(ADDRESS_KEY)).partition("/")[0])
        stranger = socket.create_connection(("127.0.0.1", port))
        stranger.sendall(b"0" * 32 + (1).to_bytes(4, "little"))
        follower = connect_follower(store, COORDINATOR, 1, 10.0)
        leader = opening.result(10)
    stranger.settimeout(5)
    assert stranger.recv(1) == b""  # closed by process 0
    leader.broadcast((np.arange(3, dtype=np.int32),))
    assert follower.broadcast((np.zeros(3, np.int32),))[0].tolist() == [0, 1, 2]
    for end in (stranger, leader, follower):
        end.close()


def test_process_0_gives_up_on_a_follower_that_never_connects() -> None:
    with pytest.raises(LinkError, match=r"followers \[1\] did not connect"):
        open_leader(Store(), COORDINATOR, 2, 0.3)


def test_a_follower_sees_process_0_leave() -> None:
    leader, (follower,) = open_group()
    leader.close()
    with pytest.raises(LinkError, match="closed"):
        follower.broadcast((np.zeros(4, np.int32),))


def test_process_0_sees_a_follower_leave() -> None:
    leader, (follower,) = open_group()
    follower.close()
    with pytest.raises(LinkError, match="follower 1"):
        for _ in range(100):  # the first writes may still land in the kernel's buffer
            leader.broadcast((np.zeros(4096, np.int32),))


def test_a_message_of_the_wrong_size_is_refused() -> None:
    leader, (follower,) = open_group()
    leader.broadcast((np.zeros(5, np.int32),))
    with pytest.raises(LinkError, match="20 bytes where 16 were expected"):
        follower.broadcast((np.zeros(4, np.int32),))


def test_a_scheduler_on_process_0_drives_a_follower_over_the_link() -> None:
    leader, (end,) = open_group()
    leader_engine, follower = RecordingEngine(slots=3), FollowerThreadOn(RecordingEngine(slots=3), end)
    broken: list[str] = []
    engine = LockstepEngine(leader_engine, leader, step_timeout=2.0, startup_timeout=5.0, keepalive_seconds=0.5,
                            on_broken=broken.append)
    engine.compile()
    sched = Scheduler(engine, max_queue=8)
    sched.start()
    outs = [Collector() for _ in range(3)]
    for prompt, out in zip(((20, 21), (30,), (40, 41, 42)), outs):
        sched.submit(req(prompt, max_tokens=4, ignore_eos=True), out)
    for out in outs:
        assert out.done.wait(5)
    assert [out.tokens for out in outs] == [[22, 23, 24, 25], [31, 32, 33, 34], [43, 44, 45, 46]]
    sched.stop()
    engine.close()
    follower.thread.join(5)
    assert follower.code == 0 and broken == []
    assert len(follower.engine.steps) == len(leader_engine.steps) and all(
        same_batch(a, b) for a, b in zip(leader_engine.steps, follower.engine.steps))
