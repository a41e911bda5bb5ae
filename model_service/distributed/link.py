"""The lockstep messages' way from process 0 to its followers: one TCP connection per follower.

A step's plan used to travel through a JAX collective (broadcast_one_to_all) followed by a blocking copy to
the host on every process: process 0 could not dispatch a step before every follower had finished the
previous one and joined the broadcast, so host work and device work never overlapped. Over a socket the
plan is a few kilobytes written by process 0 (it does not wait for anyone) and read by a follower as soon as
it is ready for the next call; the step's own collectives are what keeps the processes in step.

Setup goes through jax.distributed's coordination service, which every process has already joined:
process 0 listens on its coordinator host (any free port) and publishes `host:port` and a random token under
`ADDRESS_KEY`; each follower reads it, connects and introduces itself with the token and its process id.
A connection without the token is closed, so only members of this group are sent plans.

The ends implement lockstep.Channel: `broadcast(arrays)` on process 0 sends the arrays to every follower and
returns them; on a follower it returns process 0's arrays, which have the shapes of the zeros passed in
(ops.Codec fixes every message's shape from the header before it).
"""

from __future__ import annotations

import logging
import secrets
import socket
import struct
import time
from collections.abc import Sequence
from typing import Protocol

import numpy as np

log = logging.getLogger(__name__)

ADDRESS_KEY = "grok_lockstep/address"
_HELLO = struct.Struct("<32sI")  # token (hex, 32 bytes), process id
_LENGTH = struct.Struct("<Q")  # bytes of the arrays that follow


class KeyValue(Protocol):
    """The part of jax.distributed's coordination client used here (a dict stands in for it in tests)."""

    def key_value_set(self, key: str, value: str) -> None: ...
    def blocking_key_value_get(self, key: str, timeout_in_ms: int) -> str: ...


class LinkError(ConnectionError):
    """A connection of the group closed or failed; the group is broken."""


def _split_host(coordinator: str) -> str:
    host = coordinator.rpartition(":")[0]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise LinkError("process 0 closed the lockstep connection")
        got += n


class LeaderLink:
    """Process 0's end: the followers' connections, in process order."""

    def __init__(self, connections: Sequence[socket.socket]) -> None:
        self._connections = list(connections)

    def broadcast(self, arrays: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
        body = [np.ascontiguousarray(a).tobytes() for a in arrays]
        message = b"".join([_LENGTH.pack(sum(len(b) for b in body)), *body])
        for i, connection in enumerate(self._connections):
            try:
                connection.sendall(message)
            except OSError as e:
                raise LinkError(f"the lockstep connection to follower {i + 1} failed: {e}") from e
        return arrays

    def close(self) -> None:
        for connection in self._connections:
            connection.close()


class FollowerLink:
    """A follower's end: reads messages of the shapes it expects."""

    def __init__(self, connection: socket.socket) -> None:
        self._connection = connection

    def broadcast(self, arrays: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
        header = bytearray(_LENGTH.size)
        _recv_exactly(self._connection, memoryview(header))
        (size,) = _LENGTH.unpack(header)
        expected = sum(a.nbytes for a in arrays)
        if size != expected:
            raise LinkError(f"a lockstep message of {size} bytes where {expected} were expected: the processes "
                            "were started with different settings")
        body = bytearray(size)
        _recv_exactly(self._connection, memoryview(body))
        out, at = [], 0
        for a in arrays:
            out.append(np.frombuffer(body, a.dtype, a.size, at).reshape(a.shape))
            at += a.nbytes
        return tuple(out)

    def close(self) -> None:
        self._connection.close()


def _tuned(connection: socket.socket) -> socket.socket:
    connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a plan is one small write: send it now
    connection.settimeout(None)  # every wait is bounded by the lockstep engine or the follower's watchdog
    return connection


def open_leader(store: KeyValue, coordinator: str, num_processes: int, timeout: float) -> LeaderLink:
    """Listen, publish the address, and accept one connection from each of the other processes."""
    host = _split_host(coordinator)
    token = secrets.token_hex(16)
    with socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET) as server:
        port = server.getsockname()[1]
        store.key_value_set(ADDRESS_KEY, f"{port}/{token}")
        followers: dict[int, socket.socket] = {}
        deadline = time.monotonic() + timeout
        while len(followers) < num_processes - 1:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(1, num_processes)) - set(followers))
                raise LinkError(f"followers {missing} did not connect to {host}:{port} within {timeout:g} s")
            server.settimeout(left)
            try:
                connection, peer = server.accept()
            except socket.timeout:
                continue
            pid = _introduced(connection, token, num_processes, left)
            if pid is None or pid in followers:
                log.warning("refused a lockstep connection", extra={"peer": str(peer)})
                connection.close()
                continue
            followers[pid] = _tuned(connection)
    log.info("lockstep link open", extra={"port": port, "followers": len(followers)})
    return LeaderLink([followers[pid] for pid in sorted(followers)])


def _introduced(connection: socket.socket, token: str, num_processes: int, timeout: float) -> int | None:
    """The process id a connection introduces itself with, or None when it is not one of the group's."""
    connection.settimeout(min(timeout, 10.0))
    hello = bytearray(_HELLO.size)
    try:
        _recv_exactly(connection, memoryview(hello))
    except (OSError, LinkError):
        return None
    sent_token, pid = _HELLO.unpack(hello)
    if not secrets.compare_digest(sent_token, token.encode()) or not 0 < pid < num_processes:
        return None
    return pid


def connect_follower(store: KeyValue, coordinator: str, process_id: int, timeout: float) -> FollowerLink:
    """Read process 0's address from the coordination service, connect and introduce this process."""
    port, _, token = store.blocking_key_value_get(ADDRESS_KEY, int(timeout * 1000)).partition("/")
    host = _split_host(coordinator)
    connection = socket.create_connection((host, int(port)), timeout=timeout)
    connection.sendall(_HELLO.pack(token.encode(), process_id))
    log.info("lockstep link open", extra={"leader": f"{host}:{port}", "process_id": process_id})
    return FollowerLink(_tuned(connection))
