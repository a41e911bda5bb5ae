"""How a step's results leave the model service: the decode thread's hand-back (scheduler + delivery.py) and the
GenerateMany stream's outgoing message (many.py), both built for one hand-over per step, not one per token."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Mapping

from grok.model.v1 import model_pb2
from model_service.loop_state import SchedulerMetrics
from model_service.many import ManyStream, outbox_var
from model_service.requests import Emission, FinishReason, GenerationRequest, TokenOut, Timings
from model_service.responses import to_response
from tests.engine.conftest import Runner
from tests.engine.fake_engine import FakeEngine


class CountingMetrics(SchedulerMetrics):
    """Counts the tokens the decode thread has delivered so far."""

    def __init__(self) -> None:
        self.tokens = 0

    def add_tokens(self, n: int) -> None:
        self.tokens += n


def test_a_steps_emissions_leave_together_after_its_whole_delivery(running: Runner) -> None:
    engine = FakeEngine(slots=3)
    metrics = CountingMetrics()
    sched = running(engine, metrics=metrics)
    seen: dict[str, list[int]] = {"b": [], "c": []}  # per request: tokens delivered (all requests) at each emission
    done = {name: threading.Event() for name in seen}

    def watcher(name: str):  # type: ignore[no-untyped-def]
        def emit(emission: Emission) -> None:
            seen[name].append(metrics.tokens)
            if emission.finish_reason is not None or emission.error is not None:
                done[name].set()
        return emit

    engine.running.clear()  # the first request's step waits in the engine until both others are queued
    first = threading.Event()
    sched.submit(GenerationRequest("a", (5, 6, 7), max_tokens=2), lambda e: first.set() if e.finish_reason else None)
    for name in seen:
        sched.submit(GenerationRequest(name, (20, 21, 22), max_tokens=6), watcher(name))
    engine.running.set()
    assert all(event.wait(10) for event in done.values()) and first.wait(10)
    # b and c draw in the same steps: each emission went out after both of the step's tokens were counted.
    assert len(seen["b"]) == len(seen["c"]) == 6
    assert seen["b"] == seen["c"]


def emission(ids: tuple[int, ...], finish: FinishReason | None = None, timings: Timings | None = None,
             prompt: tuple[TokenOut, ...] | None = None) -> Emission:
    return Emission(tuple(TokenOut(i, 0.25, ((i, 0.25), (i + 1, 0.125))) for i in ids), len(ids), 4,
                    finish_reason=finish, timings=timings, index=1, prompt=prompt)


def test_a_response_built_in_place_equals_one_built_alone() -> None:
    batch = [emission((3, 4), prompt=(TokenOut(9, 0.5, ()),), timings=Timings(0.1, 0.2, 0.003)),
             emission((5,), FinishReason.EOS, Timings(0.1, 0.2, 0.004))]
    for details in (True, False):
        response = to_response(batch, details)
        assert list(response.token_ids) == [3, 4, 5]
        assert [t.id for t in response.tokens] == ([3, 4, 5] if details else [])
        assert response.tokens[0].top_tokens[1].id == 4 if details else True
        assert response.finish_reason == model_pb2.FINISH_REASON_EOS
        assert (response.index, response.prompt_tokens, response.completion_tokens) == (1, 4, 1)
        assert response.timings.mean_step_seconds == 0.004
        assert [t.id for t in response.prompt_logprobs] == [9]
    assert not to_response([emission((3,))]).HasField("timings")


def test_outbox_responses_are_written_inside_the_next_message() -> None:
    async def one(request: model_pb2.GenerateRequest, timeout: float | None,
                  trace_context: Mapping[str, str]) -> AsyncIterator[model_pb2.GenerateResponse]:
        add = outbox_var.get()
        assert add is not None
        for token in request.token_ids:
            add().token_ids.append(token)  # what the servicer does with a decode step's tokens
        yield model_pb2.GenerateResponse(completion_tokens=len(request.token_ids))

    async def scenario() -> list[model_pb2.GenerateManyResponse]:
        stream = ManyStream(one, asyncio.Event())

        async def requests() -> AsyncIterator[model_pb2.GenerateManyRequest]:
            yield model_pb2.GenerateManyRequest(start=model_pb2.StartRequest(
                id=7, request=model_pb2.GenerateRequest(token_ids=[1, 2])))
        return [m async for m in stream.messages(requests())]

    messages = asyncio.run(asyncio.wait_for(scenario(), 10))
    updates = [u for m in messages for u in m.updates]
    assert [u.id for u in updates] == [7] * len(updates)
    responses = [r for u in updates for r in u.responses]
    assert [list(r.token_ids) for r in responses] == [[1], [2], []]
    assert responses[-1].completion_tokens == 2
    assert updates[-1].ended and updates[-1].code == 0
