"""A bound on what the gateway holds for a gRPC stream whose client reads slower than the model writes.

Every request to a model replica rides on a shared GenerateMany stream (model_streams.py), which cannot stop for
one request without stopping the others, so a request's responses keep arriving while its client reads nothing.
`bounded` reads a request's responses ahead into a buffer of at most `limit` bytes, from which the client's
stream takes them as gRPC's flow control lets it. When the client has left more than that unread, the model
request is ended (its slot freed within a step) and the client, once it reads again, gets what was produced up
to then and RESOURCE_EXHAUSTED saying why. What gRPC itself holds for the call (the client's flow-control window
and the sockets' buffers) comes on top and is bounded by gRPC. The HTTP side bounds its writes itself
(gateway/http/flow.py).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Generic, Protocol, TypeVar

import grpc

from gateway.errors import GatewayError

MAX_UNREAD_BYTES = 256 * 1024  # a request's responses the gateway holds for a client that has not read them


class Message(Protocol):
    def ByteSize(self) -> int: ...  # noqa: N802 (protobuf's name)


M = TypeVar("M", bound=Message)


def too_slow(limit: int) -> GatewayError:
    return GatewayError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"the client left more than {limit // 1024} KiB of this stream's responses unread, so the "
                        "request was ended; read the stream as it arrives (or ask for fewer tokens or completions)")


class _Buffer(Generic[M]):
    def __init__(self) -> None:
        self.items: collections.deque[tuple[M, int]] = collections.deque()  # (message, its bytes)
        self.bytes = 0
        self.full = False  # the limit was passed: nothing more is read from the model
        self.waiter: asyncio.Future[None] | None = None  # the client's side, waiting for an item or the end

    def wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)


async def _read_ahead(messages: AsyncIterator[M], buffer: _Buffer[M], limit: int) -> None:
    """Move `messages` into `buffer` until they end or it holds more than `limit` bytes (then they are closed:
    the model request ends)."""
    try:
        async for message in messages:
            size = message.ByteSize()
            buffer.items.append((message, size))
            buffer.bytes += size
            buffer.wake()
            if buffer.bytes > limit:
                buffer.full = True
                return
    finally:
        buffer.wake()
        close = getattr(messages, "aclose", None)
        if close is not None:
            await close()


async def bounded(messages: AsyncIterator[M], limit: int = MAX_UNREAD_BYTES,
                  join: Callable[[M, M], bool] | None = None) -> AsyncIterator[M]:
    """`messages` in order, read ahead at most `limit` bytes; then the error they ended with, or RESOURCE_EXHAUSTED
    when the reader fell behind by more than `limit`. Closing this generator closes `messages`. `join(a, b)`
    (optional) appends message `b` to `a` in place when it can (True): messages that queued up while the previous
    one was being written go out as one, so a writer that falls behind sends fewer, longer messages instead of
    falling further behind."""
    buffer: _Buffer[M] = _Buffer()
    reader = asyncio.create_task(_read_ahead(messages, buffer, limit))
    loop = asyncio.get_running_loop()
    try:
        while True:
            if buffer.items:
                message, size = buffer.items.popleft()
                buffer.bytes -= size
                while join is not None and buffer.items and join(message, buffer.items[0][0]):
                    buffer.bytes -= buffer.items.popleft()[1]
                yield message
            elif buffer.full:
                raise too_slow(limit)
            elif reader.done():
                reader.result()  # the stream's own error, if it ended with one
                return
            else:
                buffer.waiter = loop.create_future()
                try:
                    await buffer.waiter
                finally:
                    buffer.waiter = None
    finally:
        if not reader.done():
            reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await reader
