"""The gateway's requests to a model replica share one GenerateMany stream (gateway.model_streams); a replica
without GenerateMany (an older version) gets a Generate call per request, and `--model-streams 0` asks for
that; cancellation and deadlines stay per request."""

from __future__ import annotations

import asyncio
import concurrent.futures
import pathlib

import grpc
import pytest

from gateway.client import GatewayClient
from gateway.model_streams import single_address
from tests.gateway.conftest import Stack, fake_stack
from tests.gateway.test_gateway import outcome_of, outcomes
from tests.waiting import wait_until


def streams_opened(stack: Stack) -> int:
    return sum(r.get("msg") == "many stream opened" for r in stack.models[0].log_records())


def complete_many(stack: Stack, count: int) -> list[str]:
    with GatewayClient(stack.address, timeout=30) as client, concurrent.futures.ThreadPoolExecutor(count) as pool:
        return list(pool.map(lambda i: client.complete(f"p|r{i}", max_tokens=2).text, range(count)))


def test_concurrent_requests_share_one_stream(tmp_path: pathlib.Path) -> None:
    stack = fake_stack(tmp_path, [["--delay", "0.02"]])
    try:
        assert complete_many(stack, 6) == [f"r{i}" for i in range(6)]
        assert streams_opened(stack) == 1
        assert outcomes(stack).count("finished") == 6
    finally:
        stack.stop()


@pytest.mark.parametrize("setting", ["legacy replica", "--model-streams 0"])
def test_a_call_per_request_when_asked_or_when_the_replica_is_older(tmp_path: pathlib.Path, setting: str) -> None:
    legacy = setting == "legacy replica"
    stack = fake_stack(tmp_path, [["--legacy"] if legacy else []], *([] if legacy else ["--model-streams", "0"]))
    try:
        assert complete_many(stack, 3) == ["r0", "r1", "r2"]
        assert streams_opened(stack) == 0
    finally:
        stack.stop()


def test_a_cancelled_or_late_request_on_the_stream_is_cancelled_alone(tmp_path: pathlib.Path) -> None:
    """A client's deadline ends its request at the model (cancel message) while the request beside it on the same
    stream finishes."""
    stack = fake_stack(tmp_path, [["--delay", "0.05"]])
    try:
        with GatewayClient(stack.address, timeout=30) as client, concurrent.futures.ThreadPoolExecutor(2) as pool:
            slow = pool.submit(lambda: client.complete("p|ab", max_tokens=100, ignore_eos=True, timeout=0.5,
                                                       request_id="late"))
            fine = pool.submit(lambda: client.complete("p|cd", max_tokens=4, ignore_eos=True, request_id="fine"))
            with pytest.raises(grpc.RpcError) as late:
                slow.result()
            assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert fine.result().usage.completion_tokens == 4
        assert outcome_of(stack, "late") == "cancelled"
        assert outcome_of(stack, "fine") == "finished"
        wait_until(lambda: streams_opened(stack) == 1)
    finally:
        stack.stop()


@pytest.mark.parametrize(("target", "single"), [
    ("unix:/run/grok/model.sock", True), ("127.0.0.1:50053", True), ("[::1]:50053", True),
    ("localhost:50053", True), ("ipv4:10.0.0.1:50053", True), ("model:50053", False),
    ("ipv4:10.0.0.1:50053,10.0.0.2:50053", False), ("dns:///model:50053", False)])
def test_targets_that_may_name_several_replicas_rotate_their_streams(target: str, single: bool) -> None:
    assert single_address(target) is single


class _IdleCall:
    """A GenerateMany call that takes every message and never answers."""

    def __aiter__(self) -> "_IdleCall":
        return self

    async def __anext__(self) -> object:
        await asyncio.Event().wait()  # never set: the replica never answers
        raise StopAsyncIteration

    async def write(self, message: object) -> None:
        pass

    async def done_writing(self) -> None:
        pass

    def cancel(self) -> None:
        pass


class _CountingStub:
    def __init__(self) -> None:
        self.calls = 0

    def GenerateMany(self) -> _IdleCall:  # noqa: N802 - the gRPC method's name
        self.calls += 1
        return _IdleCall()


@pytest.mark.parametrize(("target", "streams"), [("dns:///model:50053", 3), ("ipv4:10.0.0.1:1,10.0.0.2:1", 3),
                                                 ("127.0.0.1:50053", 1), ("unix:/tmp/m.sock", 1)])
def test_short_requests_one_after_another_spread_over_the_replicas_of_a_scaled_target(target: str,
                                                                                     streams: int) -> None:
    """Six requests within a second: a target of several replicas opens a new stream (gRPC's round robin: the next
    address) every SPREAD_LANE_REQUESTS of them, as one call per request spread them; one address keeps one."""
    from gateway.model_streams import SPREAD_LANE_REQUESTS, Lanes
    from grok.model.v1 import model_pb2

    async def six() -> int:
        stub = _CountingStub()
        lanes = Lanes(stub, target, 1)  # type: ignore[arg-type]
        for _ in range(6):
            lanes.start(model_pb2.GenerateRequest(), None, ())
        lanes.close()
        return stub.calls

    assert SPREAD_LANE_REQUESTS == 2
    assert asyncio.run(six()) == streams
