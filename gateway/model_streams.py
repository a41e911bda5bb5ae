"""The gateway's side of GenerateMany: every request to a model replica rides on one stream to it.

One Generate call per request costs a gRPC message (an HTTP/2 frame, a write, a read, a wake-up on each side)
per request per decode step; on a GenerateMany stream (grok.model.v1) a step's tokens for every request on it
arrive as one message. `Lane` is one such stream: requests start on it with a `start` message, are cancelled
with a `cancel` message, and each reads its own responses from a `ManyCall`, which reads like the Generate
call it replaces (`read()` a response or EOF, `done()`, `cancel()`; a failure is the grpc.aio.AioRpcError the
Generate call would have raised, with the same status details), so failover, error mapping and draining in
gateway.model_pool work unchanged. Each request keeps its own deadline (sent with it, and enforced here too).

A lane is opened on a replica's first request and opened again after it failed or ended (the replica drains
or restarted: the requests it still had get UNAVAILABLE). An old lane takes no new requests and is closed
once its own ended; the next one is a new call, which gRPC's round_robin gives to the next address. A target
of one address (a unix socket, an IP address, localhost) keeps a lane `MAX_LANE_AGE_SECONDS`; a target that
may stand for several replicas (a DNS name, an ipv4:/ipv6: list: a scaled deployment) only
`SPREAD_LANE_AGE_SECONDS` and `SPREAD_LANE_REQUESTS` requests, so that its requests are spread over every address
behind it, as one call per request spread them (short requests one after another too), and replicas added later
are found.
"""

from __future__ import annotations

import asyncio
import collections
import ipaddress
import itertools
import logging
from collections.abc import Sequence

import grpc

from grok.model.v1 import model_pb2, model_pb2_grpc
from serving_common.errors import DETAILS_KEY

log = logging.getLogger(__name__)

MAX_LANE_AGE_SECONDS = 30.0  # the model service's default --max-connection-age-seconds
SPREAD_LANE_AGE_SECONDS = 1.0
SPREAD_LANE_REQUESTS = 2  # a lane to a target of several replicas takes this many requests, then the next call
TRACE_KEYS = frozenset({"traceparent", "tracestate"})
_CLOSE = object()  # ends a lane's outgoing messages (half-close)


def single_address(target: str) -> bool:
    """Whether `target` names one server: a unix socket, an IP address or localhost (with a port)."""
    if target.startswith(("unix:", "unix-abstract:")):
        return True
    if target.startswith(("ipv4:", "ipv6:")):
        return "," not in target
    host = target.rsplit(":", 1)[0].strip("[]") if ":" in target else target
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return host == "localhost"
    return True


def rpc_error(code: grpc.StatusCode, details: str, status_details: bytes = b"") -> grpc.aio.AioRpcError:
    """The error a Generate call ending with this status would raise (its details in the trailer, as gRPC puts them)."""
    trailers = grpc.aio.Metadata((DETAILS_KEY, status_details)) if status_details else grpc.aio.Metadata()
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), trailers, details)


CODES = {code.value[0]: code for code in grpc.StatusCode}


class ManyCall:
    """One request on a lane, read as its Generate call would be."""

    def __init__(self, lane: Lane, request_id: int, deadline: float | None) -> None:
        self.lane = lane
        self.id = request_id
        self.items: collections.deque[model_pb2.GenerateResponse] = collections.deque()
        self.end: grpc.aio.AioRpcError | None = None
        self.ended = False
        self._waiter: asyncio.Future[None] | None = None
        # One timer for the deadline (the event loop's clock), not one per read.
        self._timer = None if deadline is None else asyncio.get_running_loop().call_at(deadline, self._expire)

    def _expire(self) -> None:
        if not self.ended:
            self.fail(rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))
            self.lane.cancel(self.id)

    def _wake(self) -> None:
        if self.ended and self._timer is not None:
            self._timer.cancel()
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def deliver(self, update: model_pb2.RequestUpdate) -> None:
        self.items.extend(update.responses)
        if update.ended:
            self.ended = True
            if update.code:
                self.end = rpc_error(CODES.get(update.code, grpc.StatusCode.UNKNOWN), update.message,
                                     update.status_details)
        self._wake()

    def fail(self, error: grpc.aio.AioRpcError) -> None:
        if not self.ended:
            self.ended, self.end = True, error
            self._wake()

    async def read(self) -> object:
        """The next response, grpc.aio.EOF after the last, or the AioRpcError the request ended with."""
        while not self.items:
            if self.ended:
                if self.end is not None:
                    raise self.end
                return grpc.aio.EOF
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self.items.popleft()

    def done(self) -> bool:
        return self.ended

    def cancel(self) -> None:
        """Cancel the request at the replica (its slot is freed within a step); reads end with CANCELLED."""
        if not self.ended:
            self.fail(rpc_error(grpc.StatusCode.CANCELLED, "Locally cancelled by application!"))
            self.lane.cancel(self.id)


class Lane:
    """One GenerateMany stream to a replica and the requests on it."""

    def __init__(self, stub: model_pb2_grpc.ModelServiceStub, address: str, max_age: float,
                 max_requests: int | None = None) -> None:
        self.address = address
        self.max_age = max_age
        self.max_requests = max_requests  # None: any number
        self.calls: dict[int, ManyCall] = {}
        self.ids = itertools.count(1)
        self.started = 0
        self.outgoing: asyncio.Queue[object] = asyncio.Queue()
        self.opened_at = asyncio.get_running_loop().time()
        self.retiring = False
        self.closed = False
        # Written by one task of ours, not from a request iterator: a write that finds the call ended (a replica
        # without GenerateMany ends it at once) then fails here alone, instead of turning the call's status
        # into gRPC's INTERNAL "Internal error from Core".
        self.call = stub.GenerateMany()
        self.writer = asyncio.create_task(self._write())
        self.reader = asyncio.create_task(self._read())

    @property
    def usable(self) -> bool:
        too_old = asyncio.get_running_loop().time() - self.opened_at > self.max_age
        if not self.retiring and (too_old or (self.max_requests is not None and self.started >= self.max_requests)):
            self.retire()
        return not self.closed and not self.retiring

    async def _write(self) -> None:
        try:
            while (message := await self.outgoing.get()) is not _CLOSE:
                await self.call.write(message)
            await self.call.done_writing()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError) as error:
            log.debug("model stream write failed", extra={"replica": self.address, "error": str(error)})

    def start(self, request: model_pb2.GenerateRequest, deadline: float | None,
              metadata: Sequence[tuple[str, str]]) -> ManyCall:
        call = ManyCall(self, next(self.ids), deadline)
        self.started += 1
        start = model_pb2.StartRequest(id=call.id, request=request,
                                       trace_context={k: v for k, v in metadata if k in TRACE_KEYS})
        if deadline is not None:
            start.timeout_seconds = max(0.0, deadline - asyncio.get_running_loop().time())
        self.calls[call.id] = call
        self.outgoing.put_nowait(model_pb2.GenerateManyRequest(start=start))
        return call

    def cancel(self, request_id: int) -> None:
        if self.calls.pop(request_id, None) is not None and not self.closed:
            self.outgoing.put_nowait(model_pb2.GenerateManyRequest(cancel=request_id))
        self._close_if_retired()

    def retire(self) -> None:
        """No new requests; half-close once the ones on it ended."""
        self.retiring = True
        self._close_if_retired()

    def _close_if_retired(self) -> None:
        if self.retiring and not self.calls and not self.closed:
            self.closed = True
            self.outgoing.put_nowait(_CLOSE)

    async def _read(self) -> None:
        error = rpc_error(grpc.StatusCode.UNAVAILABLE, "the replica ended its GenerateMany stream (draining?)")
        try:
            async for message in self.call:
                for update in message.updates:
                    call = self.calls.get(update.id)
                    if call is None:
                        continue  # cancelled here already
                    call.deliver(update)
                    if update.ended:
                        del self.calls[update.id]
                self._close_if_retired()
        except grpc.aio.AioRpcError as failure:
            error = failure
            if failure.code() != grpc.StatusCode.CANCELLED:
                log.info("model stream ended", extra={"replica": self.address, "code": failure.code().name})
        except asyncio.CancelledError:
            error = rpc_error(grpc.StatusCode.CANCELLED, "the gateway closed the stream")
            raise
        finally:
            self.closed = True
            for call in list(self.calls.values()):
                call.fail(error)
            self.calls.clear()

    def close(self) -> None:
        self.closed = True
        self.call.cancel()
        self.writer.cancel()
        self.reader.cancel()


class Lanes:
    """A replica's lanes: up to `count`, a request goes on the one with the fewest requests."""

    def __init__(self, stub: model_pb2_grpc.ModelServiceStub, address: str, count: int) -> None:
        self.stub = stub
        self.address = address
        self.count = count
        one = single_address(address)
        self.max_age = MAX_LANE_AGE_SECONDS if one else SPREAD_LANE_AGE_SECONDS
        self.max_requests = None if one else SPREAD_LANE_REQUESTS
        self.lanes: list[Lane] = []

    def start(self, request: model_pb2.GenerateRequest, deadline: float | None,
              metadata: Sequence[tuple[str, str]]) -> ManyCall:
        self.lanes = [lane for lane in self.lanes if not lane.closed]
        usable = [lane for lane in self.lanes if lane.usable]
        if len(usable) < self.count:
            lane = Lane(self.stub, self.address, self.max_age, self.max_requests)
            self.lanes.append(lane)
        else:
            lane = min(usable, key=lambda candidate: len(candidate.calls))
        return lane.start(request, deadline, metadata)

    def close(self) -> None:
        for lane in self.lanes:
            lane.close()
        self.lanes = []
