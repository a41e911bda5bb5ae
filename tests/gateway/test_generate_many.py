"""ModelService.GenerateMany on the real golden model: many requests on one stream, one message a step for all
of them, each request with its own tokens, cancellation (its slot freed for the next), deadline and status."""

from __future__ import annotations

import queue
from collections.abc import Iterator

import grpc
from google.rpc import error_details_pb2, status_pb2

from grok.model.v1 import model_pb2
from tests.gateway.conftest import Stubs

PROMPT = [5, 9, 13]


class Stream:
    """One GenerateMany call driven from the test: `start`/`cancel` send, `read` returns the next message."""

    def __init__(self, stubs: Stubs) -> None:
        self.outgoing: queue.Queue[model_pb2.GenerateManyRequest | None] = queue.Queue()
        self.call = stubs.model.GenerateMany(self._requests(), timeout=120)
        self.responses: dict[int, list[model_pb2.GenerateResponse]] = {}
        self.ends: dict[int, model_pb2.RequestUpdate] = {}
        self.order: list[int] = []  # the ids in the order their requests ended
        self.messages = 0

    def _requests(self) -> Iterator[model_pb2.GenerateManyRequest]:
        while (message := self.outgoing.get()) is not None:
            yield message

    def start(self, stream_id: int, timeout: float | None = None, **fields: object) -> None:
        start = model_pb2.StartRequest(id=stream_id, request=model_pb2.GenerateRequest(**fields))
        if timeout is not None:
            start.timeout_seconds = timeout
        self.outgoing.put(model_pb2.GenerateManyRequest(start=start))

    def cancel(self, request_id: int) -> None:
        self.outgoing.put(model_pb2.GenerateManyRequest(cancel=request_id))

    def read(self) -> model_pb2.GenerateManyResponse:
        """The next message (its updates also noted in responses, ends and order)."""
        message = next(self.call)
        self.messages += 1
        for update in message.updates:
            self.responses.setdefault(update.id, []).extend(update.responses)
            if update.ended:
                self.ends[update.id] = update
                self.order.append(update.id)
        return message

    def until_ended(self, ids: set[int]) -> None:
        while not ids <= set(self.ends):
            self.read()

    def close(self) -> None:
        self.outgoing.put(None)
        self.call.cancel()


def generated(responses: list[model_pb2.GenerateResponse]) -> list[int]:
    return [t for r in responses for t in r.token_ids]


def test_a_step_of_every_request_travels_in_one_message(golden_stubs: Stubs) -> None:
    """Two requests decoding together: fewer messages than responses, and each request's tokens are the ones its
    own Generate call gives."""
    stream = Stream(golden_stubs)
    try:
        for request_id in (1, 2):
            stream.start(request_id, token_ids=PROMPT, max_tokens=24, ignore_eos=True, request_id=f"many-{request_id}")
        stream.until_ended({1, 2})
    finally:
        stream.close()
    alone = generated(list(golden_stubs.model.Generate(
        model_pb2.GenerateRequest(token_ids=PROMPT, max_tokens=24, ignore_eos=True), timeout=60)))
    responses = stream.responses
    assert generated(responses[1]) == generated(responses[2]) == alone
    assert all(end.code == 0 for end in stream.ends.values())
    assert stream.messages < len(responses[1]) + len(responses[2]), (stream.messages, len(responses[1]),
                                                                     len(responses[2]))


def test_a_cancelled_request_frees_its_slot_for_the_next(golden_stubs: Stubs) -> None:
    """Two slots, two long requests; the first is cancelled after its first tokens: a third request gets its slot
    and finishes while the second is still decoding. The cancelled one ends CANCELLED, the others OK."""
    stream = Stream(golden_stubs)
    try:
        stream.start(1, token_ids=PROMPT, max_tokens=120, ignore_eos=True)
        stream.start(2, token_ids=PROMPT, max_tokens=120, ignore_eos=True)
        while not any(u.id == 1 and u.responses for u in stream.read().updates):
            pass
        stream.cancel(1)
        stream.start(3, token_ids=PROMPT, max_tokens=2, ignore_eos=True)
        stream.until_ended({1, 2, 3})
    finally:
        stream.close()
    responses, ends, order = stream.responses, stream.ends, stream.order
    assert grpc.StatusCode.CANCELLED.value[0] == ends[1].code
    assert ends[2].code == ends[3].code == 0
    assert len(generated(responses[3])) == 2 and len(generated(responses[2])) == 120
    assert order.index(3) < order.index(2), order


def test_each_request_has_its_own_deadline_and_status(golden_stubs: Stubs) -> None:
    """A request past its deadline ends DEADLINE_EXCEEDED, a bad one INVALID_ARGUMENT with the field violation in
    its status details; the request beside them on the stream is not affected."""
    stream = Stream(golden_stubs)
    try:
        stream.start(1, timeout=0.000001, token_ids=PROMPT, max_tokens=100, ignore_eos=True)
        stream.start(2, token_ids=PROMPT, max_tokens=4, temperature=-1.0)
        stream.start(3, timeout=60, token_ids=PROMPT, max_tokens=4, ignore_eos=True)
        stream.until_ended({1, 2, 3})
    finally:
        stream.close()
    responses, ends = stream.responses, stream.ends
    assert ends[1].code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0], ends[1]
    assert ends[2].code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "temperature" in ends[2].message
    status = status_pb2.Status.FromString(ends[2].status_details)
    bad = error_details_pb2.BadRequest()
    assert status.details[0].Unpack(bad) and bad.field_violations[0].field == "temperature"
    assert ends[3].code == 0 and len(generated(responses[3])) == 4
