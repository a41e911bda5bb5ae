"""A client's cancel that reaches the gateway while gRPC is writing a message to it: gRPC cancels its own
send, not the handler, and closes the handler's generator. The call must still count and log as CANCELLED
(not OK) and cancel its model call at once."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gateway.config import GatewayConfig
from gateway.servicer import GatewayServicer
from grok.gateway.v1 import gateway_pb2


class Metrics:
    def __init__(self) -> None:
        self.codes: list[str] = []

    def finished(self, method: str, code: str, finish_reason: str, seconds: float) -> None:
        self.codes.append(code)


class Pipeline:
    """Streams one message, then waits for a model that never answers; records that the stream was closed."""

    def __init__(self) -> None:
        self.metrics = Metrics()
        self.closed = False

    async def stream(self, *args: Any, **kwargs: Any) -> AsyncIterator[gateway_pb2.GenerateResponse]:
        try:
            yield gateway_pb2.GenerateResponse(text="In")
            await asyncio.Event().wait()
        finally:
            self.closed = True  # the pipeline's model call is cancelled here


class Context:
    def time_remaining(self) -> float:
        return 100.0


@pytest.mark.parametrize("method", ["Generate", "Chat"])
def test_a_stream_closed_after_a_message_counts_as_cancelled_and_closes_the_model_call(
        method: str, caplog: pytest.LogCaptureFixture) -> None:
    pipeline = Pipeline()
    servicer = GatewayServicer(pipeline, GatewayConfig(tokenizer="t:1", models=("m:1",)))  # type: ignore[arg-type]
    request = (gateway_pb2.GenerateRequest(prompt="In the beginning") if method == "Generate"
               else gateway_pb2.ChatRequest(messages=[gateway_pb2.ChatMessage(role="user", content="hi")]))

    async def call() -> bool:
        stream = getattr(servicer, method)(request, Context())
        await anext(stream)
        await stream.aclose()  # what gRPC does when the cancel arrives during its send; runs the handler's finally
        closed = pipeline.closed
        return closed

    with caplog.at_level(logging.INFO, logger="gateway.servicer"):
        closed_at_once = asyncio.run(call())
    assert closed_at_once, "the model call was left to garbage collection"
    assert pipeline.metrics.codes == ["CANCELLED"]
    assert [r.code for r in caplog.records if r.msg == "request"] == ["CANCELLED"]
