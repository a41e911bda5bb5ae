"""The server interceptor every service installs: request ids, malformed requests, errors -> statuses.

For each call it
- takes the caller's `x-request-id` (or makes one, when there is none or it is not printable ASCII),
  tags the call's log lines with it and echoes it in the trailing metadata; an id longer than 128
  characters is refused with INVALID_ARGUMENT;
- refuses a request that does not parse (corrupt protobuf, a string field that is not UTF-8) with
  INVALID_ARGUMENT and one warning line; grpcio alone answers UNKNOWN naming an internal exception
  class and logs a traceback;
- reads a unary request from the request stream, so that a call whose stream ends without a complete
  message (an empty or truncated body) is refused with INVALID_ARGUMENT; grpcio alone never answers it;
- ends the call with the status `serving_common.errors.status_of` gives a raised `ServiceError` or
  `DomainError`, details included (`google.rpc.Status` with BadRequest / RetryInfo); anything else
  raised is INTERNAL, logged with its traceback and the
  request id, and the process keeps serving;
- opens the call's span (serving_common.tracing) under the trace context of the caller's `traceparent`
  metadata, current for the whole call and ended with its status (health and reflection calls have none).

Servicers therefore raise and never call `context.abort` themselves. `install(interceptors)` adds it
to the interceptors of a server created elsewhere.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, NoReturn

import grpc
from opentelemetry import trace

from serving_common import tracing
from serving_common.errors import DETAILS_KEY, ServiceError, invalid_argument, status_of
from serving_common.logs import given_request_id, new_request_id, request_id_too_long, request_id_var

log = logging.getLogger(__name__)

REQUEST_ID_KEY = "x-request-id"
# Health checks and reflection: infrastructure, polled all the time; a span each would bury the requests.
UNTRACED = ("/grpc.health.", "/grpc.reflection.")
Metadata = tracing.Metadata
Behavior = Callable[..., Any]
Start = Callable[[Any], Awaitable["_Call"]]


class _Malformed:
    """Stands in for a request that failed to parse, so the call can be refused with a real status."""

    def __init__(self, type_name: str, error: Exception) -> None:
        # protobuf says "Error parsing message with type 'X': <reason>"; the reason is what helps.
        self.reason = str(error).rpartition(": ")[2] or type(error).__name__
        self.type_name = type_name

    def error(self) -> ServiceError:
        return invalid_argument("request", f"not a valid {self.type_name} message ({self.reason}): send a "
                                "well-formed protobuf message whose string fields are UTF-8")


def _tolerant(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserialize is None:
        return None
    owner = getattr(deserialize, "__self__", None)
    descriptor = getattr(owner, "DESCRIPTOR", None)
    type_name = getattr(descriptor, "full_name", "request")

    def parse(raw: bytes) -> Any:
        try:
            return deserialize(raw)
        except Exception as error:  # noqa: BLE001 - any parse failure is the caller's bad input
            return _Malformed(type_name, error)

    return parse


class _Call:
    """One call's request id and the way it ends with an error."""

    def __init__(self, service: str, method: str, request_id: str, context: grpc.aio.ServicerContext) -> None:
        self.service = service
        self.method = method
        self.request_id = request_id
        self.context = context
        self.span: trace.Span = trace.INVALID_SPAN
        self.code: grpc.StatusCode | None = None  # set when the call ends with an error status

    def begin(self, metadata: Metadata | None) -> None:
        request_id_var.set(self.request_id)
        self.context.set_trailing_metadata(((REQUEST_ID_KEY, self.request_id),))
        if not self.method.startswith(UNTRACED):
            self.span = tracing.start_call(self.method, metadata, self.request_id)

    def end(self, message: str = "") -> None:
        """The call is over: end its span with its status (once)."""
        if self.span is trace.INVALID_SPAN:
            return
        code = self.code or (grpc.StatusCode.CANCELLED if self.context.cancelled() else grpc.StatusCode.OK)
        tracing.end_call(self.span, code, message)
        self.span = trace.INVALID_SPAN

    async def refuse(self, malformed: _Malformed) -> NoReturn:
        error = malformed.error()
        log.warning("malformed request refused", extra={"method": self.method, "detail": malformed.reason})
        await self._abort(error)

    async def refuse_id(self, problem: str) -> NoReturn:
        log.warning("request id refused", extra={"method": self.method, "detail": problem})
        await self._abort(invalid_argument("x-request-id", problem))

    async def refuse_empty(self) -> NoReturn:
        log.warning("empty request refused", extra={"method": self.method})
        await self._abort(invalid_argument(
            "request", "the call ended before its request message arrived (an empty or truncated body): "
            "send one complete length-prefixed protobuf message"))

    async def fail(self, error: Exception) -> NoReturn:
        if isinstance(error, grpc.aio.AbortError):
            raise error  # the call already has its status
        if (status := status_of(error)) is not None:
            log.info("rpc failed", extra={"method": self.method, "code": status.code.name, "detail": status.message})
            await self._abort(status)
        log.error("unexpected error", exc_info=error, extra={"method": self.method})
        await self._abort(ServiceError(grpc.StatusCode.INTERNAL, f"internal error in the {self.service} service "
                                       f"(request id {self.request_id}); its logs have the details"))

    async def _abort(self, error: ServiceError) -> NoReturn:
        self.code = error.code
        self.end(error.message)
        trailers = ((DETAILS_KEY, error.status_proto().SerializeToString()), (REQUEST_ID_KEY, self.request_id))
        await self.context.abort(error.code, error.message, trailing_metadata=trailers)
        raise AssertionError("abort returned")  # pragma: no cover - abort always raises


async def _checked(requests: AsyncIterator[Any], call: _Call) -> AsyncIterator[Any]:
    async for request in requests:
        if isinstance(request, _Malformed):
            log.warning("malformed request refused", extra={"method": call.method, "detail": request.reason})
            raise request.error()
        yield request


async def _one_request(requests: AsyncIterator[Any], call: _Call) -> Any:
    """The single message of a unary call; a request stream that ends without one is refused."""
    async for request in requests:
        if isinstance(request, _Malformed):
            await call.refuse(request)
        return request
    await call.refuse_empty()


def _wrap_unary_request(inner: Behavior, start: Start, streams: bool) -> Behavior:
    """Unary request, read from the request *stream*; `streams` says whether the response is a stream.

    gRPC's own unary handling drops a call whose request stream ends without a complete message and
    never sends it a status (the client waits for its deadline); reading the request as a stream here
    lets such a call be refused at once.
    """
    if streams and inspect.isasyncgenfunction(inner):
        async def stream_out(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            call = await start(context)
            try:
                request = await _one_request(requests, call)
                try:
                    async for response in inner(request, context):
                        yield response
                except Exception as error:  # noqa: BLE001 - mapped to a status
                    await call.fail(error)
            finally:
                call.end()
        return stream_out

    async def single(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
        call = await start(context)
        try:
            request = await _one_request(requests, call)
            try:
                return await inner(request, context)  # a response, or None for a context.write() stream
            except Exception as error:  # noqa: BLE001 - mapped to a status
                await call.fail(error)
        finally:
            call.end()
    return single


def _wrap_stream_request(inner: Behavior, start: Start, streams: bool) -> Behavior:
    if streams and inspect.isasyncgenfunction(inner):
        async def stream_out(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            call = await start(context)
            try:
                async for response in inner(_checked(requests, call), context):
                    yield response
            except Exception as error:  # noqa: BLE001 - mapped to a status
                await call.fail(error)
            finally:
                call.end()
        return stream_out

    async def single(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
        call = await start(context)
        try:
            return await inner(_checked(requests, call), context)
        except Exception as error:  # noqa: BLE001 - mapped to a status
            await call.fail(error)
        finally:
            call.end()
    return single


class StatusInterceptor(grpc.aio.ServerInterceptor):
    """Installed first on every server of the stack; `service` names it in INTERNAL messages."""

    def __init__(self, service: str) -> None:
        self.service = service

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None:
            return None
        method = details.method
        too_long = request_id_too_long(given_request_id(details.invocation_metadata))
        request_id = new_request_id(None if too_long else details.invocation_metadata)

        async def start(context: grpc.aio.ServicerContext) -> _Call:
            call = _Call(self.service, method, request_id, context)
            call.begin(details.invocation_metadata)
            if too_long:
                await call.refuse_id(too_long)
            return call

        kind = "stream_stream" if handler.response_streaming else "stream_unary"
        if handler.request_streaming:
            wrapped = _wrap_stream_request(getattr(handler, kind), start, handler.response_streaming)
        else:
            unary_kind = "unary_stream" if handler.response_streaming else "unary_unary"
            wrapped = _wrap_unary_request(getattr(handler, unary_kind), start, handler.response_streaming)
        return handler._replace(request_deserializer=_tolerant(handler.request_deserializer), request_streaming=True,
                                unary_unary=None, unary_stream=None, **{kind: wrapped})


def install(service: str, interceptors: Sequence[grpc.aio.ServerInterceptor] = ()) -> list[grpc.aio.ServerInterceptor]:
    """The interceptor list for `grpc.aio.server(interceptors=...)`: ours first, then `interceptors`."""
    return [StatusInterceptor(service), *interceptors]
