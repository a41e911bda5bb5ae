"""The decode-loop watchdog: a model whose decode steps stop advancing while work is pending reports
NOT_SERVING and fails its streams with UNAVAILABLE; it serves again once the steps advance again."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2

from grok.model.v1 import model_pb2, model_pb2_grpc
from model_service.loop_state import Heartbeat
from model_service.requests import SchedulerError
from model_service.server import ModelServer
from model_service.watchdog import Watchdog
from serving_common.errors import details_of
from tests.engine.conftest import LoopThread, golden_server_config
from tests.engine.fake_engine import FakeEngine
from tests.engine.test_service import _started, health_status
from tests.waiting import wait_until

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


class FakeScheduler:
    def __init__(self, beat: Heartbeat) -> None:
        self.beat = beat
        self.failed: list[SchedulerError] = []

    def heartbeat(self) -> Heartbeat:
        return self.beat

    def fail_pending(self, error: SchedulerError) -> int:
        self.failed.append(error)
        return self.beat.pending


class FakeHealth:
    def __init__(self) -> None:
        self.reports: list[bool] = []

    async def set(self, serving: bool) -> None:
        self.reports.append(serving)


def test_idle_is_not_a_stall_and_pending_work_without_progress_is() -> None:
    dog = Watchdog(FakeScheduler(Heartbeat(0, 0.0, 0, True)), FakeHealth(), lambda _: None, stall_seconds=5)
    assert dog.diagnose(Heartbeat(steps=3, at=0.0, pending=0, alive=True), now=100.0) is None
    assert dog.diagnose(Heartbeat(steps=3, at=98.0, pending=2, alive=True), now=100.0) is None
    assert "no decode step for 6.0 s with 2 request(s) pending" in str(
        dog.diagnose(Heartbeat(steps=3, at=94.0, pending=2, alive=True), now=100.0))
    assert dog.diagnose(Heartbeat(steps=3, at=100.0, pending=0, alive=False), now=100.0) == \
        "the decode loop is not running"


@pytest.fixture(scope="module")
def loop() -> Iterator[LoopThread]:
    lt = LoopThread()
    yield lt
    lt.close()


def test_a_stalled_decode_loop_is_not_serving_fails_streams_unavailable_then_recovers(loop: LoopThread) -> None:
    engine = FakeEngine(slots=2, vocab_size=512, sequence_len=128, step_delay=0.01)
    server: ModelServer = loop.run(_started(golden_server_config(slots=2, watchdog_seconds=0.5), engine))
    address = f"127.0.0.1:{server.port}"
    try:
        loop.run(server.load())
        with grpc.insecure_channel(address) as channel:
            stub = model_pb2_grpc.ModelServiceStub(channel)
            request = model_pb2.GenerateRequest(token_ids=[20], max_tokens=100, ignore_eos=True)
            stream = stub.Generate(request, timeout=30)
            next(stream)
            engine.running.clear()  # the next decode step hangs, like a wedged device
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as caught:
                for _ in stream:
                    pass
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "stopped making progress" in caught.value.details()
            assert details_of(caught.value).retry_after is not None
            assert time.monotonic() - started < 5
            assert health_status(address) == NOT_SERVING
            with pytest.raises(grpc.RpcError) as refused:  # new work is refused at once, not queued forever
                next(stub.Generate(request, timeout=5))
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE

            engine.running.set()  # the device comes back
            wait_until(lambda: health_status(address) == SERVING, 10, interval=0.05, message="never SERVING again")
            short = model_pb2.GenerateRequest(token_ids=[20], max_tokens=3, ignore_eos=True)
            assert [t for r in stub.Generate(short, timeout=10) for t in r.token_ids] == [21, 22, 23]
            # the end of a stream reaches the client before the decode thread takes its slot back
            scheduler = server.scheduler
            assert scheduler is not None
            wait_until(lambda: scheduler.stats()["free"] == 2, 10, interval=0.01, message="a slot was never freed")
    finally:
        engine.running.set()
        loop.run(server.stop(0))


def test_a_prefill_that_hangs_on_an_idle_model_is_a_stall_too(loop: LoopThread) -> None:
    engine = FakeEngine(slots=2, vocab_size=512, sequence_len=128)
    server: ModelServer = loop.run(_started(golden_server_config(slots=2, watchdog_seconds=0.5), engine))
    address = f"127.0.0.1:{server.port}"
    try:
        loop.run(server.load())
        engine.running.clear()  # the first request's prefill will hang
        with grpc.insecure_channel(address) as channel:
            stub = model_pb2_grpc.ModelServiceStub(channel)
            with pytest.raises(grpc.RpcError) as caught:
                list(stub.Generate(model_pb2.GenerateRequest(token_ids=[20], max_tokens=3), timeout=30))
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            assert health_status(address) == NOT_SERVING
            engine.running.set()
            wait_until(lambda: health_status(address) == SERVING, 10, interval=0.05, message="never SERVING again")
    finally:
        engine.running.set()
        loop.run(server.stop(0))


def test_a_busy_but_advancing_loop_is_never_flagged(loop: LoopThread) -> None:
    # Steps of 0.1 s under a watchdog of ten steps: only a loop that stops advancing could trip it, not a
    # step delayed by a busy machine.
    engine = FakeEngine(slots=2, vocab_size=512, sequence_len=128, step_delay=0.1)
    server: ModelServer = loop.run(_started(golden_server_config(slots=2, watchdog_seconds=1.0), engine))
    try:
        loop.run(server.load())
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = model_pb2_grpc.ModelServiceStub(channel)
            results: list[int] = []
            threads = [threading.Thread(target=lambda: results.append(sum(
                len(r.token_ids) for r in stub.Generate(model_pb2.GenerateRequest(
                    token_ids=[20], max_tokens=15, ignore_eos=True), timeout=30)))) for _ in range(3)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
        assert results == [15, 15, 15]  # 1.5 s each, steps of 0.1 s: slow, never stalled
    finally:
        loop.run(server.stop(0))
