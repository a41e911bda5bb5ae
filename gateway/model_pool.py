"""The model replicas: least outstanding requests among healthy ones, failover on UNAVAILABLE, and a request no
replica started retried while every one is down (gateway.clients has the channels' options and deadlines)."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import grpc

from gateway.clients import MODEL_CHANNEL_OPTIONS, Metadata, remaining
from gateway.errors import GatewayError, down, from_upstream
from gateway.model_streams import Lanes, ManyCall
from grok.model.v1 import model_pb2, model_pb2_grpc
from serving_common.tls import ChannelTLS, secure_channel

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Replica:
    """One model service address and what the gateway knows about it."""

    address: str
    channel: grpc.aio.Channel
    stub: model_pb2_grpc.ModelServiceStub
    outstanding: int = 0
    serving: bool = False  # set by the health watch
    lanes: Lanes | None = None  # its GenerateMany streams (None: a Generate call per request)
    serves_many: bool | None = None  # its GetInfo announced GenerateMany (None: not asked yet)

    async def call(self, request: model_pb2.GenerateRequest, deadline: float | None,
                   metadata: Metadata) -> grpc.aio.UnaryStreamCall | ManyCall:
        if self.lanes is not None and self.serves_many is None:
            self.serves_many = await self._announces_many(deadline)
        if self.lanes is not None and self.serves_many:
            return self.lanes.start(request, deadline, metadata)
        return self.stub.Generate(request, timeout=remaining(deadline), metadata=metadata)

    async def _announces_many(self, deadline: float | None) -> bool | None:
        """Whether the replica serves GenerateMany, as its GetInfo says (an older version says nothing: a Generate
        call per request); None when it did not answer (asked again next time; this request uses Generate)."""
        try:
            info = await self.stub.GetInfo(model_pb2.GetInfoRequest(), timeout=remaining(deadline))
        except grpc.aio.AioRpcError:
            return None
        if not info.generate_many:
            log.warning("model replica does not serve GenerateMany (an older version?): a Generate call per request",
                        extra={"replica": self.address})
        return info.generate_many

    async def first(self, request: model_pb2.GenerateRequest, deadline: float | None,
                    metadata: Metadata) -> tuple[grpc.aio.UnaryStreamCall | ManyCall, object]:
        """Start the request here and read its first response (AioRpcError as the call raised it)."""
        call = await self.call(request, deadline, metadata)
        try:
            return call, await call.read()
        except grpc.aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.UNIMPLEMENTED or not isinstance(call, ManyCall):
                raise
        except BaseException:
            call.cancel()
            raise
        if self.serves_many:  # the first of the requests that were on its stream to find out
            log.warning("model replica has no GenerateMany after all: a Generate call per request",
                        extra={"replica": self.address})
            self.serves_many = False  # the replica ended the stream: every request on it gets UNIMPLEMENTED too
        return await self.first(request, deadline, metadata)


class ModelStream:
    """An open model Generate stream whose first response was already read."""

    def __init__(self, replica: Replica, call: grpc.aio.UnaryStreamCall | ManyCall, first: object) -> None:
        self.replica = replica
        self.call = call
        self.first = first
        self.closed = False

    async def responses(self) -> AsyncIterator[model_pb2.GenerateResponse]:
        reply = self.first
        while reply is not grpc.aio.EOF:
            yield reply  # type: ignore[misc]
            try:
                reply = await self.call.read()
            except grpc.aio.AioRpcError as error:
                raise from_upstream(error, "model", self.replica.address) from error

    async def drain(self) -> None:
        """After the final response: read the call's end, so it completes OK instead of being cancelled."""
        try:
            while await self.call.read() is not grpc.aio.EOF:
                pass
        except grpc.aio.AioRpcError as error:
            log.debug("model stream ended badly after its last token", extra={"code": error.code().name})

    def close(self) -> None:
        """Cancel the call if still running (frees the model's slot) and stop counting it."""
        if not self.closed:
            self.closed = True
            self.replica.outstanding -= 1
            if not self.call.done():
                self.call.cancel()


T = TypeVar("T")
RETRY_FIRST_PAUSE = 0.25  # seconds before a request no replica could start is tried again; doubled each time
RETRY_MAX_PAUSE = 2.0
RETRY_MIN_LEFT = 0.1  # a retry needs this much of the deadline left after its pause


class NoReplica(GatewayError):
    """UNAVAILABLE: every model replica was unavailable and none started the request (nothing reached its
    client), so it may be tried again."""


class ModelPool:
    """The model replicas: least outstanding requests among healthy ones, failover on UNAVAILABLE."""

    def __init__(self, addresses: Sequence[str], tls: ChannelTLS | None = None, streams: int = 1,
                 retry_seconds: float = 0.0) -> None:
        self.streams = streams  # GenerateMany streams per replica (0: a Generate call per request)
        self.retry_seconds = retry_seconds  # GatewayConfig.model_retry_seconds
        self.replicas = [self._replica(a, tls) for a in addresses]
        self._turn = itertools.count()
        self._info: model_pb2.GetInfoResponse | None = None

    def _replica(self, address: str, tls: ChannelTLS | None) -> Replica:
        channel = secure_channel(address, tls, MODEL_CHANNEL_OPTIONS)
        stub = model_pb2_grpc.ModelServiceStub(channel)
        return Replica(address, channel, stub, lanes=Lanes(stub, address, self.streams) if self.streams else None)

    def order(self) -> list[Replica]:
        """Replicas to try, best first: SERVING, connected, fewest in flight; ties rotate."""
        start = next(self._turn) % len(self.replicas)
        rotated = self.replicas[start:] + self.replicas[:start]
        ready = grpc.ChannelConnectivity.READY
        return sorted(rotated, key=lambda r: (not r.serving, r.channel.get_state() != ready, r.outstanding))

    def forget_info(self) -> None:
        self._info = None

    async def info(self, deadline: float | None) -> model_pb2.GetInfoResponse:
        """The model's GetInfo (replicas serve the same model), cached after the first success; while every
        replica is unavailable it is asked again as `generate` retries."""
        if self._info is not None:
            return self._info
        return await self._retrying(lambda: self._info_once(deadline), deadline)

    async def _info_once(self, deadline: float | None) -> model_pb2.GetInfoResponse:
        problems = []
        for replica in self.order():
            try:
                self._info = await replica.stub.GetInfo(model_pb2.GetInfoRequest(), timeout=remaining(deadline))
                return self._info
            except grpc.aio.AioRpcError as error:
                if error.code() != grpc.StatusCode.UNAVAILABLE:
                    raise from_upstream(error, "model", replica.address) from error
                problems.append(f"{replica.address}: {error.details()}")
        log.warning("no model replica answered GetInfo", extra={"problems": problems})
        error = down("model", f"none of its {len(self.replicas)} replica(s) answered")
        raise NoReplica(error.code, error.message, retry_after=error.retry_after)

    async def generate(self, request: model_pb2.GenerateRequest, deadline: float | None,
                       metadata: Metadata = ()) -> ModelStream:
        """Start Generate on the best replica. A replica that answers UNAVAILABLE or RESOURCE_EXHAUSTED
        before its first response is skipped; when every one did, the request gets that status, except that
        when every one was unavailable (none started it: nothing reached its client) it is tried again, after
        pauses growing from RETRY_FIRST_PAUSE to RETRY_MAX_PAUSE, for up to `retry_seconds` and never past its
        deadline, as a load balancer would while a replica restarts."""
        return await self._retrying(lambda: self._generate_once(request, deadline, metadata), deadline)

    async def _retrying(self, once: Callable[[], Awaitable[T]], deadline: float | None) -> T:
        """`once()` again while it raises NoReplica, for up to `retry_seconds` and never past `deadline`."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self.retry_seconds
        pause = RETRY_FIRST_PAUSE
        tries = 1
        while True:
            try:
                return await once()
            except NoReplica:
                wait = min(pause, give_up - loop.time())
                if deadline is not None:
                    wait = min(wait, deadline - loop.time() - RETRY_MIN_LEFT)
                if wait <= 0:
                    raise
                log.warning("no model replica available: retrying the request", extra={
                    "attempt": tries, "pause_s": round(wait, 3)})
                await asyncio.sleep(wait)
                pause, tries = min(pause * 2, RETRY_MAX_PAUSE), tries + 1

    async def _generate_once(self, request: model_pb2.GenerateRequest, deadline: float | None,
                             metadata: Metadata) -> ModelStream:
        problems: list[str] = []
        busy: GatewayError | None = None
        for replica in self.order():
            remaining(deadline)  # DEADLINE_EXCEEDED before starting anything when it passed
            replica.outstanding += 1
            try:
                call, first = await replica.first(request, deadline, metadata)
            except grpc.aio.AioRpcError as error:
                replica.outstanding -= 1
                if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    busy = from_upstream(error, "model", replica.address)
                elif error.code() != grpc.StatusCode.UNAVAILABLE:
                    raise from_upstream(error, "model", replica.address) from error
                problems.append(f"{replica.address}: {error.details()}")
                log.warning("model replica refused, trying the next",
                            extra={"replica": replica.address, "code": error.code().name})
                continue
            except BaseException:
                replica.outstanding -= 1
                raise
            return ModelStream(replica, call, first)
        if busy is not None:
            raise busy
        log.warning("no model replica accepted the request", extra={"problems": problems})
        error = down("model", f"none of its {len(self.replicas)} replica(s) accepted the request")
        raise NoReplica(error.code, error.message, retry_after=error.retry_after)

    async def close(self) -> None:
        for replica in self.replicas:
            if replica.lanes is not None:
                replica.lanes.close()
        await asyncio.gather(*(r.channel.close() for r in self.replicas))
