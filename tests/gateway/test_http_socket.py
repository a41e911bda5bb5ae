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
