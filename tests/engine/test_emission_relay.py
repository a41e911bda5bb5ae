"""The model servicer's hand-off from the decode thread to the event loop (model_service.servicer.EmissionRelay)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from model_service.requests import Emission, FinishReason, TokenOut
from model_service.servicer import EmissionRelay, EmissionSink


def emission(token: int, finish: FinishReason | None = None) -> Emission:
    return Emission((TokenOut(token, 0.5, ()),), completion_tokens=1, prompt_tokens=3, finish_reason=finish)


class CountingLoop:
    """An event loop whose call_soon_threadsafe calls (wake-ups from other threads) are counted."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.wake_ups = 0
        real = self.loop.call_soon_threadsafe

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.wake_ups += 1
            return real(*args, **kwargs)

        self.loop.call_soon_threadsafe = counted  # type: ignore[method-assign]

    def take_all(self, sinks: list[EmissionSink]) -> list[list[int]]:
        async def take() -> list[list[int]]:
            batches = await asyncio.gather(*(s.take() for s in sinks))
            return [[e.tokens[0].id for e in batch] for batch in batches]
        return self.loop.run_until_complete(asyncio.wait_for(take(), 5))


@pytest.fixture
def counting() -> Iterator[CountingLoop]:
    loop = CountingLoop()
    yield loop
    loop.loop.close()


def on_decode_thread(*work: tuple[EmissionSink, Emission]) -> None:
    """Emit from another thread, as the scheduler's decode thread does after a step; re-raise its error."""
    errors: list[BaseException] = []

    def emit_all() -> None:
        try:
            for sink, e in work:
                sink.emit(e)
        except BaseException as error:  # noqa: BLE001 - handed to the test's thread
            errors.append(error)

    thread = threading.Thread(target=emit_all)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]


def test_a_steps_emissions_for_every_request_wake_the_loop_once(counting: CountingLoop) -> None:
    relay = EmissionRelay(counting.loop)
    sinks = [relay.sink() for _ in range(8)]
    on_decode_thread(*((sink, emission(10 + i)) for i, sink in enumerate(sinks)))
    assert counting.wake_ups == 1
    assert counting.take_all(sinks) == [[10 + i] for i in range(8)]
    on_decode_thread(*((sink, emission(20 + i)) for i, sink in enumerate(sinks)))  # the next step wakes it again
    assert counting.wake_ups == 2
    assert counting.take_all(sinks) == [[20 + i] for i in range(8)]


def test_a_sink_returns_everything_that_arrived_since_it_last_took_in_order(counting: CountingLoop) -> None:
    relay = EmissionRelay(counting.loop)
    sink, other = relay.sink(), relay.sink()
    on_decode_thread((sink, emission(1)), (other, emission(7)), (sink, emission(2)))
    on_decode_thread((sink, emission(3, FinishReason.LENGTH)))
    assert counting.take_all([sink]) == [[1, 2, 3]]  # the reader was slower than three tokens: one batch
    assert counting.take_all([other]) == [[7]]


def test_take_waits_for_the_next_emission(counting: CountingLoop) -> None:
    relay = EmissionRelay(counting.loop)
    sink = relay.sink()

    async def scenario() -> list[int]:
        taking = asyncio.ensure_future(sink.take())
        # The task runs before wait's zero timeout fires (both are due now, the task first): it reaches its
        # await on the next emission and is still pending, as nothing has been emitted.
        _, pending = await asyncio.wait({taking}, timeout=0)
        assert pending == {taking}
        await asyncio.to_thread(sink.emit, emission(5))
        return [e.tokens[0].id for e in await asyncio.wait_for(taking, 5)]

    assert counting.loop.run_until_complete(scenario()) == [5]


def test_emitting_after_the_loop_closed_is_harmless() -> None:
    loop = asyncio.new_event_loop()
    relay = EmissionRelay(loop)
    sink = relay.sink()
    loop.close()
    on_decode_thread((sink, emission(1)), (sink, emission(2)))  # must not raise on the decode thread
