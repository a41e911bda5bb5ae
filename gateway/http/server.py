"""uvicorn serving the HTTP app inside the gateway's own event loop (beside the grpc.aio server).

uvicorn's `Server.serve()` would install its own SIGTERM/SIGINT handlers and fight the gateway's
drain; so the server is driven through its startup / main_loop / shutdown steps instead, on a socket
bound here (port 0 picks a free port, and a port in use fails before anything starts). Shutdown stops
accepting connections, lets in-flight responses (streams included) finish within the grace period,
then cancels what is left.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl

import uvicorn
from fastapi import FastAPI

from gateway.http.slow_clients import BODY_SECONDS, HEADER_SECONDS, STALL_SECONDS, guarded
from serving_common.tls import ServerTLS
from serving_common.uds import SocketFile, bind_unix, no_tcp

log = logging.getLogger(__name__)
HTTP_INSTEAD = "serve the HTTP API on a unix socket file with --http-uds PATH, or turn it off with --http-port 0"


def bind_socket(host: str, port: int) -> socket.socket:
    """A bound TCP socket for uvicorn (IPv6 when `host` is an IPv6 address).

    Made with proto IPPROTO_TCP, so asyncio turns Nagle's algorithm off (TCP_NODELAY) on every accepted
    connection, as it does for sockets it creates itself: with proto 0 it left it on, and on a kept-alive
    connection the first token's event waited for the client's delayed ACK of the headers (~40 ms)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    except OSError as error:
        raise OSError(no_tcp(f"--http-port {port}", error.strerror or str(error), HTTP_INSTEAD)) from None
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise OSError(f"--http-port: could not bind {host}:{port} ({error.strerror or error})") from None
    return sock


class HttpServer:
    """One uvicorn server on one socket; `start`, then `begin_shutdown` + `wait_stopped`."""

    def __init__(self, app: FastAPI, host: str, port: int, tls: ServerTLS | None, grace_seconds: float,
                 header_seconds: float = HEADER_SECONDS, body_seconds: float = BODY_SECONDS,
                 stall_seconds: float = STALL_SECONDS, uds: str | None = None) -> None:
        self.uds = uds  # a unix socket file instead of host:port (serving_common.uds); the port is then 0
        self.socket_file: SocketFile | None = None
        if uds is not None:
            self.socket, self.socket_file = bind_unix(uds, "--http-uds")
            self.port = 0
        else:
            self.socket = bind_socket(host, port)
            self.port = self.socket.getsockname()[1]
        self.tls = tls
        tls_options = {}
        if tls is not None:
            tls.ssl_context()  # fail at start-up, naming the flag, if the files are unusable
            tls_options = {"ssl_certfile": tls.cert, "ssl_keyfile": tls.key}
            if tls.client_ca:
                tls_options |= {"ssl_ca_certs": tls.client_ca, "ssl_cert_reqs": ssl.CERT_REQUIRED}
        # Slow clients: see slow_clients.py (headers and body each have a deadline).
        self.config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off",
                                     http=guarded(header_seconds, body_seconds, stall_seconds),
                                     timeout_graceful_shutdown=grace_seconds, **tls_options)  # type: ignore[arg-type]
        self.server = uvicorn.Server(self.config)
        self._main: asyncio.Task[None] | None = None
        self._stopping: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.config.load()
        self.server.lifespan = self.config.lifespan_class(self.config)
        await self.server.startup(sockets=[self.socket])
        self._main = asyncio.create_task(self.server.main_loop())
        where = {"uds": self.uds} if self.uds else {"port": self.port}
        log.info("http serving", extra={**where, "tls": self.tls is not None})

    def begin_shutdown(self) -> None:
        """Stop accepting connections now; in-flight requests go on (see `wait_stopped`)."""
        if self._stopping is None:
            self.server.should_exit = True
            self._stopping = asyncio.create_task(self._shutdown())

    async def _shutdown(self) -> None:
        if self._main is not None:
            await self._main
        await self.server.shutdown(sockets=[self.socket])
        if self.socket_file is not None:
            self.socket_file.remove()

    async def wait_stopped(self) -> None:
        """Wait until every in-flight request finished (or the grace period cancelled it)."""
        self.begin_shutdown()
        assert self._stopping is not None
        await self._stopping
