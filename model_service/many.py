"""GenerateMany: many Generate requests over one stream, one message out for everything that is ready together.

A gateway keeps one GenerateMany stream open to each replica instead of one Generate call per request, so a
decode step's tokens for all of its requests travel as one message, not one message (and one HTTP/2 frame,
one write, one read, one wake-up on each side) per request per step.

Each started request runs in its own task over the same per-request generator Generate serves (`OneRequest`):
the same validation, responses, deadline and errors. Its responses and its end go into an outbox; the stream's
writer sends whatever the outbox holds as one GenerateManyResponse. The EmissionRelay (servicer.py) hands a
decode step's emissions to every request's task in one event-loop turn, and the writer is woken after them,
so a step's news of every request of the stream leaves as one message. A `cancel` message (or the end of the
stream) cancels the request's task, which cancels its scheduler request: its slot is freed within a step.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import logging
from collections.abc import AsyncIterator, Callable, Mapping

import grpc

from grok.model.v1 import model_pb2
from serving_common.errors import ServiceError, status_of

log = logging.getLogger(__name__)

# (request, seconds it may take or None, its trace context) -> its responses; raises what ends it.
OneRequest = Callable[[model_pb2.GenerateRequest, float | None, Mapping[str, str]],
                      AsyncIterator[model_pb2.GenerateResponse]]

# Set in each request's task: a new, empty response of that request, already in the outbox (inside the message
# the stream sends next), for the caller to fill. A OneRequest may use it for responses it has ready outside its
# own turn (the servicer's decode-step tokens: no wake-up of the task and its generators per request per step,
# and no response built and then copied into the message); what it yields goes the same way, after them.
outbox_var: contextvars.ContextVar[Callable[[], model_pb2.GenerateResponse] | None] = contextvars.ContextVar(
    "many_outbox", default=None)


def ended(update: model_pb2.RequestUpdate, error: BaseException | None) -> None:
    """Mark `update` as its request's last, with the status `error` ends it with (None: OK)."""
    update.ended = True
    if error is None:
        return
    status = status_of(error) if isinstance(error, Exception) else None
    if status is None:
        if isinstance(error, asyncio.CancelledError):
            status = ServiceError(grpc.StatusCode.CANCELLED, "cancelled")
        else:
            log.error("request failed", exc_info=error)
            status = ServiceError(grpc.StatusCode.INTERNAL, "the model service failed; its logs have the details")
    proto = status.status_proto()
    update.code, update.message, update.status_details = proto.code, proto.message, proto.SerializeToString()


class ManyStream:
    """The requests of one GenerateMany call and the outbox of their news."""

    def __init__(self, one: OneRequest, draining: asyncio.Event) -> None:
        self.one = one
        self.draining = draining
        self.tasks: dict[int, asyncio.Task[None]] = {}
        self.message = model_pb2.GenerateManyResponse()  # the next message out; the outbox's updates live in it
        self.outbox: dict[int, model_pb2.RequestUpdate] = {}
        self.news = asyncio.Event()
        self.reading = True  # the client may still start requests

    def _update(self, request_id: int) -> model_pb2.RequestUpdate:
        update = self.outbox.get(request_id)
        if update is None:
            update = self.outbox[request_id] = self.message.updates.add(id=request_id)
            self.news.set()
        return update

    def _response(self, request_id: int) -> model_pb2.GenerateResponse:
        """A new response of the request, in the outbox (the `outbox_var` of its task)."""
        return self._update(request_id).responses.add()

    def start(self, start: model_pb2.StartRequest) -> None:
        if start.id in self.tasks:
            error = ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"id {start.id} is in use on this stream")
            ended(self._update(start.id), error)
            return
        timeout = start.timeout_seconds if start.HasField("timeout_seconds") else None
        self.tasks[start.id] = asyncio.create_task(self._run(start.id, start.request, timeout,
                                                             dict(start.trace_context)))

    def cancel(self, request_id: int) -> None:
        task = self.tasks.get(request_id)
        if task is not None:
            task.cancel()

    async def _run(self, request_id: int, request: model_pb2.GenerateRequest, timeout: float | None,
                   trace_context: Mapping[str, str]) -> None:
        error: BaseException | None = None
        outbox_var.set(functools.partial(self._response, request_id))  # in this task's context
        try:
            async with contextlib.aclosing(self.one(request, timeout, trace_context)) as responses:
                async for response in responses:
                    self._update(request_id).responses.append(response)
        except BaseException as failure:  # noqa: BLE001 - every end is reported (CancelledError: a cancel message)
            error = failure
        finally:
            del self.tasks[request_id]
            ended(self._update(request_id), error)
            self.news.set()

    async def read(self, requests: AsyncIterator[model_pb2.GenerateManyRequest]) -> None:
        """Start and cancel requests as the client asks, until it half-closes."""
        try:
            async for message in requests:
                kind = message.WhichOneof("kind")
                if kind == "start":
                    self.start(message.start)
                elif kind == "cancel":
                    self.cancel(message.cancel)
        finally:
            self.reading = False
            self.news.set()

    def finished(self) -> bool:
        """Nothing left to send or to wait for: the client is done, or the service drains and no request is open."""
        return not self.tasks and not self.outbox and (not self.reading or self.draining.is_set())

    async def messages(self, requests: AsyncIterator[model_pb2.GenerateManyRequest]
                       ) -> AsyncIterator[model_pb2.GenerateManyResponse]:
        """The call's outgoing messages: the outbox each time it has news."""
        reader = asyncio.create_task(self.read(requests))
        drained = asyncio.create_task(self.draining.wait())
        drained.add_done_callback(lambda _: self.news.set())
        try:
            while not self.finished():
                await self.news.wait()
                self.news.clear()
                if self.outbox:
                    message, self.message, self.outbox = self.message, model_pb2.GenerateManyResponse(), {}
                    yield message
        finally:
            drained.cancel()
            reader.cancel()
            for task in list(self.tasks.values()):
                task.cancel()
