"""The model servicer's Generate closed by gRPC after a response (the gateway's cancel arrived while gRPC was
sending): the call counts and logs as CANCELLED, not OK, and the scheduler's request is cancelled at once."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from grok.model.v1 import model_pb2
from model_service.metrics import Metrics
from model_service.requests import Emission, TokenOut
from model_service.servicer import ModelServicer


class Handle:
    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class Guidance:
    async def compile_async(self, request: Any) -> None:
        return None


class Scheduler:
    """Emits one token for a request and then nothing more (a long generation)."""

    def __init__(self) -> None:
        self.guidance = Guidance()
        self.handles: list[Handle] = []

    def validate(self, request: Any) -> None:
        pass

    def submit(self, request: Any, emit: Any, grammar: Any = None) -> Handle:
        emit(Emission((TokenOut(7, 0.5, ()),), completion_tokens=1, prompt_tokens=3))
        self.handles.append(Handle())
        return self.handles[-1]


class Context:
    def time_remaining(self) -> float:
        return 100.0

    def add_done_callback(self, callback: Any) -> None:
        pass


def test_a_generate_closed_after_a_response_counts_as_cancelled_and_cancels_the_request(
        caplog: pytest.LogCaptureFixture) -> None:
    metrics = Metrics()
    servicer = ModelServicer(model_pb2.GetInfoResponse(), metrics)
    scheduler = Scheduler()
    servicer.attach(scheduler)  # type: ignore[arg-type]

    async def call() -> bool:
        stream = servicer.Generate(model_pb2.GenerateRequest(token_ids=[1, 2, 3], max_tokens=50), Context())
        first = await anext(stream)
        assert list(first.token_ids) == [7]
        await stream.aclose()  # what gRPC does when the cancel arrives during its send; runs the handler's finally
        cancelled = scheduler.handles[0].cancelled
        return cancelled

    with caplog.at_level(logging.INFO, logger="model_service.servicer"):
        cancelled_at_once = asyncio.run(call())
    assert cancelled_at_once, "the scheduler's request was left to garbage collection"
    assert [r.code for r in caplog.records if r.msg == "generate finished"] == ["CANCELLED"]
    assert metrics.registry.get_sample_value("grok_model_requests_total", {"code": "CANCELLED"}) == 1
    assert not metrics.registry.get_sample_value("grok_model_requests_total", {"code": "OK"})
