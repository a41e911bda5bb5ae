"""The shared server interceptor: request ids, malformed requests, ServiceError -> status with
google.rpc details, unexpected errors -> INTERNAL without killing the server; and health Watch
streams that end when the server drains."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from grok.tokenizer.v1 import tokenizer_pb2 as pb
from grok.tokenizer.v1 import tokenizer_pb2_grpc
from serving_common.errors import FieldViolation, details_of, invalid_argument, resource_exhausted
from serving_common.grpc_server import add_health_and_reflection, bind, new_server
from serving_common.logs import request_id_var

ENCODE = "/grok.tokenizer.v1.TokenizerService/Encode"
DECODE_STREAM = "/grok.tokenizer.v1.TokenizerService/DecodeStream"


class Servicer(tokenizer_pb2_grpc.TokenizerServiceServicer):
    """Encode's text selects the behaviour; the reply carries the request id the handler saw."""

    async def Encode(self, request: pb.EncodeRequest, context: grpc.aio.ServicerContext) -> pb.EncodeResponse:
        if request.text == "bad":
            raise invalid_argument("text", "must not be 'bad'")
        if request.text == "busy":
            raise resource_exhausted("the queue is full; retry later", retry_after=1.5)
        if request.text == "bug":
            raise KeyError("a bug")
        return pb.EncodeResponse(token_ids=[len(request_id_var.get())])

    async def DecodeStream(self, request_iterator: AsyncIterator[pb.DecodeStreamRequest],
                           context: grpc.aio.ServicerContext) -> AsyncIterator[pb.DecodeStreamResponse]:
        async for request in request_iterator:
            yield pb.DecodeStreamResponse(text=str(len(request.token_ids)))


Scenario = Callable[[grpc.aio.Channel, Any], Awaitable[Any]]


def run(scenario: Scenario) -> Any:
    async def main() -> Any:
        server = new_server("test")
        tokenizer_pb2_grpc.add_TokenizerServiceServicer_to_server(Servicer(), server)
        reporter = add_health_and_reflection(server, ["grok.tokenizer.v1.TokenizerService"])
        port = bind(server, "127.0.0.1", 0)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                return await scenario(channel, reporter)
        finally:
            await server.stop(0)
    return asyncio.run(main())


async def failed(call: Awaitable[Any]) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value


def test_malformed_protobuf_and_bad_utf8_are_invalid_argument_with_one_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    async def scenario(channel: grpc.aio.Channel, _: Any) -> list[grpc.aio.AioRpcError]:
        raw = channel.unary_unary(ENCODE)
        errors = [await failed(raw(b"\x0a\xff")), await failed(raw(b"\x0a\x02\xff\xfe"))]
        ok = await tokenizer_pb2_grpc.TokenizerServiceStub(channel).Encode(pb.EncodeRequest(text="fine"))
        assert ok.token_ids  # the server serves on
        return errors

    with caplog.at_level(logging.INFO):
        errors = run(scenario)
    for error, reason in zip(errors, ("Wire format was corrupt", "String field had bad UTF-8")):
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "grok.tokenizer.v1.EncodeRequest" in error.details() and reason in error.details()
        assert "class" not in error.details() and "DecodeError" not in error.details()
        assert details_of(error).violations[0].field == "request"
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [r.getMessage() for r in warnings] == ["malformed request refused"] * 2
    assert not any(r.exc_info for r in caplog.records)


def test_a_malformed_message_inside_a_client_stream_is_invalid_argument() -> None:
    async def scenario(channel: grpc.aio.Channel, _: Any) -> tuple[str, grpc.aio.AioRpcError]:
        call = channel.stream_stream(DECODE_STREAM)()
        await call.write(pb.DecodeStreamRequest(token_ids=[1, 2]).SerializeToString())
        first = pb.DecodeStreamResponse.FromString(await call.read()).text
        await call.write(b"\x0a\xff")
        return first, await failed(call.read())

    first, error = run(scenario)
    assert first == "2"
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "grok.tokenizer.v1.DecodeStreamRequest" in error.details()


def test_service_errors_carry_bad_request_and_retry_info_details() -> None:
    async def scenario(channel: grpc.aio.Channel, _: Any) -> list[grpc.aio.AioRpcError]:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
        return [await failed(stub.Encode(pb.EncodeRequest(text=t))) for t in ("bad", "busy")]

    bad, busy = run(scenario)
    assert (bad.code(), bad.details()) == (grpc.StatusCode.INVALID_ARGUMENT, "text: must not be 'bad'")
    assert details_of(bad).violations == (FieldViolation("text", "must not be 'bad'"),)
    assert busy.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert details_of(busy).retry_after == 1.5 and not details_of(busy).violations


def test_unexpected_errors_are_internal_with_the_request_id_and_the_server_serves_on(
        caplog: pytest.LogCaptureFixture) -> None:
    async def scenario(channel: grpc.aio.Channel, _: Any) -> tuple[grpc.aio.AioRpcError, int]:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
        error = await failed(stub.Encode(pb.EncodeRequest(text="bug"), metadata=(("x-request-id", "rid-42"),)))
        after = await stub.Encode(pb.EncodeRequest(text="fine"))
        return error, after.token_ids[0]

    with caplog.at_level(logging.INFO):
        error, _ = run(scenario)
    assert error.code() == grpc.StatusCode.INTERNAL
    assert "rid-42" in error.details() and "KeyError" not in error.details()
    assert ("x-request-id", "rid-42") in tuple(error.trailing_metadata())
    logged = [r for r in caplog.records if r.getMessage() == "unexpected error"]
    assert len(logged) == 1 and logged[0].exc_info is not None


def test_the_request_id_reaches_the_handler_and_comes_back() -> None:
    async def scenario(channel: grpc.aio.Channel, _: Any) -> tuple[int, tuple, int]:
        stub = tokenizer_pb2_grpc.TokenizerServiceStub(channel)
        call = stub.Encode(pb.EncodeRequest(text="x"), metadata=(("x-request-id", "abc"),))
        reply = await call
        fresh = await stub.Encode(pb.EncodeRequest(text="x"))
        return reply.token_ids[0], tuple(await call.trailing_metadata()), fresh.token_ids[0]

    seen, trailers, fresh = run(scenario)
    assert seen == len("abc") and ("x-request-id", "abc") in trailers
    assert fresh == 16  # a new id of 16 hex digits when the caller sends none


def test_watch_streams_end_when_the_server_drains() -> None:
    async def scenario(channel: grpc.aio.Channel, reporter: Any) -> list[int]:
        await reporter.set(True)
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
        seen = [(await watch.read()).status]
        await reporter.drain()

        while (reply := await asyncio.wait_for(watch.read(), 10)) is not grpc.aio.EOF:
            seen.append(reply.status)  # the stream ends instead of waiting for the server to stop
        assert await watch.code() == grpc.StatusCode.OK
        return seen

    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    assert run(scenario) == [serving, not_serving]


GET_PIECES = "/grok.tokenizer.v1.TokenizerService/GetPieces"


@pytest.mark.parametrize("method", [ENCODE, GET_PIECES])
def test_a_unary_request_stream_that_ends_without_a_message_is_invalid_argument(method: str) -> None:
    """A client that half-closes a unary call without sending its message (curl with an empty body) used
    to get no status at all: the call hung until the client's own deadline."""
    async def scenario(channel: grpc.aio.Channel, _: Any) -> grpc.aio.AioRpcError:
        call = channel.stream_stream(method)(iter(()), timeout=10)
        return await failed(call.read())

    error = run(scenario)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert "request" in (error.details() or "")


def test_a_truncated_unary_request_gets_a_status_over_plain_http2(tmp_path: Any) -> None:
    """curl --http2-prior-knowledge sends a gRPC frame whose length prefix promises more than the body."""
    import subprocess

    body = tmp_path / "truncated.bin"
    body.write_bytes(b"\x00\x00\x00\x00\x64" + b"\x0a\x02hi")

    async def main() -> str:
        server = new_server("test")
        tokenizer_pb2_grpc.add_TokenizerServiceServicer_to_server(Servicer(), server)
        port = bind(server, "127.0.0.1", 0)
        await server.start()
        try:
            curl = await asyncio.create_subprocess_exec(
                "curl", "-s", "-m", "10", "--http2-prior-knowledge", "-D", "-", "-H", "content-type: application/grpc",
                "-H", "te: trailers", "--data-binary", f"@{body}", f"http://127.0.0.1:{port}{ENCODE}",
                stdout=asyncio.subprocess.PIPE)
            out, _ = await curl.communicate()
            return out.decode(errors="replace")
        finally:
            await server.stop(0)

    headers = asyncio.run(main()).lower()
    assert "grpc-status: 3" in headers or "grpc-status: 13" in headers, headers
