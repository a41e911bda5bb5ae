"""A bounded slowloris against the gateway's HTTP server (loopback only, a fixed number of clients,
stops by itself): clients that send headers or a body a byte at a time are disconnected at the
header / body deadline, while an ordinary request is still answered. Before, uvicorn held them open
as long as they kept trickling."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

from fastapi import FastAPI, Request

from gateway.http.server import HttpServer

CLIENTS = 10
GIVE_UP_SECONDS = 8.0  # the attack stops by itself; deadlines under test are 0.5 s


def app() -> FastAPI:
    api = FastAPI()

    @api.post("/echo")
    async def echo(request: Request) -> dict[str, int]:
        return {"bytes": len(await request.body())}

    return api


async def trickle(port: int, head: bytes, then: bytes) -> bytes:
    """Send `head`, then `then` one byte every 0.2 s; what the server answered once it closed, or b"OPEN"
    when it was still open at GIVE_UP_SECONDS."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head)
    await writer.drain()
    answer = b""
    stop = time.monotonic() + GIVE_UP_SECONDS
    try:
        for byte in then:
            if time.monotonic() > stop:
                return b"OPEN"
            try:
                chunk = await asyncio.wait_for(reader.read(4096), 0.2)
            except asyncio.TimeoutError:
                writer.write(bytes([byte]))
                await writer.drain()
                continue
            answer += chunk
            if not chunk or reader.at_eof():
                return answer or b"CLOSED"
        return b"OPEN"
    except (ConnectionResetError, BrokenPipeError):
        return answer or b"CLOSED"
    finally:
        writer.close()


def run_attack(head: bytes, then: bytes) -> tuple[list[bytes], int]:
    async def main() -> tuple[list[bytes], int]:
        server = HttpServer(app(), "127.0.0.1", 0, None, grace_seconds=1.0, header_seconds=0.5, body_seconds=0.5)
        await server.start()
        try:
            results = await asyncio.gather(*(trickle(server.port, head, then) for _ in range(CLIENTS)))
            status = await asyncio.to_thread(ordinary_request, server.port)
            return list(results), status
        finally:
            await server.wait_stopped()
    return asyncio.run(main())


def ordinary_request(port: int) -> int:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\n\r\nhi")
        return int(s.recv(4096).split(b" ")[1])


def test_headers_sent_a_byte_at_a_time_are_cut_off_with_408() -> None:
    results, status = run_attack(b"POST /echo HTTP/1.1\r\n", b"x-slow: " + b"a" * 200)
    assert all(r != b"OPEN" for r in results), results
    assert all(r.startswith(b"HTTP/1.1 408") for r in results), results
    assert status == 200


def test_a_body_sent_a_byte_at_a_time_is_cut_off() -> None:
    results, status = run_attack(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 500\r\n\r\n", b"b" * 500)
    assert all(r != b"OPEN" for r in results), results
    assert status == 200


def streaming_app(produced: list[int], closed: asyncio.Event) -> FastAPI:
    """/stream answers an endless event stream of 1 KiB events, counting what it produced."""
    from fastapi.responses import StreamingResponse

    api = FastAPI()

    async def events() -> Any:
        try:
            while True:
                produced[0] += 1024
                yield b"data: " + b"x" * 1016 + b"\n\n"
                await asyncio.sleep(0)  # as a stream waiting on the model does
        finally:
            closed.set()

    @api.post("/stream")
    async def stream() -> StreamingResponse:
        return StreamingResponse(events(), media_type="text/event-stream")

    return api


def test_a_client_that_stops_reading_is_cut_off_and_its_stream_ended() -> None:
    """Issue 64.6: a client reading nothing held its stream open while the server buffered for it. Writes wait
    once WRITE_BUFFER_BYTES are buffered (back-pressure reaches the producer), and a client that takes nothing
    for `stall_seconds` is disconnected: its stream ends (here at once; in the gateway that cancels the model
    call), and what the server produced for it stays bounded."""
    async def main() -> tuple[bool, int, float]:
        produced, closed = [0], asyncio.Event()
        server = HttpServer(streaming_app(produced, closed), "127.0.0.1", 0, None, grace_seconds=1.0,
                            stall_seconds=0.5)
        await server.start()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        try:
            await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", server.port))
            await asyncio.get_running_loop().sock_sendall(sock, b"POST /stream HTTP/1.1\r\nhost: x\r\n"
                                                                b"content-length: 0\r\n\r\n")
            began = time.monotonic()
            try:
                await asyncio.wait_for(closed.wait(), 10)
            except asyncio.TimeoutError:
                return False, produced[0], time.monotonic() - began
            return True, produced[0], time.monotonic() - began
        finally:
            sock.close()
            await server.wait_stopped()

    ended, produced, seconds = asyncio.run(main())
    assert ended, f"the stream was still open after {seconds:.1f} s ({produced} bytes produced)"
    assert produced < 16 << 20, produced  # loopback buffers autotune to megabytes; the point is that it ended
