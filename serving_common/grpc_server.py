"""gRPC server plumbing shared by the services: health, reflection, connection age, binding.

serving_common.lifecycle puts them together and drains a server on SIGTERM."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from serving_common.interceptor import install
from serving_common.uds import GRPC_INSTEAD, no_tcp, tcp_refused

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


class HealthService(health_pb2_grpc.HealthServicer):
    """grpc.health.v1 whose Watch streams end once the server drains.

    grpcio's servicer keeps a Watch open until the server stops it, so a connected watcher (the
    gateway watches every backend) held a SIGTERM'd server for its whole grace period even when idle.
    Here a watcher gets NOT_SERVING and then the end of its stream, and the drain ends as soon as the
    real calls do. Every status starts NOT_SERVING.
    """

    def __init__(self, services: Iterable[str]) -> None:
        self._status = {name: NOT_SERVING for name in ("", *services)}
        self._changed: asyncio.Event | None = None  # replaced on every change; created on the loop
        self.draining = False

    def _event(self) -> asyncio.Event:
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    def status(self, service: str) -> int | None:
        return self._status.get(service)

    def set(self, service: str, status: int) -> None:
        self._status[service] = status
        changed, self._changed = self._event(), asyncio.Event()
        changed.set()

    def drain(self) -> None:
        """NOT_SERVING everywhere and end every Watch stream."""
        self.draining = True
        for name in self._status:
            self.set(name, NOT_SERVING)

    async def Check(self, request: health_pb2.HealthCheckRequest,  # noqa: N802 (gRPC's name)
                    context: grpc.aio.ServicerContext) -> health_pb2.HealthCheckResponse:
        status = self._status.get(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=status)

    async def List(self, request: health_pb2.HealthListRequest,  # noqa: N802
                   context: grpc.aio.ServicerContext) -> health_pb2.HealthListResponse:
        return health_pb2.HealthListResponse(
            statuses={name: health_pb2.HealthCheckResponse(status=s) for name, s in self._status.items()})

    async def Watch(self, request: health_pb2.HealthCheckRequest,  # noqa: N802
                    context: grpc.aio.ServicerContext) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        last = None
        while True:
            changed = self._event()
            status = self._status.get(request.service, SERVICE_UNKNOWN)
            if status != last:
                yield health_pb2.HealthCheckResponse(status=status)
                last = status
                continue  # the status may have changed while the reply was sent
            if self.draining:
                return
            await changed.wait()


class HealthReporter:
    """Sets the same status for the overall server ("") and each named service.

    Once `drain()` was called the server stays NOT_SERVING (a load finishing or a dependency coming
    back during shutdown must not advertise it again) and Watch streams are closed.
    """

    def __init__(self, servicer: HealthService, services: Iterable[str]) -> None:
        self.servicer = servicer
        self.services = ("", *services)
        self.serving = False  # what the servicer reports now (it starts NOT_SERVING)

    @property
    def draining(self) -> bool:
        return self.servicer.draining

    async def set(self, serving: bool) -> None:
        """Report SERVING or NOT_SERVING (SERVING is ignored while draining; unchanged status is a no-op)."""
        serving = serving and not self.draining
        if serving == self.serving:
            return
        self.serving = serving
        status = SERVING if serving else NOT_SERVING
        for name in self.services:
            self.servicer.set(name, status)

    async def drain(self) -> None:
        """NOT_SERVING from now on; Watch streams end."""
        self.serving = False
        self.servicer.drain()


def add_health_and_reflection(server: grpc.aio.Server, service_full_names: Iterable[str]) -> HealthReporter:
    """Register grpc.health.v1 (initially NOT_SERVING) and server reflection for the given services."""
    names = tuple(service_full_names)
    servicer = HealthService(names)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    reflection.enable_server_reflection(
        (*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server
    )
    return HealthReporter(servicer, names)


# gRPC turns SO_REUSEPORT on by default: a second process bound to a port in use then starts anyway
# and the kernel splits the calls between the two. Off, binding a port in use fails.
NO_PORT_SHARING = ("grpc.so_reuseport", 0)
# gRPC refuses request headers between its soft (8 KiB) and hard (16 KiB) limits at random, with a
# RESOURCE_EXHAUSTED that no retry fixes. One limit, 16 KiB, so that a header below it always reaches
# the interceptor (which refuses an over-long x-request-id with INVALID_ARGUMENT) and one above it never does.
METADATA_LIMIT_BYTES = 16 << 10
HEADER_LIMITS = (("grpc.max_metadata_size", METADATA_LIMIT_BYTES),
                 ("grpc.absolute_max_metadata_size", METADATA_LIMIT_BYTES))


def new_server(service: str, options: Sequence[tuple[str, Any]] = (),
               interceptors: Sequence[grpc.aio.ServerInterceptor] = ()) -> grpc.aio.Server:
    """A grpc.aio server with the shared status interceptor first (see serving_common.interceptor) that
    refuses to share its port with another process."""
    return grpc.aio.server(interceptors=install(service, interceptors), options=[NO_PORT_SHARING, *HEADER_LIMITS, *options])


# gRPC core reads INT_MAX milliseconds as "no limit".
_NO_LIMIT_MS = 2**31 - 1


def connection_age_options(max_age_seconds: float, grace_seconds: float | None = None) -> list[tuple[str, int]]:
    """Server options that end each client connection after about `max_age_seconds` (0: never).

    gRPC sends a GOAWAY once a connection is that old (+-10% jitter): calls in flight finish on it
    (for at most `grace_seconds`; None: no limit, so a long generation is never cut), new calls open
    a new connection, and a client balancing over a `dns:///` name re-resolves it on the way. That
    is how replicas added behind a name (a scaled Deployment, `compose --scale`) get traffic from
    clients that are already connected; a DNS answer alone never reaches them.
    """
    if max_age_seconds <= 0:
        return []
    grace_ms = _NO_LIMIT_MS if grace_seconds is None else _milliseconds(grace_seconds)
    return [("grpc.max_connection_age_ms", _milliseconds(max_age_seconds)),
            ("grpc.max_connection_age_grace_ms", grace_ms)]


def _milliseconds(seconds: float) -> int:
    """At least 1 ms (gRPC reads 0 as "immediately" for grace, and an age must be positive), at most no limit."""
    return int(min(float(_NO_LIMIT_MS), max(1.0, seconds * 1000.0)))


def bind(server: grpc.aio.Server, host: str, port: int) -> int:
    """Bind an insecure port and return the port actually bound (port 0 picks a free one)."""
    try:
        bound = server.add_insecure_port(f"{host}:{port}")
    except RuntimeError:  # grpcio >= 1.5x raises instead of returning 0
        bound = 0
    if bound == 0:
        raise bind_error(host, port)
    return bound


def bind_error(host: str, port: int) -> OSError:
    """Why `host:port` could not be bound: no TCP on this host at all (say --uds), else in use or not here."""
    if (reason := tcp_refused(host)) is not None:
        return OSError(no_tcp(f"could not bind {host}:{port}", reason, GRPC_INSTEAD))
    return OSError(f"could not bind {host}:{port} (in use, or the address is not on this machine)")
