"""The HTTP port's connections send each event at once (TCP_NODELAY).

asyncio sets TCP_NODELAY on accepted connections only when the listening socket says it is TCP
(proto IPPROTO_TCP); a listener made with socket.socket(family, SOCK_STREAM) has proto 0, so every
connection kept Nagle's algorithm. On a kept-alive connection (AIPerf, the openai package, any pooled
client) the response headers went out alone and the first token's event then waited for the client's
delayed ACK: ~40 ms added to every time to first token after a connection's first request.
"""

from __future__ import annotations

import asyncio
import socket

from gateway.http.server import bind_socket
from tests.gateway.conftest import Stack


class _Record(asyncio.Protocol):
    nodelay: list[int] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        sock = transport.get_extra_info("socket")
        self.nodelay.append(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        transport.close()


def test_connections_accepted_on_the_http_socket_have_nagle_off() -> None:
    async def accept_one() -> list[int]:
        listener = bind_socket("127.0.0.1", 0)
        server = await asyncio.get_running_loop().create_server(_Record, sock=listener)
        port = listener.getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        for _ in range(100):
            if _Record.nodelay:
                break
            await asyncio.sleep(0.01)
        writer.close()
        server.close()
        await server.wait_closed()
        return _Record.nodelay

    assert asyncio.run(accept_one()) == [1]


def test_request_headers_over_16_kib_are_400_whole_or_in_pieces(fast_stack: Stack) -> None:
    """The documented limit holds for a header block sent in one write (h11 alone limited only pieces)."""
    body = b'{"prompt": "x", "max_tokens": 2}'
    for size, pieces in ((80_000, 1), (17_000, 1), (17_000, 40)):
        head = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\nx-big: %s\r\n\r\n" % (len(body), b"a" * size))
        with socket.create_connection(("127.0.0.1", fast_stack.http_port), timeout=30) as conn:
            step = -(-len(head) // pieces)
            try:
                for i in range(0, len(head), step):
                    conn.sendall(head[i:i + step])
                conn.sendall(body)
            except (BrokenPipeError, ConnectionResetError):
                pass  # refused before the rest arrived
            reply = read_all(conn)
        assert reply.startswith(b"HTTP/1.1 400"), reply[:200]
    with socket.create_connection(("127.0.0.1", fast_stack.http_port), timeout=30) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\nx-big: %s\r\nconnection: close\r\n\r\n%s" % (len(body), b"a" * 15_000, body))
        assert read_all(conn).startswith(b"HTTP/1.1 200")


def read_all(conn: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    out = b""
    try:
        while chunk := conn.recv(65536):
            out += chunk
    except ConnectionResetError:
        pass
    return out


def test_an_absolute_form_request_target_is_served_as_its_path(fast_stack: Stack) -> None:
    """RFC 9112 3.2.2: a server must accept the absolute form (`POST http://host/path HTTP/1.1`, as proxies and some
    clients send it), its authority taking the place of the Host header. It answered 404."""
    body = b'{"prompt": "x", "max_tokens": 2}'
    for target in (b"http://127.0.0.1/v1/completions", b"HTTP://example.test:8000/v1/completions?x=1"):
        with socket.create_connection(("127.0.0.1", fast_stack.http_port), timeout=30) as conn:
            conn.sendall(b"POST %s HTTP/1.1\r\nhost: other\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (target, len(body), body))
            reply = read_all(conn)
        assert reply.startswith(b"HTTP/1.1 200"), reply[:300]
        assert b'"text_completion"' in reply
    with socket.create_connection(("127.0.0.1", fast_stack.http_port), timeout=30) as conn:
        conn.sendall(b"GET http://127.0.0.1/nowhere HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        reply = read_all(conn)
    assert reply.startswith(b"HTTP/1.1 404") and b"GET /nowhere is not a route" in reply, reply[:300]
