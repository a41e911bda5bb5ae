"""Read and write timeouts and the header size limit for the HTTP port: uvicorn's h11 protocol with a deadline on each
request's headers and on its body, and at most MAX_HEADER_BYTES of request line and headers.

uvicorn closes a connection that sends nothing for `timeout_keep_alive` seconds, but a client sending
a byte at a time cancels that timer with each byte and is then held without limit (slowloris): 30 such
clients held 30 connections and their tasks forever. Here, from the moment a connection is ready for a
request, its headers must be complete within `header_seconds`; once they are, its body must be complete
within `body_seconds` (h11 limits the headers' size, and the app the body's). A client that misses a
deadline gets its connection closed: 408 first when no request had started, so an honest but slow client
learns why.

h11 limits only headers that arrive in pieces (its buffer of an incomplete event); a whole header block in one
read was parsed at any size (80 KiB accepted). The limit is counted here, on the bytes received while a
request's headers are awaited: over it, 400 and the connection closed, as h11 answers an incomplete one.

A client that stops reading a stream (issue 64.6) was buffered for: the server kept producing its events. Now at
most WRITE_BUFFER_BYTES wait in the connection's buffer (asyncio then pauses writing, and uvicorn's send, the
response's generator and the model stream it reads wait with it), and a connection whose writing stays paused
for `stall_seconds` is aborted: its request ends as when a client goes away (the gateway cancels the model call).
"""

from __future__ import annotations

import asyncio
import json
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)

HEADER_SECONDS = 10.0  # nginx's client_header_timeout is 60 s; our requests are small JSON bodies
BODY_SECONDS = 60.0  # the whole body (at most 4 MiB), from the end of its headers
# A client that stops reading: writes wait once this much is buffered for it (then the response's producer, and
# the model stream behind it, wait too), and after STALL_SECONDS with nothing taken it is disconnected, which
# ends its request as a client gone does (nginx's send_timeout is 60 s).
WRITE_BUFFER_BYTES = 64 * 1024
STALL_SECONDS = 30.0
_TIMEOUT_408 = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
MAX_HEADER_BYTES = 16 * 1024  # the request line and headers, as h11's default and the gRPC ports' limit
_HEADERS_400 = json.dumps({"error": {
    "message": f"the request line and headers are over {MAX_HEADER_BYTES} bytes; send fewer or shorter headers",
    "type": "invalid_request_error", "param": None, "code": None}}).encode()


class GuardedH11Protocol(H11Protocol):
    """H11Protocol with header and body deadlines (`guarded(...)` makes a subclass with the values)."""

    header_seconds = HEADER_SECONDS
    body_seconds = BODY_SECONDS
    stall_seconds = STALL_SECONDS

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._phase: object = None
        self._deadline: asyncio.TimerHandle | None = None
        self._stall: asyncio.TimerHandle | None = None
        self._head = bytearray()  # bytes of the headers awaited, until their end is seen
        super().connection_made(transport)
        transport.set_write_buffer_limits(high=WRITE_BUFFER_BYTES)
        self._follow()

    def pause_writing(self) -> None:
        """The client is not taking what is written: it has `stall_seconds` to start again."""
        super().pause_writing()
        if self._stall is None and self.stall_seconds > 0:
            self._stall = self.loop.call_later(self.stall_seconds, self._stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None

    def _stalled(self) -> None:
        self._stall = None
        if self.transport.is_closing():
            return
        log.info("http client stopped reading, connection closed", extra={
            "client": self.client, "stalled_seconds": self.stall_seconds,
            "buffered_bytes": self.transport.get_write_buffer_size()})
        self.transport.abort()  # close() would wait for the buffer to drain: it never would

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is h11.IDLE and self._headers_too_large(data):
            return
        super().data_received(data)
        self._follow()

    def _headers_too_large(self, data: bytes) -> bool:
        """Count `data` toward the awaited headers; past the limit, answer 400, close, and say so."""
        self._head += data[:MAX_HEADER_BYTES + 4]
        end = self._head.find(b"\r\n\r\n")
        if (end if end >= 0 else len(self._head)) <= MAX_HEADER_BYTES:
            if end >= 0:
                self._head.clear()
            return False
        log.info("http request headers too large, connection closed", extra={"client": self.client})
        self.transport.write(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(_HEADERS_400), _HEADERS_400))
        self.transport.close()
        return True

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None
        super().connection_lost(exc)

    def _follow(self) -> None:
        """Arm the deadline of the phase the peer is in (headers, body) when it changed; none otherwise."""
        phase = self.conn.their_state
        if phase is self._phase:
            return
        self._phase = phase
        self._disarm()
        seconds = {h11.IDLE: self.header_seconds, h11.SEND_BODY: self.body_seconds}.get(phase)
        if seconds is not None and not self.transport.is_closing():
            self._deadline = self.loop.call_later(seconds, self._expired, phase)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self, phase: object) -> None:
        self._deadline = None
        if self.conn.their_state is not phase or self.transport.is_closing():
            return
        waiting = "headers" if phase is h11.IDLE else "body"
        log.info("http client too slow, connection closed", extra={"waiting_for": waiting, "client": self.client})
        if phase is h11.IDLE and (self.cycle is None or self.cycle.response_complete):  # no request open
            self.transport.write(_TIMEOUT_408)
        self.transport.close()


def guarded(header_seconds: float, body_seconds: float, stall_seconds: float = STALL_SECONDS) -> type[GuardedH11Protocol]:
    """The protocol class for uvicorn.Config(http=...) with these deadlines."""
    return type("GuardedH11", (GuardedH11Protocol,), {"header_seconds": header_seconds, "body_seconds": body_seconds,
                                                      "stall_seconds": stall_seconds})
