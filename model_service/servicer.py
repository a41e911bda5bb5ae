"""grok.model.v1.ModelService: protobuf <-> scheduler requests.

Scheduler errors propagate as they are (SchedulerError, a DomainError): serving_common.errors.status_of
gives their status and google.rpc details, and the shared interceptor ends the call with them.

No JAX here. Generate submits a request to the Scheduler, whose decode thread hands back one
Emission per request per step through the `emit` callback. An EmissionRelay carries them to the event
loop with one wake-up for everything emitted together (a step's tokens for every request), not one
per token; each stream then sends what it received as one message (so tokens that are ready together
travel together when the client reads slower than the model decodes). Client cancellation and
deadline expiry cancel the request, which frees its slot at the next step boundary.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping

import grpc
from opentelemetry import trace

from grok.model.v1 import model_pb2, model_pb2_grpc
from model_service.generate_trace import GenerateTrace
from model_service.many import ManyStream, outbox_var
from model_service.metrics import Metrics
from model_service.responses import Straight, to_response, to_responses
from model_service.requests import (
    Emission,
    ErrorKind,
    GenerationRequest,
    RequestHandle,
    SchedulerError,
)
from model_service.constraint import Constraint, ConstraintKind
from model_service.sampling_settings import SamplingSettings
from model_service.scheduler import Scheduler
from serving_common import tracing
from serving_common.errors import STATUS, invalid_argument, status_of
from serving_common.logs import new_request_id, request_id_too_long, request_id_var

log = logging.getLogger(__name__)

GENERATE_METHOD = "/grok.model.v1.ModelService/Generate"


def to_request(msg: model_pb2.GenerateRequest, request_id: str, time_remaining: float | None) -> GenerationRequest:
    """The domain request; field values are checked by validation.py when it is submitted."""
    return GenerationRequest(
        request_id=request_id,
        prompt=tuple(msg.token_ids),
        sampling=to_sampling(msg),
        seed=msg.seed if msg.HasField("seed") else None,
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else None,
        ignore_eos=msg.ignore_eos,
        deadline=None if time_remaining is None else time.monotonic() + time_remaining,
        stop_token_ids=tuple(msg.stop_token_ids),
        n=msg.n or 1,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
        constraint=to_constraint(msg),
        cache_salt=msg.cache_salt,
    )


def to_constraint(msg: model_pb2.GenerateRequest) -> Constraint | None:
    """The request's structured-output constraint (the `constraint` oneof), None when unset."""
    which = msg.WhichOneof("constraint")
    if which is None:
        return None
    kind = ConstraintKind(which)
    if kind is ConstraintKind.CHOICE:
        return Constraint(kind, choices=tuple(msg.choice.choices))
    return Constraint(kind, getattr(msg, which))


def to_sampling(msg: model_pb2.GenerateRequest) -> SamplingSettings:
    """How the request's tokens are drawn (unset optional fields mean "off")."""
    return SamplingSettings(
        temperature=msg.temperature,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0,
        allowed=tuple(msg.allowed_token_ids),
        blocked=tuple(msg.blocked_token_ids),
        top_logprobs=msg.top_logprobs,
        top_k=msg.top_k, min_p=msg.min_p,
        repetition_penalty=msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0,
        presence_penalty=msg.presence_penalty, frequency_penalty=msg.frequency_penalty,
        logit_bias=tuple(sorted(msg.logit_bias.items())), min_tokens=msg.min_tokens)


def _until_end(batch: list[Emission], open_samples: int) -> list[Emission]:
    """`batch` up to the request's last emission: its error, or the finish of the last open sample."""
    finished = 0
    for i, emission in enumerate(batch):
        finished += emission.error is None and emission.finish_reason is not None
        if emission.error is not None or finished >= open_samples:
            return batch[:i + 1]
    return batch


class EmissionSink:
    """One request's emissions on the event loop: `take()` waits for and returns all that arrived.

    With `direct` set, an emission that neither ends the request nor fails it goes to `direct` at once, on the
    loop, instead of waking the request's task, unless emissions are waiting for the task (order is kept)."""

    def __init__(self, relay: EmissionRelay) -> None:
        self._relay = relay
        self._items: list[Emission] = []
        self._waiter: asyncio.Future[None] | None = None
        self.direct: Callable[[Emission], None] | None = None

    def emit(self, emission: Emission) -> None:
        """The scheduler's `emit` callback (decode thread)."""
        self._relay.post(self, emission)

    def put(self, emission: Emission) -> None:
        """On the loop (called by the relay)."""
        if self.direct is not None and not self._items and emission.error is None and emission.finish_reason is None:
            self.direct(emission)
            return
        self._items.append(emission)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def take(self) -> list[Emission]:
        while not self._items:
            self._waiter = self._relay.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        items, self._items = self._items, []
        return items


class EmissionRelay:
    """Carries emissions from the decode thread to the event loop with one wake-up per batch.

    A wake-up (call_soon_threadsafe: a self-pipe write, an epoll return, a loop iteration, a GIL
    hand-over) per request per step cost the model process more than the protobuf and the gRPC write
    of the token. Here the first emission after a delivery schedules one callback and the rest of the
    step's emissions (the decode thread holds the GIL while it emits them) join it.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[EmissionSink, Emission]] = []
        self._scheduled = False

    def sink(self) -> EmissionSink:
        return EmissionSink(self)

    def post(self, sink: EmissionSink, emission: Emission) -> None:
        """Any thread."""
        with self._lock:
            self._pending.append((sink, emission))
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop is closed (the server is gone): nobody is left to read it
            pass

    def _deliver(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
            self._scheduled = False
        for sink, emission in pending:
            sink.put(emission)


class ModelServicer(model_pb2_grpc.ModelServiceServicer):
    """Serves Generate once `attach` gave it a running scheduler; UNAVAILABLE before."""

    def __init__(self, info: model_pb2.GetInfoResponse, metrics: Metrics) -> None:
        self.info = info
        self.metrics = metrics
        self.scheduler: Scheduler | None = None
        self.unavailable: str | None = None  # set by the watchdog while the decode loop is stalled
        self._relay: EmissionRelay | None = None
        self.draining = asyncio.Event()  # set by drain(): GenerateMany streams end once their requests did

    def _relay_for(self, loop: asyncio.AbstractEventLoop) -> EmissionRelay:
        """The relay of the loop serving the calls (made on the first call: the loop is known then)."""
        if self._relay is None or self._relay.loop is not loop:
            self._relay = EmissionRelay(loop)
        return self._relay

    def attach(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler

    def refuse(self, reason: str | None) -> None:
        """Answer new requests UNAVAILABLE with `reason` (None: serve again)."""
        self.unavailable = reason

    async def GetInfo(self, request: model_pb2.GetInfoRequest,
                      context: grpc.aio.ServicerContext) -> model_pb2.GetInfoResponse:
        return self.info

    async def Generate(self, request: model_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[model_pb2.GenerateResponse]:
        rid = new_request_id(given=request.request_id) if request.request_id else request_id_var.get()
        on_handle: Callable[[RequestHandle], None] = lambda handle: context.add_done_callback(lambda _: handle.cancel())
        # Under the call's span (the shared interceptor's).
        async with contextlib.aclosing(self._generate(request, context.time_remaining(), rid,
                                                      trace.get_current_span(), on_handle)) as responses:
            async for response in responses:
                yield response

    async def GenerateMany(self, request_iterator: AsyncIterator[model_pb2.GenerateManyRequest],
                           context: grpc.aio.ServicerContext) -> AsyncIterator[model_pb2.GenerateManyResponse]:
        stream = ManyStream(self._one, self.draining)
        async with contextlib.aclosing(stream.messages(request_iterator)) as messages:
            async for message in messages:
                yield message

    async def _one(self, request: model_pb2.GenerateRequest, time_remaining: float | None,
                   trace_context: Mapping[str, str]) -> AsyncIterator[model_pb2.GenerateResponse]:
        """One request of a GenerateMany stream, in its own task: its own request id and its own span, named as
        a Generate call's (the gateway's trace looks the same either way)."""
        rid = new_request_id(given=request.request_id)
        request_id_var.set(rid)  # this task's logs
        span = tracing.start_call(GENERATE_METHOD, tuple(trace_context.items()), rid)
        code, message = grpc.StatusCode.OK, ""
        try:
            async with contextlib.aclosing(self._generate(request, time_remaining, rid, span)) as responses:
                async for response in responses:
                    yield response
        except BaseException as error:
            status = status_of(error) if isinstance(error, Exception) else None
            code = status.code if status is not None else (
                grpc.StatusCode.CANCELLED if isinstance(error, (asyncio.CancelledError, GeneratorExit))
                else grpc.StatusCode.INTERNAL)
            message = status.message if status is not None else ""
            raise
        finally:
            tracing.end_call(span, code, message)

    def drain(self) -> None:
        """The service drains: GenerateMany streams end once their requests did."""
        self.draining.set()

    async def _generate(self, request: model_pb2.GenerateRequest, time_remaining: float | None, rid: str,
                        span: trace.Span, on_handle: Callable[[RequestHandle], None] | None = None
                        ) -> AsyncIterator[model_pb2.GenerateResponse]:
        """One request's responses (Generate's, or one of a GenerateMany stream's), its log line and metrics."""
        if (problem := request_id_too_long(request.request_id)) is not None:
            raise invalid_argument("request_id", problem)
        code = grpc.StatusCode.OK
        spans = GenerateTrace(span)
        try:
            # aclosing: a handler closed early cancels its request now, not at garbage collection.
            async with contextlib.aclosing(self._stream(request, time_remaining, rid, on_handle,
                                                        spans.observe if spans.on else None)) as responses:
                async for response in responses:
                    spans.observe(response)
                    yield response
        except SchedulerError as e:
            code = STATUS[e.kind]
            if e.kind is not ErrorKind.CANCELLED:  # a cancelled call's status is the client's already
                raise  # serving_common.errors.status_of gives its status
        except (asyncio.CancelledError, GeneratorExit):
            # GeneratorExit: the caller's cancel reached gRPC while it was sending a response; it closes the
            # handler's generator instead of cancelling the handler.
            code = grpc.StatusCode.CANCELLED
            raise
        except Exception:
            code = grpc.StatusCode.INTERNAL  # the interceptor logs it and answers INTERNAL
            raise
        finally:
            spans.close(len(request.token_ids))
            self.metrics.rpc_done(code.name)
            log.info("generate finished", extra={"request_id": rid, "code": code.name,
                                                 "prompt_tokens": len(request.token_ids)})

    async def _stream(self, request: model_pb2.GenerateRequest, time_remaining: float | None, rid: str,
                      on_handle: Callable[[RequestHandle], None] | None,
                      observe: Callable[[model_pb2.GenerateResponse], None] | None
                      ) -> AsyncIterator[model_pb2.GenerateResponse]:
        """The request's responses. On a GenerateMany stream (`outbox_var` set) a step's tokens go straight to the
        stream's outbox from the relay's delivery, and only the request's end comes through here."""
        scheduler = self.scheduler
        if scheduler is None:
            raise SchedulerError(ErrorKind.UNAVAILABLE, "the model is still loading or compiling; retry shortly")
        if self.unavailable is not None:
            raise SchedulerError(ErrorKind.UNAVAILABLE, self.unavailable)
        sink = self._relay_for(asyncio.get_running_loop()).sink()
        domain = to_request(request, rid, time_remaining)
        scheduler.validate(domain)  # the cheap checks first: a bad request waits for no compile
        grammar = await scheduler.guidance.compile_async(domain)  # off the loop and the decode thread
        handle = scheduler.submit(domain, sink.emit, grammar=grammar)
        if on_handle is not None:
            on_handle(handle)
        open_samples = domain.n
        details = not request.ids_only or request.top_logprobs > 0
        if (outbox := outbox_var.get()) is not None:
            sink.direct = Straight(details, observe, outbox)
        try:
            while True:
                batch = await sink.take()
                if len(batch) == 1 and batch[0].finish_reason is None and batch[0].error is None:
                    yield to_response(batch, details)  # the common case: one step's tokens of one sample
                    continue
                batch = _until_end(batch, open_samples)
                error = batch[-1].error
                good = [e for e in batch if e.error is None]
                for response in to_responses(good, details):
                    yield response
                if error is not None:
                    raise error
                open_samples -= sum(e.finish_reason is not None for e in good)
                if open_samples <= 0:
                    return
        finally:
            sink.direct = None  # nothing reaches the outbox after the request's end
            handle.cancel()
