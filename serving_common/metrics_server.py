"""The Prometheus /metrics endpoint of a service, started so that a port in use stops the service
with a message naming the flag and the port (prometheus_client alone raises a bare OSError from
inside the event loop, which ended in a traceback)."""

from __future__ import annotations

import socket
import threading
from http.server import ThreadingHTTPServer
from typing import Any

from prometheus_client import CollectorRegistry, MetricsHandler, disable_created_metrics, start_http_server

from serving_common.uds import SocketFile, bind_unix, no_tcp, tcp_refused


def new_registry() -> CollectorRegistry:
    """A service's own registry. Counters and histograms then export no `_created` series (a second series per
    counter that no dashboard reads; vLLM turns them off the same way)."""
    disable_created_metrics()  # process-wide, read at each scrape: every registry exports none
    return CollectorRegistry()


METRICS_INSTEAD = "turn it off with --metrics-port 0"


def serve_metrics(port: int, host: str, registry: CollectorRegistry, instead: str = METRICS_INSTEAD) -> None:
    """Serve `registry` on host:port (a daemon thread); OSError naming --metrics-port when it cannot bind, and
    `instead` (what to do) where this host allows no TCP at all."""
    if (reason := tcp_refused(host)) is not None:
        raise OSError(no_tcp(f"--metrics-port {port}", reason, instead))
    try:
        start_http_server(port, addr=host, registry=registry)
    except OSError as error:
        raise OSError(f"--metrics-port: could not bind {host}:{port} ({error.strerror or error})") from None


class _UnixHTTPServer(ThreadingHTTPServer):
    """An HTTP server on a socket file bound beforehand (serving_common.uds: checked, owner-only)."""

    address_family = socket.AF_UNIX
    daemon_threads = True

    def get_request(self) -> tuple[socket.socket, Any]:
        request, _ = self.socket.accept()
        return request, ("unix", 0)  # the handler reads a (host, port) pair, which a unix peer has not


def serve_metrics_unix(path: str, registry: CollectorRegistry, flag: str = "--metrics-uds") -> SocketFile:
    """Serve `registry`'s /metrics on the unix socket file `path` (a daemon thread), for a host without TCP:
    `curl --unix-socket PATH http://localhost/metrics`, or the gateway's `--model-metrics unix:PATH`."""
    sock, made = bind_unix(path, flag)
    server = _UnixHTTPServer(path, MetricsHandler.factory(registry), bind_and_activate=False)
    server.socket.close()
    server.socket = sock
    server.server_activate()
    threading.Thread(target=server.serve_forever, name="metrics-uds", daemon=True).start()
    return made
