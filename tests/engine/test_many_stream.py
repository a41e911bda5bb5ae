"""model_service.many.ManyStream with hand-driven requests: what is ready together leaves as one message, each
request ends with its own status, a cancel ends one request, and a draining service ends the stream once its
requests did."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping

import grpc

from grok.model.v1 import model_pb2
from model_service.many import ManyStream
from serving_common.errors import ServiceError


class Steps:
    """Requests that each produce one response per `step()`, all woken by the same event (as a decode step's
    emissions reach every request in one event-loop turn); a prompt of [0] fails with INVALID_ARGUMENT."""

    def __init__(self) -> None:
        self.event = asyncio.Event()
        self.cancelled: list[int] = []

    def step(self) -> None:
        self.event.set()
        self.event = asyncio.Event()

    async def one(self, request: model_pb2.GenerateRequest, timeout: float | None,
                  trace_context: Mapping[str, str]) -> AsyncIterator[model_pb2.GenerateResponse]:
        if list(request.token_ids) == [0]:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, "token_ids: 0 is the pad id")
        try:
            for produced in range(1, request.max_tokens + 1):
                await self.event.wait()
                yield model_pb2.GenerateResponse(token_ids=[produced], completion_tokens=produced)
        except asyncio.CancelledError:
            self.cancelled.append(request.max_tokens)
            raise


def start(request_id: int, max_tokens: int, token_ids: tuple[int, ...] = (5,)) -> model_pb2.GenerateManyRequest:
    return model_pb2.GenerateManyRequest(start=model_pb2.StartRequest(
        id=request_id, request=model_pb2.GenerateRequest(token_ids=token_ids, max_tokens=max_tokens)))


async def drive() -> None:
    steps, draining = Steps(), asyncio.Event()
    incoming: asyncio.Queue[model_pb2.GenerateManyRequest | None] = asyncio.Queue()

    async def requests() -> AsyncIterator[model_pb2.GenerateManyRequest]:
        while (message := await incoming.get()) is not None:
            yield message

    messages = ManyStream(steps.one, draining).messages(requests())
    for message in (start(1, 2), start(2, 3), start(3, 50), start(4, 1, (0,))):
        incoming.put_nowait(message)
    first = await anext(messages)  # the refused request's end, before any step
    assert [(u.id, u.ended, u.code) for u in first.updates] == [(4, True, grpc.StatusCode.INVALID_ARGUMENT.value[0])]
    assert first.updates[0].message == "token_ids: 0 is the pad id"

    steps.step()
    one_step = await anext(messages)  # every request's token of the step: one message
    assert sorted((u.id, list(u.responses[0].token_ids)) for u in one_step.updates) == [(1, [1]), (2, [1]), (3, [1])]

    steps.step()
    second = await anext(messages)
    assert {u.id: u.ended for u in second.updates} == {1: True, 2: False, 3: False}
    assert second.updates[0].code == 0

    incoming.put_nowait(model_pb2.GenerateManyRequest(cancel=3))
    cancelled = await anext(messages)
    assert [(u.id, u.ended, u.code) for u in cancelled.updates] == [(3, True, grpc.StatusCode.CANCELLED.value[0])]
    assert steps.cancelled == [50]

    draining.set()  # request 2 still runs: the stream goes on until it ended, then ends by itself
    steps.step()
    last = await anext(messages)
    assert [(u.id, u.ended) for u in last.updates] == [(2, True)]
    assert [m async for m in messages] == []


def test_many_stream_batches_a_step_ends_each_request_alone_and_ends_after_a_drain() -> None:
    asyncio.run(asyncio.wait_for(drive(), 10))


def test_a_sink_hands_step_tokens_straight_on_and_keeps_ends_and_order() -> None:
    """The servicer's GenerateMany path: a decode step's tokens go to `direct` from the relay's delivery (no turn of
    the request's task); an end, and anything after it, waits for the task, in order."""
    from model_service.requests import Emission, FinishReason, TokenOut
    from model_service.servicer import EmissionRelay

    def step(n: int, finish: FinishReason | None = None) -> Emission:
        return Emission(tokens=(TokenOut(n, 0.5, ()),), completion_tokens=n, prompt_tokens=3, finish_reason=finish)

    async def drive_sink() -> None:
        sink = EmissionRelay(asyncio.get_running_loop()).sink()
        straight: list[Emission] = []
        sink.direct = straight.append
        sink.put(step(1))
        sink.put(step(2))
        assert [e.completion_tokens for e in straight] == [1, 2]
        sink.put(step(3, FinishReason.LENGTH))  # the end (of one sample): for the task
        sink.put(step(4))  # behind it: never overtakes it
        assert len(straight) == 2
        assert [e.completion_tokens for e in await sink.take()] == [3, 4]
        sink.put(step(5))
        assert [e.completion_tokens for e in straight] == [1, 2, 5]

    asyncio.run(drive_sink())
