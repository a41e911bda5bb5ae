"""How every service's gRPC server is built and stopped: one path the three services share.

`assemble` makes the server (the shared status interceptor first, its port not shared), registers the
service with grpc.health.v1 (NOT_SERVING until the service says otherwise) and reflection, and binds
the port, with TLS when configured. `drain` is the one shutdown sequence: health NOT_SERVING (Watch
streams end), `before_stop` (stop admitting work; wait for work already routed here), stop accepting
and give the calls in flight what is left of the grace period, then `after_stop` (stop a decode
thread, close channels). `serve_until_signal` runs it on SIGTERM/SIGINT.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from serving_common.grpc_server import HealthReporter, add_health_and_reflection, new_server
from serving_common.tls import ServerTLS, bind_port

log = logging.getLogger(__name__)

Hook = Callable[[], Awaitable[None]]


def freeze_startup_heap() -> int:
    """Collect once, then move every object that survives (what starting the service built: modules, the
    model, compiled programs) into the collector's permanent generation; returns how many. A full collection
    while serving then walks only what was made since, instead of stalling every call while it walks the
    startup heap too (136 ms on the medium model service). Called once a service is about to report SERVING."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


@dataclass(frozen=True)
class Assembled:
    """A bound, not yet started server and its health reporter (NOT_SERVING)."""

    server: grpc.aio.Server
    health: HealthReporter
    port: int


def assemble(service: str, full_name: str, register: Callable[[grpc.aio.Server], None], host: str, port: int,
             tls: ServerTLS | None, *, options: Sequence[tuple[str, Any]] = (),
             interceptors: Sequence[grpc.aio.ServerInterceptor] = (), uds: str | None = None) -> Assembled:
    """The server of `service` ("model": named in INTERNAL messages) serving `full_name`, which
    `register` adds; port 0 picks a free one. `uds`: listen on that unix socket file instead of
    host:port (serving_common.uds; the port is then 0)."""
    server = new_server(service, options, interceptors)
    register(server)
    health = add_health_and_reflection(server, [full_name])
    return Assembled(server, health, bind_port(server, host, port, tls, uds))


async def drain(server: grpc.aio.Server, health: HealthReporter, grace: float | None,
                before_stop: Hook | None = None, after_stop: Hook | None = None) -> None:
    """NOT_SERVING, `before_stop`, stop with the rest of `grace` (None: no limit), `after_stop`.

    The grace period is the whole drain: what `before_stop` takes comes out of the calls' time.
    """
    loop = asyncio.get_running_loop()
    began = loop.time()
    await health.drain()
    if before_stop is not None:
        await before_stop()
    await server.stop(None if grace is None else max(0.0, grace - (loop.time() - began)))
    if after_stop is not None:
        await after_stop()


async def serve_until_signal(server: grpc.aio.Server, health: HealthReporter, grace_seconds: float,
                             before_stop: Hook | None = None, after_stop: Hook | None = None,
                             ready: Callable[[], None] | None = None) -> None:
    """Wait for SIGTERM/SIGINT, then `drain`. `ready` runs once the signals are handled (a service's "serving"
    log line: after it, a SIGTERM drains)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if ready is not None:
        ready()
    await stop.wait()
    log.info("draining", extra={"grace_seconds": grace_seconds})
    await drain(server, health, grace_seconds, before_stop, after_stop)
    log.info("stopped")
