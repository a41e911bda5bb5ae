"""Issue 64.6, the gRPC side: a client that reads nothing from its Generate stream. Every request rides on a
shared GenerateMany stream to the model (gateway/model_streams.py), which keeps delivering a request's responses
whatever its client reads; the gateway held them all for it (323 KB for one n = 4 stream), and the model computed
the request to its end. Now the gateway holds at most gateway.stream_buffer.MAX_UNREAD_BYTES of responses a
client has not read, then ends the model request; the client gets what was produced and RESOURCE_EXHAUSTED."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from gateway.config import GatewayConfig
from gateway.errors import GatewayError
from gateway.server import SERVICE_NAME
from gateway.servicer import GatewayServicer
from gateway.stream_buffer import MAX_UNREAD_BYTES, bounded
from grok.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from serving_common.lifecycle import assemble

MESSAGE_TEXT = "x" * 16000  # a large response, so that gRPC's own buffers fill in a fraction of a second


class Metrics:
    def finished(self, method: str, code: str, finish_reason: str, seconds: float) -> None:
        self.code = code


class PushingModel:
    """A pipeline over a model that pushes responses into the request's queue whatever its client reads, as a
    GenerateMany lane delivers them (one each time the event loop comes back to it), until the request's stream
    is closed."""

    def __init__(self) -> None:
        self.metrics = Metrics()
        self.queue: asyncio.Queue[gateway_pb2.GenerateResponse] = asyncio.Queue()
        self.held = 0  # bytes in the queue
        self.produced = 0
        self.most_held = 0  # the most bytes the queue held
        self.closed = asyncio.Event()

    async def _push(self) -> None:
        while True:
            message = gateway_pb2.GenerateResponse(text=MESSAGE_TEXT)
            self.queue.put_nowait(message)
            self.produced += message.ByteSize()
            self.held += message.ByteSize()
            self.most_held = max(self.most_held, self.held)
            await asyncio.sleep(0)  # a yield to the loop (no wait): the next response comes when it returns

    async def stream(self, *args: Any, **kwargs: Any) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        model = asyncio.create_task(self._push())
        try:
            while True:
                message = await self.queue.get()
                self.held -= message.ByteSize()
                yield message
        finally:
            model.cancel()  # the model request is cancelled
            self.closed.set()


def test_a_grpc_client_that_reads_nothing_has_its_request_ended_and_then_reads_why() -> None:
    async def main() -> tuple[bool, PushingModel, int, grpc.StatusCode, str]:
        model = PushingModel()
        servicer = GatewayServicer(model, GatewayConfig("unused:1", ("unused:2",)))  # type: ignore[arg-type]
        built = assemble("gateway", SERVICE_NAME,
                         lambda server: gateway_pb2_grpc.add_GatewayServiceServicer_to_server(servicer, server),
                         "127.0.0.1", 0, None)
        await built.server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{built.port}") as channel:
                call = gateway_pb2_grpc.GatewayServiceStub(channel).Generate(gateway_pb2.GenerateRequest(prompt="a"))
                await call.read()  # then nothing for a while
                try:
                    await asyncio.wait_for(model.closed.wait(), 10)
                except asyncio.TimeoutError:
                    pass
                ended = model.closed.is_set()
                if not ended:
                    call.cancel()
                    return ended, model, 1, grpc.StatusCode.CANCELLED, ""
                read = 1
                try:
                    while await call.read() is not grpc.aio.EOF:
                        read += 1
                except grpc.aio.AioRpcError as error:
                    return ended, model, read, error.code(), error.details() or ""
                return ended, model, read, await call.code(), await call.details()
        finally:
            await built.server.stop(None)

    ended, model, read, code, details = asyncio.run(main())
    assert ended, f"the model request was still running after 10 s ({model.produced} bytes produced)"
    assert model.most_held <= 2 * len(MESSAGE_TEXT) + 64  # the lane's queue no longer grows for the client
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "unread" in details, (code, details)
    assert read * len(MESSAGE_TEXT) <= model.produced  # what was produced up to the cut, then why
    assert model.metrics.code == "RESOURCE_EXHAUSTED"


def test_a_stream_read_as_it_arrives_passes_whole_with_its_own_ending() -> None:
    async def source() -> AsyncIterator[gateway_pb2.GenerateResponse]:
        for i in range(200):
            yield gateway_pb2.GenerateResponse(text=str(i) * 1000)
            await asyncio.sleep(0)  # a yield (no wait): each message arrives on a later turn of the loop, as a model's
        raise GatewayError(grpc.StatusCode.INVALID_ARGUMENT, "stop: too long")

    async def main() -> tuple[list[str], GatewayError]:
        out: list[str] = []
        with pytest.raises(GatewayError) as error:
            async for message in bounded(source(), limit=4096):
                out.append(message.text)
        return out, error.value

    texts, error = asyncio.run(main())
    assert texts == [str(i) * 1000 for i in range(200)]  # 200 KB through a 4 KiB read-ahead, in order
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT


def test_the_read_ahead_stops_at_its_limit_and_closes_the_source() -> None:
    async def main() -> tuple[int, bool, GatewayError | None]:
        produced, closed = [0], asyncio.Event()

        async def source() -> AsyncIterator[gateway_pb2.GenerateResponse]:
            try:
                while True:
                    produced[0] += 1
                    yield gateway_pb2.GenerateResponse(text="y" * 1000)
            finally:
                closed.set()

        stream = bounded(source(), limit=10_000)
        await stream.__anext__()  # then the reader stops taking them, until the read-ahead closed the source
        await asyncio.wait_for(closed.wait(), 10)
        failure = None
        try:
            async for _ in stream:
                pass
        except GatewayError as error:
            failure = error
        return produced[0], closed.is_set(), failure

    produced, closed, failure = asyncio.run(main())
    assert closed and produced <= 13  # ~10 of 1 KB past the one read, then the source is closed
    assert failure is not None and failure.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert MAX_UNREAD_BYTES >= 64 * 1024  # the default leaves room for a client that pauses
